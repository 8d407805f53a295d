"""A real torchrun launch: 4 CPU ranks (gloo), each with its own temp dir, one S3 bucket."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.fs as pafs
import pytest

from checkpoint_store import StorageContext

pytest.importorskip("torch")

WORKER = os.path.join(os.path.dirname(__file__), "_torchrun_worker.py")


@pytest.mark.slow
def test_torchrun_four_ranks_commit_shards_to_s3(tmp_path, s3_location):
    import torch

    result = tmp_path / "result.json"
    env = {**os.environ, **s3_location.env, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
         WORKER, s3_location.uri, str(result)],
        env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = json.loads(result.read_text())
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert len({r["attempt_id"] for r in ranks}) == 1
    # Step 2 failed on rank 2 (its directory vanished) and was aborted on every rank.
    assert [r["errors"] for r in ranks][2][0][:2] == [2, "CheckpointNotFoundError"]
    assert "rank 2" in ranks[2]["errors"][0][2]
    for r in (0, 1, 3):
        assert [e[:2] for e in ranks[r]["errors"]] == [[2, "CheckpointAbortedError"]]
    # Every rank ends on the same committed checkpoint.
    assert {r["latest"] for r in ranks} == {f"{s3_location.uri}/ddp/t/checkpoint_000003"}

    ctx = StorageContext(s3_location.uri, "ddp", "t", storage_options=s3_location.storage_options)
    committed = ctx.committed_checkpoints()
    assert [m["index"] for _, m in committed] == [0, 1, 3]
    assert not ctx.filesystem.get_file_info(
        pafs.FileSelector(ctx.checkpoint_path(2), recursive=True, allow_not_found=True))
    (first, meta0), (second, meta1), (last, meta3) = committed
    shards = [f"shard_{r}.pt" for r in range(4)]
    assert sorted(e["path"] for e in meta0["manifest"]) == shards
    assert sorted(e["path"] for e in meta3["manifest"]) == shards
    assert meta0["world_size"] == 4
    # Rank 0's metrics are the ones recorded (the others add 10 * rank to the loss).
    assert meta0["metrics"]["rank"] == 0 and meta0["metrics"]["loss"] < 10
    assert [e["path"] for e in meta1["manifest"]] == ["rank0_only.txt"]
    rows = ctx.read_results()
    assert [r["rank"] for r in rows] == [0, 0, 0]  # the aborted report wrote no row
    assert rows[-1]["loss"] == ranks[0]["row"]["loss"]
    assert [r["checkpoint_dir_name"] for r in rows] == [
        "checkpoint_000000", "checkpoint_000001", "checkpoint_000003"]
    local = first.to_directory(tmp_path / "down")
    assert sorted(os.listdir(local)) == [f"shard_{r}.pt" for r in range(4)]
    weights = []
    for r in range(4):
        shard = torch.load(os.path.join(local, f"shard_{r}.pt"))
        assert shard["rank"] == r
        weights.append(shard["weight"])
    # DDP keeps replicas identical: every shard holds the same weights.
    assert all(torch.equal(w, weights[0]) for w in weights)
    # Nothing of ours is left behind in the bucket besides the trial's files.
    keys = ctx.filesystem.get_file_info(pafs.FileSelector(ctx.trial_path, recursive=True))
    assert not [k.path for k in keys if ".cs_rank" in k.path or ".cs_staging" in k.path]
