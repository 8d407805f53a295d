"""The lease: which one live :class:`~checkpoint_store.retention.CheckpointManager`
manages a trial, and the one thread per process that renews every lease.

Owns the lease file (:data:`LEASE_FILE`, ``<trial>/.cs_manager_lease.json``),
the rule that says whether a lease is live (:func:`live_lease`, also used by
the CLI's ``prune``/``gc`` and the UI), taking it over, renewing it in the
background and releasing it. Threads: the keeper thread calls
:meth:`Lease.renew`; the manager's thread calls everything else; both meet
under the lease's own lock.
"""

from __future__ import annotations

import collections
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from typing import TypedDict, cast

import pyarrow.fs as pafs

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import FORMAT_VERSION, LEASE_FILE, LEASE_LOCK
from checkpoint_store._results import writer as _results
from checkpoint_store._util import clock as _clock
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.liveness import process_alive, process_token
from checkpoint_store._util.locks import OneWorker, condition
from checkpoint_store.backends.base import canonical_uri_text
from checkpoint_store.errors import CheckpointStoreError, TrialInUseError
from checkpoint_store.storage import StorageContext

__all__ = ["LEASE_FILE", "Lease", "LeaseBody", "live_lease"]

logger = logging.getLogger(__name__)

_LEASE_KIND = "checkpoint_manager_lease"


class LeaseBody(TypedDict, total=False):
    """The lease file's fields, as written (an older version may lack some)."""

    kind: str
    format_version: int
    holder: str  # a random id per lease: the holder compares it to know it still holds
    host: str
    pid: int
    proc: str | None  # the holder incarnation (_util.liveness.process_token)
    trial: str  # the trial's canonical URI (StorageContext.canonical_uri)
    ttl_s: float
    renewed_at: float  # Unix seconds, the holder's clock
    expires_at: float  # Unix seconds, the holder's clock


def live_lease(storage: StorageContext) -> LeaseBody | None:
    """The lease of a live checkpoint manager on this trial, or None.

    Returns the lease file's fields (``host``, ``pid``, ``expires_at`` in Unix
    seconds, ``trial``) when, by the rule every manager applies before taking
    over: it is unexpired on the storage's clock, names this trial's canonical
    location (a lease copied in with the directory does not), and its holder
    is not a dead or zombie process on this host, nor a pid since reused by
    another process. A lease file that stays unreadable (empty or cut short:
    being rewritten, or its writer was killed) counts as live for
    :data:`UNREADABLE_TTL_S` after its modification time; its fields are then
    ``expires_at`` alone. Used by tools that must not delete behind a running
    job's back (the CLI's prune and gc).

    Raises:
        OSError: the lease file exists but cannot be read.
    """
    live = Lease(storage, ttl_s=0.0)._live_other()
    return live[0] if live is not None else None


#: Slack (seconds) for stores that stamp modification times to the whole
#: second (S3): a lease renewed 0.1 s ago may carry a stamp 0.9 s older.
_MTIME_SLACK_S = 1.0

#: Seconds (at least) an unreadable lease file counts as live after its last
#: modification when the reader has no ttl of its own (:func:`live_lease`):
#: a manager's default ``lease_ttl_s``.
UNREADABLE_TTL_S = 60.0


