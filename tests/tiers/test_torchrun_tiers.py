"""A real torchrun launch with a local tier per rank (gloo, 2 CPU ranks): the ranks
agree over the process group at start, the durable copies meet through storage."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from _tier_helpers import child_env, read_files

from checkpoint_store import StorageContext

WORKER = os.path.join(os.path.dirname(__file__), "_torchrun_tier_worker.py")


def _launch(tmp_path, phase: str) -> list[dict]:
    store, fast = str(tmp_path / "durable"), str(tmp_path / "fast")
    result = tmp_path / f"result-{phase}"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         WORKER, store, fast, str(result), phase],
        env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"result-{phase}.{r}").read_text()) for r in range(2)]


@pytest.mark.slow
def test_torchrun_ranks_with_their_own_local_tiers(tmp_path):
    pytest.importorskip("torch")
    first = _launch(tmp_path, "write")
    assert [r["resumed"] for r in first] == [None, None]
    assert [r["durable_index"] for r in first] == [1, 1]
    ctx = StorageContext(str(tmp_path / "durable"), "e", "t")
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0, 1]
    with ctx.checkpoint("checkpoint_000001").as_directory() as d:
        assert read_files(d) == {"shard_0.bin": b"0-1"}  # rank 1 added an empty part
    again = _launch(tmp_path, "resume")
    for rank, r in enumerate(again):
        uri, is_local = r["resumed"]
        assert is_local and uri.endswith(f"node{rank}/e/t/rank_{rank}/checkpoint_000001")
    shutil.rmtree(tmp_path / "fast" / "node0")
    lost = _launch(tmp_path, "resume")
    assert [r["resumed"][0] for r in lost] == [ctx.checkpoint("checkpoint_000001").uri] * 2
