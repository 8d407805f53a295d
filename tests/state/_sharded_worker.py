"""One rank of the sharded-state tests (tests/state/test_sharded_state.py); not a test module.

Usage: torchrun --nproc_per_node N _sharded_worker.py save|load STORAGE_PATH OUT_DIR [PLACEMENT]

``save``: every rank reports the same logical state (a DTensor sharded by
rows, a replicated tensor, a small replicated one, a JSON value) twice,
then a third time with a tensor rank 1 cannot save. ``PLACEMENT`` ``tier``:
each rank with a local tier of its own (``OUT_DIR/fast<rank>``).
``load``: every rank loads the newest checkpoint into DTensors on its own
mesh (``PLACEMENT``: ``rows`` = Shard(0), ``cols`` = Shard(1)) and writes
whether its local shards equal the expected slices, and the bytes it read
and holds of each tensor; then that a target overlapping a DTensor's local
shard is refused.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def full_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(1037, 300, generator=g),  # uneven rows on 2, 3, 4 and 8 ranks
            "emb": torch.randn(2048, 128, generator=g),
            "bias": torch.randn(300, generator=g),
            "wide": torch.randn(64, 4096, generator=g),  # rows wide enough for tiles
        },
        "step": step,
    }


def _overlap_refused(ckpt, w) -> bool:
    """A StateSlice over part of the DTensor ``w``'s local shard, under
    another key, overlaps ``w``'s target: refused on every rank, naming both
    keys, with nothing changed."""
    from checkpoint_store.errors import StateMismatchError
    from checkpoint_store.state import StateSlice

    local = w.to_local()
    before = local.clone()
    try:
        ckpt.load_state(into={"model": {"w": w, "emb": StateSlice(local[:2, :64], (0, 0))}})
    except StateMismatchError as exc:
        return ("'model/w'" in str(exc) and "'model/emb'" in str(exc)
                and bool(torch.equal(local, before)))
    return False


def main() -> None:
    mode, storage_path, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    placement = sys.argv[4] if len(sys.argv) > 4 else "rows"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    from checkpoint_store import session

    if mode == "save":
        kw = {}
        if placement == "tier":
            from checkpoint_store import LocalTier

            kw["local_tier"] = LocalTier(os.path.join(out_dir, f"fast{rank}"))
        with session.start(storage_path=storage_path, experiment_name="exp", trial_name="t",
                           sync_timeout_s=60, **kw) as s:
            for step in (1, 2):
                full = full_state(step)
                state = {
                    "model": {
                        "w": distribute_tensor(full["model"]["w"], mesh, [Shard(0)]),
                        "emb": full["model"]["emb"],  # replicated, as DDP holds it
                        "bias": distribute_tensor(full["model"]["bias"], mesh, [Replicate()]),
                        "wide": distribute_tensor(full["model"]["wide"], mesh, [Shard(0)]),
                    },
                    "step": step,
                }
                s.report({"loss": 1.0 / step}, state=state)
            # Step 3: rank 1 alone holds a tensor it cannot save (a Partial
            # placement): the index is aborted on every rank.
            from torch.distributed.tensor import DTensor, Partial

            state["step"] = 3
            if rank == 1:
                state["model"]["bad"] = DTensor.from_local(torch.ones(4), mesh, [Partial()])
            error = None
            try:
                s.report({"loss": 0.1}, state=state)
                s.wait()  # the other ranks learn of the abort from their background commit
            except Exception as exc:
                error = [type(exc).__name__, str(exc)]
            latest = s.get_checkpoint().path
        result = {"rank": rank, "error": error, "latest": latest}
    else:
        with session.start(storage_path=storage_path, experiment_name="exp", trial_name="t",
                           sync_timeout_s=60) as s:
            ckpt = s.get_checkpoint()
            full = full_state(2)
            place = [Shard(0)] if placement == "rows" else [Shard(1)]
            into = {
                "model": {
                    "w": distribute_tensor(torch.zeros(1037, 300), mesh, place),
                    "emb": distribute_tensor(torch.zeros(2048, 128), mesh, place),
                    "bias": torch.zeros(300),
                    "wide": distribute_tensor(torch.zeros(64, 4096), mesh, place),
                },
            }
            import checkpoint_store.state._read as _read

            read: dict[str, int] = {}
            real = _read.read_box

            def counting(*args, **kwargs):
                n = real(*args, **kwargs)
                read[args[2]] = read.get(args[2], 0) + n
                return n

            _read.read_box = counting  # what load_state calls
            out = ckpt.load_state(into=into)
            ok = {}
            for key in ("w", "emb", "wide"):
                dt = into["model"][key]
                expect = distribute_tensor(full["model"][key], mesh, place).to_local()
                ok[key] = bool(torch.equal(dt.to_local(), expect)) and out["model"][key] is dt
            ok["bias"] = bool(torch.equal(into["model"]["bias"], full["model"]["bias"]))
            ok["step"] = ckpt.load_state(keys="step")["step"] == 2
            ok["overlap_refused"] = _overlap_refused(ckpt, into["model"]["w"])
            local = {k: into["model"][k].to_local().numel() * 4 for k in ("w", "emb", "wide")}
            result = {"rank": rank, "ok": ok, "read": read, "local": local,
                      "checkpoint": ckpt.path}
    with open(os.path.join(out_dir, f"{mode}-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
