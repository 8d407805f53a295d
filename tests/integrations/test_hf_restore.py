"""restore_latest on its own (checkpoints shaped as CheckpointStoreCallback
commits them, no Trainer): what it leaves in the user's output_dir, also
after a restore killed part-way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")

from checkpoint_store import Checkpoint, session  # noqa: E402
from checkpoint_store.integrations.hf import restore_latest  # noqa: E402

NAMES = {"experiment_name": "bert", "trial_name": "run0"}


def _commit_saves(tmp_path, kw, steps, *, best=None, size=1000):
    """One committed checkpoint per step, as the callback reports a save."""
    with session.start(**kw, **NAMES) as sess:
        for step in steps:
            d = tmp_path / "src" / f"checkpoint-{step}"
            d.mkdir(parents=True)
            state = {"global_step": step, "best_global_step": best,
                     "best_model_checkpoint": f"/old/machine/checkpoint-{best}" if best else None}
            (d / "trainer_state.json").write_text(json.dumps(state))
            (d / "model.safetensors").write_bytes(bytes([step % 256]) * size)
            os.makedirs(d / "sub")
            (d / "sub" / "shard.bin").write_bytes(b"x" * size)
            sess.report({"global_step": step, "epoch": step / 4},
                        checkpoint=Checkpoint.from_directory(d))


def _tree(root) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in names]
    return sorted(out)


USER_FILES = ["model.safetensors", "sub/shard.bin", "trainer_state.json"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_restore_leaves_nothing_of_ours_in_output_dir(tmp_path, request, where):
    if where == "s3":
        loc = request.getfixturevalue("s3_location")
        kw = {"storage_path": loc.uri, "storage_options": loc.storage_options}
    else:
        kw = {"storage_path": str(tmp_path / "store")}
    _commit_saves(tmp_path, kw, [2, 4, 6], best=4)
    out = tmp_path / "out"
    for _ in range(2):  # the second call finds both copies complete
        assert restore_latest(out, **kw, **NAMES) == str(out / "checkpoint-6")
        # The latest, and the best beside it; each exactly the user's files.
        assert sorted(os.listdir(out)) == ["checkpoint-4", "checkpoint-6"]
        assert _tree(out / "checkpoint-6") == _tree(out / "checkpoint-4") == USER_FILES


_KILLED = """
import sys
sys.path[:0] = {paths!r}
from pyarrow.fs import LocalFileSystem
from checkpoint_store.integrations.hf import restore_latest
from checkpoint_store.testing.faults import faulty_filesystem

fs = faulty_filesystem(LocalFileSystem(), latency=0.05)  # a slow link: time to be killed
restore_latest({out!r}, storage_path={store!r}, storage_filesystem=fs,
               experiment_name="bert", trial_name="run0")
"""


@pytest.mark.slow  # a child process importing transformers, on a slow link
def test_a_restore_killed_part_way_is_finished_by_the_next(tmp_path):
    store = str(tmp_path / "store")
    _commit_saves(tmp_path, {"storage_path": store}, [2, 4], size=300_000)
    out = tmp_path / "out"
    script = _KILLED.format(paths=sys.path, out=str(out), store=store)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and any(n.startswith(".cs_download") for n in os.listdir(out))):
            assert proc.poll() is None and time.monotonic() < deadline, "never started"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = sorted(os.listdir(out))
    assert "checkpoint-4" not in left and any(n.startswith(".") for n in left), left

    assert restore_latest(out, storage_path=store, **NAMES) == str(out / "checkpoint-4")
    assert os.listdir(out) == ["checkpoint-4"]
    assert _tree(out / "checkpoint-4") == USER_FILES
    assert (out / "checkpoint-4" / "model.safetensors").read_bytes() == bytes([4]) * 300_000


def test_ranks_restoring_at_once_share_the_lock_and_leave_nothing(tmp_path, monkeypatch):
    """Every rank calls restore_latest together; the lock file each removes on
    leaving must never let two of them in at once (a waiter that won the
    removed file's lock takes it again)."""
    from concurrent.futures import ThreadPoolExecutor

    from checkpoint_store.integrations import hf

    store = str(tmp_path / "store")
    _commit_saves(tmp_path, {"storage_path": store}, [2, 4], best=2)
    out = tmp_path / "out"
    inside, overlaps = [0], []
    real = hf._restore_step

    def counted(*args):
        inside[0] += 1
        overlaps.append(inside[0])
        try:
            time.sleep(0.02)
            return real(*args)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(hf, "_restore_step", counted)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: restore_latest(out, storage_path=store, **NAMES),
                            range(16)))
    assert got == [str(out / "checkpoint-4")] * 16
    assert max(overlaps) == 1 and len(overlaps) == 32  # latest and best, one at a time
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]
    assert _tree(out / "checkpoint-4") == USER_FILES


@pytest.mark.parametrize("shape", ["file", "under_a_file"])
def test_an_output_dir_that_is_a_file_is_an_invalid_config_error(tmp_path, shape):
    from checkpoint_store import InvalidConfigError

    kw = {"storage_path": str(tmp_path / "store")}
    _commit_saves(tmp_path, kw, [2])
    blocker = tmp_path / "out"
    blocker.write_bytes(b"not a directory")
    out = blocker if shape == "file" else blocker / "run"
    with pytest.raises(InvalidConfigError, match="is a file"):
        restore_latest(out, **kw, **NAMES)
    assert blocker.read_bytes() == b"not a directory"
    # A directory there restores as usual.
    assert restore_latest(tmp_path / "ok", **kw, **NAMES) == str(tmp_path / "ok" / "checkpoint-2")


@pytest.mark.parametrize("damage", ["truncated", "deleted", "unreadable marker"])
def test_a_restore_past_a_damaged_newest_checkpoint_warns(tmp_path, damage):
    """A newest checkpoint whose damage the listing shows is skipped with a
    warning naming it, as one a checksum finds is; the one before is restored."""
    kw = {"storage_path": str(tmp_path / "store")}
    _commit_saves(tmp_path, kw, [2, 4, 6])
    newest = tmp_path / "store" / "bert" / "run0" / "checkpoint_000002"
    if damage == "truncated":
        os.truncate(newest / "model.safetensors", 3)
    elif damage == "deleted":
        os.remove(newest / "trainer_state.json")
    else:
        (newest / ".internal_metadata.json").write_text("{not json")
    with pytest.warns(RuntimeWarning, match="checkpoint_000002.*damaged"):
        path = restore_latest(tmp_path / "out", **kw, **NAMES)
    assert path == str(tmp_path / "out" / "checkpoint-4")
    assert json.loads((tmp_path / "out" / "checkpoint-4" / "trainer_state.json")
                      .read_text())["global_step"] == 4
