"""A signal's exception (``KeyboardInterrupt`` on Ctrl-C, the ``SystemExit`` of
a program's own SIGTERM handler) cutting a save short, through more entry
points than tests/state/test_persist_abort.py and
tests/util/test_signal_cut_workers.py cover: ``report(state=...)`` in the
background, with dedup, ``num_to_keep=1`` and a local tier, directory
checkpoints (sync and async), and Lightning's ``CheckpointStoreIO(async_save=True)``.

After each cut the process goes on (the next save commits, ``wait()`` and the
end return), and a new run on the same trial resumes the newest committed
checkpoint and finds nothing foreign or left over.

Each cut is made where the interpreter runs a pending signal handler (after
a call returned, as a function begins): a ``sys.settrace`` line event of the
named line of one function. Two waits for ever found this way are fixed
(the report lock, an idle upload worker), and so are the leftovers found
this way: a directory left uncommitted in the trial after the session's end
(a later session of the same process kept it), a scratch copy of a whole
state left in the staging root for as long as the process lives.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from checkpoint_store import Checkpoint, CheckpointConfig, UploadConfig, session
from checkpoint_store._commit.protocols import RenameCommit
from checkpoint_store.retention.deletes import Deleter
from checkpoint_store.session._executors import BackgroundWork
from checkpoint_store.session._ledger import ReportLedger
from checkpoint_store.session._pipeline import ReportPipeline
from checkpoint_store.session._targets import DurableTarget
from checkpoint_store.session._uploads import BackgroundUploader, _move_contents
from checkpoint_store.state import staging_root
from checkpoint_store.state._stage_copy import StagingCopier
from checkpoint_store.storage import StorageContext
from checkpoint_store.testing import session_internals
from checkpoint_store.tiers import LocalTier

MiB = 1 << 20
#: How long a wait that returns at once here may take before it counts as hung.
HUNG_S = 5.0


def _state(seed: int, n: int = 64 * 1024) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.random(n, dtype=np.float32), "b": rng.random(n, dtype=np.float32),
            "step": seed}


def _directory(tmp_path, step: int) -> Checkpoint:
    d = tmp_path / f"src{step}"
    d.mkdir()
    (d / "model.bin").write_bytes(np.full(MiB // 4, step, dtype=np.float32).tobytes())
    (d / "step.txt").write_text(str(step))
    return Checkpoint.from_directory(str(d))


def _line_of(func: Callable, text: str) -> int:
    """The line of ``func`` whose source holds ``text`` (one only)."""
    src, first = inspect.getsourcelines(func)
    found = [first + i for i, line in enumerate(src) if text in line]
    assert len(found) == 1, (func, text, found)
    return found[0]


@contextlib.contextmanager
def _cut_at(func: Callable, text: str | None = None, after: int = 0,
            nth: int = 1) -> Iterator[list[bool]]:
    """Raise ``KeyboardInterrupt`` once, at the first (``nth``) line event of
    ``func`` (``text``: of its line holding ``text``, or ``after`` lines
    below it) on this thread; yields a list that holds True once the cut
    was made."""
    code = inspect.unwrap(func).__code__
    line = None if text is None else _line_of(func, text) + after
    made: list[bool] = []
    seen = [0]

    def local(frame, event, arg):
        if event == "line" and not made and (line is None or frame.f_lineno == line):
            seen[0] += 1
            if seen[0] == nth:
                made.append(True)
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is code and not made else None

    sys.settrace(tracer)
    try:
        yield made
    finally:
        sys.settrace(None)


def _run_for(fn: Callable[[], None], timeout: float = HUNG_S) -> tuple[bool, threading.Thread,
                                                                       list[BaseException]]:
    """Run ``fn`` on a thread: (whether it returned within ``timeout``, the
    thread, its exception if any)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), t, errors


def _names(root: str) -> list[str]:
    trial = os.path.join(root, "e", "t")
    return sorted(n for n in os.listdir(trial) if n.startswith("checkpoint_"))


