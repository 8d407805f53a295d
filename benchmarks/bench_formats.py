"""Export and import throughput against the storage's read bandwidth, and
peak memory of an export (issue 44's targets).

Standalone: ``python -m benchmarks.bench_formats [--quick] [--reps 3]``
prints one JSON object (the rows below).

Every ratio is measured in this one run, candidates alternating per
repetition, on the same files:

* ``read``: the storage's read bandwidth: every byte of the source state's
  shards read front to back in pieces of ``CHUNK_BYTES`` through the same
  filesystem (one stream, as an export reads).
* ``write``: the storage's write bandwidth: as many bytes written in pieces
  of ``CHUNK_BYTES`` through one output stream (an export also writes each
  byte once: where the storage writes slower than it reads, that bounds it).
* ``write, fsynced`` (local disk): the same, then fsynced: the disk's own
  write bandwidth, the floor of an export whose files are made durable
  (a DCP directory: DCP's ``sync_files``).
* ``read while writing, fsynced`` (local disk): ``read`` and ``write,
  fsynced`` at once, on two threads: what the disk gives an export that
  reads a checkpoint and writes it durably (the bound of a DCP export).
* ``export hf``: ``export_checkpoint(state -> Hugging Face folder)`` on the
  same storage (read, CRC32C check, write).
* ``export torch_save``, ``export dcp``: the same state to one ``torch.save``
  file, to a DCP directory (on S3: written to a local temporary directory,
  then uploaded: torch writes local files).
* ``import hf in place``: ``import_checkpoint(folder)`` of that folder where
  it is (each file read once for its checksums, no copy).
* ``import hf copy``: ``import_checkpoint(folder, elsewhere on the same storage)``.

Each row: bytes of tensor data / median seconds, and its ratio to ``read``.
Storage: the local disk (before each candidate dirty pages are written back
and the files dropped from the page cache: every candidate reads from the
disk) and S3 on a moto server on 127.0.0.1.

Memory: in a subprocess, a state of ``--rss-gib`` GiB whose largest tensor
is 64 MiB is exported to a local Hugging Face folder, a ``torch.save`` file
and a DCP directory, and the folder imported, while VmRSS is sampled
every 2 ms; the growth over the value after imports, against the bound
``2 x largest + 64 MiB``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

from benchmarks._common import GiB, MiB


def _make_state(root: str, total: int, largest: int) -> dict[str, Any]:
    """Write a state of ``total`` bytes (tensors of ``largest`` bytes and a
    few small ones) into ``root``; returns its tensor index."""
    import torch

    from checkpoint_store.state import write_state

    n = max(1, total // largest)
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(largest // 4, generator=g) for i in range(n)}
    model.update({f"layers.{i}.bias": torch.randn(1024, generator=g) for i in range(n)})
    return write_state({"model": model, "step": 1}, root, shard_bytes=1 << 30)


def _read_all(fs: Any, files: list[str]) -> int:
    from checkpoint_store.formats import CHUNK_BYTES

    n = 0
    for path in files:
        with fs.open_input_file(path) as f:
            size = f.size()
            at = 0
            while at < size:
                piece = f.read_at(min(CHUNK_BYTES, size - at), at)
                at += len(piece)
        n += size
    return n


def _evict(kind: str, *roots: str) -> None:
    """Local disk: write back dirty pages, then drop every file under
    ``roots`` from the page cache, so each candidate reads from the disk
    (the storage's own bandwidth), none from memory another one warmed."""
    if kind != "local":
        return
    os.sync()
    for root in roots:
        for dirpath, _dirs, names in os.walk(root):
            for name in names:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _write_all(fs: Any, path: str, nbytes: int) -> None:
    """``nbytes`` written to ``path`` in pieces of ``CHUNK_BYTES``, one stream."""
    from checkpoint_store.formats import CHUNK_BYTES

    piece = os.urandom(CHUNK_BYTES)
    with fs.open_output_stream(path) as out:
        left = nbytes
        while left > 0:
            out.write(piece[:min(left, CHUNK_BYTES)])
            left -= CHUNK_BYTES


def _write_synced(path: str, nbytes: int) -> None:
    """``nbytes`` written to local ``path`` as :func:`_write_all` does, then
    fsynced: the disk's own write bandwidth, what a writer that makes its
    files durable (DCP's ``sync_files``) cannot beat."""
    from checkpoint_store.formats import CHUNK_BYTES

    piece = os.urandom(CHUNK_BYTES)
    with open(path, "wb") as out:
        left = nbytes
        while left > 0:
            out.write(piece[:min(left, CHUNK_BYTES)])
            left -= CHUNK_BYTES
        out.flush()
        os.fsync(out.fileno())


def _place(kind: str, server: Any) -> tuple[str, dict[str, Any]]:
    if kind == "local":
        return tempfile.mkdtemp(prefix="bench-formats-"), {}
    opts = dict(server.storage_options("pyarrow"))
    return f"s3://{server.bench_bucket}/{uuid.uuid4().hex[:8]}", opts


def _throughput(kind: str, total: int, largest: int, reps: int, server: Any) -> dict[str, Any]:
    from checkpoint_store import Checkpoint, StorageContext
    from checkpoint_store.formats import export_checkpoint, import_checkpoint
    from checkpoint_store.registry import resolve

    root, opts = _place(kind, server)
    src = tempfile.mkdtemp(prefix="bench-formats-src-")
    try:
        tensors = _make_state(src, total, largest)
        nbytes = sum(e["offsets"][1] - e["offsets"][0] for e in tensors.values())
        ctx = StorageContext(root, "exp", "t", storage_options=opts or None, fsync=False)
        ck = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {"tensors": tensors})
        backend, ck_path = resolve(ck.uri, storage_options=opts or None)
        shards = sorted({e["file"] for e in tensors.values()})
        files = [f"{ck_path}/{s}" for s in shards]
        names = ["read", "write", "export hf", "export torch_save", "export dcp",
                 "import hf in place", "import hf copy"]
        held: dict[str, Any] = {}
        if kind == "local":
            # The formats' own writers with the tensors already in memory: what
            # torch.save and dcp.save (with the export's writer settings) cost
            # without any read, the floor of an export to that format here.
            names += [WRITE_SYNCED, READ_AND_SYNCED, BASE_TORCH, BASE_DCP]
            held = {k: v.clone() for k, v in ck.load_state()["model"].items()}
        times: dict[str, list[float]] = {k: [] for k in names}
        for rep in range(reps):
            hf = f"{root.rstrip('/')}/hf-{rep}"
            order = list(times)
            order = order[rep % len(order):] + order[:rep % len(order)]
            for name in order:
                if name == "import hf in place":
                    _ensure_export(ck, f"{hf}-p", opts)
                elif name == "import hf copy":
                    _ensure_export(ck, f"{hf}-c", opts)
                _evict(kind, root)
                if name == "read":
                    t0 = time.perf_counter()
                    _read_all(backend.filesystem, files)
                elif name == "write":
                    t0 = time.perf_counter()
                    _write_all(backend.filesystem, f"{ck_path}-w{rep}", nbytes)
                elif name == "export hf":
                    t0 = time.perf_counter()
                    export_checkpoint(ck, f"{hf}-x", max_shard_size=GiB,
                                      target_storage_options=opts or None)
                    times[name].append(time.perf_counter() - t0)
                    continue
                elif name in ("export torch_save", "export dcp"):
                    fmt = name.split()[1]
                    target = f"{root.rstrip('/')}/{fmt}-{rep}" + (".pt" if fmt == "torch_save"
                                                                   else "")
                    t0 = time.perf_counter()
                    export_checkpoint(ck, target, format=fmt,  # type: ignore[arg-type]
                                      target_storage_options=opts or None)
                elif name == WRITE_SYNCED:
                    t0 = time.perf_counter()
                    _write_synced(f"{root}/synced-{rep}", nbytes)
                elif name == READ_AND_SYNCED:
                    import threading

                    t0 = time.perf_counter()
                    reader = threading.Thread(target=_read_all, args=(backend.filesystem, files))
                    reader.start()
                    _write_synced(f"{root}/both-{rep}", nbytes)
                    reader.join()
                elif name == BASE_TORCH:
                    import torch

                    t0 = time.perf_counter()
                    torch.save(held, f"{root}/held-{rep}.pt")
                elif name == BASE_DCP:
                    import torch.distributed.checkpoint as dcp

                    t0 = time.perf_counter()
                    dcp.save(held, storage_writer=dcp.FileSystemWriter(
                        f"{root}/held-dcp-{rep}", single_file_per_rank=False, thread_count=1),
                        no_dist=True)
                elif name == "import hf in place":
                    t0 = time.perf_counter()
                    import_checkpoint(f"{hf}-p", storage_options=opts or None)
                else:
                    t0 = time.perf_counter()
                    import_checkpoint(f"{hf}-c", f"{root.rstrip('/')}/copy-{rep}",
                                      storage_options=opts or None,
                                      dest_storage_options=opts or None)
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        read_bw = nbytes / med["read"]
        return {"storage": kind, "bytes": nbytes, "largest": largest, "reps": reps,
                "rows": {k: {"s": round(med[k], 3), "MiB/s": round(nbytes / med[k] / MiB, 1),
                             "ratio_to_read": round(nbytes / med[k] / read_bw, 3)}
                         for k in med}}
    finally:
        shutil.rmtree(src, ignore_errors=True)
        if kind == "local":
            shutil.rmtree(root, ignore_errors=True)


