"""The manager: applies a :class:`CheckpointConfig` to the committed checkpoints of one trial.

Owns registration (a committed checkpoint enters the kept set, evicted ones
are deleted after the state is written), the restore of a new manager from
the state file or, when that is missing or corrupt, from the checkpoints'
internal metadata, ownership (a run id: only this run's committed
checkpoints are ever deleted), the record of checkpoints a read found
damaged (never ranked, resumed from or deleted) and the queries the session
and tools ask (best, latest, kept). The decision itself is
:class:`~checkpoint_store.retention.selection.Selection`; the lease is
:mod:`~checkpoint_store.retention.lease`; the file is
:mod:`~checkpoint_store.retention.state`; what a restore rebuilds is
:mod:`~checkpoint_store.retention.rebuild`; the delete of an evicted
checkpoint is :mod:`~checkpoint_store.retention.deletes`.
"""

from __future__ import annotations

import logging
import math
import posixpath
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import MANAGER_STATE, parse_checkpoint_dir_name
from checkpoint_store.checkpoint import Checkpoint, written_metadata
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointStoreError,
    InvalidConfigError,
)
from checkpoint_store.retention.config import CheckpointConfig
from checkpoint_store.retention.deletes import Deleter, delete_evicted, uncommit_evicted
from checkpoint_store.retention.lease import Lease
from checkpoint_store.retention.policies import PolicyCheckpoint, check_metrics, evaluate
from checkpoint_store.retention.rebuild import is_ours, rebuild
from checkpoint_store.retention.recorded import config_for
from checkpoint_store.retention.restore import Candidates, created_at
from checkpoint_store.retention.scoring import missing_score_error, score_of
from checkpoint_store.retention.selection import Entry, Selection, check_report
from checkpoint_store.retention.state import (
    LogRecord,
    ManagerState,
    StoredCheckpoint,
)
from checkpoint_store.retention.statelog import StateLog
from checkpoint_store.storage import StorageContext

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager"]

def _release_collected(lease: Lease) -> None:
    """Release the lease of a manager collected without :meth:`close`. A
    finalizer runs inside whatever code triggered the collection, often on
    another thread and in another test or session: nothing may escape it
    (an escaped error is only printed as "Exception ignored"), so even a
    ``BaseException`` from the storage client (a simulated crash, a
    ``KeyboardInterrupt`` that landed in the client) is logged and dropped,
    and the lease then expires by itself."""
    try:
        lease.release()
    except BaseException as exc:  # noqa: BLE001  see above
        logger.debug("could not release the lease %s of a collected manager: %r",
                     lease.path, exc)


