"""Sharded state: planning, bytes written per rank, bytes read per rank, time a save blocks.

Standalone: ``python -m benchmarks.bench_sharded [--mib 256] [--ranks 4]``
prints one JSON object and the markdown rows of docs/benchmarks.md
("Sharded state").

- **Planning**: a tensor of 20,000 rows saved as 10,000 pieces of 2 rows,
  asked for as 10,000 boxes of 2 rows shifted by one (each overlaps two
  pieces): :class:`~checkpoint_store.state._shards.ShardIndex` built once,
  every box looked up, against a scan of every piece per box (the product;
  timed on 1,000 boxes and scaled).
- **Writes**: ``write_part`` of a state of ``--mib`` MiB (a DTensor-like
  row split is what replicated tensors of 1 MiB and more get) on
  ``--ranks`` ranks: the bytes of each rank's files against an even share.
- **Reads**: every rank of 2, 3 and 8 asks for its rows of every tensor
  (``StateSlice``), then for its columns (row pieces read as column
  shards: the pieces' tiles); bytes read per rank against its slice, and
  all ranks together against the state. With them, the CPU per GiB a save
  spends on block and on tile CRCs. ``--io-only`` runs these alone.
- **Blocked time**: two ranks (storage rendezvous, local disk) each report
  the state four times, waiting for each commit before the next report (a
  step longer than the save); the median time ``report()`` blocks after the
  first (which starts the persist process) against the two ranks copying
  their share at once. Measured twice: ranks as processes (as torchrun
  starts them; each its own interpreter) and ranks as threads of one
  process (which share one GIL for flattening and planning). Two floors:
  ``memcpy_s``, one ``memcpy`` of the share's bytes as one buffer (the
  target's), and ``memcpy_pieces_s``, the same bytes copied as the rank's
  pieces are (one ``numpy.copyto`` per tensor piece, 16 MiB each at 256
  MiB): glibc's ``memcpy`` switches to non-temporal stores only above a
  size it derives from the cache size (about 112 MiB on this box, whose
  virtual CPU reports 300 MiB of L3), so one 128 MiB copy runs about 1.5x
  faster than the same bytes in pieces, whoever copies them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

from benchmarks._common import MiB


def _planning(pieces: int = 10_000) -> dict[str, Any]:
    from checkpoint_store.state._shards import ShardIndex

    rows = 2 * pieces
    entry = {"dtype": "F32", "shape": [rows, 64], "framework": "torch",
             "shards": [{"file": "f", "offsets": [0, 0], "crc32c": "0", "offset": [2 * i, 0],
                         "shape": [2, 64]} for i in range(pieces)]}
    boxes = [([2 * i + 1, 0], [min(rows, 2 * i + 3), 64]) for i in range(pieces)]
    t0 = time.perf_counter()
    index = ShardIndex(entry)
    found = sum(len(index.find(lo, hi)) for lo, hi in boxes)
    planned = time.perf_counter() - t0
    sample = boxes[:1000]
    t0 = time.perf_counter()
    for lo, hi in sample:
        [p for p in entry["shards"]
         if all(p["offset"][d] < hi[d] and lo[d] < p["offset"][d] + p["shape"][d]
                for d in range(2))]
    scan = (time.perf_counter() - t0) * len(boxes) / len(sample)
    return {"pieces": pieces, "boxes": pieces, "overlaps": found, "planned_s": planned,
            "scan_s_estimated": scan}


def _state(mib: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    n = mib * MiB // 4 // 8  # eight tensors
    rows = 1031  # no rank count divides it
    return {"model": {f"layer{i}.weight": torch.randn(rows, n // rows, generator=g)
                      for i in range(8)}, "step": 1}


def _writes_and_reads(work: str, mib: int, ranks: int) -> dict[str, Any]:
    from checkpoint_store.state._placement import write_part
    from checkpoint_store.state._shards import merged_state_file

    state = _state(mib)
    root = os.path.join(work, "sharded")
    parts = [write_part(state, root, r, ranks) for r in range(ranks)]
    raw, _ = merged_state_file(parts)
    with open(os.path.join(root, "state.json"), "wb") as f:
        f.write(raw)
    written = [sum(os.path.getsize(os.path.join(root, n)) for n in os.listdir(root)
                   if n.startswith(f"tensors-rank{r:05d}-")) for r in range(ranks)]
    even = sum(written) / ranks
    reads = {str(m): _reads(root, state, m, cols=False) for m in (2, 3, 8)}
    col_reads = {str(m): _reads(root, state, m, cols=True) for m in (2, 3, 8)}
    # The same state saved by one rank (tensors whole, with their blocks).
    from checkpoint_store.state import write_state

    one = os.path.join(work, "one-rank")
    write_state(state, one)
    one_reads = {str(m): _reads(one, state, m, cols=False) for m in (2, 3, 8)}
    return {"written": written, "max_over_even": max(written) / even, "reads": reads,
            "col_reads": col_reads, "one_rank_reads": one_reads, "crc_cpu": _crc_cpu(state)}


def _reads(root: str, state: dict[str, Any], m: int, *, cols: bool) -> dict[str, Any]:
    """Every rank of ``m`` asks for its rows (``cols``: its columns) of every
    tensor; the bytes ``read_box`` read per rank against its slice, and all
    ranks together against the state."""
    import numpy as np
    import pyarrow.fs as pafs

    from checkpoint_store.state import StateSlice, _read, load_state

    total = sum(t.nbytes for t in state["model"].values())
    per_rank = []
    for r in range(m):
        counted: list[int] = []
        real = _read.read_box

        def counting(*a: Any, _real: Any = real, _c: list[int] = counted, **k: Any) -> int:
            n = _real(*a, **k)
            _c.append(n)
            return n

        _read.read_box = counting
        try:
            into = {}
            slice_bytes = 0
            for key, t in state["model"].items():
                d = 1 if cols else 0
                a, b = t.shape[d] * r // m, t.shape[d] * (r + 1) // m
                shape = (t.shape[0], b - a) if cols else (b - a, t.shape[1])
                dest = np.empty(shape, dtype=np.float32)
                slice_bytes += dest.nbytes
                into[key] = StateSlice(dest, (0, a) if cols else (a, 0))
            load_state(pafs.LocalFileSystem(), root, into={"model": into})
        finally:
            _read.read_box = real
        per_rank.append({"read": sum(counted), "slice": slice_bytes})
    return {"max_ratio": max(p["read"] / p["slice"] for p in per_rank),
            "all_ranks_ratio": sum(p["read"] for p in per_rank) / total}


def _crc_cpu(state: dict[str, Any]) -> dict[str, float]:
    """CPU seconds per GiB a save spends on a piece's block CRCs and on its
    tile CRCs (what ``finish_part`` adds to each piece, on the commit thread)."""
    from checkpoint_store.state._shards import block_crcs
    from checkpoint_store.state._tiles import tile_crcs

    tensors = list(state["model"].values())
    gib = sum(t.nbytes for t in tensors) / (1 << 30)
    t0 = time.process_time()
    for t in tensors:
        block_crcs(t.numpy().tobytes(), t.shape[1] * 4)
    blocks = time.process_time() - t0
    t0 = time.process_time()
    for t in tensors:
        tile_crcs(t.numpy().tobytes(), list(t.shape), 4)
    tiles = time.process_time() - t0
    return {"blocks_s_per_gib": blocks / gib, "tiles_s_per_gib": tiles / gib}


def _pieces(state: dict[str, Any], rank: int) -> list[Any]:
    """The bytes of ``rank``'s pieces of ``state`` on two ranks (uint8 arrays)."""
    import torch

    from checkpoint_store.state._placement import localize

    local, _ = localize(state, rank, 2)
    return [t.reshape(-1).view(torch.uint8).numpy() for t in local["model"].values()]


