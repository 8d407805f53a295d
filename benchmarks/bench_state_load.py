"""Loading a saved state (docs/state.md), against baselines measured in the same run.

* ``local``: a 1 GiB state (16 float32 tensors of 64 MiB) on local disk, page
  cache warm. ``load_state(mmap=True)`` (checksums on, so every page is
  read once) and ``load_state()`` (``preadv`` into new tensors) against
  ``readinto`` of the same files' bytes into a preallocated buffer, and
  ``readinto`` into new tensors (what every loader making new tensors pays:
  fresh pages); the ratio is the baseline's time over ours (>= 0.8 for the
  memory map is the target: at least 0.8x the speed of reading the bytes).
* ``partial_s3``: 10 % of the tensors of a state on moto, the bytes the
  client received counted by a relay in front of the server, against the
  asked tensors' bytes (<= 1.1x plus ``state.json`` and the marker is the target).

Run: ``python -m benchmarks.bench_state_load [--quick]``; prints one JSON object.
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

MiB = 1024 * 1024


def _state(n: int, numel: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)},
            "step": 1}


def local(quick: bool, reps: int = 5) -> dict[str, Any]:
    from checkpoint_store import Checkpoint

    n, numel = (16, (4 if quick else 64) * MiB // 4)
    work = tempfile.mkdtemp(prefix="bench-state-")
    try:
        ck = Checkpoint.from_state(_state(n, numel), os.path.join(work, "ck"))
        files = sorted(os.path.join(ck.path, f) for f in os.listdir(ck.path)
                       if f.endswith(".safetensors"))
        total = sum(os.path.getsize(f) for f in files)
        buf = bytearray(max(os.path.getsize(f) for f in files))

        def readinto() -> None:
            view = memoryview(buf)
            for f in files:
                with open(f, "rb", buffering=0) as fh:
                    fh.readinto(view[: os.path.getsize(f)])

        def mmap_load() -> None:
            ck.load_state(mmap=True)

        def fresh_readinto() -> None:
            # What any loader that makes new tensors pays: fresh pages, then the bytes.
            import torch

            for f in files:
                t = torch.empty(os.path.getsize(f), dtype=torch.uint8)
                with open(f, "rb", buffering=0) as fh:
                    fh.readinto(memoryview(t.numpy()))

        def read_load() -> None:
            ck.load_state()

        candidates = {"readinto": readinto, "load_state(mmap=True)": mmap_load,
                      "readinto into new tensors": fresh_readinto,
                      "load_state()": read_load}
        for fn in candidates.values():  # warm the page cache and the imports
            fn()
        times: dict[str, list[float]] = {k: [] for k in candidates}
        for _ in range(reps):
            for name, fn in candidates.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        return {
            "bytes": total, "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
            "median_s": med,
            "GiB_per_s": {k: total / v / 2**30 for k, v in med.items()},
            "speed_vs_readinto": {k: med["readinto"] / v for k, v in med.items()},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def partial_s3(quick: bool) -> dict[str, Any]:
    from checkpoint_store import Checkpoint, StorageContext
    from checkpoint_store.state import STATE_FILE, write_state
    from checkpoint_store.testing.servers import S3Server
    from tests.backends.relay import CountingRelay

    n, numel = (20, (1 if quick else 4) * MiB // 4)
    work = tempfile.mkdtemp(prefix="bench-state-s3-")
    with S3Server.start() as server:
        bucket = server.create_bucket()
        relay = CountingRelay(server.port)
        try:
            out: dict[str, Any] = {}
            for engine in ("pyarrow", "s3fs"):
                ctx = StorageContext(f"s3://{bucket}/{engine}", "exp", "t",
                                     storage_options={**server.storage_options(engine),
                                                      "endpoint_url": relay.url})
                tree = _state(n, numel)
                src = os.path.join(work, engine)
                tensors = write_state(tree, src, shard_bytes=64 * MiB)
                ck = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0,
                                            {"tensors": tensors})
                asked = [f"model/layer{i}.weight" for i in (3, 16)]
                asked_bytes = sum(tensors[k]["offsets"][1] - tensors[k]["offsets"][0]
                                  for k in asked)
                meta = os.path.getsize(os.path.join(src, STATE_FILE))
                relay.reset()
                t0 = time.perf_counter()
                ck.load_state(asked)
                dt = time.perf_counter() - t0
                got, requests = relay.received, list(relay.requests)
                relay.reset()
                ck.load_state()
                whole = relay.received
                out[engine] = {
                    "state_bytes": sum(e["offsets"][1] - e["offsets"][0]
                                       for e in tensors.values()),
                    "asked_bytes": asked_bytes, "state_json_bytes": meta,
                    "received_bytes": got, "requests": len(requests),
                    "received_over_asked": got / asked_bytes,
                    "received_over_asked_plus_metadata": got / (asked_bytes + meta),
                    "whole_load_received_bytes": whole, "partial_s": dt,
                    "request_lines": [r.decode("latin-1")[:90] for r in requests],
                }
            return out
        finally:
            relay.close()
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("local", "partial_s3"))
    args = parser.parse_args()
    result: dict[str, Any] = {}
    if args.only in (None, "local"):
        result["local"] = local(args.quick)
    if args.only in (None, "partial_s3"):
        result["partial_s3"] = partial_s3(args.quick)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