class CheckpointManager:
    """Keeps the best K committed checkpoints of one trial and deletes the rest.

    Args:
        config: the retention rules.
        storage: the trial's :class:`StorageContext`; every I/O goes through it.
        read_only: restore and answer queries, but never write the state,
            delete, take the lease or register (for inspection tools). Given
            the default ``CheckpointConfig()``, a read-only manager applies
            the config the trial recorded, so :attr:`best_checkpoint` is the
            best by the recorded metric and order; a config naming another
            metric or order warns (:mod:`~checkpoint_store.retention.recorded`).
        lease_ttl_s: seconds after which the lease of a holder that stopped
            renewing (a crash on another host) expires. Renewed every third of it.
        background_deletes: delete evicted checkpoints on a background thread
            (:mod:`~checkpoint_store.retention.deletes`) instead of inside
            :meth:`register`; the eviction is in the state before either.
            :meth:`wait_deletes` and :meth:`close` wait for them. A session's
            manager does (default False: ``register`` returns once deleted).

    A new manager on a trial that already has checkpoints restores its state
    from ``.checkpoint_manager.json``, or rebuilds it from the committed
    checkpoints' internal metadata with a warning when the file is missing
    or corrupt. A checkpoint it hands out (best, latest, resume candidates)
    that a read finds damaged keeps no slot: see :meth:`mark_invalid`.
    Memory is O(num_to_keep) however many checkpoints are
    registered. Use as a context manager, or call :meth:`close`, to release
    the lease (a :class:`~checkpoint_store.session.Session` does it when it ends).

    Raises:
        InvalidConfigError: bad arguments, or a state file from a newer format.
        CheckpointConflictError: another live manager holds the trial's lease.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        storage: StorageContext,
        *,
        read_only: bool = False,
        lease_ttl_s: float = 60.0,
        background_deletes: bool = False,
    ):
        if not isinstance(config, CheckpointConfig):
            raise InvalidConfigError(
                f"config must be a CheckpointConfig, got {type(config).__name__}"
            )
        if not isinstance(storage, StorageContext):
            raise InvalidConfigError(
                f"storage must be a StorageContext, got {type(storage).__name__}"
            )
        if (
            isinstance(lease_ttl_s, bool)
            or not isinstance(lease_ttl_s, (int, float))
            or not lease_ttl_s > 0
            or not math.isfinite(lease_ttl_s)
        ):
            raise InvalidConfigError(f"lease_ttl_s must be a positive number, got {lease_ttl_s!r}")
        config = config_for(config, storage, read_only=bool(read_only))
        self.config = config
        self._storage = storage
        self._read_only = bool(read_only)
        self._sel = Selection(config)
        self._warned: set[str] = set()
        self._pending: list[str] = []
        # Pending names a delete is working on right now (the deleter's, off the mutex).
        self._deleting: set[str] = set()
        # Pending name -> what its uncommit left (``_uncommit_evicted``), for the deleter.
        self._leftovers: dict[str, str] = {}
        self._deleter: Deleter | None = Deleter(self._delete_due) if background_deletes else None
        self._foreign: list[str] = []
        self._foreign_meta: dict[str, Mapping[str, Any]] = {}
        self.restored_from_state = False
        #: Why the stored state could not be used at restore (``"corrupt (...)"``,
        #: ``"unreadable (...)"``), or None: read whole, or none there.
        self.state_problem: str | None = None
        #: The trial directory's listing made at restore, for the start's cleanup
        #: to reuse; None when the restore deleted a checkpoint since.
        self.restore_listing: list[pafs.FileInfo] | None = None
        #: ``dir_name -> index`` of the committed checkpoints in ``restore_listing``
        #: (inspected at restore): a cleanup need not inspect them again.
        self.restore_known: dict[str, int] = {}
        self._uncommitted: list[str] = []
        #: ``dir_name -> why``: committed checkpoints a read found damaged.
        self._invalid: dict[str, str] = {}
        # A damaged checkpoint may be found by a download on the user's thread
        # while a background upload registers another.
        self._mutex = threading.RLock()
        self._next_index = 0
        self._closed = False
        self._log = StateLog(storage)
        self.run_id: str = ""
        self._lease: Lease | None = None
        try:
            # Inside the try: a signal's exception once the lease is taken
            # (before the finalizer is registered) releases it too; else the
            # keeper renews a lease no manager holds for as long as the
            # process lives, and the next manager of this trial is refused.
            if not self._read_only:
                self._lease = Lease(storage, lease_ttl_s)
                self._lease.acquire()
                weakref.finalize(self, _release_collected, self._lease)
            self._restore()
        except BaseException:
            if self._lease is not None:
                self._lease.release()
            raise

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the background deletes, fold the state's log records into a
        snapshot, then release the lease. Idempotent; safe while an exception
        propagates. The manager is read-only afterwards."""
        self.wait_deletes()
        if not self.read_only and self._log.records:
            # Fold the run's log records into one snapshot, so a finished trial
            # holds no .cs_state-log-* files (a failure is logged: the records
            # stay, and the next writer folds them in).
            try:
                with self._mutex:
                    self._save_state()
            except Exception as exc:  # noqa: BLE001 - closing goes on
                logger.warning("could not compact the retention state of %s: %s",
                               self._storage.uri(self._storage.trial_path), exc)
        self._closed = True
        if self._lease is not None:
            self._lease.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_deletes(self, timeout: float | None = None) -> bool:
        """Wait until the background deletes scheduled so far are done (or
        failed: logged, still in :attr:`pending_deletes`, retried later).

        Returns:
            True when none is running, False after ``timeout`` seconds.
        """
        return self._deleter is None or self._deleter.wait(timeout)

    @property
    def read_only(self) -> bool:
        """True when this manager writes and deletes nothing: opened read-only,
        closed, or its lease was taken over by another manager."""
        return (
            self._read_only or self._closed or (self._lease is not None and self._lease.lost)
        )

    # -- registration --------------------------------------------------------------------

    def validate_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Raise exactly as :meth:`register` would for these metrics, touching nothing.

        The session calls it before uploading, so a refused report leaves no
        checkpoint behind.

        Raises:
            MetadataError: ``metrics`` is not a JSON object of serialisable values.
            InvalidConfigError: the score is not numeric, or missing under
                ``missing_score="raise"``; a policy answers with something other
                than indexes.
        """
        clean = _json.to_json_object(metrics, "metrics")
        if self.config.policy is not None:
            check_metrics(self.config.policy, clean)
            # A policy that answers badly is refused before anything is uploaded.
            views = [e.view() for e in self._sel.ordered()]
            views.append(PolicyCheckpoint(self._next_index, "", clean, time.time()))
            evaluate(self.config.effective_policy(), views)
        attr = self.config.checkpoint_score_attribute
        if attr is None:
            return
        if score_of(metrics, attr) is None and self.config.missing_score == "raise":
            raise missing_score_error(attr)

    def register(self, checkpoint: Checkpoint, metrics: Mapping[str, Any]) -> list[str]:
        """Track a newly committed checkpoint of this trial and apply retention.

        The state is written before anything is deleted. With
        ``background_deletes`` the evicted checkpoints are deleted after this
        call returns, else before. A delete that fails is logged and retried
        at the next registration (or by the next manager); it never makes
        this call fail.

        Args:
            checkpoint: a committed checkpoint directly inside this trial.
            metrics: the metrics reported with it (JSON-serialisable).

        Returns:
            Directory names evicted by this call (deleted, or scheduled for a
            retried delete).

        Raises:
            InvalidConfigError: the score is not numeric, or missing under
                ``missing_score="raise"``; the checkpoint is not committed, or not
                in this trial. Nothing is written or deleted then.
            MetadataError: ``metrics`` is not JSON-serialisable.
            CheckpointConflictError: the checkpoint's internal metadata names
                another run.
            CheckpointStoreError: this manager is read-only or closed.
        """
        with self._mutex:
            return self._register(checkpoint, metrics)

    def _register(self, checkpoint: Checkpoint, metrics: Mapping[str, Any]) -> list[str]:
        if self._read_only or self._closed:
            raise CheckpointStoreError(
                "this checkpoint manager is read-only or closed; create a new "
                "CheckpointManager (or session) to register checkpoints"
            )
        clean = _json.to_json_object(metrics, "metrics")
        index = self._registrable_index(checkpoint)
        score = check_report(self.config, clean, index, self._warned, stacklevel=3)
        dir_name = posixpath.basename(checkpoint.path.rstrip("/"))
        if dir_name in self._pending:
            self._pending.remove(dir_name)
        created = created_at(written_metadata(checkpoint))
        evicted = self._sel.add(Entry(index, dir_name, score, clean, created))
        self._next_index = max(self._next_index, index + 1)
        names = [e.dir_name for e in evicted]
        self._pending.extend(n for n in names if n not in self._pending)
        if self.read_only:  # lease lost: remember, never write or delete
            return names
        record = LogRecord(0, StoredCheckpoint(index, dir_name, score, clean, created),
                           evict=tuple(names), next_index=self._next_index)
        if self._log.append(record, self._state):
            self._uncommit_evicted()
            self._schedule_deletes()
        return names

    def _registrable_index(self, checkpoint: Checkpoint) -> int:
        """The index of ``checkpoint`` if this manager may register it.

        Raises:
            InvalidConfigError: not committed, or not a directory of this trial.
            CheckpointConflictError: its internal metadata names another run.
        """
        trial = self._storage.trial_path.rstrip("/")
        if posixpath.dirname(checkpoint.path.rstrip("/")) != trial:
            raise InvalidConfigError(
                f"checkpoint {checkpoint.uri} is not a directory of trial "
                f"{self._storage.uri(trial)}; persist it with StorageContext.persist_checkpoint"
            )
        meta = written_metadata(checkpoint)
        index = meta.get("index")
        if isinstance(index, bool) or not isinstance(index, int):
            raise InvalidConfigError(
                f"{checkpoint.uri} is not a committed checkpoint (no index in its internal "
                "metadata); only committed checkpoints can be registered"
            )
        owner = meta.get("run_id")
        if owner is not None and owner != self.run_id:
            raise CheckpointConflictError(
                f"{checkpoint.uri} belongs to run {owner!r}, not to this trial's run "
                f"{self.run_id!r}; it is left alone"
            )
        return index

    # -- queries ------------------------------------------------------------------------------

    @property
    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest kept checkpoint (highest index), or None.

        With ``keep_latest=True`` (the default) it is the newest registered
        one; a checkpoint that was evicted is never returned.
        """
        top = self._sel.newest()
        return self._handout(top.dir_name) if top is not None else None

    @property
    def latest_index(self) -> int | None:
        """The highest index registered (or restored), kept or not; None before any."""
        return self._sel.latest_index

    @property
    def next_index(self) -> int:
        """An index no checkpoint of this trial has used: numbering continues after
        restores and evictions."""
        return self._next_index

    @property
    def best_checkpoints(self) -> list[tuple[Checkpoint, dict[str, Any]]]:
        """Kept checkpoints with their metrics, best first (ties: newer first;
        NaN/missing last). Without a score attribute, most recent first."""
        return [
            (self._handout(e.dir_name), dict(e.metrics)) for e in self._sel.ranked()
        ]

    @property
    def best_checkpoint(self) -> Checkpoint | None:
        """The best kept checkpoint, or None before the first registration.

        A NaN or missing score is never best while any number is kept."""
        ranked = self._sel.ranked()
        return self._handout(ranked[0].dir_name) if ranked else None

    @property
    def kept_dir_names(self) -> list[str]:
        """Directory names of the kept checkpoints, oldest first."""
        return [e.dir_name for e in self._sel.ordered()]

    @property
    def kept_scores(self) -> dict[str, float | None]:
        """``dir_name -> score`` of the kept checkpoints (None: NaN or missing;
        the index when ranking by recency)."""
        return {e.dir_name: e.score for e in self._sel.ordered()}

    def resume_candidates(self) -> Candidates:
        """The checkpoints a resume may load, oldest first, with what is known of
        them (``index``, ``metrics``, ``created_at``): the kept ones and the
        committed ones of another run found at restore. Their files are not
        checked here: the caller verifies the one it hands out
        (:meth:`StorageContext.latest_verified_checkpoint`). Each item is built
        when first read (a resume reads the newest one or two of them)."""
        def meta(e: Entry) -> dict[str, Any]:
            return {"index": e.index, "metrics": e.metrics, "created_at": e.created_at}

        foreign = [(i, n, dict(self._foreign_meta.get(n) or {"index": i})) for n in self._foreign
                   if (i := parse_checkpoint_dir_name(n)) is not None]

        def items() -> list[tuple[str, dict[str, Any]]]:
            out = [(e.index, e.dir_name, meta(e)) for e in self._sel.ordered()] + foreign
            out.sort(key=lambda t: (t[0], t[1]))
            return [(n, m) for _, n, m in out]

        top = self._sel.newest()  # without reading a lazy state's chunks
        tops = foreign + ([(top.index, top.dir_name, meta(top))] if top is not None else [])
        newest = max(tops, key=lambda t: (t[0], t[1]), default=None)
        return Candidates(self._handout, items,
                          None if newest is None else (newest[1], newest[2]))

    def known_committed(self) -> dict[str, int]:
        """``dir_name -> index`` of the committed checkpoints this manager knows
        (kept, and another run's found at restore), for a cleanup that need not
        inspect them again."""
        known = {e.dir_name: e.index for e in self._sel.ordered()}
        known.update((n, i) for n in self._foreign
                     if (i := parse_checkpoint_dir_name(n)) is not None)
        return known

    # -- damaged checkpoints ------------------------------------------------------------------

    def _handout(self, dir_name: str) -> Checkpoint:
        """The Checkpoint of ``dir_name``, reporting damage its reads find back here."""
        ref = weakref.ref(self)

        def found(exc: CheckpointCorruptError) -> None:
            manager = ref()
            if manager is not None:
                manager.mark_invalid(dir_name, " ".join(str(exc).split()))

        return self._storage.checkpoint(dir_name)._report_corrupt_to(found)

    def mark_invalid(self, dir_name: str, reason: str) -> bool:
        """Record that a read found the kept (or another run's) checkpoint
        ``dir_name`` damaged: a file missing, added, or not matching its size or
        CRC32C. It leaves the ranking and the resume candidates at once, so good
        checkpoints are kept in its place; it is never deleted by retention;
        the retention state records it (a restart, ``ls``, ``best`` and the
        web page know it without reading its bytes again). Warns once.

        Called by the reads of the checkpoints this manager hands out
        (:meth:`Checkpoint.verify`, :meth:`Checkpoint.to_directory`, the
        resume's verification in ``get_checkpoint()``).

        Returns:
            True when newly recorded; False when already recorded, evicted
            (its delete is due anyway) or not a checkpoint this manager knows.
        """
        with self._mutex:
            if dir_name in self._invalid or dir_name in self._pending:
                return False
            if dir_name in self._foreign:
                self._foreign.remove(dir_name)
            elif dir_name in self._sel.kept:
                self._sel.kept.pop(dir_name, None)
            else:
                return False
            self._invalid[dir_name] = reason
            trial = self._storage.uri(self._storage.trial_path)
            warnings.warn(
                f"checkpoint {dir_name} of trial {trial} is invalid ({reason}); it is left "
                "out of the ranking and of resume, and kept on storage (never deleted by "
                "retention): inspect it, then delete it by hand", RuntimeWarning, stacklevel=2)
            if not self.read_only:
                self._log.append(LogRecord(0, invalid=((dir_name, reason),)), self._state)
            return True

    @property
    def invalid(self) -> dict[str, str]:
        """``dir_name -> why`` of this trial's checkpoints found damaged (by a
        read, or at restore by their listing not matching the manifest), still
        on storage. Never ranked, resumed from or deleted."""
        return dict(self._invalid)

    @property
    def pending_deletes(self) -> list[str]:
        """Evicted directory names not deleted yet: being deleted in the
        background, or whose delete failed and will be retried."""
        return list(self._pending)

    @property
    def foreign_dir_names(self) -> list[str]:
        """Committed checkpoints in this trial that name another run or trial in
        their internal metadata. Never deleted, never ranked."""
        return list(self._foreign)

    @property
    def uncommitted_dir_names(self) -> list[str]:
        """``checkpoint_NNNNNN`` directories without a commit marker found at restore
        (an interrupted upload, a hand-made directory). Never deleted by the manager."""
        return list(self._uncommitted)

    # -- state ---------------------------------------------------------------------------------

    @property
    def state_path(self) -> str:
        """Path (within the storage filesystem) of ``.checkpoint_manager.json``."""
        return posixpath.join(self._storage.trial_path, MANAGER_STATE)


    def _state(self) -> ManagerState:
        return ManagerState(
            run_id=self.run_id,
            config=self.config.to_json(),
            latest_index=self._sel.latest_index,
            next_index=self._next_index,
            checkpoints={e.dir_name: StoredCheckpoint(e.index, e.dir_name, e.score, e.metrics,
                                                      e.created_at)
                         for e in self._sel.ordered()},
            pending_deletes=tuple(self._pending),
            invalid=dict(self._invalid),
        )

    def _save_state(self) -> bool:
        """Write a snapshot of the state; False (logged) when storage refused it, in
        which case nothing may be deleted yet."""
        return self._log.compact(self._state())

    def _is_ours(self, meta: Mapping[str, Any]) -> bool:
        return is_ours(meta, self.run_id, self._storage.trial_name)

    def _schedule_deletes(self) -> None:
        """Delete the pending evictions: now, or on the deleter thread."""
        if not self._pending:
            return
        if self._deleter is None:
            self._delete_pending()
        else:
            self._deleter.kick()

    def _uncommit_evicted(self) -> None:
        """With background deletes: take every pending eviction out of the
        listings now (the caller holds the mutex; the eviction is in the
        state), so that when ``register`` returns readers see exactly the
        kept set. The deleter removes what is left."""
        if self._deleter is None:
            return  # the deletes run inline, before register returns
        for name in self._pending:
            if name in self._deleting or name in self._leftovers:
                continue
            left = uncommit_evicted(self._storage, name, self._is_ours, self._foreign)
            if left is not None:
                self._leftovers[name] = left

    def _delete_due(self) -> None:
        """One round of the deleter thread: the deletes run outside the mutex
        (a report registering meanwhile does not wait for them)."""
        with self._mutex:
            if self.read_only:
                return
            names = [n for n in self._pending if n not in self._deleting]
            self._deleting.update(names)
        try:
            self._delete_names(names)
        finally:
            with self._mutex:
                self._deleting.difference_update(names)

    def _delete_pending(self) -> None:
        self._delete_names([n for n in self._pending if n not in self._deleting])

    def _delete_names(self, names: list[str]) -> None:
        if not names:
            return
        if self._lease is not None and not self._lease.check():
            return
        done = tuple(name for name in names if self._delete_evicted(name))
        if done:
            with self._mutex:
                self._pending = [n for n in self._pending if n not in done]
                for name in done:
                    self._leftovers.pop(name, None)
                if not self.read_only:
                    self._log.append(LogRecord(0, deleted=done), self._state)

    def _delete_evicted(self, name: str) -> bool:
        """Delete one evicted checkpoint; False (logged) to retry it later. True also
        when it now belongs to another run: then it is left alone for good."""
        with self._mutex:
            left = self._leftovers.get(name)
        return delete_evicted(self._storage, name, self._is_ours, self._foreign, left)

    def retry_deletes(self) -> list[str]:
        """Retry the failed deletes now; returns the names still pending."""
        self.wait_deletes()
        with self._mutex:
            if not self.read_only:
                self._delete_pending()
            return list(self._pending)

    # -- restore -----------------------------------------------------------------------------

    def _restore(self) -> None:
        """Take over the trial from its stored state, checking only what can have
        changed since its last record: one listing of the trial, and an
        inspection of each directory the state does not know (newer
        checkpoints, leftovers, foreign ones) and of the newest kept one (the
        one a resume loads). Without a usable state, every committed
        checkpoint's internal metadata rebuilds it. Then resume any deletes
        that were due."""
        r = rebuild(self.config, self._storage, self._log, self._sel, self._warned,
                    self._next_index, self.state_path, read_only=self._read_only)
        self.restored_from_state = r.restored_from_state
        self.state_problem = r.state_problem
        self.run_id = r.run_id
        self.restore_listing = r.restore_listing
        self.restore_known = r.restore_known
        self._invalid = r.invalid
        self._pending = r.pending
        self._uncommitted = r.uncommitted
        self._foreign = r.foreign
        self._foreign_meta = r.foreign_meta
        self._next_index = r.next_index
        if self._read_only:
            return
        if r.needs_write and self._save_state():
            if self._pending:
                self.restore_listing = None
            self._delete_pending()
        elif not r.needs_write:
            self._log.collect_garbage()
