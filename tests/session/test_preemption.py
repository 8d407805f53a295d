"""Preemption: a signal becomes a committed checkpoint, then a stop
(``session.start(preemption=PreemptionConfig(...))``, docs/preemption.md).

The tests send real signals to this process (pytest runs them in the main
thread, where Python runs signal handlers) or to a child process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint, LocalTier, PreemptionConfig, StorageContext, session
from checkpoint_store.errors import InvalidConfigError, Preempted, TrialStopped
from checkpoint_store.session import _preemption

# Each test starts from a fresh process's handlers (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_signal_handlers")


# -- the configuration --------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"signals": ("SIGNOPE",)}, "unknown signal"),
    ({"signals": (9999,)}, "unknown signal number"),
    ({"signals": ("SIGKILL",)}, "cannot be caught"),
    ({"signals": (signal.SIGSTOP,)}, "cannot be caught"),
    ({"signals": ()}, "at least one"),
    ({"signals": (1.5,)}, "a name"),
    ({"signals": None}, "sequence"),
    ({"grace_period_s": 0}, "positive"),
    ({"grace_period_s": -1.0}, "positive"),
    ({"grace_period_s": float("inf")}, "positive"),
    ({"grace_period_s": float("nan")}, "positive"),
    ({"grace_period_s": True}, "positive"),
    ({"grace_period_s": "30"}, "positive"),
    ({"grace_period_s": 5, "stop_margin_s": 5}, "stop_margin_s"),
    ({"grace_period_s": 5, "stop_margin_s": -1}, "stop_margin_s"),
    ({"exit_code": 256}, "exit_code"),
    ({"exit_code": -1}, "exit_code"),
    ({"exit_code": True}, "exit_code"),
])
def test_a_bad_preemption_config_is_refused(kwargs, match):
    with pytest.raises(InvalidConfigError, match=match):
        PreemptionConfig(**kwargs)


def test_signal_names_are_normalised():
    config = PreemptionConfig(signals=("term", signal.SIGUSR1, int(signal.SIGINT), "SIGTERM"))
    assert config.signals == ("SIGTERM", "SIGUSR1", "SIGINT")
    assert config.code_for(int(signal.SIGUSR1)) == 128 + int(signal.SIGUSR1)
    assert PreemptionConfig(exit_code=0).code_for(15) == 0
    assert PreemptionConfig(grace_period_s=120).margin_s == 10.0
    assert PreemptionConfig(grace_period_s=5).margin_s == 1.0


@pytest.mark.parametrize("value", ["yes", 30, {"grace_period_s": 3}])
def test_start_refuses_another_preemption_value_before_writing(tmp_path, value):
    root = tmp_path / "store"
    with pytest.raises(InvalidConfigError, match="PreemptionConfig"):
        session.start(storage_path=str(root), experiment_name="e", trial_name="t",
                      preemption=value)
    assert not root.exists()


# -- where it runs: a URI, a pyarrow filesystem, an fsspec filesystem ----------------------


def _place(form: str, kind: str, request: pytest.FixtureRequest, tmp_path: Any
           ) -> tuple[str, dict[str, Any]]:
    """``(storage_path, extra start() arguments)`` of ``kind`` given as ``form``."""
    if kind == "local":
        root = str(tmp_path / "store")
        if form == "uri":
            return root, {}
        if form == "pyarrow":
            return root, {"storage_filesystem": pafs.LocalFileSystem()}
        import fsspec

        return root, {"storage_filesystem": fsspec.filesystem("file")}
    if form == "uri":
        loc = request.getfixturevalue("s3_location")
        return loc.uri, {"storage_options": dict(loc.storage_options)}
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    if form == "pyarrow":
        fs = pafs.S3FileSystem(access_key=server.access_key_id,
                               secret_key=server.secret_access_key, region="us-east-1",
                               scheme="http", endpoint_override=f"127.0.0.1:{server.port}")
        return f"{bucket}/runs", {"storage_filesystem": fs}
    import s3fs

    fs = s3fs.S3FileSystem(key=server.access_key_id, secret=server.secret_access_key,
                           endpoint_url=server.endpoint_url, skip_instance_cache=True,
                           use_listings_cache=False)
    return f"{bucket}/runs", {"storage_filesystem": fs}


def _ctx(root: str, extra: dict[str, Any]) -> StorageContext:
    return StorageContext(root, "e", "t", storage_filesystem=extra.get("storage_filesystem"),
                          storage_options=extra.get("storage_options"))


def _state(step: int) -> dict[str, Any]:
    return {"w": np.arange(64, dtype=np.float32) * step, "step": step}


FORMS = [("uri", "local"), ("pyarrow", "local"), ("fsspec", "local"), ("uri", "s3"),
         ("pyarrow", "s3"), pytest.param("fsspec", "s3", marks=pytest.mark.slow)]


@pytest.mark.parametrize("form, kind", FORMS)
def test_a_sigterm_becomes_a_committed_preemption_checkpoint_then_a_stop(
        form, kind, request, tmp_path):
    root, extra = _place(form, kind, request, tmp_path)
    acked = []
    with pytest.raises(Preempted) as stop:
        with session.start(storage_path=root, experiment_name="e", trial_name="t",
                           preemption=PreemptionConfig(grace_period_s=60), **extra) as s:
            for step in range(1, 100):
                if step == 4:
                    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs right here
                    assert s.reached_preemption and session.reached_preemption()
                if step % 10 == 0 or session.reached_preemption():
                    s.report({"step": step}, state=_state(step))  # async: acknowledged
                else:
                    s.report({"step": step})
                acked.append(step)
    assert acked == [1, 2, 3]  # the report of step 4 committed, then raised
    exc = stop.value
    assert isinstance(exc, SystemExit) and isinstance(exc, TrialStopped)
    assert exc.code == 143 and exc.signal == "SIGTERM" and exc.status == "preempted"
    ctx = _ctx(root, extra)
    committed = ctx.committed_checkpoints()
    assert [m["metrics"]["step"] for _, m in committed] == [4]
    meta = committed[-1][1]
    assert meta["preemption"]["signal"] == "SIGTERM"
    assert meta["preemption"]["grace_period_s"] == 60.0
    assert abs(meta["preemption"]["signalled_at"] - time.time()) < 120
    stop_record = ctx.read_stop()
    assert stop_record is not None and stop_record["status"] == "preempted"
    assert "SIGTERM" in stop_record["reason"]
    assert ctx.read_error() is None
    assert [r["step"] for r in ctx.read_results()] == [1, 2, 3, 4]
    # The handler is given back; the lease too: a restart starts at once and resumes step 4.
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    with session.start(storage_path=root, experiment_name="e", trial_name="t", **extra) as s:
        ckpt = s.get_checkpoint()
        assert ckpt is not None
        assert int(ckpt.load_state()["step"]) == 4
        s.report({"step": 5})
    assert ctx.read_stop() is None  # the restart ended otherwise


def test_the_flag_is_false_without_preemption_and_without_a_session(tmp_path):
    assert session.reached_preemption() is False
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t") as s:
        assert s.reached_preemption is False and session.reached_preemption() is False


def test_a_directory_checkpoint_after_the_signal_is_the_preemption_checkpoint(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(b"weights")
    root = str(tmp_path / "store")
    config = PreemptionConfig(signals=("SIGUSR1",), grace_period_s=30, exit_code=85)
    with pytest.raises(Preempted) as stop:
        with session.start(storage_path=root, experiment_name="e", trial_name="t",
                           preemption=config, upload_config=session.UploadConfig(
                               upload_mode="async")) as s:
            s.report({"step": 1}, checkpoint=Checkpoint.from_directory(str(src)))
            os.kill(os.getpid(), signal.SIGUSR1)
            s.report({"step": 2}, checkpoint=Checkpoint.from_directory(str(src)))
    assert stop.value.code == 85 and stop.value.signal == "SIGUSR1"
    committed = StorageContext(root, "e", "t").committed_checkpoints()
    assert [(m["metrics"]["step"], "preemption" in m) for _, m in committed] == [
        (1, False), (2, True)]
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_a_metrics_only_report_after_the_signal_stops_with_the_newest_checkpoint(tmp_path):
    root = str(tmp_path / "store")
    with pytest.raises(Preempted):
        with session.start(storage_path=root, experiment_name="e", trial_name="t",
                           preemption=True) as s:
            s.report({"step": 1}, state=_state(1))
            os.kill(os.getpid(), signal.SIGTERM)
            s.report({"step": 2})
    ctx = StorageContext(root, "e", "t")
    committed = ctx.committed_checkpoints()
    assert [m["metrics"]["step"] for _, m in committed] == [1]  # acknowledged before: kept
    assert "preemption" not in committed[0][1]
    assert [r["step"] for r in ctx.read_results()] == [1, 2]
    assert ctx.read_stop()["status"] == "preempted"


def test_the_local_tiers_persist_policy_never_keeps_the_preemption_checkpoint_local(tmp_path):
    root = str(tmp_path / "store")
    tier = LocalTier(tmp_path / "fast", persist=lambda index, row: False)
    with pytest.raises(Preempted):
        with session.start(storage_path=root, experiment_name="e", trial_name="t",
                           local_tier=tier, preemption=True) as s:
            for step in (1, 2):
                s.report({"step": step}, state=_state(step))
            os.kill(os.getpid(), signal.SIGTERM)
            s.report({"step": 3}, state=_state(3))
    committed = StorageContext(root, "e", "t").committed_checkpoints()
    # Steps 1 and 2 stay local (persist said no); the preemption checkpoint is durable.
    assert [m["metrics"]["step"] for _, m in committed] == [3]
    assert committed[0][1]["preemption"]["signal"] == "SIGTERM"
    with session.start(storage_path=root, experiment_name="e", trial_name="t") as s:
        assert int(s.get_checkpoint().load_state()["step"]) == 3


def test_a_loop_that_never_reports_is_stopped_before_the_grace_ends(tmp_path):
    root = str(tmp_path / "store")
    config = PreemptionConfig(grace_period_s=1.5, stop_margin_s=1.0)
    t0 = None
    with pytest.raises(Preempted):
        with session.start(storage_path=root, experiment_name="e", trial_name="t",
                           preemption=config) as s:
            s.report({"step": 1}, state=_state(1))
            os.kill(os.getpid(), signal.SIGTERM)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30:  # a long step, no report()
                time.sleep(0.01)
    took = time.monotonic() - t0
    assert 0.3 < took < 10, took
    ctx = StorageContext(root, "e", "t")
    assert [m["metrics"]["step"] for _, m in ctx.committed_checkpoints()] == [1]
    assert ctx.read_stop()["status"] == "preempted"


def test_a_second_signal_stops_at_once(tmp_path):
    root = str(tmp_path / "store")
    with pytest.raises(Preempted):
        with session.start(storage_path=root, experiment_name="e", trial_name="t",
                           preemption=PreemptionConfig(signals=("SIGINT",))) as s:
            s.report({"step": 1}, state=_state(1))
            os.kill(os.getpid(), signal.SIGINT)
            assert s.reached_preemption  # the first Ctrl-C only asks
            os.kill(os.getpid(), signal.SIGINT)
            pytest.fail("not stopped")
    assert StorageContext(root, "e", "t").read_stop()["status"] == "preempted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# -- without preemption=: a SIGTERM still ends the session through its path ---------------


def test_an_unhandled_sigterm_ends_the_session_cleanly(tmp_path):
    root = str(tmp_path / "store")
    with pytest.raises(SystemExit) as exit_:
        with session.start(storage_path=root, experiment_name="e", trial_name="t") as s:
            s.report({"step": 1}, state=_state(1))  # async: still being written
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("not stopped")
    assert exit_.value.code == 143 and not isinstance(exit_.value, Preempted)
    ctx = StorageContext(root, "e", "t")
    assert [m["metrics"]["step"] for _, m in ctx.committed_checkpoints()] == [1]
    assert "SystemExit" in (ctx.read_error() or "")
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    # The lease is released: a restart starts at once.
    with session.start(storage_path=root, experiment_name="e", trial_name="t") as s:
        assert int(s.get_checkpoint().load_state()["step"]) == 1


def test_a_programs_own_sigterm_handler_is_left_alone(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t") as s:
            os.kill(os.getpid(), signal.SIGTERM)
            s.report({"step": 1})
        assert seen == [signal.SIGTERM]
        # With preemption on SIGTERM, other signals' handlers are untouched, and
        # the program's SIGTERM handler comes back when the session ends.
        with pytest.raises(Preempted):
            with session.start(storage_path=str(tmp_path), experiment_name="e",
                               trial_name="t2", preemption=True) as s:
                os.kill(os.getpid(), signal.SIGTERM)
                s.report({"step": 1})
        assert seen == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- sessions of other threads ------------------------------------------------------------


def test_a_thread_session_needs_the_handler_installed_by_the_main_thread(tmp_path):
    root = tmp_path / "store"
    errors: list[BaseException] = []
    config = PreemptionConfig(signals=("SIGUSR2",))

    def start_in_thread(out: list[Any]) -> None:
        try:
            with session.start(storage_path=str(root), experiment_name="e", trial_name="t",
                               preemption=config) as s:
                out.append(s)
                while not s.reached_preemption:
                    time.sleep(0.01)
                s.report({"step": 1}, state=_state(1))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=start_in_thread, args=([],))
    t.start()
    t.join()
    assert isinstance(errors[0], InvalidConfigError)
    assert "install_preemption_handlers" in str(errors[0])
    assert not root.exists()  # refused before anything was written

    errors.clear()
    session.install_preemption_handlers(["SIGUSR2"])
    try:
        started: list[Any] = []
        t = threading.Thread(target=start_in_thread, args=(started,))
        t.start()
        while not started and t.is_alive():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGUSR2)
        t.join(30)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], Preempted)
        ctx = StorageContext(str(root), "e", "t")
        assert [m["preemption"]["signal"] for _, m in ctx.committed_checkpoints()] == ["SIGUSR2"]
    finally:
        _preemption._pinned.discard(int(signal.SIGUSR2))
        signal.signal(signal.SIGUSR2, _preemption._installed.pop(int(signal.SIGUSR2)))


# -- a process: its exit status, and signals to its process group -------------------------

_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    from checkpoint_store import session, PreemptionConfig
    root, how = sys.argv[1], sys.argv[2]
    if how == "sys.exit":
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    preemption = PreemptionConfig(exit_code=42) if how == "preemption" else None
    big = {f"w{i}": np.random.rand(1_000_000) for i in range(4)}  # 32 MB a save
    with session.start(storage_path=root, experiment_name="e", trial_name="t",
                       preemption=preemption):
        for step in range(1, 10_000):
            big["w0"][0] = step
            if preemption is None or step % 3 == 0 or session.reached_preemption():
                session.report({"step": step}, state={**big, "step": step})
            else:
                session.report({"step": step})
            print("ACK", step, flush=True)
""")