def _resumes(root: str, monkeypatch, newest: str, **start) -> None:
    """A new run (another run id: another process) on the trial resumes
    ``newest`` and, once started, finds nothing foreign or uncommitted."""
    monkeypatch.setenv("CHECKPOINT_STORE_RUN_ID", "the_next_run")
    with session.start(storage_path=root, experiment_name="e", trial_name="t", **start) as s:
        resumed = s.get_checkpoint()
        assert resumed is not None and resumed.path.endswith(newest)
        scan = StorageContext(root, "e", "t").scan()
        assert scan.foreign == [] and scan.uncommitted == []
    monkeypatch.delenv("CHECKPOINT_STORE_RUN_ID")


# -- defects -------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["report", "next_checkpoint_dir"])
def test_a_signal_as_a_report_takes_its_lock_does_not_hang_the_end_of_the_session(
        tmp_path, monkeypatch, where):
    """Ctrl-C in a training loop inside ``with session.start(...)``, landing
    just after a report took the report lock: the ``KeyboardInterrupt``
    leaves the block, whose end (``close()``: settle under the report lock)
    must return, so the program exits. The lock was once taken inside a
    ``@contextmanager`` generator: a cut as its ``__enter__`` returned left
    the lock held while the exception lived, and the end waited for ever.
    Now the lock is entered as itself (``with ledger.lock``) and the cut
    lands at the first line of ``ReportLedger.open_txn``, under it."""
    root = str(tmp_path / "runs")
    caught: list[BaseException] = []

    def run() -> None:
        try:
            with session.start(storage_path=root, experiment_name="e", trial_name="t") as s:
                s.report({"step": 0}, state=_state(0))
                with _cut_at(ReportLedger.open_txn) as made:
                    if where == "report":
                        s.report({"step": 1}, state=_state(1))
                    else:
                        s.next_checkpoint_dir()
                assert not made  # not reached: the cut raised
        except KeyboardInterrupt as exc:
            caught.append(exc)

    ended, t, errors = _run_for(run)
    assert ended, "the end of the session waits for ever for the report lock"
    assert not errors and caught
    _resumes(root, monkeypatch, "checkpoint_000000")


def _lanes(s) -> list[BackgroundUploader]:
    return list(session_internals(s).pipeline.work._lanes.values())


@pytest.mark.parametrize("line", ["self._cond.notify_all()", "self._worker.ensure()"])
@pytest.mark.parametrize("kind", ["state", "directory-async", "state-tier", "directory-tier"])
def test_a_signal_as_a_job_is_queued_for_an_idle_worker_does_not_hang(tmp_path, kind, line):
    """The report before has committed and its lane's worker waits idle for
    the next job; the cut report's submit is cut at ``line`` (at the notify
    it once followed the append: the job was queued, the worker never told). Then
    the next report (no tier: its slot on the durable lane) and ``wait()``
    (with a tier) must return, and the end of the session too."""
    root = str(tmp_path / "runs")
    start: dict = {"upload_config": UploadConfig(upload_mode="async")}
    if kind.endswith("tier"):
        start = {"local_tier": LocalTier(str(tmp_path / "tier"))}

    def save(step: int) -> dict:
        return ({"state": _state(step)} if kind.startswith("state")
                else {"checkpoint": _directory(tmp_path, step)})

    with session.start(storage_path=root, experiment_name="e", trial_name="t", **start) as s:
        s.report({"step": 0}, **save(0))
        s.wait()
        time.sleep(0.2)  # the lanes' workers are idle, waiting for a job
        with _cut_at(BackgroundUploader.submit, line) as made:
            with pytest.raises(KeyboardInterrupt):
                s.report({"step": 1}, **save(1))
        assert made

        def go_on() -> None:
            if not kind.endswith("tier"):
                s.report({"step": 2}, **save(2))
            s.wait()

        returned, t, errors = _run_for(go_on)
        if not returned:  # wake the workers, so that the session can end
            while t.is_alive():
                for up in _lanes(s):
                    with up._mutex:
                        up._cond.notify_all()
                t.join(0.1)
        assert returned, "a queued job waits for ever for its idle worker"
        assert not errors


def _in_staging_root() -> list[str]:
    """Scratch directories of this process in the staging root."""
    root = staging_root()
    mine = f"-{os.getpid()}_"
    return sorted(n for n in os.listdir(root) if mine in n) if os.path.isdir(root) else []