def _ensure_export(ck: Any, target: str, opts: dict[str, Any]) -> None:
    from checkpoint_store.formats import export_checkpoint

    export_checkpoint(ck, target, max_shard_size=GiB, target_storage_options=opts or None)


# -- memory ---------------------------------------------------------------------------

_CHILD = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
import torch  # imported before the baseline: the bound is on what the export adds
import torch.distributed.checkpoint  # (imported lazily by a DCP export: ~90 MiB)
from checkpoint_store import Checkpoint
from checkpoint_store.formats import export_checkpoint, import_checkpoint
from benchmarks._common import rss_bytes as _rss
src, out, largest = sys.argv[2], sys.argv[3], int(sys.argv[4])
peak = [0]; stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], _rss()); time.sleep(0.002)
res = {}
for name, fn in (("export hf", lambda: export_checkpoint(Checkpoint(src), out + "/hf",
                                                          max_shard_size=1 << 30)),
                 ("export torch_save", lambda: export_checkpoint(
                     Checkpoint(src), out + "/x.pt", format="torch_save")),
                 ("export dcp", lambda: export_checkpoint(Checkpoint(src), out + "/dcp",
                                                          format="dcp")),
                 ("import hf in place", lambda: import_checkpoint(out + "/hf")),
                 ("import hf copy", lambda: import_checkpoint(out + "/hf", out + "/copy",
                                                              source_format="hf"))):
    base = _rss(); peak[0] = base; stop.clear()
    t = threading.Thread(target=sample, daemon=True); t.start()
    t0 = time.perf_counter(); fn(); dt = time.perf_counter() - t0
    stop.set(); t.join()
    res[name] = {"growth_MiB": round((peak[0] - base) / 2**20, 1), "s": round(dt, 2)}
