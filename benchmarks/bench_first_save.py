"""The first ``report(state=...)`` of a session against the later ones.

Standalone: ``python -m benchmarks.bench_first_save [--size-mib 1024]
[--sessions 5] [--step-s 2]`` prints one JSON object and the markdown rows
of docs/benchmarks.md ("Saving from memory", first save).

Each round starts a fresh session (new trial directory, a staging budget the
size of the state) with ``UploadConfig(warm_staging=True)`` and with
``warm_staging=False`` (the order alternates by round), waits ``--step-s``
seconds (the first training step, during which a warm session gets its
persist process and staging pages ready), then times how long the first
``report(state=...)`` blocks, then three more. The floor: ``np.copyto`` of
the same bytes into a buffer written once before (no page faults).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from typing import Any

from benchmarks._common import MiB


def _round(work: str, state: dict[str, Any], warm: bool, step_s: float,
           budget: int) -> tuple[float, list[float]]:
    from checkpoint_store import StorageContext
    from checkpoint_store.session import Session, UploadConfig

    root = tempfile.mkdtemp(dir=work)
    s = Session(StorageContext(root, "e", "t"),
                upload_config=UploadConfig(staging_budget=budget, warm_staging=warm))
    try:
        time.sleep(step_s)  # the first step
        t0 = time.perf_counter()
        s.report({"loss": 0.0}, state=state)
        first = time.perf_counter() - t0
        s.wait()
        later = []
        for _ in range(3):
            t0 = time.perf_counter()
            s.report({"loss": 0.0}, state=state)
            later.append(time.perf_counter() - t0)
            s.wait()
        return first, later
    finally:
        s.close()
        shutil.rmtree(root, ignore_errors=True)


def run(size_mib: int = 1024, sessions: int = 5, step_s: float = 2.0) -> dict[str, Any]:
    import numpy as np

    n_tensors = 16
    per = size_mib * MiB // n_tensors // 4
    state = {f"w{i}": np.random.default_rng(i).random(per, dtype=np.float32)
             for i in range(n_tensors)}
    nbytes = sum(v.nbytes for v in state.values())
    floor_buf = {k: np.empty_like(v) for k, v in state.items()}
    for k, v in state.items():
        np.copyto(floor_buf[k], v)  # written once: no faults in the timed copies
    memcpy = []
    for _ in range(5):
        t0 = time.perf_counter()
        for k, v in state.items():
            np.copyto(floor_buf[k], v)
        memcpy.append(time.perf_counter() - t0)
    del floor_buf
    work = tempfile.mkdtemp(prefix="bench-first-")
    out: dict[str, Any] = {"bytes": nbytes, "sessions": sessions, "step_s": step_s,
                           "memcpy_s": statistics.median(memcpy), "warm": {}, "cold": {}}
    try:
        for r in range(sessions):
            for warm in ((True, False) if r % 2 == 0 else (False, True)):
                first, later = _round(work, state, warm, step_s, nbytes)
                key = "warm" if warm else "cold"
                out[key].setdefault("first_s", []).append(first)
                out[key].setdefault("later_s", []).extend(later)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for key in ("warm", "cold"):
        first = statistics.median(out[key]["first_s"])
        later = statistics.median(out[key]["later_s"])
        out[key]["first_over_later"] = first / later
        out[key]["later_over_memcpy"] = later / out["memcpy_s"]
    return out


def markdown(b: dict[str, Any]) -> str:
    ms = lambda s: f"{s * 1000:.0f} ms"  # noqa: E731
    rows = [
        f"First `report(state=...)` of a session, {b['bytes'] / MiB:.0f} MiB in 16 float32 "
        f"tensors, staging budget = the state, {b['sessions']} fresh sessions per variant, "
        f"alternating, the first save {b['step_s']:g} s after `start` (the first step); "
        f"memcpy floor {ms(b['memcpy_s'])}:",
        "",
        "| variant | first save (median) | later saves (median) | first / later "
        "| later / memcpy |",
        "|---|---|---|---|---|",
    ]
    for key, name in (("warm", "`warm_staging=True`"), ("cold", "`warm_staging=False`")):
        v = b[key]
        rows.append(f"| {name} | {ms(statistics.median(v['first_s']))} "
                    f"| {ms(statistics.median(v['later_s']))} | {v['first_over_later']:.2f} "
                    f"| {v['later_over_memcpy']:.2f} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--sessions", type=int, default=5)
    ap.add_argument("--step-s", type=float, default=2.0)
    args = ap.parse_args(argv)
    b = run(args.size_mib, args.sessions, args.step_s)
    print(json.dumps(b, indent=1))
    print(markdown(b))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
