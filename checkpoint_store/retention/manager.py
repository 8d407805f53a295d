"""The manager: applies a :class:`CheckpointConfig` to the committed checkpoints of one trial.

Owns registration (a committed checkpoint enters the kept set, evicted ones
are deleted after the state is written), the restore of a new manager from
the state file or, when that is missing or corrupt, from the checkpoints'
internal metadata, ownership (a run id: only this run's committed
checkpoints are ever deleted) and the queries the session and tools ask
(best, latest, kept). The decision itself is
:class:`~checkpoint_store.retention.selection.Selection`; the lease is
:mod:`~checkpoint_store.retention.lease`; the file is
:mod:`~checkpoint_store.retention.state`.
"""

from __future__ import annotations

import logging
import math
import posixpath
import time
import uuid
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import pyarrow.fs as pafs

from checkpoint_store import _fsutil, _json
from checkpoint_store._layout import MANAGER_STATE, parse_checkpoint_dir_name
from checkpoint_store._manifest import inspect_checkpoint, read_internal_metadata
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointStoreError,
    InvalidConfigError,
)
from checkpoint_store.retention.config import CheckpointConfig
from checkpoint_store.retention.lease import Lease
from checkpoint_store.retention.policies import PolicyCheckpoint, check_metrics, evaluate
from checkpoint_store.retention.scoring import config_score, missing_score_error, score_of
from checkpoint_store.retention.selection import Entry, Selection, check_report
from checkpoint_store.retention.state import LogRecord, ManagerState, StoredCheckpoint
from checkpoint_store.retention.statelog import StateLog
from checkpoint_store.storage import StorageContext

__all__ = ["CheckpointManager"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Committed:
    """A committed checkpoint directory found at restore."""

    index: int
    dir_name: str
    meta: Mapping[str, Any]


@dataclass
class _Listing:
    """One listing of the trial directory: all a restart lists."""

    files: set[str] = field(default_factory=set)
    dirs: dict[str, int] = field(default_factory=dict)  # checkpoint_NNNNNN -> index
    entries: list[pafs.FileInfo] = field(default_factory=list)

    @classmethod
    def of(cls, storage: StorageContext) -> _Listing:
        listing = cls()
        listing.entries = _fsutil.list_dir(storage.filesystem, storage.trial_path,
                                           retry=storage.retry)
        for fi in listing.entries:
            name = posixpath.basename(fi.path.rstrip("/"))
            index = parse_checkpoint_dir_name(name)
            if fi.type == pafs.FileType.File:
                listing.files.add(name)
            elif index is not None:
                listing.dirs[name] = index
        return listing


@dataclass
class _Scan:
    """What a trial directory holds, as restore sees it."""

    committed: list[_Committed] = field(default_factory=list)  # oldest first
    present: set[str] = field(default_factory=set)
    highest_dir_index: int = -1
    uncommitted: list[str] = field(default_factory=list)
    corrupt: dict[str, str] = field(default_factory=dict)  # name -> what is wrong


def _scan(storage: StorageContext, listing: _Listing, names: list[str]) -> _Scan:
    """Inspect the ``checkpoint_NNNNNN`` directories ``names`` of ``listing``:
    committed, corrupt, or not committed."""
    scan = _Scan(present=set(listing.dirs), highest_dir_index=max(listing.dirs.values(),
                                                                  default=-1))
    for name in sorted(names, key=listing.dirs.__getitem__):
        insp = inspect_checkpoint(storage.filesystem, posixpath.join(storage.trial_path, name),
                                  retry=storage.retry)
        if insp.state == "committed" and insp.meta is not None:
            scan.committed.append(_Committed(insp.meta["index"], name, insp.meta))
        elif insp.state == "invalid":
            # A commit marker whose files no longer match it (a file added,
            # removed or resized): corrupt, not an unfinished write.
            scan.corrupt[name] = insp.reason or "does not match its manifest"
        else:
            scan.uncommitted.append(name)
    scan.committed.sort(key=lambda c: c.index)
    return scan


def _created_at(meta: Mapping[str, Any]) -> float | None:
    """``created_at`` of internal metadata, when it is a number."""
    value = meta.get("created_at")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _run_id_of(committed: list[_Committed], trial_name: str) -> str:
    """Without a state file: the run id of the newest committed checkpoint of this
    trial, else a new one."""
    mine = [c.meta["run_id"] for c in committed
            if c.meta.get("trial_name") in (None, trial_name)
            and isinstance(c.meta.get("run_id"), str)]
    return mine[-1] if mine else uuid.uuid4().hex


class _Candidates(Sequence[tuple[Checkpoint, dict[str, Any]]]):
    """``(Checkpoint, meta)`` pairs built on first read, the same object after."""

    def __init__(self, storage: StorageContext, items: list[tuple[str, dict[str, Any]]]):
        self._storage = storage
        self._items = items
        self._built: dict[int, tuple[Checkpoint, dict[str, Any]]] = {}

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, i: int) -> tuple[Checkpoint, dict[str, Any]]: ...

    @overload
    def __getitem__(self, i: slice) -> list[tuple[Checkpoint, dict[str, Any]]]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        j = i + len(self._items) if i < 0 else i
        if not 0 <= j < len(self._items):
            raise IndexError(i)
        if j not in self._built:
            name, meta = self._items[j]
            self._built[j] = (self._storage.checkpoint(name), dict(meta))
        return self._built[j]


