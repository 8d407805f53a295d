"""Checkpoints written in place (``session.next_checkpoint_dir()``), committed
without a copy: the manifest is built from the directory, the marker goes last."""

from __future__ import annotations

import json
import os
import posixpath

import google_crc32c
import pytest

from checkpoint_store import Checkpoint, StorageContext, session
from checkpoint_store._format.layout import INTERNAL_METADATA, is_internal_name, written_record_name
from checkpoint_store.errors import CheckpointCorruptError, CheckpointNotFoundError


def _crc(data: bytes) -> str:
    return f"{google_crc32c.value(data):08x}"


def _write(fs, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as f:
        f.write(data)


def test_local_commit_in_place_copies_nothing(tmp_path):
    with session.start(storage_path=tmp_path, experiment_name="e", trial_name="t") as s:
        where = s.next_checkpoint_dir()
        assert where == s.next_checkpoint_dir()  # the same until it is reported
        assert where == str(tmp_path / "e" / "t" / "checkpoint_000000")
        os.makedirs(os.path.join(where, "sub"))
        files = {"model.bin": b"m" * 1000, "sub/opt.bin": b"o" * 10}
        for rel, data in files.items():
            with open(os.path.join(where, rel), "wb") as f:
                f.write(data)
        inodes = {rel: os.stat(os.path.join(where, rel)).st_ino for rel in files}
        row = s.report({"loss": 1.0}, checkpoint=Checkpoint(where))
        assert row["checkpoint_dir_name"] == "checkpoint_000000"
        assert s.next_checkpoint_dir().endswith("checkpoint_000001")
    assert {rel: os.stat(os.path.join(where, rel)).st_ino for rel in files} == inodes
    meta = json.loads(open(os.path.join(where, INTERNAL_METADATA), "rb").read())
    assert meta["manifest"] == [{"path": rel, "size": len(d), "crc32c": _crc(d)}
                                for rel, d in sorted(files.items())]
    assert meta["metrics"]["loss"] == 1.0
    # Only the user's files and our marker: the claim is gone.
    assert sorted(os.listdir(where)) == [INTERNAL_METADATA, "model.bin", "sub"]
    ctx = StorageContext(tmp_path, "e", "t")
    [(ckpt, _)] = ctx.committed_checkpoints()
    ckpt.verify()


@pytest.mark.parametrize("where", ["memory", "s3", "s3fs", "azure", "gcs"])
def test_commit_in_place_on_object_stores(where, request):
    if where == "memory":
        kw = {"storage_path": f"memory://inplace-{os.getpid()}-{id(request)}"}
    else:
        loc = request.getfixturevalue(f"{where}_location")
        kw = {"storage_path": loc.uri, "storage_options": loc.storage_options}
    with session.start(experiment_name="e", trial_name="t", **kw) as s:
        uri = s.next_checkpoint_dir()
        scheme = kw["storage_path"].split("://")[0]
        assert uri.startswith(f"{scheme}://") and uri.endswith("/e/t/checkpoint_000000")
        ctx = s.storage
        path = ctx.checkpoint_path(0)
        _write(ctx.filesystem, posixpath.join(path, "w.bin"), b"abc")
        s.report({"step": 1}, checkpoint=Checkpoint(uri, storage_options=kw.get("storage_options")))
    ctx = StorageContext(experiment_name="e", trial_name="t", **kw)
    [(ckpt, meta)] = ctx.committed_checkpoints()
    assert meta["manifest"] == [{"path": "w.bin", "size": 3, "crc32c": _crc(b"abc")}]
    ckpt.verify()
    assert ctx.scan().uncommitted == []


def test_unfinished_dcp_save_is_never_committed(tmp_path):
    with session.start(storage_path=tmp_path, experiment_name="e", trial_name="t") as s:
        where = s.next_checkpoint_dir()
        with open(os.path.join(where, "__0_0.distcp"), "wb") as f:
            f.write(b"shard")
        with pytest.raises(CheckpointCorruptError, match=r"\.metadata"):
            s.report({"loss": 1.0}, checkpoint=Checkpoint(where))
        assert StorageContext(tmp_path, "e", "t").committed_checkpoints() == []
        # The save finishes on a retry into the same directory: that commits.
        assert s.next_checkpoint_dir() == where
        with open(os.path.join(where, ".metadata"), "wb") as f:
            f.write(b"meta")
        s.report({"loss": 0.5}, checkpoint=Checkpoint(where))
    [(_, meta)] = StorageContext(tmp_path, "e", "t").committed_checkpoints()
    assert [e["path"] for e in meta["manifest"]] == [".metadata", "__0_0.distcp"]


def test_empty_in_place_dir_is_refused(tmp_path):
    with session.start(storage_path=tmp_path, experiment_name="e", trial_name="t") as s:
        where = s.next_checkpoint_dir()
        with pytest.raises(CheckpointNotFoundError, match="no files"):
            s.report({}, checkpoint=Checkpoint(where))


def _one_report_then_killed_mid_save(root) -> tuple[str, str]:
    """A run that commits ``checkpoint_000000`` in place, then fills
    ``checkpoint_000001`` and is killed before its report: both paths."""
    with session.start(storage_path=root, experiment_name="e", trial_name="t") as s:
        first = s.next_checkpoint_dir()
        with open(os.path.join(first, "a"), "wb") as f:
            f.write(b"1")
        s.report({}, checkpoint=Checkpoint(first))
        second = s.next_checkpoint_dir()
        with open(os.path.join(second, "a"), "wb") as f:
            f.write(b"2")
    return first, second


def test_crash_before_report_leaves_nothing_listed_and_is_cleaned(tmp_path):
    first, second = _one_report_then_killed_mid_save(tmp_path)
    ctx = StorageContext(tmp_path, "e", "t", run_id="another-run")
    assert [c.path for c, _ in ctx.committed_checkpoints()] == [first]
    # The claim names the run that reserved it: ours, uncommitted, removable.
    assert ctx.scan().uncommitted == ["checkpoint_000001"]
    assert ctx.remove_uncommitted() == ["checkpoint_000001"]


def test_written_records_spare_the_read_back(tmp_path):
    """A size/CRC32C record of our writer is trusted when the size matches the
    listing (the file is not read); a record whose size differs is ignored."""
    with session.start(storage_path=tmp_path, experiment_name="e", trial_name="t") as s:
        where = s.next_checkpoint_dir()
        for name, data in {"a": b"aaaa", "b": b"bb"}.items():
            with open(os.path.join(where, name), "wb") as f:
                f.write(data)
        record = {"files": [{"path": "a", "size": 4, "crc32c": "0badc0de"},
                            {"path": "b", "size": 99, "crc32c": "0badc0de"}]}
        with open(os.path.join(where, written_record_name("rank0")), "w") as f:
            json.dump(record, f)
        s.report({}, checkpoint=Checkpoint(where))
    meta = json.loads(open(os.path.join(where, INTERNAL_METADATA), "rb").read())
    assert meta["manifest"] == [{"path": "a", "size": 4, "crc32c": "0badc0de"},
                                {"path": "b", "size": 2, "crc32c": _crc(b"bb")}]
    assert not os.path.exists(os.path.join(where, written_record_name("rank0")))


def test_two_ranks_write_in_place_rank0_commits(tmp_path, ranks):
    def rank(r: int) -> tuple[str, str | None]:
        with session.start(storage_path=tmp_path, experiment_name="e", trial_name="t",
                           world_rank=r, world_size=2, attempt_id="a1",
                           sync_timeout_s=30, _thread_only=True) as s:
            where = s.next_checkpoint_dir()
            with open(os.path.join(where, f"shard_{r}.bin"), "wb") as f:
                f.write(bytes([r]) * (r + 1))
            # Rank 1 passes None: the directory it was handed is the checkpoint.
            row = s.report({"r": r}, checkpoint=Checkpoint(where) if r == 0 else None)
            return where, row["checkpoint_dir_name"]

    out = ranks(2, rank)
    assert out[0] == out[1] == (str(tmp_path / "e" / "t" / "checkpoint_000000"),
                                "checkpoint_000000"), out
    [(ckpt, meta)] = StorageContext(tmp_path, "e", "t").committed_checkpoints()
    assert [e["path"] for e in meta["manifest"]] == ["shard_0.bin", "shard_1.bin"]
    assert meta["world_size"] == 2 and meta["metrics"]["r"] == 0
    ckpt.verify()
    assert not [n for n in os.listdir(ckpt.path) if is_internal_name(n)]


def test_a_restart_that_keeps_its_run_id_cleans_its_dead_save(tmp_path, monkeypatch):
    """A launcher keeps ``CHECKPOINT_STORE_RUN_ID`` across restarts: the save
    a killed process left in ``checkpoint_000001`` is that run id's, but with
    one rank nobody of this run can still be writing it. The restart removes
    it, as it removes another run's, instead of keeping it for ever."""
    monkeypatch.setenv("CHECKPOINT_STORE_RUN_ID", "job1")
    first, second = _one_report_then_killed_mid_save(tmp_path)
    ctx = StorageContext(tmp_path, "e", "t")
    assert ctx.scan("job1").active == ["checkpoint_000001"]
    with session.start(storage_path=tmp_path, experiment_name="e", trial_name="t") as s:
        assert s.get_checkpoint().path == first
        assert ctx.scan().uncommitted == [] and not os.path.exists(second)
