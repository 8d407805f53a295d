"""A killed save's scratch directory is removed by the next session or save.

A Lightning async save stages its snapshot in a scratch directory of the
staging root, where the persist process writes a state file; a process
killed meanwhile left that directory (a partial state file per preemption)
for good. Scratch directories are now named after their maker
(``lightning-<pid>_<ticks>-*``, checkpoint_store/state/_staging_dir.py), and
the next session start or Lightning save on the machine removes those of
dead processes, never one of a live process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from checkpoint_store import Checkpoint, session  # noqa: E402
from checkpoint_store._format.layout import DOWNLOAD_PREFIX, STATE_STAGING_PREFIX  # noqa: E402
from checkpoint_store.integrations.lightning import CheckpointStoreIO  # noqa: E402
from checkpoint_store.state import ENV_STAGING_DIR, scratch_dir  # noqa: E402

_REPO = str(Path(__file__).resolve().parents[2])

# Saves one Lightning checkpoint in the background and is SIGKILLed (by
# itself) as soon as the persist process has begun its state file.
_KILLED_SAVE = textwrap.dedent("""
    import glob, os, signal, sys, time, torch
    from checkpoint_store.integrations.lightning import CheckpointStoreIO
    staging, out = sys.argv[1:3]
    io = CheckpointStoreIO(async_save=True)
    state = {"state_dict": {f"w{i}": torch.randn(256, 256) for i in range(64)},
             "global_step": 1}
    io.save_checkpoint(state, os.path.join(out, "a.ckpt"))
    deadline = time.monotonic() + 60
    while not [p for p in glob.glob(os.path.join(staging, "lightning-*", "*"))]:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)
""")

# Makes one scratch directory of KIND with a partial file, then is SIGKILLed.
_KILLED_SCRATCH = textwrap.dedent("""
    import os, signal, sys
    from checkpoint_store.state import scratch_dir
    d = scratch_dir(sys.argv[1])
    with open(os.path.join(d, "part.safetensors"), "wb") as f:
        f.write(b"partial")
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.fixture
def staging(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "staging"
    root.mkdir()
    monkeypatch.setenv(ENV_STAGING_DIR, str(root))
    return root


def _run_killed(script: str, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=_REPO)
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, timeout=300,
                         capture_output=True, text=True)
    assert out.returncode == -9, out.stderr[-2000:]


def test_a_killed_lightning_async_save_leaves_nothing_after_the_next_save(staging, tmp_path):
    """The handed input: the staging directory a killed async save left is
    removed by the next save, which leaves nothing of its own either."""
    _run_killed(_KILLED_SAVE, str(staging), str(tmp_path / "ckpts"))
    left = [p.name for p in staging.iterdir()]
    assert len(left) == 1 and left[0].startswith("lightning-"), left
    assert list((staging / left[0]).iterdir()), "the kill came before any file was written"
    io = CheckpointStoreIO(async_save=True)
    try:
        io.save_checkpoint({"global_step": 2, "w": torch.ones(8)}, str(tmp_path / "b.ckpt"))
        assert left[0] not in os.listdir(staging)
        io.wait()
    finally:
        io.teardown()
    assert os.listdir(staging) == []


@pytest.mark.parametrize("kind", [STATE_STAGING_PREFIX, DOWNLOAD_PREFIX])
def test_a_killed_processes_scratch_is_removed_by_the_next_session(kind, staging, tmp_path):
    """Found by myself: a state's scratch directory (report(state=...)) and a
    download's temporary directory, left by a kill, go at the next session
    start; a live process's own scratch stays."""
    _run_killed(_KILLED_SCRATCH, kind)
    dead = [p.name for p in staging.iterdir()]
    assert len(dead) == 1 and dead[0].startswith(kind)
    mine = scratch_dir(kind)  # this process is alive: never swept
    with session.start(storage_path=str(tmp_path / "runs")) as s:
        assert sorted(os.listdir(staging)) == [os.path.basename(mine)]
        s.report({"x": 1})
    assert os.path.isdir(mine)
    os.rmdir(mine)


def test_a_download_to_a_temporary_directory_is_a_swept_scratch_dir(staging, tmp_path):
    """Found by myself: Checkpoint downloads into a new temporary directory
    (remote checkpoints) now go to the staging root, named after this process."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"w" * 32)
    with session.start(storage_path="memory://staging-leftovers/runs") as s:
        s.report({"x": 1}, checkpoint=Checkpoint.from_directory(str(src)))
        ck = s.get_checkpoint()
    t0 = time.monotonic()
    with ck.as_directory() as d:
        assert Path(d, "w.bin").read_bytes() == b"w" * 32
        assert Path(d).parent == staging and Path(d).name.startswith(DOWNLOAD_PREFIX)
        assert str(os.getpid()) in Path(d).name
    assert time.monotonic() - t0 < 60
    # Gone with the block (the download's lock file beside it may stay: not a scratch dir).
    assert [n for n in os.listdir(staging) if n.startswith(DOWNLOAD_PREFIX)] == []
