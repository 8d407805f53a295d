"""torch.distributed.checkpoint: saved in place into session.next_checkpoint_dir()
and committed without a copy; StorageWriter/StorageReader on our backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from checkpoint_store import (  # noqa: E402
    Checkpoint,
    NestedCheckpointError,
    StorageContext,
    session,
)
from checkpoint_store._format.layout import INTERNAL_METADATA  # noqa: E402
from checkpoint_store.integrations.torch import StorageReader, StorageWriter  # noqa: E402

# Two ranks (gloo, a file store); the second save's writer fails in finish()
# (after every rank wrote its data, before DCP's .metadata).
WORKER = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from checkpoint_store import Checkpoint, session
    from checkpoint_store._format.layout import is_internal_name

    class FailingWriter(FileSystemWriter):
        def finish(self, metadata, results):
            raise OSError("disk full while writing .metadata")

    rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + out + "/pg", rank=rank,
                            world_size=2)
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(64, 64).state_dict(), "step": 3}
    result = {}
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       world_rank=rank, world_size=2, sync_timeout_s=60) as s:
        where = s.next_checkpoint_dir()
        dcp.save(state, checkpoint_id=where)
        inodes = {n: os.stat(os.path.join(where, n)).st_ino for n in os.listdir(where)
                  if not is_internal_name(n)}
        s.report({"loss": 1.0}, checkpoint=Checkpoint(where) if rank == 0 else None)
        result.update(where=where, inodes=inodes)
        failed = s.next_checkpoint_dir()
        try:
            dcp.save({"model": state["model"], "step": 4},
                     storage_writer=FailingWriter(failed))
        except CheckpointException as exc:  # a BaseException
            result["save_error"] = type(exc).__name__
        result["failed"] = failed
    dist.destroy_process_group()
    # The session keeps no reference to the group: destroying it stops gloo's
    # threads now (a group freed at interpreter exit aborts the process).
    result["gloo_threads"] = sum(
        open(f"/proc/self/task/{t}/comm").read().startswith("pt_gloo")
        for t in os.listdir("/proc/self/task"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
""")


@pytest.mark.slow  # two processes importing torch: several seconds on a shared CPU
def test_two_ranks_save_in_place_without_a_copy(tmp_path):
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(store), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["where"] == r1["where"] == str(store / "e" / "t" / "checkpoint_000000")
    assert r0["failed"] == r1["failed"] == str(store / "e" / "t" / "checkpoint_000001")
    assert r0["save_error"] == r1["save_error"] == "CheckpointException"
    assert r0["gloo_threads"] == r1["gloo_threads"] == 0

    where = r0["where"]
    # DCP's files, our marker, nothing else; and the very same files (no copy).
    [(ckpt, meta)] = StorageContext(store, "e", "t").committed_checkpoints()
    assert ckpt.path == where
    dcp_files = {e["path"] for e in meta["manifest"]}
    assert ".metadata" in dcp_files and any(n.endswith(".distcp") for n in dcp_files)
    assert set(os.listdir(where)) == dcp_files | {INTERNAL_METADATA}
    assert {n: os.stat(os.path.join(where, n)).st_ino for n in dcp_files} == r0["inodes"]
    assert meta["world_size"] == 2
    ckpt.verify()

    torch.manual_seed(0)
    expected = torch.nn.Linear(64, 64).state_dict()
    loaded = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "step": 0}
    dcp.load(loaded, checkpoint_id=where)
    assert loaded["step"] == 3
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected.items())

    # The failed save (data written, no .metadata) is not listed; resume takes
    # the previous checkpoint, and a later run's cleanup removes the leftover.
    assert "checkpoint_000001" in os.listdir(store / "e" / "t")
    assert StorageContext(store, "e", "t").scan().uncommitted == ["checkpoint_000001"]
    with session.start(storage_path=store, experiment_name="e", trial_name="t") as s:
        assert s.get_checkpoint().path == where
        assert not (store / "e" / "t" / "checkpoint_000001").exists()
        # A failed index is never reused: nothing can mix with its leftovers.
        assert s.next_checkpoint_dir() == str(store / "e" / "t" / "checkpoint_000002")


def _roundtrip(uri: str, storage_options: dict) -> None:
    torch.manual_seed(1)
    state = {"model": torch.nn.Linear(64, 64).state_dict(), "step": 3}
    with session.start(storage_path=uri, storage_options=storage_options,
                       experiment_name="e", trial_name="t") as s:
        where = s.next_checkpoint_dir()
        assert where.startswith(uri.split("://")[0] + "://")
        dcp.save(state, storage_writer=StorageWriter(where, storage_options=storage_options))
        s.report({"loss": 0.5}, checkpoint=Checkpoint(where, storage_options=storage_options))
        ckpt = s.get_checkpoint()
    meta = dict(ckpt.internal_metadata)
    assert {e["path"] for e in meta["manifest"]} >= {".metadata", "__0_0.distcp"}
    ckpt.verify()  # the CRC32Cs computed while writing match the stored bytes
    loaded = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}
    dcp.load(loaded, storage_reader=StorageReader(ckpt.uri, storage_options=storage_options))
    assert loaded["step"] == 3
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())