@pytest.mark.parametrize("how, sig, code", [
    ("default", signal.SIGTERM, 143),
    ("default", signal.SIGINT, -signal.SIGINT),
    ("sys.exit", signal.SIGTERM, 0),
    ("preemption", signal.SIGTERM, 42),
])
def test_a_signal_to_the_process_group_commits_the_last_acknowledged_save(
        tmp_path, how, sig, code):
    """The persist process runs in its own session: the group's signal reaches
    the training process only, which commits what report() acknowledged."""
    root = str(tmp_path / "store")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, root, how], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    acked = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        acked = int(line.split()[1])
        if acked >= 4:
            os.killpg(proc.pid, sig)
            break
    acked = max([acked] + [int(line.split()[1]) for line in proc.stdout])
    assert proc.wait(120) == code
    committed = [m for _, m in StorageContext(root, "e", "t").committed_checkpoints()]
    steps = [m["metrics"]["step"] for m in committed]
    if how == "preemption":
        assert steps[-1] == acked + 1 and "preemption" in committed[-1]
    else:
        assert steps[-1] == acked
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of the group is left



# -- the durable copies after the signal: newest first ------------------------------------


def test_after_the_signal_queued_copies_run_newest_first():
    from checkpoint_store.session._uploads import BackgroundUploader

    up = BackgroundUploader(max_pending=10)
    ran: list[str] = []
    gate, started = threading.Event(), threading.Event()

    def job(name: str) -> Any:
        def run() -> None:
            if name == "checkpoint_000001":
                started.set()
                gate.wait(30)  # running while the others queue
            ran.append(name)
        return run

    for i in (1, 2, 3, 4):
        up.submit(job(f"checkpoint_{i:06d}"), lambda: None, f"checkpoint_{i:06d}")
    assert started.wait(30)
    up.prefer_newest()
    up.submit(job("checkpoint_000005"), lambda: None, "checkpoint_000005")
    gate.set()
    assert up.wait(30)
    up.close()
    assert ran == ["checkpoint_000001", "checkpoint_000005", "checkpoint_000004",
                   "checkpoint_000003", "checkpoint_000002"]


def test_a_signal_during_start_is_answered_by_the_first_report(tmp_path, monkeypatch):
    from checkpoint_store.session import _session as session_module

    real = session_module.sweep_staging_root

    def sweep_then_signal() -> None:  # a step of start(), after the handler is installed
        real()
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(session_module, "sweep_staging_root", sweep_then_signal)
    root = str(tmp_path / "store")
    with pytest.raises(Preempted):
        with session.start(storage_path=root, experiment_name="e", trial_name="t",
                           preemption=True) as s:
            assert s.reached_preemption
            s.report({"step": 1}, state=_state(1))
    committed = StorageContext(root, "e", "t").committed_checkpoints()
    assert [m["preemption"]["signal"] for _, m in committed] == ["SIGTERM"]
