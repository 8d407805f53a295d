"""Top-K retention: keep the best ``num_to_keep`` checkpoints of a trial, delete the rest.

:class:`CheckpointConfig` has the fields and meaning of Ray Train's
``CheckpointConfig`` (plus ``keep_latest`` and ``missing_score``);
:class:`CheckpointManager` applies it to the committed checkpoints of one
trial; :func:`select_kept` is the same decision as a pure function, without
storage (the CLI's ``prune`` uses it). The semantics, as a table, are in
docs/retention.md:

* score: ``metrics[attr]`` if that literal key exists, else a nested lookup
  along ``/`` (``"eval/loss"`` -> ``metrics["eval"]["loss"]``). Without a
  score attribute, the most recent checkpoints are kept. A value that is not
  a number (str, bool, list, dict) is refused when it is registered.
* NaN and missing scores follow ``missing_score``: ``"worst"`` ranks them
  below every number in both orders (with one warning per attribute),
  ``"keep"`` never evicts them, ``"raise"`` refuses the report. They are
  never ranked best, and they tie with each other.
* ties go to the newer checkpoint (higher index). The kept set is a function
  of the registered ``(index, score)`` pairs alone.
* the latest checkpoint is kept besides the best K (resume needs it), unless
  ``keep_latest=False``; ``num_to_keep=None`` keeps everything.
* order is the index recorded in each checkpoint's internal metadata, never
  modification times or names.

Durability and ownership: the state goes to ``<trial>/.checkpoint_manager.json``
(atomically) before any evicted directory is deleted, so a new process
restores it; if the file is missing or corrupt, the state is rebuilt from the
committed checkpoints with a warning. The state holds a run id, which the
session also writes into every checkpoint's internal metadata; the manager
deletes only committed checkpoints of its own run, never an uncommitted
directory or a checkpoint of another run. One live manager per trial holds a
lease (``<trial>/.cs_manager_lease.json``, renewed in the background, expiring
``lease_ttl_s`` after its holder stops renewing); a second one is refused.

Where each part lives, one idea per module, each calling only those above it
in this list:

* :mod:`~checkpoint_store.retention.config`: :class:`CheckpointConfig`.
* :mod:`~checkpoint_store.retention.scoring`: :func:`lookup_metric`,
  :func:`score_of` and :func:`rank_key`, the one order every ranking uses.
* :mod:`~checkpoint_store.retention.policies`: the policies (``BestN``,
  ``LatestN``, ``EveryNSteps``, ``EveryNSeconds``, ``Steps``, ``AnyOf``, a
  callable) and :func:`evaluate`, the one evaluation.
* :mod:`~checkpoint_store.retention.selection`: :func:`select_kept`,
  :func:`explain_kept` and the manager's incremental form.
* :mod:`~checkpoint_store.retention.lease`: the lease and its keeper thread,
  :func:`live_lease`.
* :mod:`~checkpoint_store.retention.state`: the state file, and
  :func:`recorded_invalid`, the checkpoints it records as damaged.
* :mod:`~checkpoint_store.retention.rebuild`: what a new manager rebuilds
  from the state and the trial's listing at a restart.
* :mod:`~checkpoint_store.retention.deletes`: the delete of an evicted
  checkpoint, and the deleter thread.
* :mod:`~checkpoint_store.retention.manager`: :class:`CheckpointManager`.
"""

from __future__ import annotations

from checkpoint_store.retention.config import CheckpointConfig, MissingScore, ScoreOrder
from checkpoint_store.retention.lease import LEASE_FILE, LeaseBody, live_lease
from checkpoint_store.retention.manager import CheckpointManager
from checkpoint_store.retention.policies import (
    AnyOf,
    BestN,
    Custom,
    EveryNSeconds,
    EveryNSteps,
    KeepAll,
    LatestN,
    PolicyCheckpoint,
    RetentionPolicy,
    Steps,
    UnstoredPolicy,
    evaluate,
    policy_from_json,
)
from checkpoint_store.retention.scoring import (
    NOT_FOUND,
    lookup_metric,
    rank_key,
    score_of,
    score_or_none,
)
from checkpoint_store.retention.selection import CheckpointRecord, explain_kept, select_kept
from checkpoint_store.retention.statelog import recorded_invalid

__all__ = [
    "AnyOf",
    "BestN",
    "CheckpointConfig",
    "Custom",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepAll",
    "LatestN",
    "PolicyCheckpoint",
    "RetentionPolicy",
    "Steps",
    "UnstoredPolicy",
    "evaluate",
    "explain_kept",
    "policy_from_json",
    "CheckpointManager",
    "CheckpointRecord",
    "LEASE_FILE",
    "LeaseBody",
    "MissingScore",
    "NOT_FOUND",
    "ScoreOrder",
    "live_lease",
    "lookup_metric",
    "rank_key",
    "recorded_invalid",
    "score_of",
    "score_or_none",
    "select_kept",
]
