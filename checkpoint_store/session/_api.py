"""The active session and the module-level calls on it (``start``, ``report`` ...).

:mod:`checkpoint_store.session` re-exports them; they live here so that the
:class:`~checkpoint_store.session.TrialRunner`, which calls ``start`` and
``report`` from its trial thread, imports them without importing the package
that re-exports it.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import (
    CheckpointAbortedError,
    CheckpointStoreError,
    RankTimeoutError,
    TrialStopped,
)
from checkpoint_store.retention import CheckpointConfig
from checkpoint_store.session._preemption import PreemptionConfig
from checkpoint_store.session._session import AUTO_FILLED, Session, SessionContext
from checkpoint_store.session._uploads import UploadConfig
from checkpoint_store.storage import StorageContext
from checkpoint_store.tiers import LocalTier

__all__ = [
    "AUTO_FILLED",
    "CheckpointAbortedError",
    "RankTimeoutError",
    "TrialStopped",
    "Session",
    "UploadConfig",
    "SessionContext",
    "start",
    "report",
    "get_checkpoint",
    "get_context",
    "get_session",
    "next_checkpoint_dir",
    "reached_preemption",
    "wait",
]

_local = threading.local()
_process_session: Session | None = None
_state_lock = threading.Lock()


class _ActiveSession:
    """Context manager returned by :func:`start`; ends the session on exit."""

    def __init__(self, session: Session, thread_only: bool):
        self.session = session
        self._thread_only = thread_only
        _activate(session, thread_only)

    def __enter__(self) -> Session:
        return self.session

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        _deactivate(self.session, exc)

    def end(self, error: BaseException | None = None) -> None:
        """End the session; ``error``: the exception that ended the run, if any
        (recorded in the trial's ``error.txt``, see :meth:`Session.close`)."""
        _deactivate(self.session, error)


def _activate(session: Session, thread_only: bool) -> None:
    global _process_session
    if getattr(_local, "session", None) is not None:
        raise CheckpointStoreError(
            "a session is already active in this thread; end it before starting another"
        )
    _local.session = session
    if not thread_only:
        with _state_lock:
            if _process_session is None:
                _process_session = session


def _deactivate(session: Session, error: BaseException | None = None) -> None:
    try:
        session.close(error)
    finally:
        _forget(session)


def _forget(session: Session) -> None:
    global _process_session
    if getattr(_local, "session", None) is session:
        _local.session = None
    with _state_lock:
        if _process_session is session:
            _process_session = None


def start(
    *,
    storage_path: str | os.PathLike[str] = "~/checkpoint_store_results",
    experiment_name: str = "default",
    trial_name: str = "default",
    checkpoint_config: CheckpointConfig | None = None,
    upload_config: UploadConfig | None = None,
    storage_filesystem: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    world_rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    attempt_id: str | None = None,
    sync_timeout_s: float = 1800.0,
    max_concurrency: int | None = None,
    memory_budget: int | None = None,
    incremental: bool = True,
    resume_from: Checkpoint | str | os.PathLike[str] | None = None,
    local_tier: LocalTier | None = None,
    preemption: PreemptionConfig | bool | None = None,
    _thread_only: bool = False,
) -> _ActiveSession:
    """Start a session; use as ``with session.start(...) as s:``.

    Args:
        storage_path: where experiments live (local path or URI); see
            :class:`~checkpoint_store.StorageContext`.
        experiment_name, trial_name: layout names, one path component each.
        checkpoint_config: retention rules (default: keep all).
        upload_config: how ``report()`` uploads (default: synchronously);
            :class:`UploadConfig`.
        storage_filesystem: a pyarrow or fsspec filesystem used for all I/O.
        storage_options: backend options for a URI ``storage_path``.
        config: the trial's hyperparameters, written to ``params.json``.
        world_rank, world_size, local_rank: default to the ``RANK``,
            ``WORLD_SIZE``, ``LOCAL_RANK`` environment variables torchrun sets
            (else 0, 1, 0).
        attempt_id: with ``world_size > 1``, an id shared by every rank of this
            launch and unique per launch (letters, digits, ``_.-``). Default:
            broadcast by rank 0 when a torch.distributed process group is
            initialised, else ``TORCHELASTIC_RUN_ID`` plus the restart count
            (torchrun sets both). Ignored for a single rank.
        sync_timeout_s: with ``world_size > 1``, the longest any rank waits for
            the others (start and each checkpoint), in seconds; then
            :class:`RankTimeoutError` lists the missing ranks.
        max_concurrency, memory_budget, incremental: how checkpoints move
            (requests in flight, bytes buffered at once, reuse of unchanged
            files); see :class:`~checkpoint_store.StorageContext`.
        resume_from: a committed checkpoint of another run (a
            :class:`Checkpoint`, a local path or a URI on any backend; pass a
            ``Checkpoint(uri, storage_options=...)`` for backend options) to
            start from, the way Ray starts a trial from another run's
            checkpoint: ``get_checkpoint()`` returns it until this trial
            commits its own. A starting point, read once: a trial that has
            checkpoints of its own resumes from them and never reads it again
            (it may be gone by then); a trial without is refused unless it is
            committed and verifies (sizes and CRC32C), before anything is
            written. Recorded in ``params.json`` under ``"_resume_from"``, and
            never registered, moved or deleted by this trial, whatever its
            retention. This trial's indexes start at 0 as usual.
        local_tier: a fast local tier (:class:`~checkpoint_store.LocalTier`)
            in front of ``storage_path``: ``report()`` commits there and
            returns, the checkpoints its ``persist`` policy selects reach
            ``storage_path`` in the background, and ``get_checkpoint()``
            reads the newest complete copy from the fastest tier that holds
            it. See docs/tiers.md.
        preemption: a :class:`PreemptionConfig` (or True for its defaults:
            SIGTERM, 30 s of grace): a preemption signal sets
            :func:`reached_preemption`, the next ``report()`` commits its
            checkpoint on the storage_path, ends the session as
            ``preempted`` and raises :class:`~checkpoint_store.errors.Preempted`
            (a ``SystemExit`` with the scheduler's exit status); see
            docs/preemption.md. Without it, a session in the main thread
            still turns an unhandled SIGTERM into ``SystemExit(143)`` so that
            its acknowledged saves are committed and its lease released.

    Raises:
        InvalidConfigError: bad names, location, config or ranks, or several
            ranks and no attempt id; ``resume_from`` is not a checkpoint
            reference, or is one of this trial; nothing is written.
        CheckpointNotFoundError: the trial has no checkpoint of its own and
            ``resume_from`` is missing or not committed; nothing is written
            to a new trial.
        CheckpointCorruptError: the same, and ``resume_from`` fails
            verification.
        CheckpointStoreError: a session is already active in this thread.
        CheckpointConflictError: another live session holds the trial (rank 0).
        RankTimeoutError: a rank > 0 waited ``sync_timeout_s`` for rank 0 to start.
    """
    storage = StorageContext(
        storage_path, experiment_name, trial_name,
        storage_filesystem=storage_filesystem, storage_options=storage_options,
        max_concurrency=max_concurrency, memory_budget=memory_budget, incremental=incremental,
    )
    if getattr(_local, "session", None) is not None:
        raise CheckpointStoreError(
            "a session is already active in this thread; end it before starting another"
        )
    sess = Session(
        storage, checkpoint_config, upload_config=upload_config, config=config,
        world_rank=world_rank, world_size=world_size, local_rank=local_rank,
        attempt_id=attempt_id, sync_timeout_s=sync_timeout_s, resume_from=resume_from,
        local_tier=local_tier, preemption=preemption,
    )
    return _ActiveSession(sess, _thread_only)


def get_session() -> Session:
    """The active session of this thread (else of the process).

    Raises:
        CheckpointStoreError: no session is active.
    """
    s = getattr(_local, "session", None) or _process_session
    if s is None:
        raise CheckpointStoreError(
            "no active session: wrap your loop in `with checkpoint_store.session.start(...):`"
        )
    return s


def report(
    metrics: Mapping[str, Any], *, checkpoint: Checkpoint | None = None,
    upload_mode: str | None = None, staging: str | None = None,
    state: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Report ``metrics`` (and optionally a checkpoint, or a ``state`` saved
    from memory) to the active session.

    Same role as Ray Train's ``ray.train.report``. See :meth:`Session.report`
    (``upload_mode="async"`` returns before the upload; see :func:`wait`;
    ``state=``: docs/sessions.md, "Saving from memory").
    """
    ray = _ray_session()
    if ray is not None:
        if state is None:
            return ray.report(metrics, checkpoint=checkpoint)
        return ray.report(metrics, checkpoint=checkpoint, state=state)
    if state is not None:
        return get_session().report(metrics, checkpoint=checkpoint, upload_mode=upload_mode,
                                    state=state)
    if upload_mode is None and staging is None:
        return get_session().report(metrics, checkpoint=checkpoint)
    return get_session().report(metrics, checkpoint=checkpoint, upload_mode=upload_mode,
                                staging=staging)


def wait(timeout: float | None = None, *, checkpoint: Any = None) -> None:
    """Wait until the active session's background uploads are committed (or,
    given ``checkpoint``, until that checkpoint is durable).

    See :meth:`Session.wait`; raises the first background upload error.
    """
    get_session().wait(timeout, checkpoint=checkpoint)


def next_checkpoint_dir() -> str:
    """Where the active session's next checkpoint lives, to save into in place
    (``dcp.save(state, checkpoint_id=...)``); see :meth:`Session.next_checkpoint_dir`."""
    return get_session().next_checkpoint_dir()


def get_checkpoint() -> Checkpoint | None:
    """The newest committed checkpoint of the active trial, for resuming
    (under Ray without a session of ours: Ray's restored checkpoint)."""
    ray = _ray_session()
    if ray is not None:
        return ray.get_checkpoint()
    return get_session().get_checkpoint()


def _ray_session() -> Any:
    """Inside a Ray Train worker or Ray Tune function trainable, and only when no
    session of ours is active: the Ray integration's session, to which
    :func:`report` and :func:`get_checkpoint` forward
    (:func:`checkpoint_store.integrations.ray.active_session`). None otherwise.
    Imports nothing unless Ray is already loaded, so the core never imports Ray."""
    if "ray" not in sys.modules or getattr(_local, "session", None) or _process_session:
        return None
    module, _, name = _FOREIGN_SESSION.partition(":")
    active_session = getattr(importlib.import_module(module), name)
    return active_session()


#: The framework adapter whose session :func:`report` and :func:`get_checkpoint`
#: forward to, named as a dotted string (as the backend registry names its
#: built-ins): the session layer sits below the integrations and does not
#: import them; the adapter is imported on first use, only once Ray is loaded,
#: in a Ray worker that never imported it itself too.
_FOREIGN_SESSION = "checkpoint_store.integrations.ray:active_session"


def get_context() -> SessionContext:
    """Names, ranks and storage of the active session."""
    return get_session().get_context()


def reached_preemption() -> bool:
    """Whether the active session received a preemption signal
    (``start(preemption=...)``): save now, with the next ``report()``. As
    Orbax's ``reached_preemption``; False without an active session or
    without ``preemption=``. With several ranks and a torch.distributed
    process group, the flag the ranks exchanged: it turns True on every rank
    at the same report, whichever rank got the signal, and the next report
    is every rank's preemption checkpoint; without a group, this rank's own
    flag (the signal travels in the next checkpoint report's rank markers).
    See docs/sessions.md, "A preemption signal with several ranks"."""
    sess = getattr(_local, "session", None) or _process_session
    return sess is not None and sess.reached_preemption