@pytest.mark.parametrize("kind, func, text", [
    # The state was staged into checkpoint_<index> (the persist process
    # writes it whole); its commit job was never queued (once: nothing
    # dropped it).
    pytest.param("state", BackgroundWork.submit, None, id="state-staged-not-queued"),
    # Queued, the submit cut after the append: the report takes the commit
    # back before the worker takes it, or the worker commits it.
    pytest.param("state", BackgroundUploader.submit, "self._worker.ensure()",
                 id="state-staged-queued"),
    # checkpoint_<index> was made and claimed (reserve_in_place returned),
    # the stage not begun: the drop once covered the stage only.
    pytest.param("state", DurableTarget.reserve, "return self.directory(index)",
                 id="state-reserved"),
    # A synchronous directory commit, the copy into .cs_staging-checkpoint_<index>-*
    # whole: the commit once removed it on an Exception only (the report's
    # settle() removes checkpoint_<index>, never the staging directory).
    pytest.param("directory", RenameCommit._settled_move, None, id="directory-sync-copied"),
])
def test_a_cut_report_leaves_no_uncommitted_directory_after_the_session(
        tmp_path, monkeypatch, kind, func, text):
    root = str(tmp_path / "runs")

    def save(step: int) -> dict:
        return ({"state": _state(step)} if kind == "state"
                else {"checkpoint": _directory(tmp_path, step)})

    cfg = CheckpointConfig(num_to_keep=None)
    with session.start(storage_path=root, experiment_name="e", trial_name="t",
                       checkpoint_config=cfg) as s:
        s.report({"step": 0}, **save(0))
        with _cut_at(func, text) as made:
            with pytest.raises(KeyboardInterrupt):
                s.report({"step": 1}, **save(1))
        assert made
        row = s.report({"step": 2}, **save(2))
        s.wait()
    scan = StorageContext(root, "e", "t").scan()
    assert scan.foreign == []
    assert scan.committed == ["checkpoint_000000", row["checkpoint_dir_name"]]
    assert scan.uncommitted == [], f"left after the session's end: {scan.uncommitted}"


@pytest.mark.parametrize("staging, func, text, nth", [
    # The private copy made, the commit not yet queued.
    pytest.param("copy", ReportPipeline._report, 'internal = {"metrics"', 1, id="copy-opened"),
    pytest.param("move", ReportPipeline._report, 'internal = {"metrics"', 1, id="move-opened"),
    # Queued behind a busy commit, the submit cut after the append: taken back.
    pytest.param("copy", BackgroundUploader.submit, "self._worker.ensure()", 1,
                 id="copy-queued"),
    pytest.param("hardlink", BackgroundUploader.submit, "self._worker.ensure()", 1,
                 id="hardlink-queued"),
    pytest.param("move", BackgroundUploader.submit, "self._worker.ensure()", 1,
                 id="move-queued"),
    # One file of two moved into the private copy.
    pytest.param("move", _move_contents, "os.rename(s, d)", 2, id="move-moving"),
])
def test_a_directory_report_cut_before_its_commit_runs_takes_it_back(
        tmp_path, monkeypatch, staging, func, text, nth):
    """``upload_mode="async"`` stages a private copy of the reported
    directory (``staging``). Cut before its commit ran, it was neither taken
    back nor released: the commit of a report that raised still ran, and
    its copy stayed in the staging root when the commit was never queued.
    With ``staging="move"`` the reported directory was left empty, and a
    move cut short removed the files it had moved. Now the report takes
    the commit back, the copy goes, and moved files go back where they
    were."""
    root = str(tmp_path / "runs")
    start = {"upload_config": UploadConfig(upload_mode="async", max_pending_uploads=4),
             "checkpoint_config": CheckpointConfig(num_to_keep=None)}
    before = set(_in_staging_root())
    gate = threading.Event()
    with session.start(storage_path=root, experiment_name="e", trial_name="t", **start) as s:
        s.report({"step": 0}, checkpoint=_directory(tmp_path, 0))
        s.wait()
        # The lane's worker busy: a queued commit waits behind it.
        session_internals(s).pipeline.work.submit("durable", lambda: gate.wait(HUNG_S),
                                                  lambda: None, "busy")
        src = _directory(tmp_path, 1)
        with _cut_at(func, text, nth=nth) as made:
            with pytest.raises(KeyboardInterrupt):
                s.report({"step": 1}, checkpoint=src, staging=staging)
        assert made
        gate.set()
        s.wait()
        # The reported directory is the caller's again, whole.
        assert sorted(os.listdir(src.path)) == ["model.bin", "step.txt"]
        assert (tmp_path / "src1" / "step.txt").read_text() == "1"
        assert _names(root) == ["checkpoint_000000"], "the commit of a report that raised ran"
        row = s.report({"step": 2}, checkpoint=_directory(tmp_path, 2), staging=staging)
        s.wait()
    newest = row["checkpoint_dir_name"]
    assert _names(root) == ["checkpoint_000000", newest]
    left = sorted(set(_in_staging_root()) - before)
    assert left == [], f"staged copies left in {staging_root()}: {left}"
    _resumes(root, monkeypatch, newest, **start)


