"""Staging a state from its device: ``report(state=...)`` against one plain copy.

Standalone: ``python -m benchmarks.bench_state_device [--quick] [--mib 1024]
[--reps 5]`` prints one JSON object (``--quick``: 32 MiB, 3 repetitions, a
few seconds).

The state: 16 float32 tensors on the device (CUDA when there is one, else the
CPU), every fourth one transposed (a strided view), ``--mib`` MiB in all.
Candidates, alternating per repetition (A B C, B C A, ...), medians:

* ``plain copy``: the floor. On CUDA, one ``copy_(non_blocking=True)`` of each
  tensor into a preallocated pinned host buffer, then one
  ``torch.cuda.synchronize()``; on the CPU, into a preallocated buffer
  written once before: ``numpy.copyto`` of a contiguous tensor's bytes
  (memcpy), ``copy_`` of a strided one.
* ``report(state)``: ``session.report(metrics, state=...)`` with a staging
  budget of twice the state and the persist process started and the area
  pinned by an unmeasured first save; the time until it returns (``wait()``
  afterwards not counted: the loop would be training).
* ``.cpu() then copy`` (CUDA only): what staging did before: each tensor to
  pageable host memory, then copied into place; for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from benchmarks._common import MiB


def _state(nbytes: int, device: str) -> dict[str, Any]:
    import torch

    n, g = 16, torch.Generator().manual_seed(0)
    side = max(1, int((nbytes // n // 4) ** 0.5))
    model = {}
    for i in range(n):
        t = torch.rand(side, side, generator=g).to(device)
        model[f"layer{i}.weight"] = t.t() if i % 4 == 3 else t
    return {"model": model, "step": 0}


def run(nbytes: int, reps: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from checkpoint_store import CheckpointConfig, StorageContext, UploadConfig
    from checkpoint_store.session import Session
    from checkpoint_store.testing import session_internals

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    state = _state(nbytes, device)
    tensors = list(state["model"].values())
    total = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    flat.fill_(0)  # its pages exist before the timed copies
    places, at = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        places.append(flat[at:at + n].view(t.dtype).view(t.shape))
        at += n

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def plain() -> float:
        sync()
        t0 = time.perf_counter()
        for dst, src in zip(places, tensors, strict=True):
            if not cuda and src.is_contiguous():  # memcpy (copy_ would use every core)
                np.copyto(dst.view(-1).view(torch.uint8).numpy(),
                          src.view(-1).view(torch.uint8).numpy())
            else:
                dst.copy_(src, non_blocking=cuda)
        sync()
        return time.perf_counter() - t0

    def two_copies() -> float:
        sync()
        t0 = time.perf_counter()
        for dst, src in zip(places, tensors, strict=True):
            dst.copy_(src.cpu())
        return time.perf_counter() - t0

    work = tempfile.mkdtemp(prefix="cs-bench-device-")
    s = Session(StorageContext(os.path.join(work, "store"), "e", "t"),
                checkpoint_config=CheckpointConfig(num_to_keep=1),
                upload_config=UploadConfig(staging_budget=max(2 * total, 64 * MiB)))

    def report() -> float:
        sync()
        t0 = time.perf_counter()
        s.report({"loss": 0.0}, state=state)
        dt = time.perf_counter() - t0
        s.wait()
        return dt

    try:
        t0 = time.perf_counter()
        report()  # starts the persist process, faults (and pins) the area
        first = time.perf_counter() - t0
        copier = session_internals(s).stager.copier
        candidates = {"plain copy": plain, "report(state)": report}
        if cuda:
            candidates[".cpu() then copy"] = two_copies
        names = list(candidates)
        times: dict[str, list[float]] = {k: [] for k in names}
        for r in range(reps):
            for k in names[r % len(names):] + names[:r % len(names)]:
                times[k].append(candidates[k]())
        out: dict[str, Any] = {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "state_bytes": total, "reps": reps, "pinned": copier.pinned,
            "first_save_s": round(first, 4),
            "median_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
        }
        floor = out["median_s"]["plain copy"]
        out["ratio_to_plain_copy"] = {
            k: round(v / floor, 2) if floor else None for k, v in out["median_s"].items()}
        out["GBps"] = {k: round(total / v / 1e9, 2) if v else None
                       for k, v in out["median_s"].items()}
        return out
    finally:
        s.close()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 MiB, 3 repetitions")
    ap.add_argument("--mib", type=int, default=None, help="state size (default 1024)")
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args(argv)
    mib = args.mib or (32 if args.quick else 1024)
    reps = args.reps or (3 if args.quick else 5)
    res = run(mib * MiB, reps)
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
