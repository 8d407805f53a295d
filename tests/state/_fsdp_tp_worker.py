"""One rank of the FSDP2 + tensor-parallel test (tests/state/test_fsdp_tp.py); not a test module.

Usage: torchrun --nproc_per_node N _fsdp_tp_worker.py save|load|load-fsdp STORAGE_PATH OUT_DIR

A small MLP on a 2 x 2 mesh (``dp``, ``tp``): tensor parallel (colwise, then
rowwise) over ``tp``, then ``fully_shard`` over ``dp``, so the colwise
weights and biases are DTensors with FSDP2's strided shards
(``_StridedShard`` over ``dp``, ``Shard(0)`` over ``tp``) and the rowwise
weight is sharded on two dimensions; the last layer, which tensor
parallelism leaves whole, is sharded over ``dp`` alone (a DTensor on a
slice of the mesh, held the same by both ``tp`` slices).

``save`` (4 ranks): every rank reports the model's state dict; rank 0
writes each parameter's full tensor (``full_tensor()``) and placements to
``OUT_DIR/full.pt``. ``load`` (4 ranks): the same model built with other
values loads the newest checkpoint into its own state dict (DTensors on the
same layout); ``load-fsdp`` (any number of ranks): the model under
``fully_shard`` alone on a 1-D mesh does the same. Each rank writes whether
every full tensor equals the saved one to ``OUT_DIR/<mode>-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)


def model(seed: int, tp: bool = True) -> torch.nn.Module:
    torch.manual_seed(seed)
    # Layer 3 is left whole by tensor parallelism: under FSDP2 its
    # parameters are DTensors on the ``dp`` slice alone, the same on both
    # ``tp`` slices.
    m = torch.nn.Sequential(torch.nn.Linear(24, 66), torch.nn.ReLU(), torch.nn.Linear(66, 24),
                            torch.nn.Linear(24, 5))
    if not tp:
        fully_shard(m, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        return m
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    return m


def main() -> None:
    mode, storage_path, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from checkpoint_store import StorageContext, session

    if mode == "save":
        m = model(0)
        sd = m.state_dict()
        full = {k: v.full_tensor() for k, v in sd.items()}
        with session.start(storage_path=storage_path, experiment_name="exp", trial_name="t",
                           sync_timeout_s=60) as s:
            s.report({"step": 1}, state={"model": sd})
        if rank == 0:
            torch.save({"full": full,
                        "placements": {k: [repr(p) for p in v.placements]
                                       for k, v in sd.items()}},
                       os.path.join(out_dir, "full.pt"))
    else:
        m = model(1, tp=mode == "load")  # other values: each must come from the checkpoint
        sd = m.state_dict()
        ck = StorageContext(storage_path, "exp", "t").committed_checkpoints()[-1][0]
        ck.load_state(into={"model": sd})
        saved = torch.load(os.path.join(out_dir, "full.pt"), weights_only=True)["full"]
        equal = {k: bool(torch.equal(v.full_tensor(), saved[k])) for k, v in sd.items()}
        with open(os.path.join(out_dir, f"{mode}-{rank}.json"), "w") as f:
            json.dump(equal, f)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: now and then a torch
    # background thread still joinable there aborts the process ("terminate
    # called without an active exception"), after every result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
