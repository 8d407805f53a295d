"""Preemption: seconds from the SIGTERM to the committed preemption checkpoint.

Standalone: ``python -m benchmarks.bench_preemption [--quick] [--json FILE]``
prints one JSON object and the rows for docs/benchmarks.md. Each run is
:func:`checkpoint_store.testing.crash.preemption.time_preemption`: a child
trains (a step builds the state; no sleep), saves with
``session.start(preemption=PreemptionConfig(...))``, and gets SIGTERM to its
process group as a step starts with no save in flight (the worst moment: the
whole step lies between the signal and the next ``report()``). Then the
checks of the kill harness run (the preemption checkpoint committed and
marked, nothing partial, no orphan persist process).

* ``local_tier``: ``LocalTier`` (fsync on) on the local disk, the
  storage_path on the local disk too. Target: the preemption checkpoint
  committed on the local tier within one step + 2 x memcpy of the state +
  fsync, each measured in the same child (the memcpy as the best of three
  copies with numpy, the fsync after writing the state to the tier's disk).
  The copy to the storage_path and ``Preempted`` (the session closed, its
  lease released) are recorded too.
* ``s3``: the state straight to S3 (moto on 127.0.0.1), ``upload_mode="sync"``.
  Target: 1 GiB committed within 30 s of the signal; 256 MiB is measured too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any

GiB = 1 << 30
MiB = 1 << 20


def _one(storage_path: str, size: int, *, tier: bool, work: str, reps: int,
         storage_options: dict[str, Any] | None = None, env: dict[str, str] | None = None,
         preload: tuple[str, ...] = ()) -> dict[str, Any]:
    from checkpoint_store.testing.crash.preemption import PreemptionCrashConfig, time_preemption

    files = max(1, size // (256 * MiB))
    runs = []
    for r in range(reps):
        cfg = PreemptionCrashConfig(
            storage_path=storage_path, work_dir=os.path.join(work, f"w{r}"),
            storage_options=storage_options, env=env or {}, preload=preload,
            trial_name=f"t{size // MiB}-{r}", files=files, file_size=size // files, step_s=0.0,
            grace_period_s=120.0, use_tier=tier, upload_mode="async" if tier else "sync",
            tier_backlog=2)
        runs.append(time_preemption(cfg, acks_before=1))
        shutil.rmtree(cfg.work_dir, ignore_errors=True)

    def med(key: str) -> float | None:
        xs = [x[key] for x in runs if x.get(key) is not None]
        return statistics.median(xs) if xs else None

    out: dict[str, Any] = {k: med(k) for k in (
        "tier_commit_s", "durable_commit_s", "preempted_s", "exit_s", "step_s", "memcpy_s",
        "write_s", "fsync_s")}
    out.update(state_bytes=size, reps=reps, runs=runs,
               violations=[v for x in runs for v in x["violations"]],
               exit_codes=[x["exit_code"] for x in runs])
    if tier:
        bound = out["step_s"] + 2 * out["memcpy_s"] + out["fsync_s"]
        out["bound_s"] = bound
        out["met"] = out["tier_commit_s"] is not None and out["tier_commit_s"] <= bound
    else:
        out["met"] = out["durable_commit_s"] is not None and out["durable_commit_s"] <= 30.0
    return out


def _fmt(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def rows(result: dict[str, Any]) -> list[str]:
    """The docs/benchmarks.md rows."""
    lines = ["| case | state | step | memcpy | fsync | target | committed | on the storage_path "
             "| Preempted raised | |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in result["local_tier"].items():
        lines.append(
            f"| local tier (disk), storage_path on disk | {key} | {_fmt(r['step_s'])} | "
            f"{_fmt(r['memcpy_s'])} | {_fmt(r['fsync_s'])} | ≤ step + 2 × memcpy + fsync = "
            f"{_fmt(r['bound_s'])} | {_fmt(r['tier_commit_s'])} (local tier) | "
            f"{_fmt(r['durable_commit_s'])} | {_fmt(r['preempted_s'])} | "
            f"{'met' if r['met'] else '**missed**'} |")
    for key, r in result["s3"].items():
        lines.append(
            f"| straight to S3 (moto), sync | {key} | {_fmt(r['step_s'])} | - | - | ≤ 30 s | "
            f"{_fmt(r['durable_commit_s'])} | {_fmt(r['durable_commit_s'])} | "
            f"{_fmt(r['preempted_s'])} | {'met' if r['met'] else '**missed**'} |")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="256 MiB only, one repetition")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--only", default="local_tier,s3")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    reps = args.reps or (1 if args.quick else 3)
    sizes = [256 * MiB] if args.quick else [256 * MiB, GiB]
    only = set(args.only.split(","))
    result: dict[str, Any] = {"local_tier": {}, "s3": {}}
    work = tempfile.mkdtemp(prefix="cs-bench-preemption-")
    try:
        if "local_tier" in only:
            for size in sizes:
                result["local_tier"][f"{size // MiB} MiB"] = _one(
                    os.path.join(work, "store"), size, tier=True, work=work, reps=reps)
        if "s3" in only:
            from checkpoint_store.testing.servers import S3Server

            with S3Server.start() as s3:
                for size in sizes:
                    bucket = s3.create_bucket()
                    result["s3"][f"{size // MiB} MiB"] = _one(
                        f"s3://{bucket}/ckpt", size, tier=False, work=work,
                        reps=max(1, reps - 1), storage_options=s3.storage_options(),
                        env=s3.env(), preload=("s3fs", "checkpoint_store_s3"))
                    s3.delete_bucket(bucket)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["load_avg"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items()}, indent=1, default=str)[:4000])
    print("\n".join(rows(result)))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
