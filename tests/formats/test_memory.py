"""Exports stream: peak RSS stays within 2 x the largest tensor + 64 MiB
whatever the checkpoint's size (issue 44), measured in a fresh process on a
state much larger than its largest tensor, and the export read back bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

MiB = 1 << 20
TENSOR, COUNT = 16 * MiB, 32  # 512 MiB of 16 MiB tensors

_SCRIPT = r'''
import json, os, sys
import torch
from checkpoint_store import Checkpoint
from checkpoint_store.formats import export_checkpoint
from checkpoint_store.state import write_state

fmt, root, count, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
src = os.path.join(root, "state")
if not os.path.exists(src):
    n = nbytes // 4
    write_state({"model": {f"w{i}": torch.full((n,), float(i)) for i in range(count)},
                 "step": 3}, src)
ck = Checkpoint.from_directory(src)
# Warm up: every import and code path once, on a tiny state.
tiny = os.path.join(root, "tiny-" + fmt)
write_state({"model": {"w": torch.ones(4)}}, tiny)
export_checkpoint(Checkpoint.from_directory(tiny), os.path.join(root, "tiny." + fmt),
                  format=fmt)

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))

base = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
export_checkpoint(ck, os.path.join(root, "out." + fmt), format=fmt)
print(json.dumps({"growth": status("VmHWM:") - base}))
'''


def _export_growth(fmt: str, root: Any) -> int:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, fmt, str(root), str(COUNT),
                          str(TENSOR)], env=env, capture_output=True, text=True, check=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1])["growth"])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["dcp", "torch_save"])
def test_export_peak_rss_is_bounded_by_the_largest_tensor(fmt: str, tmp_path: Any) -> None:
    import torch

    growth = _export_growth(fmt, tmp_path)
    assert growth <= 2 * TENSOR + 64 * MiB, f"{fmt}: peak RSS grew {growth / MiB:.0f} MiB"
    out = str(tmp_path / f"out.{fmt}")
    if fmt == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(out, str(tmp_path / "back.pt"))
        out = str(tmp_path / "back.pt")
    got = torch.load(out, mmap=True, weights_only=True)
    assert got["step"] == 3 and len(got["model"]) == COUNT
    for i in (0, COUNT - 1):
        assert torch.equal(got["model"][f"w{i}"], torch.full((TENSOR // 4,), float(i)))
