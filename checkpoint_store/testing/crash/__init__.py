"""Crash test harness: SIGKILL a saving process at random moments, then check storage.

A child process runs a training-like loop (``session.start`` with retention
on, then ``report(..., checkpoint=...)`` forever, resuming from
``get_checkpoint()``); the parent kills it with ``SIGKILL`` after a random
delay and, after every kill, checks the trial:

* no partial checkpoint is visible: every checkpoint that lists as committed
  verifies (sizes, CRC32C) and holds exactly the bytes of its own step (no
  mix of two saves);
* every checkpoint the child was told was committed and that retention did
  not evict (or may not have evicted by the next save) still loads and
  verifies, and nothing newer than the last acknowledged one was lost;
* ``result.json`` (with the segments a killed run left on object stores)
  holds the row of every acknowledged save, and no row twice, before and
  after the next session assembles it;
* a new session's ``get_checkpoint()`` returns the newest committed one, and
  its start leaves no uncommitted leftovers; nothing is ever classified as
  foreign (all leftovers are recognisably ours).

Usage (what ``tests/crash`` and ``scripts/soak.py`` do)::

    from checkpoint_store.testing.crash import CrashConfig, CrashHarness

    cfg = CrashConfig(storage_path=str(tmp_path / "store"), log_path=str(tmp_path / "acks"))
    report = CrashHarness(cfg, seed=0).run(kills=100)
    assert report.violations == [], report.summary()

:func:`sweep_state_crashes` is the deterministic complement for the
retention state (log records, snapshots, chunks): one run per mutating
storage call, crashed exactly there, each followed by the same checks on
the state as stored and on what the next manager makes of it.
:class:`~checkpoint_store.testing.crash.fleet.FleetHarness` kills and
restarts processes that save through a local tier (directories, or states
sync and async) on other machines (a second machine's stale tier, a fresh
one, none) and two jobs on one tier path, and reports every wrong, stale,
partial or foreign resume, lost acknowledged row and duplicated step by
kind (``fleet``; docs/tiers.md).
:func:`sweep_lease_crashes` does the same for the lease (acquire, take-over
of an expired or dead holder's lease, renewals, release): after each crash a
new writer gets the trial once the dead holder's lease expires, never
alongside a live holder, and nothing but the lease file is touched.

Children are forked from a helper process (the "zygote") that has already
imported checkpoint-store, so a child starts in milliseconds, not the
half-second an interpreter plus pyarrow take.

Where things are: the saving child and the zygote in ``_child``, the checks
after a kill in ``check``, the kill loop in ``harness``, the retention-state
sweep in ``state`` and the lease sweep in ``lease``.
"""

from __future__ import annotations

from checkpoint_store.testing.crash._child import CrashConfig, payload
from checkpoint_store.testing.crash.check import check_trial
from checkpoint_store.testing.crash.fleet import FleetConfig, FleetHarness, FleetReport, Violation
from checkpoint_store.testing.crash.harness import CrashHarness, CrashReport
from checkpoint_store.testing.crash.lease import LeaseCrashReport, sweep_lease_crashes
from checkpoint_store.testing.crash.state import StateCrashReport, sweep_state_crashes

__all__ = [
    "CrashConfig",
    "CrashHarness",
    "CrashReport",
    "FleetConfig",
    "FleetHarness",
    "FleetReport",
    "LeaseCrashReport",
    "StateCrashReport",
    "check_trial",
    "payload",
    "sweep_lease_crashes",
    "sweep_state_crashes",
    "Violation",
]
