"""The local tier of one trial on one rank: fast commits, per-tier retention,
the state file, the background copy to the persistent tier, and restore.

The class is in three parts: this module (opening, queries, commits, the copy
to the persistent tier, the state file's writes), :class:`TierRetention`
(:mod:`~checkpoint_store.tiers.eviction`) and :class:`TierVerification`
(:mod:`~checkpoint_store.tiers.verify`); the state file's records and reads
are in :mod:`~checkpoint_store.tiers.statefile`.

A :class:`FastTier` knows two storages: its own (a :class:`StorageContext`
on the local tier's path, local backend) and the persistent one (the
session's storage_path), which it only reads (is this index committed
there?). Committing to the persistent tier and registering with its
retention are the caller's: :meth:`FastTier.persist` takes them as a
callback, so this module never imports the session.

Thread-safety: one report thread calls :meth:`commit` / :meth:`commit_staged`
/ :meth:`make_room`; one background thread at a time runs :meth:`persist`;
every change of the state happens under one condition variable, which also
wakes :meth:`wait_durable` and the backpressure of :meth:`make_room`.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import time
from collections.abc import Callable, Mapping
from typing import Any

from checkpoint_store._format.layout import (
    INTERNAL_METADATA,
    TIER_STATE_FILE,
    checkpoint_dir_name,
    is_temp_file_name,
    local_tier_rank_dir_name,
    parse_checkpoint_dir_name,
)
from checkpoint_store._util.inspect import inspect_checkpoint
from checkpoint_store._util.locks import condition
from checkpoint_store.checkpoint import Checkpoint, written_metadata
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointStoreError,
    InvalidConfigError,
    MetadataError,
)
from checkpoint_store.retention.deletes import Deleter
from checkpoint_store.retention.policies import PolicyCheckpoint
from checkpoint_store.storage import StorageContext
from checkpoint_store.tiers.config import LocalTier
from checkpoint_store.tiers.eviction import TierRetention
from checkpoint_store.tiers.history import LOCAL_DURABLE_URI, TrialHistory, durable_trial_uri
from checkpoint_store.tiers.lock import TierLock
from checkpoint_store.tiers.statefile import (
    TIER_STATE_VERSION,
    DurableStatus,
    TierEntry,
    _manifest_bytes,
    _read_evicting,
    _write_atomic,
    local_trial_dir,
    read_tier_state,
)
from checkpoint_store.tiers.verify import TierVerification

__all__ = ["DurableStatus", "FastTier", "TierEntry", "local_trial_dir", "read_tier_state",
           "source_bytes"]

logger = logging.getLogger(__name__)

# What a local copy lost since its commit was, by its recorded durable status.
_DURABLE_WORDS = {"durable": "its copy on the storage_path is committed",
                  "pending": "its copy on the storage_path was pending: that checkpoint is lost",
                  "local_only": "it was on the local tier only: that checkpoint is lost"}

#: Errors a retry of the copy to the persistent tier cannot cure.
_FINAL = (CheckpointConflictError, CheckpointNotFoundError, CheckpointCorruptError,
          InvalidConfigError, MetadataError)


def source_bytes(checkpoint: Checkpoint) -> int:
    """Bytes of the files in a local checkpoint directory (0 when unknown)."""
    if not checkpoint.is_local:
        return 0
    total = 0
    for dirpath, _dirs, files in os.walk(checkpoint.path):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


class FastTier(TierRetention, TierVerification):
    """The local tier of one trial on one rank.

    Args:
        config: the :class:`LocalTier`.
        durable: the persistent tier's storage (the session's), read only here.
        world_rank, world_size: this rank; with ``world_size > 1`` the tier's
            trial directory is ``<path>/<experiment>/<trial>/rank_<rank>``.
        run_id: the run id of the tier's StorageContext (cleanup spares it).

    The constructor opens the tier: creates the trial directory, removes what
    a killed writer left unfinished there, and reads the state file (rebuilt
    from the committed directories when missing or damaged). Nothing is
    verified yet: :meth:`newest_verified` checks copies, newest first.
    """

    def __init__(self, config: LocalTier, durable: StorageContext, *, world_rank: int = 0,
                 world_size: int = 1, run_id: str | None = None):
        self.config = config
        self.durable = durable
        self.world_rank = world_rank
        self.world_size = world_size
        exp, trial = durable.experiment_name, durable.trial_name
        if world_size > 1:
            self.storage = StorageContext(os.path.join(config.path, exp), trial,
                                          local_tier_rank_dir_name(world_rank),
                                          fsync=config.fsync, run_id=run_id)
        else:
            self.storage = StorageContext(config.path, exp, trial, fsync=config.fsync,
                                          run_id=run_id)
        self._mutex, self._cond = condition()  # enter _mutex, not the condition
        self._entries: dict[int, TierEntry] = {}
        # Copies to the persistent tier that failed for good in this session.
        self._failed: dict[int, BaseException] = {}
        # Indexes a copy is queued for (set by the report thread, cleared by persist()).
        self._queued: set[int] = set()
        self._last_selected: PolicyCheckpoint | None = None
        # Indexes sent to the persistent tier whatever ``persist`` says (a
        # preemption checkpoint must outlive this machine).
        self._forced: set[int] = set()
        # The newest forced index (one rank): older pending copies are skipped.
        self._preempted_at: int | None = None
        self._skipped: set[int] = set()
        self._verified: set[int] = set()
        #: Seconds :meth:`make_room` waited for space, summed.
        self.blocked_s = 0.0
        # Evicted (out of the state file's checkpoints, in its "evicting" list),
        # deleted off the report thread by the deleter.
        self._evicting: set[int] = set()
        self._tier_leftovers: dict[int, str] = {}
        # The highest index of a checkpoint_<index> directory found at open,
        # committed or not (one cleanup kept: not ours): never numbered again.
        self._dir_high = -1
        # The highest index known durable, kept after the tier evicts its copy.
        self._durable_high = -1
        self._deleter = Deleter(self._delete_evicted, name="checkpoint-store-tier-delete")
        self._open()

    # -- opening ----------------------------------------------------------------------

    @property
    def trial_dir(self) -> str:
        """The tier's trial directory (a local path)."""
        return self.storage.trial_path

    @property
    def state_path(self) -> str:
        return os.path.join(self.trial_dir, TIER_STATE_FILE)

    def _durable_uri(self) -> str:
        return durable_trial_uri(self.durable)

    def _refuse_foreign(self, copies: list[tuple[Checkpoint, dict[str, Any]]]) -> None:
        """Refuse a local trial directory that holds another persistent tier's
        checkpoints (the same experiment and trial names under another
        storage_path): its state file names that trial, or one of its
        committed ``copies`` does (the state file may be missing or damaged)."""
        try:
            with open(self.state_path, "rb") as f:
                body = json.loads(f.read())
        except (OSError, ValueError):
            body = None
        theirs = body.get("durable_uri") if isinstance(body, dict) else None
        ours = self._durable_uri()
        if not isinstance(theirs, str) or theirs == ours:
            theirs = next((meta[LOCAL_DURABLE_URI] for _, meta in copies
                           if isinstance(meta.get(LOCAL_DURABLE_URI), str)
                           and meta[LOCAL_DURABLE_URI] != ours), None)
        if theirs is not None:
            raise InvalidConfigError(
                f"the local tier directory {self.trial_dir} holds the checkpoints of "
                f"{theirs}, not of {ours}; give LocalTier another path, or "
                "delete that directory if its checkpoints are not needed (its state file "
                f"{TIER_STATE_FILE} says which durable copies are still pending)")

    def _open(self) -> None:
        # Taken before the state is read, held until close(): two jobs never
        # both pass _refuse_foreign and share the directory (tiers/lock.py).
        self._dir_lock = TierLock(self.trial_dir, self._durable_uri())
        try:
            self._open_locked()
        except BaseException:
            self._dir_lock.release()
            raise

    def close(self) -> None:
        """Release the tier's trial directory (the session's end; idempotent)."""
        self._dir_lock.release()

    def _open_locked(self) -> None:
        self.storage.ensure_trial_dir()
        # Listed once: the cleanup below removes only what is not committed.
        committed = self.storage.committed_checkpoints()
        self._refuse_foreign(committed)
        try:
            # The lock is ours: whatever is unfinished here is a dead writer's.
            self.storage.remove_uncommitted(sole_owner=True)
        except Exception as exc:  # a leftover never stops a run from starting
            logger.warning("cleanup of the local tier %s failed: %s", self.trial_dir, exc)
        for name in os.listdir(self.trial_dir):  # a state write a kill cut short
            if is_temp_file_name(name):
                try:
                    os.unlink(os.path.join(self.trial_dir, name))
                except OSError:
                    pass
        recorded = read_tier_state(self.trial_dir)
        if recorded is None and os.path.exists(self.state_path):
            logger.warning("the local tier state %s is unreadable; rebuilding it from the "
                           "committed checkpoints there", self.state_path)
        recorded = recorded or {}
        evicting = _read_evicting(self.trial_dir)
        # Rank 0's copies carry the rows the trial records (tiers/history.py).
        history = TrialHistory(self.durable) if self.world_rank == 0 else None
        stale: list[tuple[Checkpoint, str]] = []
        found: list[tuple[Checkpoint, dict[str, Any], int]] = []
        for ckpt, meta in committed:
            index = meta.get("index")
            if not isinstance(index, int) or parse_checkpoint_dir_name(
                    posixpath.basename(ckpt.path)) != index:
                continue
            if index in evicting and index not in recorded:
                self._evicting.add(index)  # evicted, then killed before its delete ended
                continue
            found.append((ckpt, meta, index))
        reset = None if history is None else history.reset_reason(
            (index, meta, recorded[index].durable if index in recorded else None)
            for _, meta, index in found)
        for ckpt, meta, index in found:
            entry = recorded.get(index)
            why = None
            if history is not None and reset is not None:
                why = None if history.knows(index, meta) else reset
            elif history is not None and (entry is None or entry.durable != "durable"):
                why = history.stale_reason(index, meta)
            if why is not None:  # another run's report owns this index now
                stale.append((ckpt, why))
                continue
            agrees = (history.durable_agrees(index, meta) if history is not None
                      else self._durable_has(index))
            if entry is None:
                # Committed here, then killed before the state recorded it:
                # the persistent tier says whether its copy landed.
                status: DurableStatus = ("durable" if agrees else
                                         "pending" if self._selects(index, meta) else
                                         "local_only")
                entry = TierEntry(index, _manifest_bytes(meta), status)
            elif entry.durable == "pending" and agrees:
                entry.durable = "durable"  # killed after the durable commit
            self._entries[index] = entry
        self._lost_since(recorded, {index for _, _, index in found})
        self._save()
        for ckpt, why in stale:
            self._drop_stale(ckpt, why)
        self._skip_present_indexes()
        if self._evicting:
            self._deleter.kick()

    def _lost_since(self, recorded: Mapping[int, TierEntry], committed: set[int]) -> None:
        """Say which copies the state file records as committed here are no
        longer (a file truncated or deleted, the marker emptied or cut short,
        the directory gone): the restore goes back past them, which must not
        happen unsaid. What is left of one is removed; its index is never
        numbered again (its row may be on the storage_path)."""
        fs = self.storage.filesystem
        for index, entry in sorted(recorded.items()):
            if index in committed or index in self._evicting:
                continue
            self._dir_high = max(self._dir_high, index)
            path = self.storage.checkpoint_path(index)
            insp = inspect_checkpoint(fs, path)
            what = ("is gone" if insp.state == "missing" else
                    f"is damaged ({insp.reason})" if insp.reason else "is no longer committed")
            status = entry.durable
            if status == "pending" and self._durable_has(index):
                status = "durable"  # its durable commit landed before the state said so
            logger.warning("the local tier's %s %s since its commit there (%s); it is not "
                           "restored: the restore takes the storage_path's copy of that index "
                           "if there is one, else an older checkpoint",
                           self.storage.uri(path), what, _DURABLE_WORDS[status])
            if insp.state != "missing":
                try:
                    self.storage.delete_checkpoint(checkpoint_dir_name(index))
                except Exception as exc:  # never restored anyway; left for a person
                    logger.warning("could not delete %s: %s", self.storage.uri(path), exc)

    def _skip_present_indexes(self) -> None:
        """Number past every ``checkpoint_<index>`` directory still here after
        cleanup and the stale copies' removal, committed or not (one being
        evicted, one whose removal failed): a state or in-place save writes straight
        into ``checkpoint_<index>`` and must never meet another writer's files
        there. One cleanup kept holds no trace of our writers (copied in by
        hand, say): it is left alone, with a warning."""
        for name in os.listdir(self.trial_dir):
            index = parse_checkpoint_dir_name(name)
            if index is None or not os.path.isdir(os.path.join(self.trial_dir, name)):
                continue
            self._dir_high = max(self._dir_high, index)
            if not os.path.exists(os.path.join(self.trial_dir, name, INTERNAL_METADATA)):
                logger.warning("the local tier's %s is not a checkpoint of this tool (no "
                               "trace of its writers): left alone, and its index is never "
                               "used; delete it if it is not needed",
                               os.path.join(self.trial_dir, name))

    def _drop_stale(self, ckpt: Checkpoint, why: str) -> None:
        """Delete a stale local copy (tiers/history.py): never restored, never
        persisted over the trial's own copy of its index."""
        logger.warning("the local tier's %s is not the trial's copy of its index: %s; it is "
                       "removed from the local tier (never restored or persisted)", ckpt.uri, why)
        try:
            self.storage.delete_checkpoint(posixpath.basename(ckpt.path.rstrip("/")))
        except Exception as exc:  # the next start finds it stale again
            logger.warning("could not delete %s: %s", ckpt.uri, exc)

    def _durable_has(self, index: int) -> bool:
        try:
            ckpt = self.durable.checkpoint(checkpoint_dir_name(index))
            return ckpt.is_committed
        except Exception:
            return False

    def _selects(self, index: int, meta: Mapping[str, Any]) -> bool:
        try:
            return self.config.selects(index, meta.get("metrics") or {},
                                       created_at=meta.get("created_at"))
        except InvalidConfigError:
            return True  # a rule that cannot decide: persisting loses nothing

    # -- queries ----------------------------------------------------------------------

    def entries(self) -> list[TierEntry]:
        """The committed checkpoints of this tier, oldest first (copies)."""
        with self._mutex:
            return [TierEntry(e.index, e.bytes, e.durable)
                    for _, e in sorted(self._entries.items())]

    @property
    def next_index(self) -> int:
        """One past the highest index committed on this tier, or of any
        ``checkpoint_<index>`` directory found there at open (0 when empty)."""
        with self._mutex:
            return max(max(self._entries, default=-1), self._dir_high) + 1

    @property
    def used_bytes(self) -> int:
        with self._mutex:
            return sum(e.bytes for e in self._entries.values())

    @property
    def durable_index(self) -> int | None:
        """The highest index whose copy on the persistent tier is committed
        (known to this tier), or None."""
        with self._mutex:
            done = [i for i, e in self._entries.items() if e.durable == "durable"]
            high = max(done + [self._durable_high])
            return high if high >= 0 else None

    def status(self, index: int) -> DurableStatus | None:
        """Where checkpoint ``index`` stands (None: not on this tier)."""
        with self._mutex:
            e = self._entries.get(index)
            return e.durable if e is not None else None

    def pending(self) -> list[int]:
        """Indexes whose copy to the persistent tier is pending, oldest first."""
        with self._mutex:
            return sorted(i for i, e in self._entries.items() if e.durable == "pending")

    def checkpoint(self, index: int) -> Checkpoint:
        """The local tier's copy of ``index`` (not checked)."""
        return self.storage.checkpoint(checkpoint_dir_name(index))

    # -- reporting ----------------------------------------------------------------------

    def selects(self, index: int, row: Mapping[str, Any]) -> bool:
        """Whether the persist policy sends ``index`` (reported with ``row``) to
        the persistent tier; remembers it as the last selected one if so."""
        now = time.time()
        chosen = (index in self._forced
                  or self.config.selects(index, row, self._last_selected, created_at=now))
        if chosen:
            self._last_selected = PolicyCheckpoint(index, checkpoint_dir_name(index), dict(row),
                                                   now)
        return chosen

    def force_persist(self, index: int) -> None:
        """Send ``index`` to the persistent tier when it is committed here,
        whatever ``persist`` selects (a preemption checkpoint).

        With one rank, the copies of older checkpoints still queued are
        skipped from now on (recorded as local only: the tier's retention
        may take them, and a restart does not copy them): the preemption
        checkpoint supersedes them as the resume point, and a backlog of
        copies (a local tier much faster than the storage_path) would
        otherwise hold its copy past the grace period. With several ranks
        every rank copies the same indexes (their commits are joint), so
        nothing is skipped."""
        self._forced.add(index)
        if self.world_size == 1:
            self._preempted_at = max(index, self._preempted_at or index)

    def commit(self, source: Checkpoint, index: int, internal: Mapping[str, Any],
               row: Mapping[str, Any], *, writer_id: str | None = None) -> tuple[Checkpoint, bool]:
        """Commit ``source`` as ``checkpoint_<index>`` of this tier and record it.

        Returns:
            The committed copy and whether ``persist`` selected it (then its
            durable copy is recorded as pending: the caller queues
            :meth:`persist`).

        Raises:
            Whatever :meth:`StorageContext.persist_checkpoint` raises; nothing
            is recorded then.
        """
        committed = self.storage.persist_checkpoint(source, index, self._stamped(internal),
                                                    writer_id=writer_id)
        return committed, self._record(index, committed, row)

    def commit_in_place(self, index: int, internal: Mapping[str, Any],
                        row: Mapping[str, Any]) -> tuple[Checkpoint, bool]:
        """Commit ``checkpoint_<index>`` of this tier, filled in place
        (:meth:`reserve_in_place`); see :meth:`commit`."""
        committed = self.storage.commit_in_place(index, self._stamped(internal))
        return committed, self._record(index, committed, row)

    def _stamped(self, internal: Mapping[str, Any]) -> dict[str, Any]:
        """``internal`` naming the persistent tier's trial this copy belongs to:
        a later session of another trial never adopts it, even when the state
        file that names that trial is gone (:meth:`_refuse_foreign`)."""
        return {**internal, LOCAL_DURABLE_URI: self._durable_uri()}

    def reserve_in_place(self, index: int) -> str:
        """Create and claim ``checkpoint_<index>`` of this tier for a writer that
        saves straight into it; returns its local path."""
        return self.storage.reserve_in_place(index)

    def commit_staged(self, source: Any, index: int, internal: Mapping[str, Any],
                      row: Mapping[str, Any]) -> tuple[Checkpoint, bool]:
        """Write a staged state (any object with ``write_to(directory) -> dict``)
        straight into ``checkpoint_<index>`` of this tier and commit it there;
        the dict it returns goes into the internal metadata as ``"tensors"``.
        See :meth:`commit`."""
        path = self.reserve_in_place(index)
        try:
            tensors = source.write_to(path)
            meta = dict(internal)
            if tensors is not None:
                meta["tensors"] = tensors
            return self.commit_in_place(index, meta, row)
        except BaseException:
            try:
                self.storage.commit_protocol.remove_leftover(path)
            except Exception:  # cleanup at the next start removes it
                pass
            raise

    def _record(self, index: int, committed: Checkpoint, row: Mapping[str, Any]) -> bool:
        selected = self.selects(index, row)
        entry = TierEntry(index, _manifest_bytes(written_metadata(committed)),
                          "pending" if selected else "local_only")
        with self._mutex:
            self._entries[index] = entry
            self._verified.add(index)
            if selected:
                self._queued.add(index)
            self._save()
            self._cond.notify_all()
        self._evict()
        return selected

    # -- the copy to the persistent tier -------------------------------------------------

    def persist(self, index: int, commit: Callable[[Checkpoint], Any],
                *, deadline_s: float | None = None, sleep: Callable[[float], None] = time.sleep
                ) -> None:
        """Copy checkpoint ``index`` of this tier to the persistent tier: call
        ``commit(local copy)`` (which uploads, commits and registers it with
        the persistent tier's retention) until it succeeds, retrying other
        errors than :data:`_FINAL` ones for ``persist_timeout_s`` with
        exponential backoff (0.5 s doubling, at most 30 s). Then records it as
        durable and applies this tier's retention. A copy older than the
        preemption checkpoint (:meth:`force_persist`, one rank) is skipped
        and recorded as local only.

        Raises:
            The last error, once retrying is over; the copy stays recorded as
            pending (the next session persists it).
        """
        preempted_at = self._preempted_at
        if preempted_at is not None and index < preempted_at:
            with self._mutex:
                self._queued.discard(index)
                first = not self._skipped
                self._skipped.add(index)
                entry = self._entries.get(index)
                if entry is not None and entry.durable == "pending":
                    entry.durable = "local_only"  # superseded: no restart copies it either
                    self._save()
                self._cond.notify_all()
            (logger.warning if first else logger.debug)(
                "%s of the local tier %s (and any older copy queued) is not copied to the "
                "persistent tier: the preemption checkpoint %s supersedes it",
                checkpoint_dir_name(index), self.trial_dir, checkpoint_dir_name(preempted_at))
            self._evict()
            return
        budget = self.config.persist_timeout_s if deadline_s is None else deadline_s
        deadline = time.monotonic() + budget
        delay = 0.5
        source = self.checkpoint(index)
        try:
            while True:
                try:
                    commit(source)
                    break
                except _FINAL:
                    raise
                except Exception as exc:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise
                    logger.warning("copying %s to the persistent tier failed (%s); retrying "
                                   "in %.1f s", checkpoint_dir_name(index), exc, min(delay, left))
                    sleep(min(delay, left))
                    delay = min(delay * 2, 30.0)
        except BaseException as exc:
            with self._mutex:
                self._failed[index] = exc
                self._queued.discard(index)
                self._cond.notify_all()
            raise
        with self._mutex:
            entry = self._entries.get(index)
            if entry is not None:
                entry.durable = "durable"
            self._durable_high = max(self._durable_high, index)
            self._queued.discard(index)
            self._save()
            self._cond.notify_all()
        self._evict()

    def mark_durable(self, index: int) -> None:
        """Record that checkpoint ``index`` is committed on the persistent tier
        (found there after a restart)."""
        with self._mutex:
            entry = self._entries.get(index)
            if entry is not None and entry.durable != "durable":
                entry.durable = "durable"
                self._save()
            self._durable_high = max(self._durable_high, index)
            self._cond.notify_all()

    def forget(self, index: int, why: str) -> None:
        """Stop treating ``index`` as pending (it can no longer be persisted:
        another rank's part is gone); the copy stays until retention takes it."""
        with self._mutex:
            entry = self._entries.get(index)
            if entry is not None and entry.durable == "pending":
                logger.warning("%s of the local tier %s will not be persisted: %s",
                               checkpoint_dir_name(index), self.trial_dir, why)
                entry.durable = "local_only"
                self._save()
            self._cond.notify_all()
        self._evict()

    def queue(self, index: int) -> None:
        """Note that a copy of ``index`` is queued (a restart's pending one)."""
        with self._mutex:
            self._queued.add(index)

    def wait_durable(self, index: int, timeout: float | None = None) -> bool:
        """Wait until checkpoint ``index`` is durable.

        Returns:
            True when it is, False on timeout.

        Raises:
            CheckpointStoreError: ``index`` is not on this tier, or ``persist``
                did not select it (it stays local only), or its copy is not
                queued (it failed, or a restart left it for the next session).
            Exception: the error its copy failed with.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        name = checkpoint_dir_name(index)
        with self._mutex:
            while True:
                entry = self._entries.get(index)
                if index in self._failed:
                    raise self._failed[index]
                if entry is None:
                    raise CheckpointStoreError(f"{name} is not on the local tier {self.trial_dir}")
                if entry.durable == "durable":
                    return True
                if entry.durable == "local_only":
                    raise CheckpointStoreError(
                        f"{name} is not selected by the LocalTier persist policy: it stays on "
                        "the local tier only")
                if index not in self._queued:
                    raise CheckpointStoreError(f"the copy of {name} to the persistent tier is "
                                               "not queued in this session")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)

    # -- the state file ----------------------------------------------------------------

    def _save(self) -> None:
        """Write the state file atomically (temp file, rename); the caller holds the lock."""
        body = {
            "version": TIER_STATE_VERSION,
            "world_rank": self.world_rank,
            "world_size": self.world_size,
            "durable_uri": self._durable_uri(),
            "updated_at": time.time(),
            "checkpoints": [e.to_json() for _, e in sorted(self._entries.items())],
            "evicting": sorted(self._evicting),
        }
        try:
            _write_atomic(self.state_path, json.dumps(body, indent=1).encode(),
                          self.config.fsync)
        except OSError as exc:  # rebuilt from the directories at the next start
            logger.warning("could not write the local tier state %s: %s", self.state_path, exc)
