"""One rank of the FSDP2 kill-and-reshard test (test_fsdp_reshard.py); not a test module.

Usage: torchrun --nproc_per_node N _fsdp_worker.py STORAGE_PATH STEPS OUT_JSON [KILL]

Trains a small MLP under FSDP2 (``fully_shard``) with Adam on seeded data
(batch ``step`` is the same whatever the rank count), reporting the model
and optimizer state every step; resumes from the trial's newest checkpoint
on whatever number of ranks it runs. ``KILL`` is ``RANK:STEP:WHEN``: that
rank SIGKILLs itself at that step, ``after-report`` (its state staged, the
commit in flight) or ``mid-step`` (after the backward pass, before the
optimizer step). Rank 0 writes ``{"start": step resumed at, "losses": {step: loss}}``
after every step.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from checkpoint_store import session


def main() -> None:
    storage, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    kill = sys.argv[4].split(":") if len(sys.argv) > 4 else None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 96), torch.nn.ReLU(),
                                torch.nn.Linear(96, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)

    def die(step: int, when: str) -> None:
        if kill is not None and int(kill[0]) == rank and int(kill[1]) == step and kill[2] == when:
            os.kill(os.getpid(), signal.SIGKILL)

    losses: dict[int, float] = {}
    with session.start(storage_path=storage, experiment_name="fsdp", trial_name="t",
                       sync_timeout_s=60) as s:
        start = 0
        checkpoint = s.get_checkpoint()
        if checkpoint is not None:
            msd, osd = get_state_dict(model, optim)
            checkpoint.load_state(into={"model": msd, "optim": osd})
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
            start = checkpoint.load_state(keys="step")["step"]
        for step in range(start, steps):
            x = torch.randn(64, 24, generator=torch.Generator().manual_seed(step))
            loss = (model(x) - x[:, :4].sum(1, keepdim=True)).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            die(step, "mid-step")
            optim.step()
            losses[step] = loss.item()
            if rank == 0:  # after every step: a killed run keeps what it trained
                with open(out, "w") as f:
                    json.dump({"start": start, "losses": losses}, f)
            msd, osd = get_state_dict(model, optim)
            s.report({"loss": loss.item()}, state={"model": msd, "optim": osd, "step": step + 1})
            die(step, "after-report")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
