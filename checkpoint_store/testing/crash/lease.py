"""Every crash point of the trial's lease (see :func:`sweep_lease_crashes`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LeaseCrashReport", "sweep_lease_crashes"]


@dataclass
class LeaseCrashReport:
    """What :func:`sweep_lease_crashes` found.

    Attributes:
        points: crash points tried (one run per point).
        crashed_before: per crash point, the call it stopped (``"create_dir
            <path>"``, ``"open_output_stream <path>"``, ``"delete_file <path>"``).
        violations: ``"point N: what is wrong"``, empty when every point was clean.
    """

    points: int = 0
    crashed_before: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)


# Long enough that no renewal thread fires during a run (it renews every ttl/3);
# expiry is brought about by ageing the lease file, not by waiting.
_SWEEP_LEASE_TTL_S = 60.0


def sweep_lease_crashes(root: str, *, stale: str | None = "expired") -> LeaseCrashReport:
    """Crash a lease holder at every mutating storage call of its lease's life,
    one run each, and check what the next writer finds.

    Each run copies a trial with committed checkpoints, a retention state and
    ``result.json`` (local disk), plants the lease a previous holder left
    (``stale``: ``"expired"``, another host's lease past its ttl; ``"dead"``,
    an unexpired lease of a process of this host that has exited; None: no
    lease), then has a holder take the lease over (or acquire it), renew it
    twice and release it, through a filesystem that dies
    (:class:`~checkpoint_store.testing.faults.SimulatedCrash`) at its k-th
    mutating call: the storage clock's probe and its delete, the trial
    directory, the lease's write, each renewal, the release's delete.

    After the crash it checks (:func:`_check_lease_after_crash`): no file but
    the lease (and a clock probe the crash cut short) was added, changed or
    removed; the lease file is absent or a whole lease of a known holder; a
    new writer is refused while the dead holder's lease is unexpired and
    takes the trial once it expires (at once when no live holder is left);
    then a third writer is refused, the dead holder, were it to come back,
    finds its lease lost and never renews over the new one, and the new
    holder's release leaves no lease. The sweep ends at the first run that
    finishes without crashing.
    """
    import shutil

    from checkpoint_store import StorageContext
    from checkpoint_store.retention.lease import Lease
    from checkpoint_store.testing.faults import SimulatedCrash, faulty_backend

    seed = os.path.join(root, "seed")
    _seed_trial(seed)
    dead_pid = _exited_pid() if stale == "dead" else None
    report = LeaseCrashReport()
    for point in range(10_000):
        store = os.path.join(root, f"point{point}")
        shutil.copytree(seed, store)
        real = StorageContext(store, "exp", "t", fsync=False)
        _plant_lease(real, stale, dead_pid)
        before = _trial_files(real)
        dying = StorageContext.from_backend(
            faulty_backend(real.backend, crash_after_writes=point), real.storage_path,
            "exp", "t", fsync=False)
        holder = Lease(dying, _SWEEP_LEASE_TTL_S)
        crashed = False
        try:
            holder.acquire()
            holder.stop_renewing()  # renewals below, at known points
            for _ in range(2):
                if not holder.renew():
                    report.violations.append(f"point {point}: a renewal found the lease lost")
            holder.release()
        except SimulatedCrash as exc:
            crashed = True
            holder.stop_renewing()  # a dead process renews nothing
            report.crashed_before.append(str(exc).removeprefix("crash point before "))
        report.points += 1
        report.violations += [f"point {point}: {v}" for v in
                              _check_lease_after_crash(real, before, holder.holder, crashed)]
        if not crashed:
            return report
    return report


def _seed_trial(store: str) -> None:
    """A closed trial with two committed checkpoints, a retention state and rows."""
    from checkpoint_store import Checkpoint, CheckpointConfig, session

    src = store + "-src"
    os.makedirs(src, exist_ok=True)
    with open(os.path.join(src, "w.bin"), "wb") as f:
        f.write(b"w" * 64)
    with session.start(storage_path=store, experiment_name="exp", trial_name="t",
                       checkpoint_config=CheckpointConfig(num_to_keep=2)) as s:
        for i in range(3):
            s.report({"score": float(i)},
                     checkpoint=Checkpoint.from_directory(src) if i else None)


def _exited_pid() -> int:
    """The pid of a process of this host that has exited (and been reaped)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _plant_lease(storage: Any, stale: str | None, dead_pid: int | None) -> None:
    """The lease a previous holder left: another host's, expired; or an
    unexpired one of an exited process of this host; or none."""
    from checkpoint_store.retention.lease import Lease

    if stale is None:
        return
    old = Lease(storage, _SWEEP_LEASE_TTL_S)
    if stale == "expired":
        old.host = "a-host-gone-for-good"
    elif stale == "dead" and dead_pid is not None:
        old.pid, old.token = dead_pid, None
    else:
        raise ValueError(f"stale must be 'expired', 'dead' or None, not {stale!r}")
    old._write()
    if stale == "expired":
        _age_lease(storage)


def _age_lease(storage: Any) -> None:
    """Make the lease file older than its ttl, as time passing would."""
    from checkpoint_store._format.layout import LEASE_FILE

    t = time.time() - _SWEEP_LEASE_TTL_S - 60.0
    os.utime(os.path.join(storage.trial_path, LEASE_FILE), (t, t))


def _trial_files(storage: Any) -> dict[str, bytes]:
    """``{relative path: bytes}`` of every file of the trial but the lease."""
    from checkpoint_store._format.layout import LEASE_FILE

    out: dict[str, bytes] = {}
    for dirpath, _, names in os.walk(storage.trial_path):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), storage.trial_path)
            if rel != LEASE_FILE:
                with open(os.path.join(dirpath, name), "rb") as f:
                    out[rel] = f.read()
    return out


