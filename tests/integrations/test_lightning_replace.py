"""Lightning re-saves of one path (``last.ckpt``) crashed at every storage write.

A re-save commits the new checkpoint beside the path, points the path at it,
then removes the old one. The process dies (``SimulatedCrash``) before its
k-th mutating storage call, for every k until a save finishes; after each
crash a fresh plugin must load the old or the new checkpoint, complete and
verified, never nothing; ``resume_path`` must return the path; and the next
save must succeed and leave no more than the path and its one current sibling.
"""

from __future__ import annotations

import posixpath
import uuid
import warnings

import pyarrow.fs as pafs
import pytest

pytest.importorskip("lightning")
import torch  # noqa: E402

from checkpoint_store._format.layout import COMMIT_LOCK  # noqa: E402
from checkpoint_store.integrations.lightning import (  # noqa: E402
    CheckpointStoreIO,
    resume_path,
)
from checkpoint_store.registry import resolve  # noqa: E402
from checkpoint_store.testing.faults import SimulatedCrash, faulty_backend  # noqa: E402


def _state(step: int) -> dict:
    return {"global_step": step, "w": torch.full((64,), float(step))}


def _io(backend, **faults) -> CheckpointStoreIO:
    """A plugin writing through ``backend`` (faulty when ``faults`` are given),
    with the real backend's capabilities and commit protocol."""
    if faults:
        backend = faulty_backend(backend, **faults)
        backend.filesystem.handler.checkpoint_store_backend = backend
    return CheckpointStoreIO(storage_filesystem=backend.filesystem, fsync=False)


def _names(backend, root: str) -> set[str]:
    return {fi.base_name for fi in backend.filesystem.get_file_info(pafs.FileSelector(root))
            } - {COMMIT_LOCK}


def _check_readable(backend, root: str, path: str, allowed: set[int], where: str) -> int:
    state = _io(backend).load_checkpoint(path)
    step = state["global_step"]
    assert step in allowed, f"{where}: loaded step {step}, want one of {allowed}"
    assert torch.equal(state["w"], _state(step)["w"]), f"{where}: a mix of two saves"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to skip: no damaged candidate
        found = resume_path(root, storage_filesystem=backend.filesystem)
    # resume_path lists committed checkpoints only, never a legacy plain file.
    assert found == (None if step == 0 else path), where
    return step


def _sweep(backend, base: str, history: list) -> int:
    """Save ``history[:-1]`` healthily, then crash the save of ``history[-1]``
    at each mutating call in turn. Returns the crash points tried."""
    for point in range(200):
        root = f"{base}/p{point}-{uuid.uuid4().hex[:6]}"
        path = f"{root}/last.ckpt"
        healthy = _io(backend)
        for step in history[:-1]:
            if step == "legacy":
                backend.filesystem.create_dir(root)
                with backend.filesystem.open_output_stream(path) as f:
                    torch.save(_state(0), f)
            else:
                healthy.save_checkpoint(_state(step), path)
        old = 0 if history[-2] == "legacy" else history[-2]
        new = history[-1]
        try:
            _io(backend, crash_after_writes=point).save_checkpoint(_state(new), path)
            crashed = False
        except SimulatedCrash:
            crashed = True
        where = f"{history} crashed at write {point}" if crashed else f"{history} finished"
        got = _check_readable(backend, root, path, {old, new} if crashed else {new}, where)
        # The run resumes and saves the same path again: it replaces whichever
        # survived and cleans up after the dead save.
        _io(backend).save_checkpoint(_state(new + 1), path)
        _check_readable(backend, root, path, {new + 1}, f"{where}, then saved again")
        left = _names(backend, root)
        assert "last.ckpt" in left and len(left) <= 2, f"{where}: left {sorted(left)}"
        assert all(n == "last.ckpt" or n.startswith(".cs_replace-last.ckpt-") for n in left)
        if not crashed:
            assert got == new
            return point + 1
    raise AssertionError("the save never finished")


HISTORIES = [
    pytest.param([1, 2], id="committed-dir"),        # the first re-save of a path
    pytest.param([1, 2, 3], id="replaced-before"),   # a path already pointing at a sibling
    pytest.param(["legacy", 5], id="legacy-file"),   # a plain .ckpt file of an old version
]


@pytest.mark.parametrize("history", HISTORIES)
def test_resave_crash_at_every_write_memory(history):
    backend, _ = resolve("memory://lt")
    points = _sweep(backend, f"/replace-{uuid.uuid4().hex[:8]}", history)
    assert points > 5  # the sweep did reach the switch and the removal of the old one


@pytest.mark.parametrize("history", HISTORIES)
def test_resave_crash_at_every_write_local(tmp_path, history):
    backend, root = resolve(str(tmp_path))
    assert backend.capabilities.atomic_rename  # the rename commit, crashed too
    assert _sweep(backend, root, history) > 3


@pytest.mark.slow
@pytest.mark.parametrize("history", HISTORIES)
def test_resave_crash_at_every_write_s3(s3_bucket, s3_storage_options, history):
    backend, root = resolve(f"s3://{s3_bucket}/replace", storage_options=s3_storage_options)
    assert not backend.capabilities.atomic_rename
    assert _sweep(backend, root, history) > 5


def test_resave_keeps_the_path_and_one_sibling(tmp_path):
    """After re-saves the path holds only the pointer; readers that list the
    directory (resume_path) see the path, never the hidden sibling."""
    backend, root = resolve("memory://lt")
    root = f"/keep-{uuid.uuid4().hex[:8]}"
    io = _io(backend)
    for step in (1, 2, 3, 4):
        io.save_checkpoint(_state(step), f"{root}/last.ckpt")
    io.save_checkpoint(_state(4), f"{root}/epoch=0-step=4.ckpt")
    names = _names(backend, root)
    assert len([n for n in names if n.startswith(".cs_replace-last.ckpt-")]) == 1
    assert names - {n for n in names if n.startswith(".cs_")} == {"last.ckpt",
                                                                 "epoch=0-step=4.ckpt"}
    assert io.load_checkpoint(f"{root}/last.ckpt")["global_step"] == 4
    # Lightning removes a last.ckpt it renamed (save_last with a version): all of it goes.
    io.remove_checkpoint(f"{root}/last.ckpt")
    assert _names(backend, root) == {"epoch=0-step=4.ckpt"}
    assert posixpath.basename(resume_path(root, storage_filesystem=backend.filesystem)) \
        == "epoch=0-step=4.ckpt"
