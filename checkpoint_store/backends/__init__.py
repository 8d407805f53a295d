"""Built-in backends and the Backend type plugins return.

Built-ins (``file``/``local``, ``memory``) are registered through the same
``checkpoint_store.backends`` entry-point group as third-party plugins; see
:mod:`checkpoint_store.registry`.
"""

from checkpoint_store.backends.base import (
    LOCAL_CAPABILITIES,
    MEMORY_CAPABILITIES,
    OBJECT_STORE_CAPABILITIES,
    Backend,
    BackendFactory,
    Capabilities,
    join,
)
from checkpoint_store.backends.handlers import wrap_filesystem

__all__ = [
    "Backend",
    "BackendFactory",
    "Capabilities",
    "LOCAL_CAPABILITIES",
    "MEMORY_CAPABILITIES",
    "OBJECT_STORE_CAPABILITIES",
    "join",
    "wrap_filesystem",
]