print(json.dumps(res))
"""


def _memory(total: int, largest: int) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="bench-formats-rss-")
    try:
        src = os.path.join(root, "state")
        _make_state(src, total, largest)
        out = os.path.join(root, "out")
        os.makedirs(out)
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        proc = subprocess.run([sys.executable, "-c", _CHILD, repo, src, out, str(largest)],
                              capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "PYTHONPATH": repo})
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
        bound = (2 * largest + 64 * MiB) / MiB
        return {"bytes": total, "largest": largest, "bound_MiB": bound,
                "rows": {k: {**v, "within": v["growth_MiB"] <= bound} for k, v in rows.items()}}
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- the results page (benchmarks/run.py --only formats; benchmarks/report_md.py) ------

#: Issue 44's throughput target, as a ratio to the storage's read bandwidth.
TARGET_RATIO = 0.8
#: Baseline rows (local disk): the format's own writer from tensors in memory.
BASE_TORCH = "torch.save, tensors in memory"
BASE_DCP = "dcp.save, tensors in memory"
#: Baseline row (local disk): the disk's write bandwidth with an fsync.
WRITE_SYNCED = "write, fsynced"
#: Baseline row (local disk): the read and the fsynced write at once, as
#: an export that makes its files durable must do both on one disk.
READ_AND_SYNCED = "read while writing, fsynced"

#: What limits a target when it is missed (matched by substring of the target).
WHY = [
    ("× read, local", "CPU-bound on this machine: every byte is read, checked against its "
     "CRC32C, copied into the writer's buffer and written (an HF export also takes the new "
     "file's CRC32C), on 2 cores shared with other jobs; the `read` row is one stream of "
     "plain reads with no checksum and no copy. The measured column gives the storage's "
     "own write bandwidth of the same run beside it."),
    ("× read, s3", "bounded by moto: one Python process on the same 2 cores serves every "
     "request, so an export or a copied import makes it both serve each byte and take it "
     "again (at 1 GiB moto's own read and write bandwidths are the `read` and `write` rows "
     "of the same run; a copy through it that moved one byte per byte it serves would run at "
     "write / (read + write) of the read row). A `torch.save` or DCP export is also written "
     "to a local temporary directory first and then uploaded (torch writes local files): "
     "two passes. An import in place writes no tensor byte."),
    ("export dcp ≥", "the disk: a DCP directory's files are made durable before its "
     "`.metadata` names them (DCP's `sync_files`, on by default), so the export reads the "
     "checkpoint and writes it durably on one disk, and cannot beat the `read while "
     "writing, fsynced` row of the same run (both at once, nothing else), which on this disk "
     "is below the 0.8× read the target asks. The export writes each tensor's file itself, "
     "the `torch.save` archive of that tensor DCP's reader expects (DCP's metadata is still "
     "DCP's: its planner and `finish`), from two reused buffers with the next tensor read "
     "on a second thread and each file fsynced on a third. `dcp.save, tensors in memory` "
     "is DCP's own writer with the same settings (one `.distcp` per tensor, each fsynced "
     "before the next is written, each tensor pickled through a Python stream) and reads "
     "nothing."),
    ("export torch_save ≥", "`torch.save` itself (`PyTorchFileWriter`, which also takes a "
     "CRC-32 of every record) is the `torch.save, tensors in memory` row, with nothing to "
     "read; the export reads each tensor from disk, checks it and copies it into one of two "
     "reused buffers on a second thread while the previous one is written."),
]


def render(res: dict[str, Any]) -> str:
    """The "Export and import (formats)" section of docs/benchmarks.md."""
    out = ["## Export and import (formats)\n",
           "From `benchmarks/bench_formats.py`: each row's bytes of tensor data / median "
           "seconds, and its ratio to the storage's read bandwidth measured in the same "
           "run (candidates alternating; local files dropped from the page cache before "
           "each).\n"]
    for t in res.get("throughput") or []:
        out.append(f"**{t['storage']}**, {t['bytes'] / MiB:.0f} MiB, largest tensor "
                   f"{t['largest'] / MiB:.0f} MiB, {t['reps']} repetitions:\n")
        out.append("| candidate | median | MiB/s | × read |")
        out.append("|---|---|---|---|")
        for name, r in t["rows"].items():
            out.append(f"| {name} | {r['s']:.2f} s | {r['MiB/s']:.0f} | "
                       f"{r['ratio_to_read']:.2f} |")
        out.append("")
    mem = res.get("memory")
    if mem:
        out.append(f"Peak RSS growth in a fresh process, a {mem['bytes'] / MiB:.0f} MiB "
                   f"state whose largest tensor is {mem['largest'] / MiB:.0f} MiB (bound "
                   f"2 × largest + 64 MiB = {mem['bound_MiB']:.0f} MiB):\n")
        out.append("| candidate | growth | time | within |")
        out.append("|---|---|---|---|")
        for name, r in mem["rows"].items():
            out.append(f"| {name} | {r['growth_MiB']:.0f} MiB | {r['s']:.1f} s | "
                       f"{'yes' if r['within'] else '**no**'} |")
        out.append("")
    return "\n".join(out) + "\n"


def targets(res: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows for the Targets table: (target, measured, met). A missed
    throughput row names the storage's write / read ratio of the same run."""
    rows: list[tuple[str, str, str]] = []
    for t in res.get("throughput") or []:
        write = t["rows"].get("write", {}).get("ratio_to_read")
        base = {"export torch_save": t["rows"].get(BASE_TORCH),
                "export dcp": t["rows"].get(BASE_DCP)}
        for name, r in t["rows"].items():
            if name in ("read", "write", WRITE_SYNCED, READ_AND_SYNCED, BASE_TORCH, BASE_DCP):
                continue
            ok = r["ratio_to_read"] >= TARGET_RATIO
            measured = f"{r['ratio_to_read']:.2f}× ({r['MiB/s']:.0f} MiB/s)"
            if not ok and write is not None and name != "import hf in place":  # writes none
                measured += f"; write itself {write:.2f}× read"
            synced = t["rows"].get(WRITE_SYNCED)
            both = t["rows"].get(READ_AND_SYNCED)
            if not ok and name == "export dcp" and synced is not None:
                measured += f"; fsynced write itself {synced['ratio_to_read']:.2f}× read"
                if both is not None:
                    measured += (f", read and fsynced write at once "
                                 f"{both['ratio_to_read']:.2f}×")
            floor = base.get(name)
            if floor is not None:
                measured += (f"; {name.split()[1].replace('_', '.')} itself from memory "
                             f"{floor['ratio_to_read']:.2f}× read, the export at "
                             f"{floor['s'] / r['s']:.2f}× its speed")
            rows.append((f"formats: {name} ≥ {TARGET_RATIO}× read, {t['storage']} "
                         f"({t['bytes'] / MiB:.0f} MiB)", measured, "yes" if ok else "**no**"))
    mem = res.get("memory") or {}
    for name, r in (mem.get("rows") or {}).items():
        rows.append((f"formats: {name} peak RSS ≤ 2 × largest + 64 MiB "
                     f"({mem['bytes'] / MiB:.0f} MiB state)",
                     f"{r['growth_MiB']:.0f} MiB vs {mem['bound_MiB']:.0f} MiB",
                     "yes" if r["within"] else "**no**"))
    return rows


