"""A download killed at any step: the next one recovers, and what it leaves is cleaned.

A forked child runs ``to_directory`` and SIGKILLs itself just before its
k-th step (every helper-directory creation, file download pass, marker write,
rename and removal counts as one), for every k until a child completes. The
process is really gone, so the liveness check sees a dead writer, as after a
real crash.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys

import pytest
from _commit_helpers import local_tree, make_source

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store.errors import CheckpointCorruptError

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs fork and SIGKILL")


def _child(ckpt_path: str, target: str, kill_at: int) -> None:
    import checkpoint_store.checkpoint as mod

    steps = [0]

    def counted(fn):
        def wrapped(*args, **kwargs):
            if steps[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            steps[0] += 1
            return fn(*args, **kwargs)
        return wrapped

    # The child dies either way: patching os and shutil for it alone is fine.
    for name in ("download_checkpoint", "_write_download_marker", "_new_sibling_dir"):
        setattr(mod, name, counted(getattr(mod, name)))
    os.rename = counted(os.rename)
    shutil.rmtree = counted(shutil.rmtree)
    try:
        Checkpoint(ckpt_path).to_directory(target)
    except BaseException:
        os._exit(1)
    os._exit(0)


def _run_child(ckpt: Checkpoint, target: str, kill_at: int) -> int:
    proc = multiprocessing.get_context("fork").Process(
        target=_child, args=(ckpt.path, target, kill_at))
    proc.start()
    proc.join(60)
    assert proc.exitcode is not None, "download child hung"
    return proc.exitcode


def _helpers(parent: str) -> list[str]:
    return sorted(n for n in os.listdir(parent)
                  if n.startswith((".cs_download-", ".cs_download_old-")))


@pytest.fixture
def store(tmp_path):
    storage = StorageContext(str(tmp_path / "store"), "exp", "trial")
    storage.ensure_trial_dir()
    ckpts = []
    for i in range(3):
        src = make_source(tmp_path / f"src{i}", i + 1, files=4, size=8192)
        ckpts.append(storage.persist_checkpoint(Checkpoint.from_directory(src), i,
                                                {"metrics": {}}))
    # The third one fails verification (one flipped byte, same size).
    bad = os.path.join(ckpts[2].path, "part0.bin")
    data = bytearray(open(bad, "rb").read())
    data[100] ^= 0xFF
    open(bad, "wb").write(bytes(data))
    return ckpts


def _crash_then(store, tmp_path, kill_at: int) -> tuple[str, dict, dict, bool] | None:
    """Download A, then B killed before step ``kill_at``; None once B completes."""
    old, new, _ = store
    parent = tmp_path / "restore"
    if parent.exists():
        shutil.rmtree(parent)
    target = str(parent / "out")
    old.to_directory(target)
    tree_a = local_tree(target)
    code = _run_child(new, target, kill_at)
    if code == 0:
        return None
    assert code == -signal.SIGKILL, code
    tree_b = local_tree(new.path)
    # Right after the crash nothing is lost: the target holds A or B whole, or,
    # between the two renames, A waits whole in the moved-aside directory.
    if os.path.lexists(target):
        assert local_tree(target) in (tree_a, tree_b)
    else:
        aside = [os.path.join(parent, n, "d") for n in _helpers(str(parent))
                 if n.startswith(".cs_download_old-")]
        assert [local_tree(d) for d in aside] == [tree_a]
    return target, tree_a, tree_b, os.path.lexists(target)


def test_a_download_killed_at_each_step_is_completed_by_the_next(store, tmp_path):
    kill_at, crashed = 0, 0
    while (state := _crash_then(store, tmp_path, kill_at)) is not None:
        target, _, tree_b, _ = state
        assert store[1].to_directory(target) == target
        assert local_tree(target) == tree_b, f"killed before step {kill_at}"
        assert _helpers(os.path.dirname(target)) == [], f"killed before step {kill_at}"
        kill_at, crashed = kill_at + 1, crashed + 1
    # Staging, download, marker, move aside (2), move in, marker, remove.
    assert crashed >= 7


def test_after_a_crash_a_failing_download_leaves_the_old_target(store, tmp_path):
    """Either the old one comes back or the new one completes: here the
    next download fails, so the target must be whole as the crash left it,
    and where the crash left none, the old one is back."""
    kill_at, restored = 0, 0
    while (state := _crash_then(store, tmp_path, kill_at)) is not None:
        target, tree_a, tree_b, target_was_there = state
        before = local_tree(target) if target_was_there else tree_a
        restored += not target_was_there
        with pytest.raises(CheckpointCorruptError, match="part0.bin"):
            store[2].to_directory(target)
        assert local_tree(target) == before, f"killed before step {kill_at}"
        assert _helpers(os.path.dirname(target)) == [], f"killed before step {kill_at}"
        kill_at += 1
    assert restored == 1  # exactly one step lies between the two renames


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_dead_writers_helpers_of_this_target_are_removed(store, tmp_path):
    parent = tmp_path / "restore"
    parent.mkdir()
    dead, live = _dead_pid(), os.getpid()
    keep = [
        f".cs_download-out-{live}-0123abcd",  # a live writer's staging
        f".cs_download_old-out-{live}-0123abcd",
        f".cs_download-out-5-{dead}-0123abcd",  # the target "out-5"'s
        f".cs_download_old-out-5-{dead}-0123abcd",
        f".cs_download-out-{dead}-notarand",  # not a name we build
    ]
    gone = [f".cs_download-out-{dead}-89abcdef", f".cs_download_old-out-{dead}-89abcdef",
            f".cs_download-out-{live}_1-89abcdef"]  # our pid, another incarnation
    for name in keep + gone:
        (parent / name).mkdir()
        (parent / name / "f.bin").write_bytes(b"x")
    store[0].to_directory(parent / "out")
    assert _helpers(str(parent)) == sorted(keep)
    assert local_tree(str(parent / "out")) == local_tree(store[0].path)