class Lease:
    """Who manages a trial right now: one JSON file renewed in the background.

    A lease is live for ``ttl_s`` after its last renewal, measured on the
    storage's clock (the lease file's modification time against a probe
    written now, :mod:`checkpoint_store._util.clock`), so a machine whose clock
    is off never takes over a live lease. Unless its holder is a dead
    process on this very host: then it is taken over at once, so a crashed
    run restarts without waiting. The holder is named by pid *and* process
    incarnation (:func:`checkpoint_store._util.liveness.process_token`): a pid reused
    by a newer process does not keep a dead holder's lease alive. The lease
    names the trial's canonical location (:meth:`StorageContext.canonical_uri`:
    on local disks the resolved real path), so every spelling of one trial
    (symlinks, ``..``, ``file://``) meets the same lease; a lease copied in
    with a whole trial directory names another location and is ignored.
    On local disks the check, write and read back happen under a file lock
    (:data:`LEASE_LOCK`), so two processes started at once never both take
    it. Object stores have no such lock and pyarrow offers no conditional
    write: there a manager writes, reads back, waits longer than its own
    check and write took (:func:`_settle_s`), and reads again, refusing if
    another holder's write came later (Fischer's mutual exclusion, which
    holds while the other's check and write take no longer than that wait).
    """

    def __init__(self, storage: StorageContext, ttl_s: float):
        self._storage = storage
        self.path = posixpath.join(storage.trial_path, LEASE_FILE)
        self.trial_uri = storage.canonical_uri(storage.trial_path)
        self._local = _fsutil.local_path(storage.filesystem, storage.trial_path) is not None
        #: Whether the check and write below are one step for every manager
        #: (a file lock on local disks, a lock of this process for the memory
        #: store); elsewhere an acquire waits and reads again.
        self._locked = self._local or _fsutil.in_process_store(storage.filesystem)
        self.ttl_s = float(ttl_s)
        self.holder = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.token = process_token()
        self.lost = False
        self.interval = max(self.ttl_s / 3.0, 0.05)
        self.next_renewal = 0.0
        self._released = False
        #: Renewals write only while True: from a taken lease's hand-over to
        #: the keeper until :meth:`_give_back` (a renewal already on its way
        #: when an acquire gives the lease back writes nothing).
        self._held = False
        self._lock = threading.Lock()

    def _live_other(self) -> tuple[LeaseBody, float] | None:
        """Another holder's live lease and its seconds left, or None (see
        :meth:`_seconds_left`). A lease file that stays unreadable counts as
        live while it is young (see :meth:`_unreadable_left`): it is returned
        with ``expires_at`` alone (no holder, host or pid)."""
        try:
            cur = self._read_body()
        except _fsutil.UnparsableFileError:
            left = self._unreadable_left()
            if left is None:
                return None
            return {"expires_at": _clock.local_time() + left}, left
        if cur is None:
            return None
        mtime = _clock.mtime_of(_fsutil.info(self._storage.filesystem, self.path))
        left = self._seconds_left(cur, mtime)
        return (cur, left) if left is not None else None

    def _read(self) -> LeaseBody | None:
        """The lease's fields; None when it is absent, or unreadable however
        often it is read again (see :meth:`_read_body`): its holder rewrites
        it at its next renewal, a take-over first asks :meth:`_live_other`."""
        try:
            return self._read_body()
        except _fsutil.UnparsableFileError as exc:
            logger.warning("the lease %s is unreadable: %s", self.path, exc)
            return None

    def _read_body(self) -> LeaseBody | None:
        """The lease's fields; None when it is absent or not a JSON object.

        Read again while it does not parse (:func:`_fsutil.read_control`): a
        holder renewing it in place, or an object store read across its
        rewrite, shows it empty or cut short for a moment. Taking that for
        "no lease" let a second job take over a live trial.

        Raises:
            UnparsableFileError: it stayed empty or cut short.
            OSError: the store refused the read.
        """
        try:
            obj = _fsutil.read_control(self._storage.filesystem, self.path)
        except FileNotFoundError:
            return None
        except OSError:
            if not _fsutil.exists(self._storage.filesystem, self.path):
                return None
            raise
        return cast(LeaseBody, obj) if isinstance(obj, dict) else None

    def _unreadable_left(self) -> float | None:
        """Seconds an unreadable lease file still counts as live, or None.

        Its holder, ttl and expiry are unknown, so its age decides: live for
        this manager's ttl (:data:`UNREADABLE_TTL_S` for :func:`live_lease`)
        after its modification time, on the storage's clock; expired after
        that, so a holder killed mid-write does not block the trial for
        ever. A store that records no modification times cannot age it: it
        stays live until deleted (the message says so).
        """
        fi = _fsutil.info(self._storage.filesystem, self.path)
        if fi.type == pafs.FileType.NotFound:
            return None  # deleted since: released
        mtime = _clock.mtime_of(fi)
        ttl = self.ttl_s if self.ttl_s > 0 else UNREADABLE_TTL_S
        if mtime is None:
            return ttl
        now = self._storage_now()
        left = mtime + ttl + _MTIME_SLACK_S - (now if now is not None else _clock.local_time())
        return left if left > 0 else None

    def _write(self) -> None:
        now = _clock.local_time()
        body: LeaseBody = {
            "kind": _LEASE_KIND,
            "format_version": FORMAT_VERSION,
            "holder": self.holder,
            "host": self.host,
            "pid": self.pid,
            "proc": self.token,
            "trial": self.trial_uri,
            "ttl_s": self.ttl_s,
            "renewed_at": now,
            "expires_at": now + self.ttl_s,
        }
        self._storage.ensure_trial_dir()
        _fsutil.write_bytes(
            self._storage.filesystem, self.path, _json.dumps(body),
            self._storage.backend.capabilities, fsync=False,
        )

    def _holder_dead(self, cur: LeaseBody) -> bool:
        """The holder ran on this host and is gone (or its pid now names another process)."""
        pid = cur.get("pid")
        if cur.get("host") != self.host or not isinstance(pid, int):
            return False
        token = cur.get("proc")
        return not process_alive(pid, token if isinstance(token, str) else None)

    def _seconds_left(self, cur: LeaseBody, mtime: float | None) -> float | None:
        """Seconds until another holder's lease expires, or None when it is not
        live (absent, ours, copied in, expired, or its holder is dead)."""
        if cur.get("holder") == self.holder:
            return None
        if self._copied_in(cur):
            return None
        if self._holder_dead(cur):
            return None
        ttl = cur.get("ttl_s")
        if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and mtime is not None:
            now = self._storage_now()
            if now is not None:
                left = mtime + float(ttl) + _MTIME_SLACK_S - now
                return left if left > 0 else None
        # A lease of an older version, or a store without modification times:
        # its holder's clock against ours.
        expires = cur.get("expires_at")
        if not isinstance(expires, (int, float)):
            return None
        left = float(expires) - _clock.local_time()
        return left if left > 0 else None

    def _names_this_trial(self, cur: LeaseBody) -> bool:
        """The lease records this trial's location, however either side spelled it."""
        recorded = cur.get("trial")
        return isinstance(recorded, str) and canonical_uri_text(recorded) == self.trial_uri

    def _copied_in(self, cur: LeaseBody) -> bool:
        """The lease came with a trial directory copied from another location.

        Compared as canonical locations, so no spelling of this trial (scheme
        alias, case, ``.``, trailing ``/``, symlink) passes for a copy. Only a
        local path on another host may name this very directory differently
        (an NFS mount point): such a lease is taken as live.
        """
        if self._names_this_trial(cur):
            return False
        return cur.get("host") == self.host or not self._local

    def _storage_now(self) -> float | None:
        """The store's clock, or None when it cannot be read: read-only
        credentials (``ui``, ``live_lease`` callers) may not write the probe."""
        try:
            return _clock.storage_now(self._storage.filesystem, self._storage.trial_path,
                                      self._storage.backend.capabilities)
        except (OSError, CheckpointStoreError) as exc:
            logger.info("could not read the storage's clock under %s (%s); judging the "
                        "lease by the local clock", self.trial_uri, exc)
            return None

    def _conflict(self, cur: LeaseBody, left: float) -> TrialInUseError:
        if not cur.keys() - {"expires_at"}:
            # Nothing to name: the file did not read as a lease (empty or cut
            # short, see _live_other), or was gone right after our own write.
            return self._unreadable_conflict(left)
        return TrialInUseError(
            f"trial {self.trial_uri} is managed by another live checkpoint manager "
            f"(host {cur.get('host')!r}, pid {cur.get('pid')}); its lease expires in "
            f"{max(left, 0.0):.0f} s unless renewed. Two managers on one trial would delete "
            "each other's checkpoints. End the other run (its lease is released when its "
            "session ends), wait for the lease to expire if that process crashed, or open "
            "this trial with CheckpointManager(..., read_only=True) to only read it."
            + self._copy_hint(cur)
        )

    def _unreadable_conflict(self, left: float) -> TrialInUseError:
        uri = self._storage.uri(self.path)
        return TrialInUseError(
            f"trial {self.trial_uri} may be managed by another live checkpoint manager: "
            f"its lease file {uri} cannot be read as a lease (empty or cut short), as "
            "while another job rewrites it or after one was killed writing it. It counts "
            f"as live for {max(left, 0.0):.0f} s more (its last modification plus the "
            "lease's ttl). Wait for that, or delete the file if no run holds this trial; "
            "or open it with CheckpointManager(..., read_only=True) to only read it."
        )

    def _copy_hint(self, cur: LeaseBody) -> str:
        """Where the lease may have come with a copy (it names another location),
        how to drop it; nothing where it names this very trial: that is a live run."""
        if cur.get("trial") is None or self._names_this_trial(cur):
            return ""
        return (f" If this directory was copied from {cur.get('trial')!r} while that run "
                f"was live, the lease came with the copy: delete {self._storage.uri(self.path)}.")

    def acquire(self) -> None:
        """Take the lease or raise :class:`~checkpoint_store.errors.TrialInUseError`
        (a :class:`CheckpointConflictError`); starts renewal."""
        try:
            # Check, write and read back as one step between processes on local
            # disks (a file lock in the trial directory): two jobs started at the
            # same moment both saw no live lease, and each read back its own.
            with _fsutil.dir_lock(self._storage.filesystem, self._storage.trial_path,
                                  LEASE_LOCK):
                began = time.monotonic()
                live = self._live_other()
                if live is not None:
                    raise self._conflict(*live)
                self._write()
                self._read_back()
                if not self._locked:
                    # No lock between processes here: another manager may
                    # have found no lease as this one did and still be about
                    # to write its own. Wait longer than that takes (this
                    # manager's own check and write, twice, as the measure)
                    # and read again: of two writes, only the last one's
                    # writer still finds its lease (Fischer's mutual
                    # exclusion with a delay).
                    time.sleep(_settle_s(time.monotonic() - began, self.ttl_s))
                    self._read_back()
            self._held = True
            _KEEPER.add(self)
            # Released at interpreter exit if nobody ended the session, while the
            # store's client still works (see _results._at_exit).
            _results.release_after_exit_flush(self)
        except (Exception, KeyboardInterrupt, SystemExit):
            # An error, or a signal's exception (Ctrl-C, a SIGTERM handler's
            # SystemExit) once the lease is written: the caller got no lease
            # to release, and a keeper not started would let it expire while
            # this process still counts as its live holder. (A crash runs
            # nothing more: the lease expires.)
            self._give_back()
            raise

    def _read_back(self) -> None:
        """Raise :class:`TrialInUseError` unless the lease file names this
        holder (another manager's write came after this one's)."""
        back = self._read()
        if back is None or back.get("holder") != self.holder:
            raise self._conflict(back or {}, self.ttl_s)

    def _give_back(self) -> None:
        """Undo an acquire that raised: stop renewing, forget the exit-time
        release, and delete the file where it is ours. Never raises. Unlike
        :meth:`release` it leaves the object as new: a refused acquire may be
        tried again, and that lease is then released as any other."""
        self.stop_renewing()
        _results.forget_at_exit(self)
        if not self._lock.acquire(timeout=RELEASE_WAIT_S):
            logger.warning("not giving back the lease %s: a renewal of it has not returned "
                           "for %.0fs (it will expire)", self.path, RELEASE_WAIT_S)
            return
        try:
            self._held = False
            self._delete_if_ours("give back")
        finally:
            self._lock.release()

    def renew(self) -> bool:
        """Extend the lease; returns False (and marks it lost) when another holder
        took it over. I/O errors are logged and retried at the next renewal.
        A lease not held (never acquired, given back, released) writes
        nothing and returns True unless it was lost: there is nothing of its
        own to extend."""
        with self._lock:
            if self.lost or self._released or not self._held:
                return not self.lost
            try:
                cur = self._read()
                if cur is not None and cur.get("holder") != self.holder:
                    self._mark_lost(cur)
                    return False
                self._write()
            except Exception as exc:  # a renewal failing must not kill training
                logger.warning("could not renew the lease %s: %s", self.path, exc)
            return True

    def check(self) -> bool:
        """Read the lease now: True if still ours (before anything is deleted)."""
        with self._lock:
            if self.lost:
                return False
            try:
                cur = self._read()
            except Exception as exc:
                logger.warning("could not read the lease %s: %s", self.path, exc)
                return False
            if cur is not None and cur.get("holder") != self.holder:
                self._mark_lost(cur)
                return False
            return True

    def _mark_lost(self, cur: LeaseBody) -> None:
        self.lost = True
        _KEEPER.remove(self)
        logger.warning(
            "the lease on %s was taken over by host %r pid %s; this checkpoint manager is "
            "now read-only and deletes nothing",
            self.trial_uri, cur.get("host"), cur.get("pid"),
        )

    def stop_renewing(self) -> None:
        _KEEPER.remove(self)

    def release(self) -> None:
        """Stop renewing and delete the lease file if it is still ours. Idempotent;
        never raises (it runs while an exception may be propagating)."""
        self.stop_renewing()
        if os.getpid() != self.pid:
            return  # a forked child: the lease is its parent's to release
        # A renewal stuck in a storage client that ignores its own timeouts
        # (s3fs waiting for "100 Continue" from a store that stopped
        # answering) must not hold the end of the session: the lease then
        # expires by itself.
        if not self._lock.acquire(timeout=RELEASE_WAIT_S):
            logger.warning("not releasing the lease %s: a renewal of it has not returned "
                           "for %.0fs (it will expire)", self.path, RELEASE_WAIT_S)
            return
        try:
            self._release_locked()
        finally:
            self._lock.release()

    def _release_locked(self) -> None:
        if self._released:
            return
        self._released = True
        _results.forget_at_exit(self)
        if self.lost:
            return
        self._delete_if_ours("release")

    def _delete_if_ours(self, what: str) -> None:
        """Delete the lease file if it names this holder (under the lease's
        lock); never raises: an error is logged, and the lease expires."""
        try:
            cur = self._read()
            if cur is not None and cur.get("holder") == self.holder:
                _fsutil.delete_file(self._storage.filesystem, self.path)
        except Exception as exc:
            logger.warning("could not %s the lease %s (it will expire): %s", what,
                           self.path, exc)


