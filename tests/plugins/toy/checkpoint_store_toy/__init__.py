"""A toy third-party backend: ``toy://bucket/key`` stored under a local folder.

It behaves like an object store (no atomic directory rename, so checkpoints
commit marker-last) while keeping its bytes in ``storage_options["root"]``
(or ``$CHECKPOINT_STORE_TOY_ROOT``). It goes through fsspec's ``DirFileSystem``
so none of checkpoint-store's local-disk fast paths apply.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from checkpoint_store.backends import Backend, Capabilities
from checkpoint_store.errors import InvalidConfigError

TOY_CAPABILITIES = Capabilities(
    atomic_rename=False, directories=True, chunk_size=1024 * 1024, concurrency=2
)


def toy_backend(uri: str, storage_options: Mapping[str, Any]) -> Backend:
    """Factory for ``toy://`` URIs; needs ``root`` (a local folder)."""
    root = storage_options.get("root") or os.environ.get("CHECKPOINT_STORE_TOY_ROOT")
    if not root:
        raise InvalidConfigError(
            "toy:// needs storage_options={'root': '/some/folder'} or CHECKPOINT_STORE_TOY_ROOT"
        )
    os.makedirs(root, exist_ok=True)
    fs = DirFileSystem(path=os.path.abspath(root), fs=LocalFileSystem())
    return Backend(
        pafs.PyFileSystem(pafs.FSSpecHandler(fs)),
        scheme="toy",
        capabilities=TOY_CAPABILITIES,
        name="toy",
    )


def not_a_backend(uri: str, storage_options: Mapping[str, Any]) -> object:
    """A broken factory (returns a plain filesystem): tests check the error names the plugin."""
    return pafs.LocalFileSystem()
