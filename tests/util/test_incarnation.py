"""PID reuse: a dead holder whose pid now names a live process is still dead
(issue 11, kind 6). Holders are named by pid plus process incarnation."""

from __future__ import annotations

import json
import os
import posixpath
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointManager,
    StorageContext,
    session,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.liveness import process_alive, process_token, writer_tag
from checkpoint_store.cli import main
from checkpoint_store.retention import LEASE_FILE, live_lease

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


@pytest.fixture
def dead_token() -> str:
    """The incarnation of a process that has exited (the crashed holder)."""
    out = subprocess.run(
        [sys.executable, "-c",
         "from checkpoint_store._util.liveness import process_token; print(process_token())"],
        check=True, capture_output=True, text=True, timeout=120,
    )
    return out.stdout.strip()


@pytest.fixture
def reused_pid(dead_token: str) -> Iterator[int]:
    """A live process started after the holder died: the newcomer that got its pid."""
    # Start times count clock ticks (10 ms): a newcomer starts ticks after the
    # holder it replaces, which had to start, crash and free its pid first.
    time.sleep(0.05)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield child.pid
    finally:
        child.kill()
        child.wait(timeout=30)


def _crashed_holders_lease(storage: StorageContext, pid: int, dead_token: str) -> None:
    """The lease a crashed manager left (same host, unexpired), now naming ``pid``."""
    storage.ensure_trial_dir()
    now = time.time()
    body = {
        "kind": "checkpoint_manager_lease", "format_version": 1, "holder": "crashed",
        "host": socket.gethostname(), "pid": pid, "proc": dead_token,
        "trial": storage.canonical_uri(storage.trial_path), "ttl_s": 60.0,
        "renewed_at": now, "expires_at": now + 60.0,
    }
    with storage.filesystem.open_output_stream(
            posixpath.join(storage.trial_path, LEASE_FILE)) as f:
        f.write(json.dumps(body).encode())


def _lease(storage: StorageContext) -> dict:
    return json.loads(_fsutil.read_bytes(storage.filesystem,
                                         posixpath.join(storage.trial_path, LEASE_FILE)))


def test_lease_of_a_crashed_holder_whose_pid_was_reused_is_taken_over(store, reused_pid,
                                                                     dead_token):
    storage = store.ctx()
    _crashed_holders_lease(storage, reused_pid, dead_token)
    assert process_alive(reused_pid)  # a pid-only check would call the holder alive
    assert live_lease(store.ctx()) is None
    started = time.monotonic()
    with CheckpointManager(CheckpointConfig(1), store.ctx()) as m:
        assert not m.read_only
        lease = _lease(storage)
        assert lease["pid"] == os.getpid() and lease["proc"] == process_token()
    assert time.monotonic() - started < 30  # at once, not after the 60 s ttl


def test_session_restarts_at_once_after_a_crash_with_pid_reuse(tmp_path, reused_pid, dead_token):
    root = str(tmp_path / "runs")
    storage = StorageContext(root, "e", "t")
    _crashed_holders_lease(storage, reused_pid, dead_token)
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"w")
    with session.start(storage_path=root, experiment_name="e", trial_name="t"):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
    # And the CLI agrees that no job holds it any more.
    result = CliRunner().invoke(main, ["prune", f"{root}/e/t", "--keep", "1"])
    assert result.exit_code == 0, result.output


def test_process_alive_tells_incarnations_apart(reused_pid, dead_token):
    assert process_alive(os.getpid(), process_token())
    assert process_alive(reused_pid, process_token(reused_pid))
    assert not process_alive(reused_pid, dead_token)
    assert not process_alive(os.getpid(), dead_token)
    assert process_alive(reused_pid)  # without a token: the pid alone


def test_temp_file_of_a_dead_writer_whose_pid_was_reused_is_cleaned(tmp_path, reused_pid,
                                                                   dead_token):
    storage = StorageContext(str(tmp_path / "runs"), "e", "t")
    storage.ensure_trial_dir()
    ticks = dead_token.rsplit(":", 1)[1]
    trial = storage.trial_path
    dead = f".cs_tmp-result.json-{reused_pid}_{ticks}-0123abcd"
    live = f".cs_tmp-result.json-{writer_tag()}-4567abcd"
    other_live = f".cs_tmp-params.json-{reused_pid}_{process_token(reused_pid).split(':')[1]}-89ab"
    for name in (dead, live, other_live):
        with open(os.path.join(trial, name), "wb") as f:
            f.write(b"partial")
    found = storage.scan()
    assert dead in found.uncommitted
    assert live not in found.uncommitted and other_live not in found.uncommitted
    assert storage.remove_uncommitted() == [dead]
    assert sorted(os.listdir(trial)) == sorted([live, other_live])


def test_temp_files_carry_the_writers_incarnation(tmp_path, monkeypatch):
    # write_bytes names its temporary file after this process's incarnation.
    seen: list[str] = []
    real_replace = os.replace

    def spy(a: str, b: str) -> None:
        seen.append(os.path.basename(a))
        real_replace(a, b)

    monkeypatch.setattr(os, "replace", spy)
    storage = StorageContext(str(tmp_path / "runs"), "e", "t")
    storage.write_params({"lr": 0.1})
    assert seen and seen[0].startswith(".cs_tmp-params.json-")
    assert f"-{writer_tag()}-" in seen[0] and "_" in writer_tag()
