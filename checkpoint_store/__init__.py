"""checkpoint-store: save, keep and load ML training checkpoints on any storage.

Layers, top to bottom: :mod:`~checkpoint_store.session` (``report``),
:mod:`~checkpoint_store.retention` (top-K), :mod:`~checkpoint_store.checkpoint`
and :mod:`~checkpoint_store._transfer.trees`, :mod:`~checkpoint_store.storage`,
:mod:`~checkpoint_store.registry` and the backends.
"""

from typing import TYPE_CHECKING, Any

from checkpoint_store.errors import (
    AmbiguousCommitError,
    AmbiguousMetricError,
    BackendUnavailableError,
    CheckpointAbortedError,
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointStoreError,
    CredentialsExpiredError,
    InvalidConfigError,
    MetadataError,
    MetricMismatchError,
    NestedCheckpointError,
    PermanentBackendError,
    Preempted,
    RankTimeoutError,
    SourceChangedError,
    SourceDeletedError,
    StateKeyError,
    StateMismatchError,
    StorageFullError,
    StorageUnreachableError,
    TensorCorruptError,
    TransientBackendError,
    TrialInUseError,
    TrialStopped,
    UnknownSchemeError,
    UnreadableSourceError,
    UnsafePathError,
    UnsupportedStateError,
)

if TYPE_CHECKING:
    from checkpoint_store import session
    from checkpoint_store._browse.experiment import Experiment, TrialSummary
    from checkpoint_store._util.retry import RetryPolicy
    from checkpoint_store.checkpoint import Checkpoint
    from checkpoint_store.registry import available_backends, register_backend
    from checkpoint_store.retention import CheckpointConfig, CheckpointManager
    from checkpoint_store.retention.upload_config import UploadConfig
    from checkpoint_store.session import PreemptionConfig, TrialRunner
    from checkpoint_store.storage import ScanResult, StorageContext
    from checkpoint_store.tiers import LocalTier

__version__ = "0.1.0"

__all__ = [
    "AmbiguousCommitError",
    "BackendUnavailableError",
    "Checkpoint",
    "CheckpointAbortedError",
    "CheckpointConfig",
    "CheckpointConflictError",
    "TrialInUseError",
    "CheckpointCorruptError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointStoreError",
    "CredentialsExpiredError",
    "Experiment",
    "AmbiguousMetricError",
    "InvalidConfigError",
    "LocalTier",
    "MetadataError",
    "MetricMismatchError",
    "NestedCheckpointError",
    "PermanentBackendError",
    "Preempted",
    "PreemptionConfig",
    "RankTimeoutError",
    "SourceChangedError",
    "SourceDeletedError",
    "StorageFullError",
    "StorageUnreachableError",
    "StateKeyError",
    "StateMismatchError",
    "TensorCorruptError",
    "UnsupportedStateError",
    "RetryPolicy",
    "ScanResult",
    "StorageContext",
    "TransientBackendError",
    "TrialRunner",
    "TrialStopped",
    "TrialSummary",
    "UnknownSchemeError",
    "UnreadableSourceError",
    "UnsafePathError",
    "UploadConfig",
    "available_backends",
    "register_backend",
    "session",
]


# Everything but the errors is imported on first use (as universal-pathlib's
# registry does): pyarrow alone takes about 120 ms to import, and a process
# that only catches our errors or reads __version__ should not pay for it.
_LAZY = {
    "Checkpoint": "checkpoint_store.checkpoint",
    "CheckpointConfig": "checkpoint_store.retention",
    "CheckpointManager": "checkpoint_store.retention",
    "Experiment": "checkpoint_store._browse.experiment",
    "LocalTier": "checkpoint_store.tiers",
    "RetryPolicy": "checkpoint_store._util.retry",
    "ScanResult": "checkpoint_store.storage",
    "StorageContext": "checkpoint_store.storage",
    "PreemptionConfig": "checkpoint_store.session",
    "TrialRunner": "checkpoint_store.session",
    "TrialSummary": "checkpoint_store._browse.experiment",
    "UploadConfig": "checkpoint_store.retention.upload_config",
    "available_backends": "checkpoint_store.registry",
    "register_backend": "checkpoint_store.registry",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "session":
        return importlib.import_module("checkpoint_store.session")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'checkpoint_store' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