class CheckpointManager:
    """Keeps the best K committed checkpoints of one trial and deletes the rest.

    Args:
        config: the retention rules.
        storage: the trial's :class:`StorageContext`; every I/O goes through it.
        read_only: restore and answer queries, but never write the state,
            delete, take the lease or register (for inspection tools).
        lease_ttl_s: seconds after which the lease of a holder that stopped
            renewing (a crash on another host) expires. Renewed every third of it.

    A new manager on a trial that already has checkpoints restores its state
    from ``.checkpoint_manager.json``, or rebuilds it from the committed
    checkpoints' internal metadata with a warning when the file is missing
    or corrupt. Memory is O(num_to_keep) however many checkpoints are
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
        self.config = config
        self._storage = storage
        self._read_only = bool(read_only)
        self._sel = Selection(config)
        self._warned: set[str] = set()
        self._pending: list[str] = []
        self._foreign: list[str] = []
        self._foreign_meta: dict[str, Mapping[str, Any]] = {}
        self.restored_from_state = False
        #: The trial directory's listing made at restore, for the start's cleanup
        #: to reuse; None when the restore deleted a checkpoint since.
        self.restore_listing: list[pafs.FileInfo] | None = None
        self._uncommitted: list[str] = []
        self._next_index = 0
        self._closed = False
        self._log = StateLog(storage)
        self.run_id: str = ""
        self._lease: Lease | None = None
        if not self._read_only:
            self._lease = Lease(storage, lease_ttl_s)
            self._lease.acquire()
            weakref.finalize(self, self._lease.release)
        try:
            self._restore()
        except BaseException:
            if self._lease is not None:
                self._lease.release()
            raise

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Release the lease. Idempotent; safe while an exception propagates.
        The manager is read-only afterwards."""
        self._closed = True
        if self._lease is not None:
            self._lease.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

        The state is written before anything is deleted. A delete that fails
        is logged and retried at the next registration (or by the next
        manager); it never makes this call fail.

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
        created_at = _created_at(checkpoint.internal_metadata)
        evicted = self._sel.add(Entry(index, dir_name, score, clean, created_at))
        self._next_index = max(self._next_index, index + 1)
        names = [e.dir_name for e in evicted]
        self._pending.extend(n for n in names if n not in self._pending)
        if self.read_only:  # lease lost: remember, never write or delete
            return names
        record = LogRecord(0, StoredCheckpoint(index, dir_name, score, clean, created_at),
                           evict=tuple(names), next_index=self._next_index)
        if self._log.append(record, self._state):
            self._delete_pending()
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
        meta = checkpoint.internal_metadata
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
        kept = self._sel.ordered()
        return self._storage.checkpoint(kept[-1].dir_name) if kept else None

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
            (self._storage.checkpoint(e.dir_name), dict(e.metrics)) for e in self._sel.ranked()
        ]

    @property
    def best_checkpoint(self) -> Checkpoint | None:
        """The best kept checkpoint, or None before the first registration.

        A NaN or missing score is never best while any number is kept."""
        ranked = self._sel.ranked()
        return self._storage.checkpoint(ranked[0].dir_name) if ranked else None

    @property
    def kept_dir_names(self) -> list[str]:
        """Directory names of the kept checkpoints, oldest first."""
        return [e.dir_name for e in self._sel.ordered()]

    @property
    def kept_scores(self) -> dict[str, float | None]:
        """``dir_name -> score`` of the kept checkpoints (None: NaN or missing;
        the index when ranking by recency)."""
        return {e.dir_name: e.score for e in self._sel.ordered()}

    def resume_candidates(self) -> Sequence[tuple[Checkpoint, dict[str, Any]]]:
        """The checkpoints a resume may load, oldest first, with what is known of
        them (``index``, ``metrics``, ``created_at``): the kept ones and the
        committed ones of another run found at restore. Their files are not
        checked here: the caller verifies the one it hands out
        (:meth:`StorageContext.latest_verified_checkpoint`). Each item is built
        when first read (a resume reads the newest one or two of them)."""
        out = [(e.index, e.dir_name, {"index": e.index, "metrics": e.metrics,
                                      "created_at": e.created_at})
               for e in self._sel.ordered()]
        out += [(i, n, dict(self._foreign_meta.get(n) or {"index": i})) for n in self._foreign
                if (i := parse_checkpoint_dir_name(n)) is not None]
        out.sort(key=lambda t: (t[0], t[1]))
        return _Candidates(self._storage, [(n, meta) for _, n, meta in out])

    def known_committed(self) -> dict[str, int]:
        """``dir_name -> index`` of the committed checkpoints this manager knows
        (kept, and another run's found at restore), for a cleanup that need not
        inspect them again."""
        known = {e.dir_name: e.index for e in self._sel.ordered()}
        known.update((n, i) for n in self._foreign
                     if (i := parse_checkpoint_dir_name(n)) is not None)
        return known

    @property
    def pending_deletes(self) -> list[str]:
        """Evicted directory names whose delete failed and will be retried."""
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
        )

    def _save_state(self) -> bool:
        """Write a snapshot of the state; False (logged) when storage refused it, in
        which case nothing may be deleted yet."""
        return self._log.compact(self._state())

    def _is_ours(self, meta: Mapping[str, Any]) -> bool:
        owner = meta.get("run_id")
        if owner is not None:
            return bool(owner == self.run_id)
        # Written before run ids existed (or by hand): judge by the trial name.
        trial = meta.get("trial_name")
        return trial is None or trial == self._storage.trial_name

    def _delete_pending(self) -> None:
        if not self._pending:
            return
        if self._lease is not None and not self._lease.check():
            return
        remaining = [name for name in self._pending if not self._delete_evicted(name)]
        if remaining != self._pending:
            done = tuple(n for n in self._pending if n not in remaining)
            self._pending = remaining
            self._log.append(LogRecord(0, deleted=done), self._state)

    def _delete_evicted(self, name: str) -> bool:
        """Delete one evicted checkpoint; False (logged) to retry it later. True also
        when it now belongs to another run: then it is left alone for good."""
        try:
            path = posixpath.join(self._storage.trial_path, name)
            meta = read_internal_metadata(self._storage.filesystem, path)
            if meta is not None and not self._is_ours(meta):
                # Replaced by another run's checkpoint since we evicted it.
                logger.warning("not deleting %s: it now belongs to run %r",
                               name, meta.get("run_id"))
                if name not in self._foreign:
                    self._foreign.append(name)
                return True
            self._storage.delete_checkpoint(name)
            return True
        except Exception as exc:  # never fail a report for a delete
            logger.warning("could not delete %s (retried at the next report): %s", name, exc)
            return False

    def retry_deletes(self) -> list[str]:
        """Retry the failed deletes now; returns the names still pending."""
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
        listing = _Listing.of(self._storage)
        self.restore_listing = listing.entries
        state, problem = self._log.load(listing.files)
        self.restored_from_state = state is not None
        trusted = ({} if state is None else
                   {n: e for n, e in state.checkpoints.items() if n in listing.dirs})
        pending_before = set(state.pending_deletes) if state is not None else set()
        unknown = [n for n in listing.dirs if n not in trusted and n not in pending_before]
        if trusted:
            unknown.append(max(trusted.values(), key=lambda e: e.index).dir_name)
        scan = _scan(self._storage, listing, unknown)
        for name in scan.corrupt.keys() | set(scan.uncommitted):
            trusted.pop(name, None)
        self.run_id = (state.run_id if state is not None
                       else _run_id_of(scan.committed, self._storage.trial_name))
        evicted = self._rebuild_selection(scan, state, trusted)
        self._continue_numbering(scan, state)
        self._log_restore(scan, state, problem)
        if self._read_only:
            return
        learned = any(c.dir_name not in trusted and self._is_ours(c.meta) and
                      c.dir_name not in pending_before for c in scan.committed)
        needs_write = (state is None and bool(scan.committed) or bool(evicted)
                       or bool(self._pending) or learned
                       or (state is not None and (state.config != self.config.to_json()
                                                  or trusted.keys() != state.checkpoints.keys())))
        if needs_write and self._save_state():
            if self._pending:
                self.restore_listing = None
            self._delete_pending()
        elif not needs_write:
            self._log.collect_garbage()

    def _rebuild_selection(self, scan: _Scan, state: ManagerState | None,
                           trusted: Mapping[str, StoredCheckpoint]) -> list[Entry]:
        """Register the kept checkpoints of the state (``trusted``) and this run's
        committed checkpoints found by ``scan`` again; returns those the config
        evicts now (queued for deletion with the deletes the state had pending)."""
        pending_before = set(state.pending_deletes) if state is not None else set()
        stored = state.checkpoints if state is not None else {}
        # Pending deletes resume, also for half-deleted directories (marker gone).
        self._pending = [n for n in sorted(pending_before) if n in scan.present]
        self._uncommitted = [n for n in scan.uncommitted if n not in pending_before]
        found: dict[str, tuple[int, Mapping[str, Any], float | None]] = {
            n: (e.index, e.metrics, e.created_at) for n, e in trusted.items()}
        for c in scan.committed:
            if not self._is_ours(c.meta):
                self._foreign.append(c.dir_name)
                self._foreign_meta[c.dir_name] = c.meta
                continue
            if c.dir_name in pending_before:
                continue
            metrics = c.meta.get("metrics")
            if not isinstance(metrics, Mapping):
                metrics = stored[c.dir_name].metrics if c.dir_name in stored else {}
            found[c.dir_name] = (c.index, metrics, _created_at(c.meta))
        evicted: list[Entry] = []
        for name, (index, metrics, created_at) in sorted(found.items(),
                                                         key=lambda kv: kv[1][0]):
            score = config_score(self.config, metrics, index, self._warned, lenient=True,
                                 stacklevel=6)
            evicted.extend(self._sel.add(Entry(index, name, score, dict(metrics), created_at)))
        for e in evicted:
            if e.dir_name not in self._pending:
                self._pending.append(e.dir_name)
        return evicted

    def _continue_numbering(self, scan: _Scan, state: ManagerState | None) -> None:
        """Numbering continues past every index a directory, a registration or the
        state remembers (also a latest that was deleted by hand)."""
        following = [self._next_index, scan.highest_dir_index + 1]
        if self._sel.latest_index is not None:
            following.append(self._sel.latest_index + 1)
        if state is not None and state.latest_index is not None:
            following.append(state.latest_index + 1)
        if state is not None and state.next_index is not None:
            following.append(state.next_index)
        self._next_index = max(following)

    def _warn_corrupt(self, scan: _Scan) -> None:
        """Name each corrupt checkpoint and why; say so louder when it is the
        newest, since resume then falls back to an older one."""
        if not scan.corrupt:
            return
        storage = self._storage
        trial = storage.uri(storage.trial_path)
        newest = max(scan.corrupt, key=lambda n: parse_checkpoint_dir_name(n) or -1)
        if (parse_checkpoint_dir_name(newest) or -1) == scan.highest_dir_index:
            kept = self._sel.ordered()
            fallback = (f"resume falls back to {kept[-1].dir_name}"
                        if kept else "no committed checkpoint is left to resume from")
            warnings.warn(
                f"the newest checkpoint of trial {trial}, {newest}, is corrupt "
                f"({scan.corrupt[newest]}): {fallback}; `checkpoint-store verify {trial}` "
                "names every fault", RuntimeWarning, stacklevel=5,
            )
        logger.warning(
            "trial %s holds corrupt checkpoints (files not matching their manifest), ignored "
            "and never deleted by retention: %s", trial,
            "; ".join(f"{n} ({why})" for n, why in sorted(scan.corrupt.items())),
        )

    def _log_restore(self, scan: _Scan, state: ManagerState | None, problem: str) -> None:
        storage = self._storage
        if state is None and scan.committed:
            warnings.warn(
                f"retention state {storage.uri(self.state_path)} is {problem}; rebuilt it from "
                f"{len(scan.committed)} committed checkpoint(s)' internal metadata",
                RuntimeWarning,
                stacklevel=4,
            )
        if self._foreign:
            logger.warning(
                "trial %s holds checkpoints of another run, left alone: %s",
                storage.uri(storage.trial_path), ", ".join(self._foreign),
            )
        self._warn_corrupt(scan)
        if self._uncommitted:
            logger.warning(
                "trial %s holds uncommitted checkpoint directories, ignored and never deleted "
                "by retention: %s", storage.uri(storage.trial_path), ", ".join(self._uncommitted),
            )