def _untouched(storage: Any, before: dict[str, bytes]) -> list[str]:
    from checkpoint_store._format.layout import CLOCK_PROBE_PREFIX

    now = _trial_files(storage)
    changed = sorted(p for p in before if now.get(p) != before[p])
    added = sorted(p for p in set(now) - set(before)
                   if not os.path.basename(p).startswith(CLOCK_PROBE_PREFIX))
    out = [f"committed data changed or removed: {changed}"] if changed else []
    return out + ([f"files added besides the lease: {added}"] if added else [])


def _check_lease_after_crash(storage: Any, before: dict[str, bytes], dead_holder: str,
                             crashed: bool) -> list[str]:
    """See :func:`sweep_lease_crashes`."""
    from checkpoint_store._format.layout import LEASE_FILE
    from checkpoint_store.retention.lease import Lease

    problems = _untouched(storage, before)
    probe = Lease(storage, _SWEEP_LEASE_TTL_S)
    cur = probe._read()
    if cur is None and os.path.exists(os.path.join(storage.trial_path, LEASE_FILE)):
        problems.append("the lease file is torn or not a lease")
    dead_holds = cur is not None and cur.get("holder") == dead_holder
    if dead_holds and not crashed:
        problems.append("a release that returned left its lease behind")
    new = Lease(storage, _SWEEP_LEASE_TTL_S)
    taken = _try_acquire(new)
    if taken and dead_holds:
        problems.append("a new writer took a lease whose holder's ttl had not run out: "
                        "two live holders")
    if not taken and not dead_holds:
        problems.append("a new writer was refused although no live holder was left")
    if not taken:
        _age_lease(storage)
        taken = _try_acquire(new)
        if not taken:
            problems.append("a new writer was refused after the dead holder's lease expired")
            return problems
    third = Lease(storage, _SWEEP_LEASE_TTL_S)
    if _try_acquire(third):
        problems.append("a third writer took the lease the new writer holds")
        third.release()
    ghost = Lease(storage, _SWEEP_LEASE_TTL_S)
    ghost.holder = dead_holder  # the dead holder, come back
    ghost._held = True  # it had taken the lease: its renewals write
    if ghost.check() or ghost.renew():
        problems.append("the old holder still believes it holds the lease")
    after = new._read()
    if after is None or after.get("holder") != new.holder:
        problems.append("the old holder's renewal overwrote the new holder's lease")
    new.release()
    if new._read() is not None:
        problems.append("the new holder's release left a lease behind")
    return problems + _untouched(storage, before)


def _try_acquire(lease: Any) -> bool:
    from checkpoint_store.errors import TrialInUseError

    try:
        lease.acquire()
    except TrialInUseError:
        return False
    lease.stop_renewing()
    return True
