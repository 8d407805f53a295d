"""A signal's exception can land between any two lines of the training thread.
Where that thread hands work to a background worker (the session's upload and
tier lanes, the evicted-checkpoint deleter, Lightning's ordered save queue),
a cut at any line of the hand-off, ``Thread.start`` included, must leave the
work either not queued or queued and run, never queued with no worker to run
it (every later wait hung: a SIGTERM whose handler called ``sys.exit`` during
a report left ``session`` end waiting for ever, until the scheduler's
SIGKILL), and never two loops at once.

Each test replays the hand-off once per line it runs (``sys.settrace`` line
events in the hand-off's own functions and in ``threading.Thread.start``),
raising ``KeyboardInterrupt`` at that line, as the interpreter raises a
signal handler's exception between two bytecodes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable

import pytest

from checkpoint_store._results.writer import ResultLog
from checkpoint_store._util.locks import OneWorker
from checkpoint_store.integrations._lightning.queue import _OrderedQueue
from checkpoint_store.retention import lease as _lease
from checkpoint_store.retention.deletes import Deleter
from checkpoint_store.retention.manager import CheckpointManager
from checkpoint_store.session._trial_runner import TrialRunner
from checkpoint_store.session._uploads import BackgroundUploader

#: How long a wait that returns at once here may take before it counts as hung.
HUNG_S = 5.0
#: The same for a trial's step, which starts a session on its first call
#: (a lease, the retention state, the results), on a box under load.
STEP_S = 30.0

WATCHED = {OneWorker.ensure.__code__, threading.Thread.start.__code__,
           BackgroundUploader.submit.__code__, Deleter.kick.__code__,
           _OrderedQueue.submit.__code__, ResultLog.append.__code__,
           CheckpointManager.__init__.__code__, _lease.Lease.acquire.__code__,
           _lease._LeaseKeeper.add.__code__, TrialRunner._start_thread.__code__,
           TrialRunner._start_locked.__code__}


def _cut_at(k: int | None, act: Callable[[], None]) -> int:
    """Run ``act``; raise ``KeyboardInterrupt`` at its ``k``-th watched line
    (None: none). Returns the number of watched lines it ran."""
    seen = [0]
    visited: set[tuple[int, int]] = set()

    def local(frame, event, arg):
        # The first visit of each line of a frame only: leaving a ``with``
        # block visits its line again, where the interpreter runs no signal
        # handler before ``__exit__`` (a trace function's exception there
        # would skip the lock's release, which no signal can).
        if event == "line" and (id(frame), frame.f_lineno) not in visited:
            visited.add((id(frame), frame.f_lineno))
            if seen[0] == k:
                seen[0] += 1
                raise KeyboardInterrupt
            seen[0] += 1
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code in WATCHED else None

    sys.settrace(tracer)
    try:
        act()
    except KeyboardInterrupt:
        assert k is not None
    finally:
        sys.settrace(None)
    return seen[0]


def _every_cut(make: Callable[[], object], act: Callable[[object], None],
               check: Callable[[object, bool], None]) -> int:
    lines = _cut_at(None, lambda: act(make()))
    assert lines > 5  # the hand-off and Thread.start were traced
    for k in range(lines):
        owner = make()
        cut: list[bool] = []

        def run(owner=owner, cut=cut):
            try:
                act(owner)
            except KeyboardInterrupt:
                cut.append(True)
                raise

        _cut_at(k, run)
        check(owner, bool(cut))
    return lines


class _Jobs:
    """Jobs that record their runs and catch two running at once."""

    def __init__(self):
        self.ran: list[str] = []
        self.cleaned: list[str] = []
        self._inside = 0
        self.overlapped = False

    def job(self, what: str) -> Callable[[], None]:
        def run():
            self._inside += 1
            self.overlapped |= self._inside > 1
            time.sleep(0.002)
            self.ran.append(what)
            self._inside -= 1
        return run


def test_an_upload_submit_cut_at_any_line_never_strands_a_job():
    def make():
        up = BackgroundUploader(max_pending=4)
        up.jobs = _Jobs()
        up.submit(up.jobs.job("a"), lambda: up.jobs.cleaned.append("a"), "a")
        return up

    def act(up):
        up.submit(up.jobs.job("b"), lambda: up.jobs.cleaned.append("b"), "b")

    def check(up, cut):
        assert up.wait(timeout=10), f"{up.pending} job(s) stranded"
        assert up.pending == 0
        assert up.jobs.ran in (["a"], ["a", "b"]) and up.jobs.cleaned == up.jobs.ran
        assert not up.jobs.overlapped
        # The lane goes on: a later job runs, in order.
        up.submit(up.jobs.job("c"), lambda: None, "c")
        assert up.wait(timeout=10) and up.jobs.ran[-1] == "c"
        up.close()

    _every_cut(make, act, check)


def test_an_upload_reserve_after_a_cut_submit_does_not_wait_for_ever():
    # Cut the first submit right after the job is queued (before any worker).
    k = 0
    while True:
        up = BackgroundUploader(max_pending=1)
        jobs = _Jobs()
        _cut_at(k, lambda up=up, jobs=jobs: up.submit(jobs.job("a"), lambda: None, "a"))
        if up.pending:  # queued: reserve must see it run
            break
        k += 1
    t0 = time.monotonic()
    assert up.reserve() >= 0 and time.monotonic() - t0 < 10
    assert jobs.ran == ["a"]
    up.close()


def test_a_deleter_kick_cut_at_any_line_never_strands_a_round():
    def make():
        jobs = _Jobs()
        d = Deleter(jobs.job("round"))
        d.jobs = jobs
        return d

    def check(d, cut):
        assert d.wait(timeout=10), "a due round has no worker"
        assert d.idle
        assert not d.jobs.overlapped
        d.kick()
        assert d.wait(timeout=10) and d.jobs.ran and d.idle

    _every_cut(make, lambda d: d.kick(), check)


def test_a_lightning_queue_submit_cut_at_any_line_never_strands_a_save():
    def make():
        q = _OrderedQueue(max_pending_saves=2)
        q.jobs = _Jobs()
        q.submit("save", "a", q.jobs.job("a"))
        q.wait()  # its worker ended: the next submit starts one
        return q

    def check(q, cut):
        done = threading.Event()

        def wait():
            q.wait()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        assert done.wait(10), "a queued save has no worker"
        assert q.jobs.ran in (["a"], ["a", "b"]) and not q.jobs.overlapped
        q.submit("save", "c", q.jobs.job("c"))
        q.wait("c")
        assert q.jobs.ran[-1] == "c"
        q.wait()

    _every_cut(make, lambda q: q.submit("save", "b", q.jobs.job("b")), check)


def test_a_result_row_append_cut_at_any_line_keeps_its_flush_timer(tmp_path):
    """On an object store rows wait in a buffer for a timer's flush; a cut
    that lost the timer's start left every later row unwritten until the
    buffer filled (1 MiB) or the session ended."""
    from checkpoint_store.storage import StorageContext

    n = [0]

    def make():
        n[0] += 1
        ctx = StorageContext(f"memory://{tmp_path.name}/cut{n[0]}", "e", "t")
        log = ResultLog(ctx, flush_interval=0.05)
        return log

    def check(log, cut):
        log.append({"training_iteration": 2})
        deadline = time.monotonic() + 10
        while log.buffered and time.monotonic() < deadline:
            time.sleep(0.01)
        assert log.buffered == 0, "rows wait for a flush timer that never runs"
        log.close()

    _every_cut(make, lambda log: log.append({"training_iteration": 1}), check)


def _keeper_threads(keeper: object) -> list[threading.Thread]:
    # Alive only: a start cut before the thread exists leaves it in
    # threading's list of threads being started, for ever.
    return [t for t in threading.enumerate()
            if t.is_alive() and getattr(getattr(t, "_target", None), "__self__", None) is keeper]


@pytest.mark.parametrize("via", ["lease", "manager"])
def test_a_lease_taken_by_a_start_cut_at_any_line_is_renewed_or_released(
        tmp_path, monkeypatch, via):
    """A cut inside the keeper thread's start, the lease queued for it, left
    the lease unrenewed: it expired while its manager still ran, and another
    process could take the trial over. A cut once the lease was written,
    before the manager that took it was built, left it renewed for as long
    as the process lived: the next manager of the trial was refused. Now a
    start that raised leaves no lease, and a lease taken is renewed by one
    keeper loop, which ends once no lease is left (each case has its own
    keeper, so each start starts its thread)."""
    from checkpoint_store import CheckpointConfig
    from checkpoint_store.storage import StorageContext

    made: list[object] = []
    keepers: list[_lease._LeaseKeeper] = []
    n = [0]

    def make():
        while made:  # the run that counted the lines
            made.pop().close() if via == "manager" else made.pop().release()
        keepers.append(_lease._LeaseKeeper())
        monkeypatch.setattr(_lease, "_KEEPER", keepers[-1])
        n[0] += 1
        return StorageContext(str(tmp_path / "runs"), "e", f"t{n[0]}")

    def act(storage):
        if via == "manager":
            made.append(CheckpointManager(CheckpointConfig(2), storage, lease_ttl_s=0.3))
        else:
            lease = _lease.Lease(storage, ttl_s=0.3)
            lease.acquire()
            made.append(lease)

    def body(storage):
        path = os.path.join(storage.trial_path, _lease.LEASE_FILE)
        return json.loads(open(path).read()) if os.path.exists(path) else None

    def check(storage, cut):
        keeper = keepers[-1]
        held = made.pop() if made else None
        assert (held is None) == cut
        if held is None:
            assert body(storage) is None, "a start that raised holds the lease"
            # A release while the keeper's loop held its mutex is queued, and
            # dropped at the loop's next turn (``_LeaseKeeper.remove``).
            assert not keeper._leases - set(keeper._removed)
            return
        first = body(storage)["renewed_at"]
        deadline = time.monotonic() + 5
        while body(storage)["renewed_at"] == first and time.monotonic() < deadline:
            time.sleep(0.02)
        assert body(storage)["renewed_at"] > first, "the lease is not renewed"
        assert len(_keeper_threads(keeper)) == 1
        held.close() if via == "manager" else held.release()  # type: ignore[attr-defined]
        assert body(storage) is None

    _every_cut(make, act, check)
    deadline = time.monotonic() + 5  # no lease left: each keeper's loop ends
    while any(map(_keeper_threads, keepers)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(map(_keeper_threads, keepers))


def test_a_trial_start_cut_at_any_line_runs_the_trial_once(tmp_path):
    """``step()`` starts the trial's thread: a cut between marking the
    runner running and starting its thread left a runner that every later
    ``step()`` waited on for ever. Now either the thread runs, or the
    runner stays as it was and the next ``step()`` starts it; ``train_fn``
    runs once either way."""
    n = [0]

    def make():
        calls: list[int] = []

        def train(config):
            calls.append(1)
            for i in range(3):
                yield {"i": i}

        n[0] += 1
        runner = TrialRunner(train, {}, storage_path=str(tmp_path / "runs"),
                             experiment_name="e", trial_name=f"t{n[0]}")
        runner.calls = calls
        return runner

    def check(runner, cut):
        assert runner.status in ("idle", "running")
        if not cut:
            assert runner.status == "running"
        # The cut step took no result: the next one takes the first.
        got = [runner.step(timeout=STEP_S)["i"] for _ in range(2)]
        assert got == ([0, 1] if cut else [1, 2])
        assert runner.calls == [1], "train_fn ran twice"
        assert runner.stop() and runner.status == "stopped"

    def act(runner):
        runner.step()

    _every_cut(make, act, check)


@pytest.mark.parametrize("starts", [1, 3])
def test_one_worker_runs_one_loop_however_often_it_is_started(starts):
    """A start whose bookkeeping a cut lost is made again; the extra thread
    finds the loop claimed and ends without running it."""
    mutex = threading.RLock()
    loops: list[str] = []
    entered: list[threading.Thread] = []
    gate = threading.Event()

    def loop():
        entered.append(threading.current_thread())
        with mutex:
            if not slot.claim():
                return
        loops.append(threading.current_thread().name)
        gate.wait(10)
        with mutex:
            slot.release()

    slot = OneWorker(loop, "w")
    with mutex:
        slot.ensure()
        for _ in range(starts - 1):
            slot._launching = None  # as if each start's record were cut
            slot.ensure()
    deadline = time.monotonic() + 10
    while len(entered) < starts and time.monotonic() < deadline:
        time.sleep(0.01)
    while not loops and time.monotonic() < deadline:
        time.sleep(0.01)
    serving = slot._serving
    for t in entered:  # while the loop runs, every other start ends at once
        if t is not serving:
            t.join(10)
            assert not t.is_alive()
    assert len(entered) == starts and len(loops) == 1
    gate.set()
    serving.join(10)
    with mutex:  # released: the next start runs the loop again
        slot.ensure()
    slot.last.join(10)
    assert len(loops) == 2