def _end_cut_while_it_waits(tmp_path, root: str, start: dict,
                            then: Callable[[], None] = lambda: None) -> tuple[Any, list[bool]]:
    """A session with one committed checkpoint and a commit still running
    as it ends, whose end is cut (``KeyboardInterrupt``) as it waits for that
    commit; ``then`` runs just before the last report. Returns the session
    and whether the cut was made; the running commit is let go."""
    gate = threading.Event()
    try:
        with pytest.raises(KeyboardInterrupt):
            with _cut_at(BackgroundWork.drain, "up.wait()") as made:
                with session.start(storage_path=root, experiment_name="e", trial_name="t",
                                   **start) as s:
                    s.report({"step": 0}, checkpoint=_directory(tmp_path, 0))
                    s.wait()
                    # A commit still running as the session ends.
                    session_internals(s).pipeline.work.submit(
                        "durable", lambda: gate.wait(HUNG_S), lambda: None, "busy")
                    then()
                    s.report({"step": 1})
    finally:
        gate.set()
    return s, made


def test_a_signal_while_the_session_end_waits_still_ends_it(tmp_path, monkeypatch):
    """A second Ctrl-C while the end of the session waits for its queued
    commits: the end once stopped there, the ``KeyboardInterrupt`` raised
    and nothing released. The trial's lease stayed held, renewed for as
    long as the process lived (the next session of the trial in this
    process was refused; a new process on this host took it over only once
    this one exited), the session's rows were never closed and the session
    took reports still. Now the end goes on to end the session, record how
    it ended and release the trial, then raises the ``KeyboardInterrupt``."""
    from checkpoint_store import CheckpointStoreError

    root = str(tmp_path / "runs")
    start = {"upload_config": UploadConfig(upload_mode="async")}
    s, made = _end_cut_while_it_waits(tmp_path, root, start)
    assert made
    trial = os.path.join(root, "e", "t")
    assert "KeyboardInterrupt" in open(os.path.join(trial, "error.txt")).read()
    with pytest.raises(CheckpointStoreError, match="ended"):
        s.report({"step": 2})
    returned, _, errors = _run_for(lambda: _resumes(root, monkeypatch, "checkpoint_000000",
                                                    **start))
    assert returned and not errors, errors


def test_a_dedup_report_cut_before_its_commit_is_queued_leaves_no_scratch_copy(
        tmp_path, monkeypatch):
    """With dedup a state is staged into a scratch directory of the staging
    root: cut before its commit was queued, it once stayed there (the whole
    state) for as long as the process lived."""
    root = str(tmp_path / "runs")
    before = set(_in_staging_root())
    with session.start(storage_path=root, experiment_name="e", trial_name="t",
                       upload_config=UploadConfig(dedup=True)) as s:
        s.report({"step": 0}, state=_state(0))
        with _cut_at(BackgroundWork.submit) as made:
            with pytest.raises(KeyboardInterrupt):
                s.report({"step": 1}, state=_state(1))
        assert made
        s.report({"step": 2}, state=_state(2))
        s.wait()
    assert _names(root) == ["checkpoint_000000", "checkpoint_000002"]
    _resumes(root, monkeypatch, "checkpoint_000002", upload_config=UploadConfig(dedup=True))
    left = sorted(set(_in_staging_root()) - before)
    assert left == [], f"scratch copies left in {staging_root()}: {left}"