def _settle_s(took_s: float, ttl_s: float) -> float:
    """Seconds an acquire without a lock between processes waits before it
    reads its lease again: twice what its own check and write took (another
    manager's take the same calls), at least :data:`_SETTLE_MIN_S`, at most
    a third of the lease's life (a renewal's interval)."""
    return min(max(2.0 * took_s, _SETTLE_MIN_S), max(ttl_s / 3.0, _SETTLE_MIN_S))


#: The shortest wait of :func:`_settle_s`, seconds.
_SETTLE_MIN_S = 0.05

#: Seconds the end of a session waits for a renewal of its lease in flight.
RELEASE_WAIT_S = 30.0


class _LeaseKeeper:
    """One daemon thread per process renews every live lease when it is due.

    Shared so that a process managing many trials (a tuning loop) runs one
    thread, not one per trial, and so that releasing a lease never waits for
    a thread to stop. A renewal runs outside the keeper's lock; a lease
    released meanwhile ignores it (``Lease.renew`` checks under its own lock).
    The thread ends once no lease is left and is started again by the next
    :meth:`add` (:class:`~checkpoint_store._util.locks.OneWorker`: a start cut
    short by a signal's exception is made again there, never two loops).
    """

    def __init__(self) -> None:
        self._mutex, self._cv = condition()  # enter _mutex, not the condition
        self._leases: set[Lease] = set()
        #: Leases removed while the mutex was held elsewhere (see :meth:`remove`).
        self._removed: collections.deque[Lease] = collections.deque()
        self._worker = OneWorker(self._run, "cs-lease-keeper", daemon=True)

    def add(self, lease: Lease) -> None:
        with self._mutex:
            self._forget_removed()
            lease.next_renewal = time.monotonic() + lease.interval
            self._leases.add(lease)
            # Also after a fork: the child has no keeper thread.
            self._worker.ensure()
            self._cv.notify()

    def remove(self, lease: Lease) -> None:
        """Stop renewing ``lease``; never waits for the keeper's mutex.

        It also runs from the finalizer of a manager collected unclosed,
        which the cycle collector runs at any allocation on any thread: also
        on the keeper thread that :meth:`add` is starting, under the mutex,
        waiting for that thread to begin. Waiting for the mutex there hung
        both for ever. When the mutex is busy the lease is queued, and
        dropped by the next holder (a released lease is never renewed)."""
        self._removed.append(lease)
        if self._mutex.acquire(blocking=False):
            try:
                self._forget_removed()
                self._cv.notify()
            finally:
                self._mutex.release()

    def _forget_removed(self) -> None:
        while self._removed:
            self._leases.discard(self._removed.popleft())

    def _run(self) -> None:
        with self._mutex:
            if not self._worker.claim():
                return
        while True:
            with self._mutex:
                self._forget_removed()
                if not self._leases:
                    self._worker.release()
                    return
                now = time.monotonic()
                due = [le for le in self._leases if le.next_renewal <= now]
                if not due:
                    wake = min(le.next_renewal for le in self._leases)
                    self._cv.wait(timeout=max(wake - now, 0.01))
                    continue
                for le in due:
                    le.next_renewal = now + le.interval
            for le in due:
                le.renew()


_KEEPER = _LeaseKeeper()

