"""One session per local tier trial directory: the directory's lock.

Two jobs with their own ``storage_path`` but the same experiment and trial
names (the defaults, say) on one :class:`~checkpoint_store.tiers.LocalTier`
path would share one tier trial directory. The check of the tier's state
file (``FastTier._refuse_foreign``) reads it and the state is written later,
so two jobs started at the same moment both passed it and committed into one
directory; a restart was then refused, or resumed the other job's
checkpoint. The directory is now taken atomically: an OS file lock
(``filelock``: ``flock`` on POSIX) on ``.cs_tier.lock`` held from the tier's
opening to the session's end. The kernel drops it when the holding process
dies, so a lock left by a killed job never blocks the next one; beside it,
``.cs_tier_holder.json`` says who holds it, for the error.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import filelock

from checkpoint_store._format.layout import TIER_HOLDER_FILE, TIER_LOCK_FILE
from checkpoint_store.errors import TrialInUseError
from checkpoint_store.tiers.statefile import _write_atomic

__all__ = ["TierLock"]


class TierLock:
    """The lock of one local tier trial directory, held until :meth:`release`.

    Args:
        trial_dir: the tier's trial directory (a local path; created here).
        durable_uri: the persistent tier's trial URI of the job taking it
            (written in the holder file, named in a second job's error).

    Raises:
        TrialInUseError: another live session (this process or another)
            holds the directory; the message names it (pid, host, its
            persistent trial, since when) and what to do. Nothing is written.
        OSError: the directory or the lock file cannot be created.
    """

    def __init__(self, trial_dir: str, durable_uri: str):
        os.makedirs(trial_dir, exist_ok=True)
        self.trial_dir = trial_dir
        self._lock: filelock.BaseFileLock | None = filelock.FileLock(
            os.path.join(trial_dir, TIER_LOCK_FILE), timeout=0)
        try:
            self._lock.acquire()
        except filelock.Timeout:
            self._lock = None
            raise _in_use(trial_dir, durable_uri) from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "durable_uri": durable_uri, "since": time.time()}
        try:
            _write_atomic(os.path.join(trial_dir, TIER_HOLDER_FILE),
                          json.dumps(holder).encode(), False)
        except OSError:  # only the message of a second job's error is poorer
            pass

    @property
    def held(self) -> bool:
        return self._lock is not None

    def release(self) -> None:
        """Release the lock (idempotent). The holder file stays: the next
        holder overwrites it, and it is read only while the lock is held."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()


def read_holder(trial_dir: str) -> dict[str, Any] | None:
    """What ``.cs_tier_holder.json`` says of the lock's holder, or None."""
    try:
        with open(os.path.join(trial_dir, TIER_HOLDER_FILE), "rb") as f:
            body = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _live_holder(trial_dir: str, wait_s: float = 2.0) -> dict[str, Any]:
    """The holder file's body once it names a live process of this host.

    The holder writes the file just after it took the lock, so a job refused
    in between reads none yet, or the previous (dead) holder's: it reads
    again for up to ``wait_s`` seconds, then takes what is there ({} if
    nothing)."""
    deadline = time.monotonic() + wait_s
    here = socket.gethostname()
    while True:
        holder = read_holder(trial_dir) or {}
        pid = holder.get("pid")
        if holder.get("host") != here and holder:
            return holder  # another host's: its liveness cannot be read here
        if isinstance(pid, int) and _alive(pid):
            return holder
        if time.monotonic() >= deadline:
            return holder
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True


def _in_use(trial_dir: str, durable_uri: str) -> TrialInUseError:
    holder = _live_holder(trial_dir)
    since = holder.get("since")
    when = (time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(since))
            if isinstance(since, (int, float)) else "")
    who = (f"process {holder.get('pid', '?')} on host {holder.get('host', '?')}, the local "
           f"tier of {holder.get('durable_uri', '?')}{when}") if holder else "another session"
    return TrialInUseError(
        f"the local tier directory {trial_dir} is in use by {who}; this job "
        f"({durable_uri}) cannot share it. Wait for that job to end, or give this "
        "job's LocalTier another path (or another experiment_name/trial_name). A job that "
        "was killed releases it by itself: nothing to delete")
