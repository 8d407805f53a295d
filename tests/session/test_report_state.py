"""report(metrics, state=...): bounded shared-memory staging, the persist process,
snapshot semantics, sync and async, errors of a dead persist process (issue 30)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import google_crc32c
import numpy as np
import pytest

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    InvalidConfigError,
    StorageContext,
    UnsupportedStateError,
    UploadConfig,
    session,
)
from checkpoint_store.errors import PersistProcessError
from checkpoint_store.testing import session_internals

MiB = 1 << 20


def _read_tensors(ckpt) -> dict[str, bytes]:
    """Every tensor's bytes, read through the tensor index of the manifest (the
    loader's view), checked against its CRC32C and against the safetensors
    header of its file."""
    meta = ckpt.internal_metadata
    out = {}
    local = ckpt.to_directory()
    for name, e in meta["tensors"].items():
        path = os.path.join(local, e["file"])
        with open(path, "rb") as f:
            head = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(head))
            b, end = e["offsets"]
            f.seek(b)
            data = f.read(end - b)
        assert header[name]["dtype"] == e["dtype"] and header[name]["shape"] == e["shape"]
        assert [x + 8 + head for x in header[name]["data_offsets"]] == [b, end]
        assert f"{google_crc32c.value(data):08x}" == e["crc32c"], name
        out[name] = data
    return out


def _tree(ckpt) -> dict:
    return ckpt.load_state()


@pytest.fixture(params=["uri", "pyarrow", "fsspec"])
def place(request, tmp_path):
    """The same local storage as a path, a pyarrow filesystem and an fsspec filesystem."""
    root = tmp_path / "store"
    root.mkdir()
    if request.param == "uri":
        return {"storage_path": str(root)}
    if request.param == "pyarrow":
        import pyarrow.fs as pafs

        return {"storage_path": "/", "storage_filesystem": pafs.SubTreeFileSystem(
            str(root), pafs.LocalFileSystem())}
    import fsspec

    return {"storage_path": str(root), "storage_filesystem": fsspec.filesystem("file")}


def test_a_state_round_trips_on_every_storage_form(place):
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    arr = np.arange(1000, dtype=np.int64)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "arr": arr, "step": 7,
             "cfg": {"name": "x", "lrs": [0.1, 0.01], "none": None}}
    want = {f"model/{k}": v.detach().numpy().tobytes() for k, v in model.state_dict().items()}
    with session.start(experiment_name="e", trial_name="t", **place) as s:
        row = s.report({"loss": 1.0}, state=state)
        assert row["checkpoint_dir_name"] == "checkpoint_000000"
        s.wait()
        ckpt = s.get_checkpoint()
    assert ckpt is not None and ckpt.path.endswith("checkpoint_000000")
    ckpt.verify()
    got = _read_tensors(ckpt)
    for name, data in want.items():
        assert got[name] == data
    assert got["arr"] == arr.tobytes()
    assert "optim/state/0/exp_avg" in got
    tree = _tree(ckpt)  # the format's loader gives the same tree back
    assert tree["step"] == 7 and tree["cfg"] == {"name": "x", "lrs": [0.1, 0.01], "none": None}
    for k, v in model.state_dict().items():
        assert torch.equal(tree["model"][k], v)
    # Optimizer state has int keys: kept as such.
    assert torch.equal(tree["optim"]["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])
    assert (tree["arr"] == arr).all()
    assert ckpt.internal_metadata["metrics"]["loss"] == 1.0


def test_the_state_is_a_snapshot(tmp_path):
    """Tensors changed right after report() returns: the saved bytes are those
    they held during report(), also for a state 4x the staging budget."""
    torch = pytest.importorskip("torch")
    big = [torch.full((2 * MiB,), float(i)) for i in range(8)]  # 8 x 8 MiB = 64 MiB
    arr = np.ones(MiB, dtype=np.float32)
    cfg = UploadConfig(staging_budget=16 * MiB)
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t",
                       upload_config=cfg) as s:
        s.report({"i": 0}, state={"big": big, "arr": arr})
        for t in big:
            t.add_(100.0)
        arr *= 3
        s.wait()
        ckpt = s.get_checkpoint()
    got = _read_tensors(ckpt)
    for i in range(8):
        assert got[f"big/{i}"] == torch.full((2 * MiB,), float(i)).numpy().tobytes()
    assert got["arr"] == np.ones(MiB, dtype=np.float32).tobytes()


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_staging_memory_stays_within_the_budget_for_a_state_four_times_larger(tmp_path):
    budget = 16 * MiB
    state = {f"t{i}": np.random.default_rng(i).random(2 * MiB // 2, dtype=np.float32)
             for i in range(16)}  # 16 x 4 MiB = 64 MiB = 4 x budget
    nbytes = sum(a.nbytes for a in state.values())
    assert nbytes == 4 * budget
    base = _rss()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t",
                       upload_config=UploadConfig(staging_budget=budget)) as s:
        sampler.start()
        try:
            s.report({"i": 0}, state=state)
            s.wait()
        finally:
            done.set()
            sampler.join()
        stager = session_internals(s).stager
        assert 0 < stager.peak_in_use <= budget
        assert stager.in_use == 0
        ckpt = s.get_checkpoint()
    assert peak[0] - base <= budget + 64 * MiB, (peak[0] - base) / MiB
    got = _read_tensors(ckpt)
    assert all(got[k] == v.tobytes() for k, v in state.items())


def test_sync_state_report_is_committed_before_it_returns(tmp_path):
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t") as s:
        s.report({"i": 0}, state={"w": np.zeros(10)}, upload_mode="sync")
        ckpt = s.get_checkpoint()
        assert ckpt is not None and ckpt.path.endswith("checkpoint_000000")
        up = session_internals(s).uploader  # committed inline: nothing is queued
        assert up is None or up.pending == 0
        assert _read_tensors(ckpt)["w"] == np.zeros(10).tobytes()


def test_retention_keeps_the_newest_state_checkpoints_and_a_restart_resumes(tmp_path):
    kw = dict(storage_path=str(tmp_path), experiment_name="e", trial_name="t",
              checkpoint_config=CheckpointConfig(num_to_keep=2))
    with session.start(**kw) as s:
        for step in range(4):
            s.report({"step": step}, state={"w": np.full(100, step), "step": step})
    with session.start(**kw) as s:
        ckpt = s.get_checkpoint()
        assert _tree(ckpt)["step"] == 3
        storage = StorageContext(str(tmp_path), "e", "t")
        assert [c.path.rsplit("/", 1)[-1] for c, _ in storage.committed_checkpoints()] == [
            "checkpoint_000002", "checkpoint_000003"]


@pytest.mark.parametrize("bad, what", [
    ({("a", 1): np.zeros(1)}, "not a string"),
    ({"a": object()}, "No pickle"),
    ({"m": {"w": np.zeros(3), "s": {1, 2}}}, "No pickle"),
])
def test_a_state_that_cannot_be_stored_is_refused_before_anything_is_written(tmp_path, bad,
                                                                              what):
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t") as s:
        with pytest.raises(UnsupportedStateError, match=what):
            s.report({"i": 0}, state=bad)
        row = s.report({"i": 1}, state={"ok": np.zeros(1)}, upload_mode="sync")
    assert row["training_iteration"] == 1 and row["checkpoint_dir_name"] == "checkpoint_000000"
    assert sorted(os.listdir(tmp_path / "e" / "t")).count("checkpoint_000000") == 1


def test_checkpoint_and_state_together_and_bad_budgets_are_refused(tmp_path):
    with pytest.raises(InvalidConfigError, match="staging_budget"):
        UploadConfig(staging_budget=10)
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t") as s:
        with pytest.raises(InvalidConfigError, match="not both"):
            s.report({}, checkpoint=s.get_checkpoint() or object(), state={"a": 1})
        with pytest.raises(InvalidConfigError, match="upload_mode"):
            s.report({}, state={"a": 1}, upload_mode="later")


def test_state_on_several_ranks_commits_one_state(tmp_path, ranks):
    """Two ranks without a process group (storage rendezvous): each writes its
    pieces, rank 0 commits one state, in the background (the default) or
    before report() returns (docs/sharded-state.md)."""
    big = np.arange(300_000, dtype=np.float32).reshape(1000, 300)  # 1.2 MB: split in two

    def rank(r):
        with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t",
                           world_rank=r, world_size=2, attempt_id="a1") as s:
            s.report({"i": 1}, state={"a": big, "step": 3})
            s.report({"i": 2}, state={"a": big + 1, "step": 4}, upload_mode="sync")
            after_sync = s.get_checkpoint().path
            s.report({"i": 3}, state={"a": big + 2, "step": 5})
            s.wait()
            return after_sync, s.get_checkpoint().path

    got = ranks(2, rank)
    trial = tmp_path / "e" / "t"
    assert got[0] == got[1] == (str(trial / "checkpoint_000001"),
                                str(trial / "checkpoint_000002"))
    for i in range(3):
        ck = Checkpoint.from_directory(str(trial / f"checkpoint_{i:06d}"))
        assert len(ck.internal_metadata["tensors"]["a"]["shards"]) == 2
        out = ck.load_state()
        assert np.array_equal(out["a"], big + i) and out["step"] == 3 + i


def test_a_rank_that_cannot_save_its_state_aborts_the_index_everywhere(tmp_path, ranks):
    """Rank 1's state holds a leaf no state can hold: rank 1 raises at that
    report; rank 0's background commit of it is aborted (its wait() raises
    that, as every background error); nothing is committed under that
    index and the next report commits on both."""
    good = {"a": np.zeros(4)}

    def rank(r):
        errors = []
        with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t",
                           world_rank=r, world_size=2, attempt_id="a1") as s:
            for i in range(2):
                try:
                    s.report({"i": i}, state=good if r == 0 or i else {"a": object()})
                    s.wait()
                    errors.append(None)
                except Exception as exc:
                    errors.append(type(exc).__name__)
            return errors, s.get_checkpoint().path

    got = ranks(2, rank)
    assert got[0][0] == ["CheckpointAbortedError", None]
    assert got[1][0] == ["UnsupportedStateError", None]
    trial = tmp_path / "e" / "t"
    assert {p for _, p in got} == {str(trial / "checkpoint_000001")}
    assert not (trial / "checkpoint_000000").exists()


def _committed(tmp_path) -> list[str]:
    storage = StorageContext(str(tmp_path), "e", "t")
    return [c.path.rsplit("/", 1)[-1] for c, _ in storage.committed_checkpoints()]


def test_a_killed_persist_process_is_an_error_not_a_hang(tmp_path):
    """Killed while a save larger than the budget is being staged (report() is
    waiting for staging memory): report() raises; nothing of it is committed;
    the next report starts a new persist process and commits."""
    budget = 2 * MiB
    state = {f"t{i}": np.full(MiB // 4, i, dtype=np.float32) for i in range(16)}  # 16 MiB
    cfg = UploadConfig(staging_budget=budget)
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t",
                       upload_config=cfg) as s:
        s.report({"i": 0}, state={"w": np.zeros(4)}, upload_mode="sync")
        stager = session_internals(s).stager
        pid = stager.persist_pid
        os.kill(pid, signal.SIGSTOP)  # holds the area full until the kill
        killer = threading.Timer(0.5, lambda: (os.kill(pid, signal.SIGKILL),
                                               os.kill(pid, signal.SIGCONT)))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(PersistProcessError, match="persist process"):
            s.report({"i": 1}, state=state)
        assert time.monotonic() - t0 < 30
        killer.join()
        assert _committed(tmp_path) == ["checkpoint_000000"]
        row = s.report({"i": 2}, state=state, upload_mode="sync")
        assert stager.persist_pid != pid
        assert _committed(tmp_path) == ["checkpoint_000000", row["checkpoint_dir_name"]]
        got = _read_tensors(s.get_checkpoint())
        assert got == {k: v.tobytes() for k, v in state.items()}


def test_a_persist_process_killed_after_report_returned_fails_that_save(tmp_path):
    """The save was staged and report() returned; the persist process dies
    before it wrote the files: wait() raises, nothing of it is committed."""
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t") as s:
        s.report({"i": 0}, state={"w": np.zeros(4)}, upload_mode="sync")
        pid = session_internals(s).stager.persist_pid
        os.kill(pid, signal.SIGSTOP)
        s.report({"i": 1}, state={"w": np.ones(8 * MiB)})  # fits: returns at once
        os.kill(pid, signal.SIGKILL)  # a stopped process dies of it too
        with pytest.raises(PersistProcessError):
            s.wait(60)
        assert _committed(tmp_path) == ["checkpoint_000000"]
        # The failed save removed its unfinished directory; the next one commits.
        assert sorted(p for p in os.listdir(tmp_path / "e" / "t")
                      if p.startswith("checkpoint_")) == ["checkpoint_000000"]
        row = s.report({"i": 2}, state={"w": np.ones(3)}, upload_mode="sync")
        assert row["checkpoint_dir_name"] == "checkpoint_000002"
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t") as s:
        assert s.get_checkpoint().path.endswith("checkpoint_000002")


@pytest.mark.slow
def test_a_state_round_trips_on_s3(s3_location):
    with session.start(storage_path=s3_location.uri,
                       storage_options=s3_location.storage_options,
                       experiment_name="e", trial_name="t") as s:
        s.report({"i": 0}, state={"w": np.arange(MiB, dtype=np.float32), "step": 1})
        s.wait()
        ckpt = s.get_checkpoint()
    ckpt.verify()
    assert _read_tensors(ckpt)["w"] == np.arange(MiB, dtype=np.float32).tobytes()


def test_replicated_and_rank_local_entries_on_several_ranks(tmp_path, ranks) -> None:
    """Two ranks (storage rendezvous): a replicated tensor (split between
    them), a JSON value (rank 0's), and RankLocal entries (a tensor, a tree
    with JSON values and an array) that differ by rank: each rank's own is
    kept, whole, under its rank number; a one-rank session saves the same
    layout."""
    import torch

    from checkpoint_store.state import RankLocal

    shared = torch.randn(600, 700)  # 1.7 MB: split between the ranks

    def rank(r):
        with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t",
                           world_rank=r, world_size=2, attempt_id="a1") as s:
            s.report({"i": 0}, state={
                "model": {"w": shared},
                "rng": RankLocal(torch.full((5,), float(r))),
                "loader": RankLocal({"epoch": 3, "position": 100 + r,
                                     "buf": np.arange(3) + r}),
                "step": 9})
            s.wait()
            return s.get_checkpoint().path

    [path, _] = ranks(2, rank)
    ck = Checkpoint.from_directory(path)
    out = ck.load_state()
    assert torch.equal(out["model"]["w"], shared)
    assert sorted(out["rng"]) == ["0", "1"]
    assert [out["rng"][k][0].item() for k in ("0", "1")] == [0.0, 1.0]
    assert [out["loader"][k]["position"] for k in ("0", "1")] == [100, 101]
    assert np.array_equal(out["loader"]["1"]["buf"], np.arange(3) + 1)
    assert out["step"] == 9
    # A rank reads only its own.
    mine = torch.zeros(5)
    ck.load_state(into={"rng": {"1": mine}})
    assert torch.equal(mine, torch.ones(5))
    # One rank: the same layout, under "0".
    with session.start(storage_path=str(tmp_path / "one"), experiment_name="e",
                       trial_name="t") as s:
        s.report({"i": 0}, state={"rng": RankLocal(torch.ones(2)), "x": 1}, upload_mode="sync")
        one = s.get_checkpoint().load_state()
    assert list(one["rng"]) == ["0"] and torch.equal(one["rng"]["0"], torch.ones(2))
