"""Tiered checkpoints: a fast local tier in front of the storage_path.

Usage::

    from checkpoint_store import session, Checkpoint, LocalTier
    from checkpoint_store.retention import EveryNSteps

    with session.start(storage_path="s3://bucket/runs", experiment_name="exp",
                       local_tier=LocalTier("/local_nvme/ckpt", num_to_keep=2,
                                            persist=EveryNSteps(1))) as s:
        start = s.get_checkpoint()        # the newest complete copy, fast tier first
        ...
        row = s.report({"loss": loss}, checkpoint=Checkpoint.from_directory(tmp))
        s.wait(checkpoint=row)            # until its copy on S3 is committed

``report()`` commits on the local tier (the same protocol as any local
storage: staging, CRC32C manifest, marker last) and returns; the
checkpoints ``LocalTier.persist`` selects are uploaded to the storage_path
(the persistent tier) in the background, in report order, committed and
registered with the session's ``CheckpointConfig`` retention there, which is
unchanged. The local tier keeps its newest ``num_to_keep`` and never deletes
one whose durable copy is pending; its state (which indexes are committed,
which durable copies are pending) is in ``.cs_tier_state.json`` in its trial
directory (docs/format.md), so a killed run's pending copies are persisted by
the next session. See docs/tiers.md.

Layer: above :mod:`~checkpoint_store.retention` and
:mod:`~checkpoint_store.storage`, below :mod:`~checkpoint_store.session`,
which calls it (this package never imports the session).

* :mod:`~checkpoint_store.tiers.config`: :class:`LocalTier`.
* :mod:`~checkpoint_store.tiers.local`: :class:`FastTier`, the local tier of one
  trial on one rank: opening, commits, the copy to the persistent tier.
* :mod:`~checkpoint_store.tiers.statefile`: its state file and :class:`TierEntry`.
* :mod:`~checkpoint_store.tiers.eviction`: its retention (eviction, backpressure).
* :mod:`~checkpoint_store.tiers.verify`: the verification of its copies for restore.
"""

from __future__ import annotations

from checkpoint_store._format.layout import TIER_STATE_FILE
from checkpoint_store.tiers.config import LocalTier, PersistPolicy, check_local_tier
from checkpoint_store.tiers.local import FastTier
from checkpoint_store.tiers.statefile import (
    DurableStatus,
    TierEntry,
    local_trial_dir,
    read_tier_state,
)

__all__ = [
    "TIER_STATE_FILE",
    "DurableStatus",
    "FastTier",
    "LocalTier",
    "PersistPolicy",
    "TierEntry",
    "check_local_tier",
    "local_trial_dir",
    "read_tier_state",
]