def _lightning(step: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(step)
    return {"state_dict": {"w": torch.rand(64, 64, generator=g),
                           "b": torch.rand(64, generator=g)},
            "global_step": step, "epoch": 0}


def _lightning_dirs(d) -> dict[str, str]:
    import pyarrow.fs as pafs

    from checkpoint_store._util.inspect import inspect_checkpoint

    fs = pafs.LocalFileSystem()
    return {n: inspect_checkpoint(fs, os.path.join(d, n)).state for n in sorted(os.listdir(d))}


def test_a_lightning_async_save_cut_before_it_is_queued_leaves_no_scratch_copy(tmp_path):
    pytest.importorskip("lightning")
    from checkpoint_store.integrations._lightning.queue import _OrderedQueue
    from checkpoint_store.integrations.lightning import CheckpointStoreIO

    d = str(tmp_path / "ckpts")
    before = set(_in_staging_root())
    io = CheckpointStoreIO(async_save=True)
    io.save_checkpoint(_lightning(0), f"{d}/step=0.ckpt")
    io.wait()
    with _cut_at(_OrderedQueue.submit) as made:
        with pytest.raises(KeyboardInterrupt):
            io.save_checkpoint(_lightning(1), f"{d}/step=1.ckpt")
    assert made
    io.save_checkpoint(_lightning(2), f"{d}/step=2.ckpt")
    returned, _, errors = _run_for(io.teardown)
    assert returned and not errors
    assert _lightning_dirs(d) == {"step=0.ckpt": "committed", "step=2.ckpt": "committed"}
    left = sorted(set(_in_staging_root()) - before)
    assert left == [], f"scratch copies left in {staging_root()}: {left}"


def _submit_lines() -> list[int]:
    from checkpoint_store.integrations._lightning.queue import _OrderedQueue

    src, first = inspect.getsourcelines(_OrderedQueue.submit)
    body = [first + i for i, line in enumerate(src) if line.strip() and i > 0
            and not line.strip().startswith(('"""', "#")) and '"""' not in line]
    return body


@pytest.mark.parametrize("full", [False, True], ids=["room", "full"])
def test_a_lightning_async_save_cut_at_any_line_of_its_queueing(tmp_path, full):
    """Cut at each line of the queue's ``submit`` (``full``: behind a save
    that holds the one pending slot, so the wait's lines run too): queued or
    not, a save whose call raised before its worker took it is not saved, as
    a cut report is not, and its snapshot is gone at once; the next save
    commits, ``teardown()`` returns and no scratch copy is left."""
    pytest.importorskip("lightning")
    from checkpoint_store.integrations._lightning.queue import _OrderedQueue
    from checkpoint_store.integrations.lightning import CheckpointStoreIO

    append = _line_of(_OrderedQueue.submit, "self._jobs.append(")
    wait = _line_of(_OrderedQueue.submit, "while kind")
    lines = _submit_lines()
    if full:  # the wait's lines run: every line up to the append
        lines = [n for n in lines if n <= append]
    else:  # no wait
        lines = [n for n in lines if not wait < n < append]
    assert len(lines) >= 3, lines
    for n, line in enumerate(lines):
        d = str(tmp_path / f"ckpts{n}")
        before = set(_in_staging_root())
        io = CheckpointStoreIO(async_save=True, max_pending_saves=1)
        io.save_checkpoint(_lightning(0), f"{d}/step=0.ckpt")
        io.wait()
        gate = threading.Event()
        if full:  # the one pending slot taken by a save that waits for the gate
            io._queue_or_none().submit("save", "gate", lambda g=gate: g.wait(HUNG_S))
            threading.Timer(0.2, gate.set).start()
        made: list[bool] = []
        code = inspect.unwrap(_OrderedQueue.submit).__code__

        def local(frame, event, arg, line=line, made=made):
            if event == "line" and not made and frame.f_lineno == line:
                made.append(True)
                raise KeyboardInterrupt
            return local

        sys.settrace(lambda f, e, a, code=code, local=local, made=made:
                     local if f.f_code is code and not made else None)
        try:
            with pytest.raises(KeyboardInterrupt):
                io.save_checkpoint(_lightning(1), f"{d}/step=1.ckpt")
        finally:
            sys.settrace(None)
        assert made, line
        gate.set()
        io.save_checkpoint(_lightning(2), f"{d}/step=2.ckpt")
        returned, _, errors = _run_for(io.teardown, 3 * HUNG_S)  # up to three saves
        assert returned and not errors, (line, errors)
        expected = {"step=0.ckpt": "committed", "step=2.ckpt": "committed"}
        assert _lightning_dirs(d) == expected, line
        left = sorted(set(_in_staging_root()) - before)
        assert left == [], f"line {line}: scratch copies left in {staging_root()}: {left}"


def test_a_lightning_async_save_cut_between_its_snapshot_and_its_queueing(tmp_path):
    """Cut at each line of ``save_checkpoint`` from the snapshot to its
    queueing: the snapshot was taken outside the ``try`` that frees it, so a
    cut between the two (building the job, entering the ``try``) kept every
    tensor of it, and its scratch files, for as long as the process lived.
    Now, as a cut inside ``submit``: not saved, nothing left, the next save
    commits and ``teardown()`` returns."""
    pytest.importorskip("lightning")
    from checkpoint_store.integrations._lightning.io import _StoreIO
    from checkpoint_store.integrations.lightning import CheckpointStoreIO

    func = _StoreIO.save_checkpoint
    code = inspect.unwrap(func).__code__
    first = _line_of(func, "staged_snapshot(checkpoint")
    last = _line_of(func, "queue.submit(")
    cuts = 0
    for line in range(first, last + 1):
        d = str(tmp_path / f"ckpts{line}")
        before = set(_in_staging_root())
        io = CheckpointStoreIO(async_save=True)
        io.save_checkpoint(_lightning(0), f"{d}/step=0.ckpt")
        io.wait()
        made: list[bool] = []

        def local(frame, event, arg, line=line, made=made):
            if event == "line" and not made and frame.f_lineno == line:
                made.append(True)
                raise KeyboardInterrupt
            return local

        sys.settrace(lambda f, e, a, local=local, made=made:
                     local if f.f_code is code and not made else None)
        try:
            io.save_checkpoint(_lightning(1), f"{d}/step=1.ckpt")
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        cuts += bool(made)
        io.save_checkpoint(_lightning(2), f"{d}/step=2.ckpt")
        returned, _, errors = _run_for(io.teardown, 3 * HUNG_S)
        assert returned and not errors, (line, errors)
        expected = {"step=0.ckpt": "committed", "step=2.ckpt": "committed"}
        if not made:  # a line the call does not run (a blank line, a comment)
            expected["step=1.ckpt"] = "committed"
        assert _lightning_dirs(d) == expected, line
        left = sorted(set(_in_staging_root()) - before)
        assert left == [], f"line {line}: scratch copies left in {staging_root()}: {left}"
    assert cuts >= 3, cuts


# -- no defect found -----------------------------------------------------------------------


def test_a_lightning_async_save_its_worker_took_before_the_cut_is_saved(tmp_path, monkeypatch):
    """The cut lands as ``submit`` returns, after the worker began the save:
    the save is not taken back (its snapshot is in use), it commits by
    ``teardown()``, whole, and no scratch copy is left."""
    pytest.importorskip("lightning")
    import torch

    from checkpoint_store.integrations._lightning.queue import _OrderedQueue
    from checkpoint_store.integrations.lightning import CheckpointStoreIO

    d = str(tmp_path / "ckpts")
    before = set(_in_staging_root())
    io = CheckpointStoreIO(async_save=True)
    io.save_checkpoint(_lightning(0), f"{d}/step=0.ckpt")
    io.wait()
    submit = _OrderedQueue.submit
    taken: list[bool] = []

    def submit_then_cut(self, kind, key, job):
        submit(self, kind, key, job)
        deadline = time.monotonic() + HUNG_S
        while not job._taken and time.monotonic() < deadline:  # the worker took it
            time.sleep(0.005)
        taken.append(job._taken)
        raise KeyboardInterrupt

    monkeypatch.setattr(_OrderedQueue, "submit", submit_then_cut)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(_lightning(1), f"{d}/step=1.ckpt")
    monkeypatch.setattr(_OrderedQueue, "submit", submit)
    assert taken == [True]
    returned, _, errors = _run_for(io.teardown)
    assert returned and not errors
    assert _lightning_dirs(d) == {"step=0.ckpt": "committed", "step=1.ckpt": "committed"}
    got = CheckpointStoreIO().load_checkpoint(f"{d}/step=1.ckpt")
    assert torch.equal(got["state_dict"]["w"], _lightning(1)["state_dict"]["w"])
    left = sorted(set(_in_staging_root()) - before)
    assert left == [], f"scratch copies left in {staging_root()}: {left}"


def _busy_state() -> dict:
    return {f"b{i}": np.full(8 * MiB // 4, i, dtype=np.float32) for i in range(4)}


@pytest.mark.parametrize("config", ["async", "async-busy", "dedup", "keep1", "tier",
                                    "tier-busy"])
def test_a_state_report_cut_while_staging_goes_on_and_resumes(tmp_path, monkeypatch, config):
    """Cut as the first piece of the state is copied into staging (behind
    a 32 MiB state the persist process is still writing, for ``-busy``):
    the next report commits, ``wait()`` and the end return, nothing is left
    in the trial, and a new run resumes the newest checkpoint."""
    root = str(tmp_path / "runs")
    start: dict = {"checkpoint_config": CheckpointConfig(num_to_keep=None)}
    if config.startswith("async"):
        start["upload_config"] = UploadConfig(upload_mode="async")
    elif config == "dedup":
        start["upload_config"] = UploadConfig(dedup=True)
    elif config == "keep1":
        start["checkpoint_config"] = CheckpointConfig(num_to_keep=1)
    else:
        start["local_tier"] = LocalTier(str(tmp_path / "tier"))
    busy = config.endswith("busy")
    rows: list[dict] = []

    def run() -> None:
        with session.start(storage_path=root, experiment_name="e", trial_name="t",
                           **start) as s:
            rows.append(s.report({"step": 0}, state=_busy_state() if busy else _state(0)))
            with _cut_at(StagingCopier.copy) as made:
                with pytest.raises(KeyboardInterrupt):
                    s.report({"step": 1}, state=_state(1))
            assert made
            rows.append(s.report({"step": 2}, state=_state(2)))
            s.wait()

    returned, _, errors = _run_for(run, 3 * HUNG_S)
    assert returned and not errors, errors
    # Staged into checkpoint_000001, the cut report consumed its index; staged
    # into a scratch directory (dedup), it wrote nothing under it.
    newest = rows[-1]["checkpoint_dir_name"]
    assert newest == ("checkpoint_000001" if config == "dedup" else "checkpoint_000002")
    kept = [newest] if config == "keep1" else ["checkpoint_000000", newest]
    assert _names(root) == kept
    scan = StorageContext(root, "e", "t").scan()
    assert scan.foreign == [] and scan.uncommitted == []
    _resumes(root, monkeypatch, newest, **start)
    got = StorageContext(root, "e", "t").checkpoint(newest).load_state()
    assert np.array_equal(got["w"], _state(2)["w"])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_directory_report_cut_while_copying_goes_on_and_resumes(tmp_path, monkeypatch, mode):
    """Cut as the directory's files begin to be copied (sync: into the
    commit's staging directory; async: into the staged copy)."""
    from checkpoint_store._transfer import plan as _plan

    root = str(tmp_path / "runs")
    start = {"upload_config": UploadConfig(upload_mode=mode)}
    rows: list[dict] = []

    def run() -> None:
        with session.start(storage_path=root, experiment_name="e", trial_name="t",
                           **start) as s:
            rows.append(s.report({"step": 0}, checkpoint=_directory(tmp_path, 0)))
            s.wait()
            with _cut_at(_plan.run) as made:
                with pytest.raises(KeyboardInterrupt):
                    s.report({"step": 1}, checkpoint=_directory(tmp_path, 1))
            assert made
            rows.append(s.report({"step": 2}, checkpoint=_directory(tmp_path, 2)))
            s.wait()

    returned, _, errors = _run_for(run, 3 * HUNG_S)
    assert returned and not errors, errors
    newest = rows[-1]["checkpoint_dir_name"]
    assert _names(root) == ["checkpoint_000000", newest]
    scan = StorageContext(root, "e", "t").scan()
    assert scan.foreign == []
    _resumes(root, monkeypatch, newest, **start)


def test_an_eviction_kick_cut_before_its_worker_starts_is_deleted_by_wait(tmp_path, monkeypatch):
    """``num_to_keep=1``, synchronous directory reports: retention evicts
    inline and kicks its deleter; the cut comes once the round is due,
    before its thread starts. ``wait()`` starts it and returns; only the
    newest checkpoint is left."""
    root = str(tmp_path / "runs")
    start = {"checkpoint_config": CheckpointConfig(num_to_keep=1)}
    rows: list[dict] = []

    def run() -> None:
        with session.start(storage_path=root, experiment_name="e", trial_name="t",
                           **start) as s:
            rows.append(s.report({"step": 0}, checkpoint=_directory(tmp_path, 0)))
            with _cut_at(Deleter.kick, "self._worker.ensure()") as made:
                with pytest.raises(KeyboardInterrupt):
                    s.report({"step": 1}, checkpoint=_directory(tmp_path, 1))
            assert made
            s.wait()
            rows.append(s.report({"step": 2}, checkpoint=_directory(tmp_path, 2)))
            s.wait()

    returned, _, errors = _run_for(run, 3 * HUNG_S)
    assert returned and not errors, errors
    newest = rows[-1]["checkpoint_dir_name"]
    assert _names(root) == [newest]
    scan = StorageContext(root, "e", "t").scan()
    assert scan.foreign == [] and scan.uncommitted == []
    _resumes(root, monkeypatch, newest, **start)


def test_a_signal_as_a_report_takes_its_lock_caught_and_dropped_lets_the_next_report_run(
        tmp_path, monkeypatch):
    """The same cut, the exception caught and dropped by the loop: the lock
    is free again and the process goes on."""
    root = str(tmp_path / "runs")
    rows: list[dict] = []

    def run() -> None:
        with session.start(storage_path=root, experiment_name="e", trial_name="t") as s:
            rows.append(s.report({"step": 0}, state=_state(0)))
            with _cut_at(ReportLedger.open_txn) as made:
                try:
                    s.report({"step": 1}, state=_state(1))
                except KeyboardInterrupt:
                    pass
            assert made
            rows.append(s.report({"step": 2}, state=_state(2)))
            s.wait()

    returned, _, errors = _run_for(run)
    assert returned and not errors, errors
    newest = rows[-1]["checkpoint_dir_name"]
    assert _names(root) == ["checkpoint_000000", newest]
    _resumes(root, monkeypatch, newest)


def test_a_third_signal_as_the_end_begins_still_releases_the_trial(tmp_path, monkeypatch):
    """A second Ctrl-C cuts the end's wait for its uploads, a third lands
    as the end then refuses later reports (``ledger.end()``, the first line
    of ``_end``): that line stood before the ``try`` whose ``finally``
    releases the lease, so the trial stayed held by this process and the
    next session of it was refused. Now the release runs however ``_end``
    is cut. (A trace function that raises is unset, so the third signal is
    raised by ``ReportLedger.end`` as it is entered.)"""
    root = str(tmp_path / "runs")
    start = {"upload_config": UploadConfig(upload_mode="async")}
    third: list[bool] = []
    end = ReportLedger.end

    def cut_end(self) -> None:
        if not third:
            third.append(True)
            raise KeyboardInterrupt
        end(self)

    _, made = _end_cut_while_it_waits(
        tmp_path, root, start, then=lambda: monkeypatch.setattr(ReportLedger, "end", cut_end))
    assert made and third
    monkeypatch.setattr(ReportLedger, "end", end)
    returned, _, errors = _run_for(lambda: _resumes(root, monkeypatch, "checkpoint_000000",
                                                    **start), timeout=30)
    assert returned and not errors, errors
