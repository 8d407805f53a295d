"""Retention at scale: 100k registrations with K=3, CPU time and memory.

Standalone: ``python benchmarks/bench_retention.py [--n 100000] [--k 3]``
prints one JSON object; :func:`main` returns it as a dict.

What is measured:

* ``select``: the ranking core the manager runs on every ``register()``
  (``checkpoint_store.retention.selection.Selection``), fed ``n`` registrations with
  pseudo-random scores (NaN every 97th), then :func:`select_kept` over the
  same records as a stream (score lookup and validation included). CPU
  seconds (``time.process_time``) from a run without tracing; tracemalloc
  peak from a second run, where ``memory_growth_bytes`` compares traced
  memory after ``n/10`` and after ``n`` registrations (flat means O(K)).
* ``manager``: full :class:`CheckpointManager.register` on ``memory://``
  storage (commit, state write, delete per call) for ``n_io`` registrations,
  reported per registration: this is the I/O-bound cost users see.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import tracemalloc
import uuid
import warnings
from typing import Any


def _score(i: int) -> float:
    if i % 97 == 0:
        return float("nan")
    return float((i * 2654435761) % 1_000_003) / 1_000_003


def _feed(n: int, k: int, trace: bool) -> tuple[float, int, int, int, int]:
    from checkpoint_store.retention import CheckpointConfig
    from checkpoint_store.retention.selection import Entry, Selection

    sel = Selection(CheckpointConfig(k, "score", "max"))
    metrics: dict[str, Any] = {}
    tenth = n // 10
    at_tenth = 0
    if trace:
        tracemalloc.start()
    t0 = time.process_time()
    for i in range(n):
        s = _score(i)
        sel.add(Entry(i, f"checkpoint_{i:06d}", None if s != s else s, metrics))
        if trace and i == tenth:
            at_tenth = tracemalloc.get_traced_memory()[0]
    cpu = time.process_time() - t0
    end = peak = 0
    if trace:
        end, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return cpu, peak, end - at_tenth, len(sel.kept), sel.latest_index or 0


def _bench_select(n: int, k: int) -> dict[str, Any]:
    # CPU without tracemalloc (it slows allocation several fold), memory in a second pass.
    cpu, _, _, kept, _ = _feed(n, k, trace=False)
    _, peak, growth, _, _ = _feed(n, k, trace=True)
    return {
        "registrations": n,
        "num_to_keep": k,
        "cpu_s": round(cpu, 4),
        "per_registration_us": round(cpu / n * 1e6, 3),
        "peak_traced_bytes": peak,
        "memory_growth_bytes": growth,
        "kept": kept,
    }


def _bench_select_kept(n: int, k: int) -> dict[str, Any]:
    from checkpoint_store.retention import CheckpointConfig, select_kept

    cfg = CheckpointConfig(k, "score", "max", keep_latest=True)
    records = ((i, f"checkpoint_{i:06d}", {"score": _score(i)}) for i in range(n))
    t0 = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        kept, evicted = select_kept(records, cfg)
    cpu = time.process_time() - t0
    return {"registrations": n, "cpu_s": round(cpu, 4), "kept": len(kept),
            "evicted": len(evicted)}


def _bench_manager(n_io: int, k: int) -> dict[str, Any]:
    from checkpoint_store import Checkpoint, CheckpointConfig, CheckpointManager, StorageContext
    from checkpoint_store._util.fs import delete_dir

    src = tempfile.mkdtemp(prefix="bench-retention-")
    with open(os.path.join(src, "w.bin"), "wb") as f:
        f.write(b"\0" * 1024)
    storage = StorageContext(f"memory://bench-retention-{uuid.uuid4().hex}", "exp", "t")
    m = CheckpointManager(CheckpointConfig(k, "score", "max"), storage)
    commit_cpu = register_cpu = 0.0
    wall0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i in range(n_io):
            t0 = time.process_time()
            ckpt = storage.persist_checkpoint(
                Checkpoint(src), i, {"metrics": {"score": _score(i)}, "run_id": m.run_id}
            )
            t1 = time.process_time()
            m.register(ckpt, {"score": _score(i)})
            register_cpu += time.process_time() - t1
            commit_cpu += t1 - t0
    wall = time.perf_counter() - wall0
    kept = len(m.kept_dir_names)
    m.close()
    delete_dir(storage.filesystem, storage.storage_path)
    return {
        "registrations": n_io,
        "storage": "memory",
        "register_cpu_ms_per_call": round(register_cpu / n_io * 1e3, 3),
        "commit_cpu_ms_per_call": round(commit_cpu / n_io * 1e3, 3),
        "wall_s": round(wall, 3),
        "kept": kept,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns (and prints, when run as a script) a dict."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100_000, help="registrations for the ranking core")
    p.add_argument("--k", type=int, default=3, help="num_to_keep")
    p.add_argument("--n-io", type=int, default=300, help="registrations through storage")
    args = p.parse_args(argv)
    result: dict[str, Any] = {
        "benchmark": "retention",
        "python": sys.version.split()[0],
        "select": _bench_select(args.n, args.k),
        "select_kept_stream": _bench_select_kept(args.n, args.k),
        "manager": _bench_manager(args.n_io, args.k),
    }
    result["goal"] = {
        "target": "100k registrations with K=3 under 1 s CPU, flat memory",
        "met": result["select"]["cpu_s"] < 1.0
        and result["select"]["memory_growth_bytes"] < 64 * 1024,
    }
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
