"""Local disks through ``pyarrow.fs.LocalFileSystem``: atomic rename, fsync."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store.backends.base import LOCAL_CAPABILITIES, Backend


def local_backend(uri: str, storage_options: Mapping[str, Any]) -> Backend:
    """Factory for ``file://`` and ``local://`` URIs (and plain local paths).

    Accepts no storage options.

    Raises:
        InvalidConfigError: a storage option was given.
    """
    if storage_options:
        from checkpoint_store.errors import InvalidConfigError

        raise InvalidConfigError(
            f"local storage takes no storage_options, got {sorted(storage_options)}"
        )
    return Backend(
        pafs.LocalFileSystem(use_mmap=False),
        scheme="file",
        capabilities=LOCAL_CAPABILITIES,
        name="local",
    )
