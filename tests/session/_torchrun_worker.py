"""One rank of the torchrun test (tests/session/test_torchrun.py); not a test module.

Usage: torchrun --nproc_per_node N _torchrun_worker.py STORAGE_URI RESULT_JSON
S3 endpoint and credentials come from the standard AWS_* variables.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

from checkpoint_store import Checkpoint, CheckpointConfig, session


def main() -> None:
    uri, result_path = sys.argv[1], sys.argv[2]
    options = {
        "engine": "pyarrow",
        "endpoint_url": os.environ["AWS_ENDPOINT_URL"],
        "access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
        "secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
        "region": os.environ["AWS_REGION"],
    }
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(4, 1)
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    # Ranks, world size and the attempt come from torchrun's variables and the process group.
    with session.start(storage_path=uri, storage_options=options, experiment_name="ddp",
                       trial_name="t", checkpoint_config=CheckpointConfig(),
                       sync_timeout_s=120) as s:
        ctx = session.get_context()
        assert (ctx.world_rank, ctx.world_size) == (rank, world)
        errors = []
        for step in range(4):
            x = torch.full((8, 4), float(rank + 1))
            loss = ddp(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with tempfile.TemporaryDirectory(prefix=f"rank{rank}-") as tmp:
                ckpt = Checkpoint.from_directory(tmp)
                if step in (0, 2, 3):
                    # Every rank writes its own shard.
                    torch.save({"rank": rank, "step": step,
                                "weight": model.weight.detach().clone()},
                               os.path.join(tmp, f"shard_{rank}.pt"))
                    if step == 2 and rank == 2:
                        # Rank 2's files vanish before its upload: step 2 must
                        # not be committed, on any rank.
                        shutil.rmtree(tmp)
                elif rank == 0:
                    # Only rank 0 saves; the others pass None (allowed with a process group).
                    with open(os.path.join(tmp, "rank0_only.txt"), "w") as f:
                        f.write("from rank 0")
                else:
                    ckpt = None
                try:
                    row = session.report({"loss": float(loss) + 10 * rank, "rank": rank},
                                         checkpoint=ckpt)
                except Exception as exc:
                    errors.append([step, type(exc).__name__, str(exc)])
                finally:
                    os.makedirs(tmp, exist_ok=True)  # TemporaryDirectory removes it
        latest = s.get_checkpoint()
    summary = {"rank": rank, "row": row, "latest": latest.uri, "attempt_id": s.attempt_id,
               "errors": errors}
    gathered = [None] * world
    dist.all_gather_object(gathered, summary)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