def test_storage_writer_reader_roundtrip_s3(s3_location):
    _roundtrip(s3_location.uri, dict(s3_location.storage_options))


def test_storage_writer_reader_roundtrip_azure(azure_location):
    _roundtrip(azure_location.uri, dict(azure_location.storage_options))


def test_storage_writer_records_checksums_so_commit_reads_nothing_back(tmp_path, monkeypatch):
    from checkpoint_store._commit import protocols as _commit

    read: list[str] = []
    real = _commit.compute_manifest

    def spy(fs, root, relpaths, caps, **kw):
        rels = list(relpaths)
        read.extend(rels)
        return real(fs, root, rels, caps, **kw)

    monkeypatch.setattr(_commit, "compute_manifest", spy)
    with session.start(storage_path=f"memory://dcp-{os.getpid()}-{id(tmp_path)}",
                       experiment_name="e", trial_name="t") as s:
        where = s.next_checkpoint_dir()
        dcp.save({"w": torch.arange(10.0)}, storage_writer=StorageWriter(where))
        s.report({}, checkpoint=Checkpoint(where))
        s.get_checkpoint().verify()
    assert read == []


def test_failed_storage_writer_save_leaves_nothing_listed(tmp_path):
    class Failing(StorageWriter):
        def finish(self, metadata, results):
            raise OSError("lost the connection before .metadata")

    with session.start(storage_path=tmp_path, experiment_name="e", trial_name="t") as s:
        first = s.next_checkpoint_dir()
        dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(first))
        s.report({}, checkpoint=Checkpoint(first))
        second = s.next_checkpoint_dir()
        with pytest.raises(CheckpointException, match="before .metadata"):
            dcp.save({"w": torch.zeros(3)}, storage_writer=Failing(second))
        # Reporting it anyway is refused: DCP's own marker is missing.
        with pytest.raises(Exception, match=r"\.metadata"):
            s.report({}, checkpoint=Checkpoint(second))
    assert [c.path for c, _ in StorageContext(tmp_path, "e", "t").committed_checkpoints()] == [
        first]


def test_crash_mid_write_leaves_nothing_listed_and_resume_continues(tmp_path):
    import pyarrow.fs as pafs

    from checkpoint_store.testing.faults import SimulatedCrash, faulty_filesystem

    root = tmp_path / "store"
    root.mkdir()
    local = pafs.LocalFileSystem()
    with session.start(storage_path=str(root), storage_filesystem=local, experiment_name="e",
                       trial_name="t") as s:
        first = s.next_checkpoint_dir()
        dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(first, local))
        s.report({"step": 1}, checkpoint=Checkpoint(first, local))
        second = s.next_checkpoint_dir()
        # The process "dies" while DCP streams the shard of the second save.
        dying = faulty_filesystem(local, crash_on_path="__0_0.distcp")
        with pytest.raises(BaseException) as info:
            dcp.save({"w": torch.zeros(3)}, storage_writer=StorageWriter(second, dying))
        assert "SimulatedCrash" in repr(info.value) or isinstance(info.value, SimulatedCrash)
    ctx = StorageContext(str(root), "e", "t", run_id="next-run")
    assert [c.path for c, _ in ctx.committed_checkpoints()] == [first]
    with session.start(storage_path=str(root), experiment_name="e", trial_name="t") as s:
        assert s.get_checkpoint().path == first
        third = s.next_checkpoint_dir()
        dcp.save({"w": torch.full((3,), 2.0)}, storage_writer=StorageWriter(third))
        row = s.report({"step": 2}, checkpoint=Checkpoint(third))
    assert row["training_iteration"] == 2  # step counting continues past the crash


def test_storage_writer_inside_a_committed_checkpoint_is_refused(tmp_path):
    """A DCP directory under a committed checkpoint would add files its manifest
    does not list: refused before DCP writes a byte; the checkpoint verifies."""
    store = tmp_path / "store"
    with session.start(storage_path=store, experiment_name="e", trial_name="t") as s:
        where = s.next_checkpoint_dir()
        dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(where))
        s.report({"loss": 0.5}, checkpoint=Checkpoint(where))
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    inner = os.path.join(where, "nested")
    with pytest.raises((NestedCheckpointError, CheckpointException),
                       match="inside the committed checkpoint"):
        dcp.save({"w": torch.zeros(3)}, storage_writer=StorageWriter(inner))
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before
    Checkpoint(where).verify()
