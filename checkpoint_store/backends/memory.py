"""In-process memory through fsspec's ``MemoryFileSystem``.

Its contents are shared by every ``memory://`` URI in the process, as in
fsspec; they vanish when the process ends. Meant for tests and notebooks.
Wrapped with :class:`~checkpoint_store.backends.handlers.LiteralFSSpecHandler`:
names are literal, and each reader gets its own view of a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from checkpoint_store.backends.base import MEMORY_CAPABILITIES, Backend
from checkpoint_store.backends.handlers import wrap_fsspec


def memory_backend(uri: str, storage_options: Mapping[str, Any]) -> Backend:
    """Factory for ``memory://`` URIs. Accepts no storage options."""
    from fsspec.implementations.memory import MemoryFileSystem

    if storage_options:
        from checkpoint_store.errors import InvalidConfigError

        raise InvalidConfigError(
            f"memory storage takes no storage_options, got {sorted(storage_options)}"
        )
    return Backend(
        wrap_fsspec(MemoryFileSystem()),
        scheme="memory",
        capabilities=MEMORY_CAPABILITIES,
        name="memory",
    )
