"""A staged state source (anything with ``write_to(directory)``) through the
local tier: written straight into the local checkpoint in the background,
committed there, then copied to the storage path."""

from __future__ import annotations

import os
import threading

import pytest
from _tier_helpers import read_files

from checkpoint_store import LocalTier, StorageContext, session
from checkpoint_store.errors import CheckpointStoreError
from checkpoint_store.testing import session_internals


class FakeStaged:
    """The StagedState protocol, minimal: files from a dict, a tensor index back."""

    def __init__(self, files: dict[str, bytes], fail: bool = False):
        self.files = files
        self.nbytes = sum(len(b) for b in files.values())
        self.fail = fail
        self.released = 0
        self.written_in: list[str] = []
        self.thread: str | None = None

    def write_to(self, directory: str) -> dict:
        self.thread = threading.current_thread().name
        self.written_in.append(directory)
        for rel, data in self.files.items():
            with open(os.path.join(directory, rel), "wb") as f:
                f.write(data)
        if self.fail:
            raise OSError("the persist process died")
        return {name: {"file": name, "offsets": [0, len(data)]}
                for name, data in self.files.items()}

    def release(self) -> None:
        self.released += 1


def _report_staged(s, source, metrics):
    """``report(metrics, state=...)`` with ``source`` as the staged state: the
    same report path, with the staging injected."""
    return session_internals(s).pipeline.report_source(metrics, source)


def test_a_staged_state_is_written_into_the_local_tier_then_persisted(tmp_path):
    store = str(tmp_path / "durable")
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=LocalTier(tmp_path / "fast")) as s:
        sources = [FakeStaged({"model.safetensors": b"m%d" % i, "state.json": b"{}"})
                   for i in range(3)]
        rows = [_report_staged(s, src, {"i": i}) for i, src in enumerate(sources)]
        s.wait()
        assert s.durable_index == 2
        got = s.get_checkpoint()
        assert got is not None and got.is_local
        assert got.internal_metadata["tensors"]["model.safetensors"]["offsets"] == [0, 2]
    for i, src in enumerate(sources):
        # Straight into the local checkpoint directory, on the background worker.
        assert src.written_in == [str(tmp_path / "fast" / "e" / "t" / f"checkpoint_00000{i}")]
        assert src.thread == "checkpoint-store-upload" and src.released == 1
    assert [r["checkpoint_dir_name"] for r in rows] == [f"checkpoint_00000{i}" for i in range(3)]
    ctx = StorageContext(store, "e", "t")
    committed = ctx.committed_checkpoints()
    assert [m["index"] for _, m in committed] == [0, 1, 2]
    assert committed[2][1]["tensors"] == {
        "model.safetensors": {"file": "model.safetensors", "offsets": [0, 2]},
        "state.json": {"file": "state.json", "offsets": [0, 2]}}
    with ctx.checkpoint("checkpoint_000002").as_directory() as d:
        assert read_files(d) == {"model.safetensors": b"m2", "state.json": b"{}"}


def test_a_failed_staged_write_commits_nothing_and_is_raised(tmp_path):
    store = str(tmp_path / "durable")
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=LocalTier(tmp_path / "fast")) as s:
        bad = FakeStaged({"model.safetensors": b"m"}, fail=True)
        _report_staged(s, bad, {"i": 0})
        with pytest.raises(OSError, match="persist process died"):
            s.wait()
        assert bad.released == 1
        assert session_internals(s).tier.entries() == []
        assert not (tmp_path / "fast" / "e" / "t" / "checkpoint_000000").exists()
        good = FakeStaged({"model.safetensors": b"ok"})
        _report_staged(s, good, {"i": 1})
        s.wait()
    assert [m["index"] for _, m in StorageContext(store, "e", "t").committed_checkpoints()] == [1]


@pytest.mark.parametrize("upload_mode", ["async", "sync"])
def test_report_state_with_a_local_tier_commits_there_then_persists(tmp_path, upload_mode):
    """``report(state=...)`` with a local tier: the persist process writes into
    the local ``checkpoint_<i>``, the local commit carries the tensor index,
    and the durable copy holds the same bytes; both load the same state."""
    np = pytest.importorskip("numpy")
    store, fast = str(tmp_path / "durable"), tmp_path / "fast"
    weights = [np.arange(1000, dtype=np.float32) * i for i in range(3)]
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=LocalTier(fast, num_to_keep=1)) as s:
        for i, w in enumerate(weights):
            s.report({"i": i}, state={"model": {"w": w}, "step": i}, upload_mode=upload_mode)
            if upload_mode == "sync":
                # Committed on the local tier, and durable, before report() returned.
                local = fast / "e" / "t" / f"checkpoint_00000{i}"
                assert (local / ".internal_metadata.json").exists()
                assert s.durable_index == i
            w += 1.0  # the saved state is the snapshot taken by report()
        s.wait()
        assert s.durable_index == 2
        got = s.get_checkpoint()
        assert got is not None and got.is_local
        assert "model/w" in got.internal_metadata["tensors"]
        restored = got.load_state()
    assert restored["step"] == 2
    np.testing.assert_array_equal(restored["model"]["w"], np.arange(1000, dtype=np.float32) * 2)
    ctx = StorageContext(store, "e", "t")
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0, 1, 2]
    durable = ctx.checkpoint("checkpoint_000001")
    durable.verify()  # raises on a damaged copy
    np.testing.assert_array_equal(durable.load_state()["model"]["w"],
                                  np.arange(1000, dtype=np.float32))
    # num_to_keep=1 on the local tier: the older local copies went once durable.
    assert sorted(p.name for p in (fast / "e" / "t").glob("checkpoint_*")) == ["checkpoint_000002"]


def test_wait_for_a_state_report_persist_did_not_select_raises(tmp_path):
    """``wait(checkpoint=...)`` right after ``report(state=...)``: the local
    commit is still in the background, yet the wait says (as it does for a
    directory) that ``persist`` did not select the checkpoint."""
    np = pytest.importorskip("numpy")
    store = str(tmp_path / "durable")
    tier = LocalTier(tmp_path / "fast", num_to_keep=5, persist=lambda index, metrics: index == 1)
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=tier) as s:
        rows = [s.report({"i": i}, state={"w": np.full(1000, i, dtype=np.float32)})
                for i in range(2)]
        with pytest.raises(CheckpointStoreError, match="not selected"):
            s.wait(checkpoint=rows[0])
        s.wait(checkpoint=rows[1])
        assert s.durable_index == 1
    assert [m["index"] for _, m in StorageContext(store, "e", "t").committed_checkpoints()] == [1]
