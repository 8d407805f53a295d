"""``report(metrics, checkpoint=...)`` and friends, the same in every loop.

Usage::

    from checkpoint_store import session, Checkpoint, CheckpointConfig

    with session.start(storage_path="s3://bucket/runs", experiment_name="exp",
                       trial_name="t0", checkpoint_config=CheckpointConfig(num_to_keep=3)):
        start = session.get_checkpoint()      # None, or the newest committed one
        for epoch in range(10):
            ...
            session.report({"loss": loss}, checkpoint=Checkpoint.from_directory(tmp))

The active session is per thread (a tuning trial runs in its own thread),
falling back to the one started first in the process, so helper threads of a
training loop report into the same session.
"""

from __future__ import annotations

from checkpoint_store.errors import (
    CheckpointAbortedError,
    Preempted,
    RankTimeoutError,
    TrialStopped,
)
from checkpoint_store.session._api import _ray_session as _ray_session
from checkpoint_store.session._api import (
    get_checkpoint,
    get_context,
    get_session,
    next_checkpoint_dir,
    reached_preemption,
    report,
    start,
    wait,
)
from checkpoint_store.session._preemption import PreemptionConfig
from checkpoint_store.session._preemption import install_handlers as install_preemption_handlers
from checkpoint_store.session._session import AUTO_FILLED, Session, SessionContext
from checkpoint_store.session._trial_runner import TrialRunner
from checkpoint_store.session._uploads import UploadConfig
from checkpoint_store.tiers import LocalTier

__all__ = [
    "AUTO_FILLED",
    "CheckpointAbortedError",
    "Preempted",
    "PreemptionConfig",
    "RankTimeoutError",
    "TrialRunner",
    "TrialStopped",
    "Session",
    "UploadConfig",
    "LocalTier",
    "SessionContext",
    "start",
    "report",
    "get_checkpoint",
    "get_context",
    "get_session",
    "install_preemption_handlers",
    "next_checkpoint_dir",
    "reached_preemption",
    "wait",
]
