"""Helpers shared by the retention tests (imported as a top-level module)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from checkpoint_store import Checkpoint, CheckpointManager, StorageContext


def save(
    manager: CheckpointManager,
    storage: StorageContext,
    source_dir: str,
    metrics: Mapping[str, Any],
    index: int | None = None,
) -> str:
    """Persist ``source_dir`` as the next checkpoint (as the session does) and
    register it; returns its directory name."""
    if index is None:
        index = max(manager.next_index, storage.next_checkpoint_index())
    ckpt = storage.persist_checkpoint(
        Checkpoint(source_dir), index, {"metrics": dict(metrics), "run_id": manager.run_id}
    )
    manager.register(ckpt, metrics)
    return os.path.basename(ckpt.path)


def scores_of(manager: CheckpointManager, attr: str) -> list[Any]:
    """The kept checkpoints' values of ``attr`` (top-level key), oldest first."""
    by_name = {c.path.rsplit("/", 1)[-1]: m for c, m in manager.best_checkpoints}
    return [by_name[n].get(attr) for n in manager.kept_dir_names]


def committed_names(storage: StorageContext) -> list[str]:
    return [c.path.rsplit("/", 1)[-1] for c, _ in storage.committed_checkpoints()]
