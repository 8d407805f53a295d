"""A stage cut short, or a state whose directory was dropped before the persist
process got to it, never leaves files behind: the persist process writes no
state the training process gave up on, and never makes a directory again.

The defect these pin down: a signal's exception (Ctrl-C, a program's own
SIGTERM handler calling ``sys.exit``) during ``report(state=...)`` made the
report drop ``checkpoint_<index>`` at once, while the persist process, still
busy with the previous save, later opened that state and made the directory
again. The next run found a complete-looking, unclaimed, uncommitted
``checkpoint_<index>``: "foreign", never resumed and never removed.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from checkpoint_store import Checkpoint, CheckpointConfig, session
from checkpoint_store.state._stage_copy import StagingCopier
from checkpoint_store.state._staging import Stager
from checkpoint_store.storage import StorageContext

MiB = 1 << 20


def _busy_state() -> dict[str, np.ndarray]:
    """Enough bytes that the persist process is still writing them when the
    next stage is interrupted and its directory removed."""
    return {f"b{i}": np.full(8 * MiB // 4, i, dtype=np.float32) for i in range(6)}


def _state(seed: int, tensors: int = 4, n: int = 64 * 1024) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.random(n, dtype=np.float32) for i in range(tensors)}


def _interrupt_copy_after(monkeypatch, pieces: int) -> None:
    """The staging copy raises ``KeyboardInterrupt`` (what a Ctrl-C raises
    between two bytecodes) after ``pieces`` pieces were copied."""
    real = StagingCopier.copy
    seen = [0]

    def copy(self, src, start, count, off):
        if seen[0] == pieces:
            raise KeyboardInterrupt
        seen[0] += 1
        return real(self, src, start, count, off)

    monkeypatch.setattr(StagingCopier, "copy", copy)


def _drain(stager: Stager, tmp_path) -> None:
    """Return once the persist process handled every message sent so far
    (they are handled in order: a later state's close answers after them)."""
    stager.stage({"x": np.zeros(4, dtype=np.float32)}, str(tmp_path / "barrier")).write_to()
    shutil.rmtree(tmp_path / "barrier")


def test_a_stage_interrupted_behind_a_busy_persist_process_leaves_no_directory(
        tmp_path, monkeypatch):
    stager = Stager(64 * MiB, piece_bytes=MiB)
    try:
        busy = stager.stage(_busy_state(), str(tmp_path / "busy"))
        _interrupt_copy_after(monkeypatch, 2)
        cut = tmp_path / "cut"
        with pytest.raises(KeyboardInterrupt):
            stager.stage(_state(1), str(cut))
        monkeypatch.undo()
        shutil.rmtree(cut)  # what the report's drop does at once
        busy.write_to()
        _drain(stager, tmp_path)
        assert not cut.exists()
        assert stager.in_use == 0  # the pieces of the cut stage were freed
    finally:
        stager.close()


def test_an_interrupted_stage_writes_nothing_into_its_directory(tmp_path, monkeypatch):
    stager = Stager(64 * MiB, piece_bytes=MiB // 4)
    try:
        _interrupt_copy_after(monkeypatch, 3)
        cut = tmp_path / "cut"
        with pytest.raises(KeyboardInterrupt):
            stager.stage(_state(2), str(cut))
        monkeypatch.undo()
        _drain(stager, tmp_path)
        assert os.listdir(cut) == []  # the caller made it; the process wrote nothing
        assert stager.in_use == 0
    finally:
        stager.close()


def test_a_stage_larger_than_the_area_interrupted_after_a_batch_went_removes_its_files(
        tmp_path, monkeypatch):
    """The area fills: the first pieces go to the persist process (which opens
    the state and writes them) before the interruption."""
    stager = Stager(2 * MiB, piece_bytes=MiB // 2)
    try:
        _interrupt_copy_after(monkeypatch, 9)
        cut = tmp_path / "cut"
        with pytest.raises(KeyboardInterrupt):
            stager.stage(_state(3, tensors=6, n=MiB // 4), str(cut))  # 6 MiB
        monkeypatch.undo()
        _drain(stager, tmp_path)
        assert os.listdir(cut) == []
        assert stager.in_use == 0
        # The stager goes on: the next state is written whole.
        stager.stage(_state(4), str(tmp_path / "next")).write_to(record=False)
        got = Checkpoint.from_directory(str(tmp_path / "next")).load_state()
        assert all(np.array_equal(got[k], v) for k, v in _state(4).items())
    finally:
        stager.close()


def test_a_directory_dropped_before_the_persist_process_opens_it_is_not_made_again(tmp_path):
    """A stage that finished, whose report then failed (say a signal while
    waiting for the write) and dropped the directory, while the persist
    process was still busy with the previous state."""
    stager = Stager(64 * MiB, piece_bytes=MiB)
    try:
        busy = stager.stage(_busy_state(), str(tmp_path / "busy"))
        dropped = tmp_path / "dropped"
        staged = stager.stage(_state(5), str(dropped))
        shutil.rmtree(dropped)
        busy.write_to()
        with pytest.raises(FileNotFoundError, match="gone"):
            staged.write_to()
        _drain(stager, tmp_path)
        assert not dropped.exists()
    finally:
        stager.close()


def test_a_report_interrupted_while_staging_leaves_no_checkpoint_directory(
        tmp_path, monkeypatch):
    """Through ``session.report``: the interrupted report's ``checkpoint_<index>``
    is gone once the persist process is idle, the next run finds nothing
    foreign, and it resumes from the report before."""
    root = str(tmp_path / "runs")
    cfg = CheckpointConfig(num_to_keep=None)
    with session.start(storage_path=root, experiment_name="e", trial_name="t",
                       checkpoint_config=cfg):
        session.report({"step": 0}, state=_busy_state())
        _interrupt_copy_after(monkeypatch, 2)
        with pytest.raises(KeyboardInterrupt):
            session.report({"step": 1}, state=_state(6))
        monkeypatch.undo()
        session.report({"step": 2}, state=_state(7))
        session.wait()
    trial = os.path.join(root, "e", "t")
    names = sorted(n for n in os.listdir(trial) if n.startswith("checkpoint_"))
    assert names == ["checkpoint_000000", "checkpoint_000002"]
    storage = StorageContext(root, "e", "t")
    scan = storage.scan()
    assert scan.foreign == [] and scan.uncommitted == []
    with session.start(storage_path=root, experiment_name="e", trial_name="t",
                       checkpoint_config=cfg) as s:
        resumed = s.get_checkpoint()
        assert resumed is not None and resumed.path.endswith("checkpoint_000002")
        got = resumed.load_state()
        assert all(np.array_equal(got[k], v) for k, v in _state(7).items())
