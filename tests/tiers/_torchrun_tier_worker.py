"""One rank of the torchrun local tier test (tests/tiers/test_torchrun_tiers.py); not a
test module.

Usage: torchrun --nproc_per_node N _torchrun_tier_worker.py STORE FAST_ROOT RESULT_JSON PHASE
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch.distributed as dist

from checkpoint_store import Checkpoint, LocalTier, session


def main() -> None:
    store, fast_root, result_path, phase = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tier = LocalTier(os.path.join(fast_root, f"node{rank}"))
    out: dict = {"rank": rank}
    with session.start(storage_path=store, experiment_name="e", trial_name="t",
                       local_tier=tier, sync_timeout_s=120) as s:
        got = s.get_checkpoint()
        out["resumed"] = None if got is None else [got.uri, got.is_local]
        if phase == "write":
            for step in range(2):
                with tempfile.TemporaryDirectory() as tmp:
                    ckpt = None
                    if step == 0 or rank == 0:  # rank 1 has no files of its own at step 1
                        with open(os.path.join(tmp, f"shard_{rank}.bin"), "wb") as f:
                            f.write(b"%d-%d" % (rank, step))
                        ckpt = Checkpoint.from_directory(tmp)
                    s.report({"step": step}, checkpoint=ckpt)
                dist.barrier()  # collectives on the training thread go on meanwhile
            s.wait()
            out["durable_index"] = s.durable_index
    with open(f"{result_path}.{rank}", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