def main(argv: list[str] | None = None, log: Any = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="64 MiB instead of 1 GiB; RSS at 256 MiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--s3-gib", type=float, default=None,
                   help="bytes for the S3 rows (default: as local)")
    p.add_argument("--rss-gib", type=float, default=None, help="state size of the RSS row")
    p.add_argument("--skip-s3", action="store_true")
    args = p.parse_args(argv)
    total = 64 * MiB if args.quick else GiB
    largest = 16 * MiB if args.quick else 64 * MiB
    out: dict[str, Any] = {"throughput": [], "memory": None}
    out["throughput"].append(_throughput("local", total, largest, args.reps, None))
    if not args.skip_s3:
        from checkpoint_store.testing.servers import S3Server

        with S3Server.start() as server:
            server.bench_bucket = "bench-formats"
            server.create_bucket(server.bench_bucket)
            s3_total = int(args.s3_gib * GiB) if args.s3_gib else total
            out["throughput"].append(_throughput("s3", s3_total, largest, args.reps, server))
    rss = int(args.rss_gib * GiB) if args.rss_gib else (256 * MiB if args.quick else 2 * GiB)
    if log:
        log(f"formats throughput: {json.dumps(out['throughput'])}")
    out["memory"] = _memory(rss, 64 * MiB)
    if log:
        log(f"formats memory: {json.dumps(out['memory'])}")
    else:
        print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
