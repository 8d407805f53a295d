"""The Lightning integration for the ``pytorch_lightning`` package (the old name).

The same classes as :mod:`checkpoint_store.integrations.lightning`, bound to
``pytorch_lightning.Callback`` and ``lightning_fabric``'s ``CheckpointIO``:
a ``pytorch_lightning.Trainer`` accepts only those.
"""

from __future__ import annotations

from checkpoint_store.integrations._lightning import (
    STATE_FILE,
    _ReportCallback,
    _StoreIO,
    _StoreModelCheckpoint,
    checkpoint_file,
    resume_path,
)

try:
    from lightning_fabric.plugins import CheckpointIO as _CheckpointIO
    from pytorch_lightning import Callback as _Callback
    from pytorch_lightning.callbacks import ModelCheckpoint as _ModelCheckpoint
except ImportError:
    raise ImportError(
        "checkpoint_store.integrations.pytorch_lightning needs pytorch_lightning: pip install "
        "pytorch-lightning (or use checkpoint_store.integrations.lightning with the "
        "'lightning' package)"
    ) from None

__all__ = [
    "STATE_FILE",
    "CheckpointStoreIO",
    "ReportCheckpointCallback",
    "StoreModelCheckpoint",
    "checkpoint_file",
    "resume_path",
]


class CheckpointStoreIO(_StoreIO, _CheckpointIO):
    """See :class:`checkpoint_store.integrations.lightning.CheckpointStoreIO`."""


class StoreModelCheckpoint(_StoreModelCheckpoint, _ModelCheckpoint):
    """See :class:`checkpoint_store.integrations.lightning.StoreModelCheckpoint`."""


class ReportCheckpointCallback(_ReportCallback, _Callback):
    """See :class:`checkpoint_store.integrations.lightning.ReportCheckpointCallback`."""