def _copy_pieces(pieces: list[Any], dst: Any) -> None:
    """Each piece into its place in ``dst`` (as large as the pieces or larger:
    the ranks' shares differ by a row), one copy per piece."""
    import numpy as np

    at = 0
    for p in pieces:
        np.copyto(dst[at:at + p.size], p)
        at += p.size


def _blocked(work: str, mib: int) -> dict[str, Any]:
    import numpy as np

    from checkpoint_store import session

    state = _state(mib)
    share = sum(t.nbytes for t in state["model"].values()) // 2
    # The floor: each of two threads copies its rank's share at the same
    # time (the two ranks below are threads of one process, too).
    pairs = [(np.ones(share, dtype=np.uint8), np.zeros(share, dtype=np.uint8))
             for _ in range(2)]

    def both(copy: Any, args: list[tuple[Any, Any]]) -> None:
        copies = [threading.Thread(target=copy, args=a) for a in args]
        for c in copies:
            c.start()
        for c in copies:
            c.join()

    copies = [(d, s) for s, d in pairs]
    memcpy = min(_timed(lambda a=copies: both(np.copyto, a)) for _ in range(3))
    per_piece = [(_pieces(state, r), np.zeros(share + MiB, dtype=np.uint8)) for r in (0, 1)]
    memcpy_pieces = min(_timed(lambda a=per_piece: both(_copy_pieces, a)) for _ in range(3))
    del pairs, copies, per_piece
    times: dict[int, list[float]] = {0: [], 1: []}
    root = tempfile.mkdtemp(dir=work)

    def rank(r: int) -> None:
        with session.start(storage_path=root, experiment_name="e", trial_name="t",
                           world_rank=r, world_size=2, attempt_id="bench") as s:
            for i in range(4):
                t0 = time.perf_counter()
                s.report({"i": i}, state=state)
                times[r].append(time.perf_counter() - t0)
                s.wait()  # the next step starts after the save, as a long step would

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    blocked = statistics.median(times[0][1:] + times[1][1:])
    return {"memcpy_s": memcpy, "memcpy_pieces_s": memcpy_pieces, "blocked_s": blocked,
            "ratio": blocked / memcpy, "ratio_pieces": blocked / memcpy_pieces}


