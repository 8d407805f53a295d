"""checkpoint-store: save, keep and load ML training checkpoints on any storage.

Layers, top to bottom: :mod:`~checkpoint_store.session` (``report``),
:mod:`~checkpoint_store.retention` (top-K), :mod:`~checkpoint_store.checkpoint`
and :mod:`~checkpoint_store.transfer`, :mod:`~checkpoint_store.storage`,
:mod:`~checkpoint_store.registry` and the backends.
"""

from checkpoint_store._retry import RetryPolicy
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import (
    BackendUnavailableError,
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointStoreError,
    CredentialsExpiredError,
    InvalidConfigError,
    MetadataError,
    PermanentBackendError,
    TransientBackendError,
    UnknownSchemeError,
)
from checkpoint_store.registry import available_backends, register_backend
from checkpoint_store.retention import CheckpointConfig, CheckpointManager
from checkpoint_store.storage import ScanResult, StorageContext

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointConflictError",
    "CheckpointCorruptError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointStoreError",
    "CredentialsExpiredError",
    "InvalidConfigError",
    "MetadataError",
    "PermanentBackendError",
    "RetryPolicy",
    "ScanResult",
    "StorageContext",
    "TransientBackendError",
    "TrialRunner",
    "UnknownSchemeError",
    "available_backends",
    "register_backend",
    "session",
]


def __getattr__(name: str):
    if name == "session":
        import importlib

        return importlib.import_module("checkpoint_store.session")
    if name == "TrialRunner":  # imported on first use: the session layer is not free
        from checkpoint_store.session._trial_runner import TrialRunner

        return TrialRunner
    raise AttributeError(f"module 'checkpoint_store' has no attribute {name!r}")
