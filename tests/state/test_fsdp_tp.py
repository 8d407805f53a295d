"""FSDP2 over tensor parallel (a 2-D mesh): FSDP2 shards a tensor-parallel
shard again on the same dimension, which DTensor describes as a strided
shard (``_StridedShard``). Saved on 4 ranks (2 x 2), loaded on the same
layout, on 3 ranks under FSDP2 alone, and whole in one process: bit-exact.
Placements whose strided shards would interleave rows are refused before
anything is written (docs/sharded-state.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from checkpoint_store import StorageContext  # noqa: E402
from checkpoint_store.state._placement import _why_not_placed  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "_fsdp_tp_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchrun(n: int, *args: str, cwd) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(n), WORKER, *args], env=env, capture_output=True, text=True, timeout=600,
        cwd=str(cwd))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.slow
def test_fsdp2_over_tensor_parallel_saves_and_loads_on_any_layout(tmp_path):
    store, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    _torchrun(4, "save", str(store), str(out), cwd=tmp_path)
    saved = torch.load(out / "full.pt", weights_only=True)
    # The layout under test: FSDP2's strided shards on the colwise weight.
    assert saved["placements"]["0.weight"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    # A parameter FSDP2 shards over the "dp" slice alone: both "tp" slices
    # hold it, and write it once between them.
    assert saved["placements"]["3.weight"] == ["Shard(dim=0)"]
    ck, meta = StorageContext(str(store), "exp", "t").committed_checkpoints()[-1]
    assert meta["world_size"] == 4
    whole = ck.load_state()["model"]  # consolidated in one process
    for key, full in saved["full"].items():
        assert torch.equal(torch.as_tensor(whole[key]), full), key
    for mode, n in (("load", 4), ("load-fsdp", 3)):
        _torchrun(n, mode, str(store), str(out), cwd=tmp_path)
        for r in range(n):
            equal = json.loads((out / f"{mode}-{r}.json").read_text())
            assert equal == {k: True for k in saved["full"]}, (mode, r, equal)


def test_strided_shards_that_give_each_rank_one_block_are_accepted():
    # FSDP2 over tensor parallel on dim 0 (mesh dp x tp), and on another dim.
    assert _why_not_placed((66, 24), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]) is None
    assert _why_not_placed((8, 6), (2, 3), [_StridedShard(1, split_factor=3), Shard(1)]) is None
    # Uneven, and more ranks than rows (empty shards): still one block each.
    assert _why_not_placed((5, 4), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]) is None
    assert _why_not_placed((3,), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]) is None
    assert _why_not_placed((8, 4), (2, 2), [Shard(0), Replicate()]) is None


def test_strided_shards_that_interleave_rows_and_partial_are_refused():
    # Shard(0) then a strided shard of it: rank (0, 0) holds rows 0 and 2.
    why = _why_not_placed((8, 4), (2, 2), [Shard(0), _StridedShard(0, split_factor=2)])
    assert why is not None and "do not give each rank one block" in why and "overlap" in why
    why = _why_not_placed((8, 4), (2,), [Partial()])
    assert why is not None and "Partial" in why and "redistribute" in why
