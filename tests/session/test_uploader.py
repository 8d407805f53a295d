"""The background lanes' worker (session/_uploads.py): one thread runs every
job of a session, waiting while idle, and never keeps a process alive."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from checkpoint_store._util.background import DEFAULT_NICE
from checkpoint_store.session._uploads import BackgroundUploader


def _ran_on(up: BackgroundUploader) -> threading.Thread:
    """Submit a job, wait for it; the thread it ran on."""
    box: list[threading.Thread] = []
    up.submit(lambda: box.append(threading.current_thread()), lambda: None, "checkpoint_000000")
    assert up.wait(30)
    return box[0]


def test_one_worker_runs_every_job_and_ends_after_close():
    up = BackgroundUploader(max_pending=2)
    first = _ran_on(up)
    time.sleep(0.05)  # idle: the worker waits for the next job
    assert first.is_alive()
    assert _ran_on(up) is first and _ran_on(up) is first
    up.close()
    first.join(10)
    assert not first.is_alive()
    # After close, a job still runs, on a worker that ends when idle.
    later = _ran_on(up)
    later.join(10)
    assert not later.is_alive() and up.committed == 4


def test_an_idle_worker_does_not_keep_the_process_alive():
    # No close(): the interpreter's exit ends the idle worker (the threading
    # exit hook), and the process exits at once.
    script = textwrap.dedent("""
        from checkpoint_store.session._uploads import BackgroundUploader
        up = BackgroundUploader()
        up.submit(lambda: print("ran", flush=True), lambda: None, "checkpoint_000000")
        up.wait()
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ran\n" and time.monotonic() - t0 < 30


def test_a_forked_child_runs_its_jobs_on_a_worker_of_its_own():
    up = BackgroundUploader()
    parent_worker = _ran_on(up)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's worker thread is not here
        code = 1
        try:
            worker = _ran_on(up)
            code = 0 if worker is not parent_worker and up.committed == 2 else 2
            up.close()
        finally:
            os.write(write, bytes([code]))
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"\x00"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
        up.close()


def _priorities(up: BackgroundUploader) -> dict[str, int]:
    """Nice value and scheduling policy of the job's thread and of a thread
    the job starts (as a transfer pool's are), and of the caller's."""
    out: dict[str, int] = {}

    def job() -> None:
        out["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        out["policy"] = os.sched_getscheduler(0)
        child = threading.Thread(target=lambda: out.__setitem__(
            "child", os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        child.start()
        child.join()

    up.submit(job, lambda: None, "checkpoint_000000")
    assert up.wait(30)
    up.close()
    out["caller"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities: Linux")
def test_the_background_worker_yields_the_cpu_to_the_loop(monkeypatch):
    """Background copies run niced and SCHED_BATCH, the threads they start
    too; the training thread keeps its priority; 0 turns it off."""
    monkeypatch.delenv("CHECKPOINT_STORE_UPLOAD_NICE", raising=False)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    got = _priorities(BackgroundUploader(max_pending=2))
    want = min(19, base + DEFAULT_NICE)
    assert (got["nice"], got["child"], got["caller"]) == (want, want, base)
    assert got["policy"] == os.SCHED_BATCH
    monkeypatch.setenv("CHECKPOINT_STORE_UPLOAD_NICE", "0")
    got = _priorities(BackgroundUploader(max_pending=2))
    assert (got["nice"], got["child"]) == (base, base)
    assert got["policy"] == os.sched_getscheduler(0)
    monkeypatch.setenv("CHECKPOINT_STORE_UPLOAD_NICE", "not a number")  # ignored, no error
    assert _priorities(BackgroundUploader(max_pending=2))["nice"] == base