def _rank_process(r: int, root: str, mib: int, barrier: Any, out: Any) -> None:
    """One rank of :func:`_blocked_processes`: its memcpy floor (both ranks
    copying at once), then four reports, each started with the other rank's."""
    import numpy as np

    from checkpoint_store import session

    state = _state(mib)
    share = sum(t.nbytes for t in state["model"].values()) // 2
    src, dst = np.ones(share, dtype=np.uint8), np.zeros(share, dtype=np.uint8)
    pieces, to = _pieces(state, r), np.zeros(share + MiB, dtype=np.uint8)
    floor, floor_pieces = [], []
    for _ in range(3):
        barrier.wait()
        floor.append(_timed(lambda d=dst, s=src: np.copyto(d, s)))
        barrier.wait()
        floor_pieces.append(_timed(lambda d=to, p=pieces: _copy_pieces(p, d)))
    del src, dst, pieces, to
    times = []
    with session.start(storage_path=root, experiment_name="e", trial_name="t",
                       world_rank=r, world_size=2, attempt_id="bench") as s:
        for i in range(4):
            barrier.wait()
            t0 = time.perf_counter()
            s.report({"i": i}, state=state)
            times.append(time.perf_counter() - t0)
            s.wait()
    out.put((r, min(floor), min(floor_pieces), times))


def _blocked_processes(work: str, mib: int) -> dict[str, Any]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    root = tempfile.mkdtemp(dir=work)
    procs = [ctx.Process(target=_rank_process, args=(r, root, mib, barrier, out))
             for r in (0, 1)]
    for p in procs:
        p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    memcpy = max(f for _, f, _, _ in got)
    memcpy_pieces = max(f for _, _, f, _ in got)
    blocked = statistics.median([t for _, _, _, ts in got for t in ts[1:]])
    return {"memcpy_s": memcpy, "memcpy_pieces_s": memcpy_pieces, "blocked_s": blocked,
            "ratio": blocked / memcpy, "ratio_pieces": blocked / memcpy_pieces}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--io-only", action="store_true",
                    help="only the writes and reads (no planning, no blocked time)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-sharded-")
    try:
        out: dict[str, Any] = {"io": _writes_and_reads(work, args.mib, args.ranks),
                               "mib": args.mib, "ranks": args.ranks}
        if not args.io_only:
            out.update(planning=_planning(), blocked=_blocked(work, args.mib),
                       blocked_processes=_blocked_processes(work, args.mib))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=1))
    io = out["io"]
    if "planning" in out:
        p = out["planning"]
        print(f"| planning {p['pieces']:,} x {p['boxes']:,} | {p['planned_s']:.2f} s "
              f"(a scan per box: {p['scan_s_estimated']:.0f} s) | < 1 s |")
    print(f"| bytes written per rank, {args.ranks} ranks | max {io['max_over_even']:.3f}x "
          "an even share | <= 1.1x |")
    for what, key in (("rows", "reads"), ("columns", "col_reads"),
                      ("rows, saved on one rank", "one_rank_reads")):
        for m, r in io[key].items():
            print(f"| read on {m} ranks, by {what} | max {r['max_ratio']:.3f}x its slice, all "
                  f"{r['all_ranks_ratio']:.3f}x the state | <= 1.1x |")
    c = io["crc_cpu"]
    print(f"| save CPU for tile CRCs | {c['tiles_s_per_gib']:.2f} s/GiB (blocks: "
          f"{c['blocks_s_per_gib']:.2f} s/GiB) | small |")
    if "planning" not in out:
        return
    for what, b in (("processes", out["blocked_processes"]), ("threads", out["blocked"])):
        print(f"| report() blocks, 2 ranks as {what} | {b['blocked_s'] * 1000:.0f} ms, "
              f"{b['ratio']:.2f}x a memcpy of the rank's share ({b['memcpy_s'] * 1000:.1f} ms; "
              f"{b['ratio_pieces']:.2f}x its pieces copied one by one, "
              f"{b['memcpy_pieces_s'] * 1000:.1f} ms) | <= 1.5x |")


if __name__ == "__main__":
    main()
