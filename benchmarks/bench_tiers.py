"""Tiered checkpoints: a fast local tier in front of S3 (moto), against baselines.

Standalone: ``python -m benchmarks.bench_tiers [--quick] [--json FILE]`` prints
one JSON object; ``python -m benchmarks.run --only tiers --merge`` puts it on
docs/benchmarks.md. Every target is a ratio against a baseline measured in
the same run (candidates alternate where they repeat):

* ``blocked``: seconds ``report()`` of a 1 GiB checkpoint (4 x 256 MiB) keeps
  the loop, with ``LocalTier`` on the local disk and the storage_path on S3
  (moto), against ``cp -r`` + ``sync`` of the same files and against a
  synchronous report straight to S3. ``wait()`` after it (the background
  upload) is recorded, not counted.
* ``restore``: a child reports with the local tier, waits until durable and
  is killed with SIGKILL; then the newest checkpoint is restored: from the
  local tier (``session.get_checkpoint()``, which verifies the copy), against
  the verified download from moto on loopback and through a 10 ms RTT,
  1 Gbit/s link (``benchmarks/latency_link.py``), each into a local directory.
* ``steady``: reports every ``1.2 x`` the upload time; the seconds from each
  ``report()`` returning to its checkpoint being durable, against the upload time.
* ``faults``: the same with 20 % transient faults on the durable tier
  (``faulty+s3``, checkpoint_store/testing/faults.py): the longest ``report()``
  against the budget (1.5 x the longest of the same reports without faults,
  measured just before), and every selected checkpoint durable once the
  session's copies are done.
* ``throughput``: a CPU-bound numpy matmul loop with a tiered report every
  few steps, against the same loop without checkpoints; the background copy
  at its default priority (niced: checkpoint_store/_util/background.py) and
  at the loop's (``CHECKPOINT_STORE_UPLOAD_NICE=0``), alternating, with the
  time ``wait()`` then takes to finish the copies.
* ``eviction``: ``num_to_keep=1`` reports of 2,000 small files on local disk
  and in memory: the loop time of ``report()`` with the deletes of evicted
  checkpoints in the background (the session's default) and inline (as
  before), side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

from benchmarks._common import MiB, Shape, machine, make_tree

FULL = Shape("4 x 256 MiB", 4, 256 * MiB)
QUICK = Shape("4 x 16 MiB", 4, 16 * MiB)
STEADY_FULL = Shape("4 x 32 MiB", 4, 32 * MiB)
STEADY_QUICK = Shape("4 x 4 MiB", 4, 4 * MiB)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _cp_sync(src: str, work: str) -> float:
    dst = os.path.join(work, f"cp-{uuid.uuid4().hex[:8]}")
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", src, dst], check=True)
    subprocess.run(["sync"], check=True)
    took = time.perf_counter() - t0
    shutil.rmtree(dst, ignore_errors=True)
    return took


def _storage(uri: str, options: dict[str, Any] | None, trial: str) -> Any:
    from checkpoint_store.storage import StorageContext

    return StorageContext(uri, "bench", trial, storage_options=options)


def _tier(path: str, **kw: Any) -> Any:
    from checkpoint_store import LocalTier

    return LocalTier(path, **kw)


def blocked(src: str, uri: str, options: dict[str, Any], work: str, reps: int) -> dict[str, Any]:
    """report() blocked: cp -r + sync, sync to S3, LocalTier (then wait())."""
    from checkpoint_store import Checkpoint
    from checkpoint_store.session import Session

    res: dict[str, list[float]] = {"cp -r + sync": [], "sync report to S3": [],
                                   "local tier report": [], "local tier wait() after": []}
    for rep in range(reps):
        res["cp -r + sync"].append(_cp_sync(src, work))
        s = Session(_storage(uri, options, f"sync{rep}-{uuid.uuid4().hex[:6]}"))
        t0 = time.perf_counter()
        s.report({"step": rep}, checkpoint=Checkpoint.from_directory(src))
        res["sync report to S3"].append(time.perf_counter() - t0)
        s.close()
        tier_dir = os.path.join(work, f"tier-{uuid.uuid4().hex[:6]}")
        s = Session(_storage(uri, options, f"tier{rep}-{uuid.uuid4().hex[:6]}"),
                    local_tier=_tier(tier_dir, num_to_keep=1))
        t0 = time.perf_counter()
        s.report({"step": rep}, checkpoint=Checkpoint.from_directory(src))
        res["local tier report"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        s.wait()
        res["local tier wait() after"].append(time.perf_counter() - t0)
        s.close()
        shutil.rmtree(tier_dir, ignore_errors=True)
        _log(f"  blocked rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in res.items()))
    out: dict[str, Any] = {k: statistics.median(v) for k, v in res.items()}
    out["times_s"] = res
    out["vs_cp_sync"] = out["local tier report"] / out["cp -r + sync"]
    out["sync_s3_over_tier"] = out["sync report to S3"] / out["local tier report"]
    return out


_CHILD = """
import os, signal, sys
from checkpoint_store import Checkpoint, LocalTier
from checkpoint_store.session import Session
from checkpoint_store.storage import StorageContext
uri, opts, trial, tier, src = sys.argv[1], {opts!r}, sys.argv[2], sys.argv[3], sys.argv[4]
s = Session(StorageContext(uri, "bench", trial, storage_options=opts),
            local_tier=LocalTier(tier, num_to_keep=1))
row = s.report({{"step": 0}}, checkpoint=Checkpoint.from_directory(src))
s.wait(checkpoint=row)
os.kill(os.getpid(), signal.SIGKILL)
"""


def restore(src: str, uri: str, options: dict[str, Any], link_url: str | None, work: str,
            reps: int) -> dict[str, Any]:
    """Restore after kill -9: local tier vs verified download (loopback, link)."""
    from checkpoint_store.session import Session

    res: dict[str, list[float]] = {"local tier": [], "download from moto (loopback)": []}
    if link_url:
        res["download through the link"] = []
    for rep in range(reps):
        trial = f"restore{rep}-{uuid.uuid4().hex[:6]}"
        tier_dir = os.path.join(work, f"tier-{trial}")
        code = subprocess.run([sys.executable, "-c", _CHILD.format(opts=options), uri, trial,
                               tier_dir, src]).returncode
        if code != -signal.SIGKILL:
            raise RuntimeError(f"the restore child exited with {code}, not by SIGKILL")
        t0 = time.perf_counter()
        s = Session(_storage(uri, options, trial), local_tier=_tier(tier_dir, num_to_keep=1))
        ckpt = s.get_checkpoint()
        assert ckpt is not None and ckpt.path.startswith(tier_dir), ckpt
        res["local tier"].append(time.perf_counter() - t0)
        s.close()
        ends = [("download from moto (loopback)", options)]
        if link_url:
            ends.append(("download through the link", {**options, "endpoint_url": link_url}))
        for name, opts in ends:
            dest = os.path.join(work, f"restore-{uuid.uuid4().hex[:6]}")
            t0 = time.perf_counter()
            s = Session(_storage(uri, opts, trial))
            ckpt = s.get_checkpoint()
            assert ckpt is not None
            ckpt.to_directory(dest)  # the download verifies sizes and CRC32C
            res[name].append(time.perf_counter() - t0)
            s.close()
            shutil.rmtree(dest, ignore_errors=True)
        shutil.rmtree(tier_dir, ignore_errors=True)
        _log(f"  restore rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in res.items()))
    out: dict[str, Any] = {k: statistics.median(v) for k, v in res.items()}
    out["times_s"] = res
    out["loopback_over_tier"] = out["download from moto (loopback)"] / out["local tier"]
    if link_url:
        out["link_over_tier"] = out["download through the link"] / out["local tier"]
    return out


def _durable_times(s: Any, n: int, interval: float, src: str, step0: int = 0
                   ) -> tuple[list[float], list[float], list[int]]:
    """``n`` reports ``interval`` s apart: (blocked s, report-return-to-durable s, indexes)."""
    from checkpoint_store import Checkpoint

    returned: dict[int, float] = {}
    durable_at: dict[int, float] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            idx = s.durable_index
            now = time.perf_counter()
            if idx is not None:
                for i in returned:
                    if i <= idx and i not in durable_at:
                        durable_at[i] = now
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    blocked_s, indexes = [], []
    try:
        for k in range(n):
            t0 = time.perf_counter()
            row = s.report({"step": step0 + k}, checkpoint=Checkpoint.from_directory(src))
            t1 = time.perf_counter()
            index = int(row["checkpoint_dir_name"].rsplit("_", 1)[-1])
            returned[index] = t1
            blocked_s.append(t1 - t0)
            indexes.append(index)
            time.sleep(max(0.0, interval - (time.perf_counter() - t0)))
        s.wait()
        time.sleep(0.05)
    finally:
        stop.set()
        watcher.join()
    lat = [durable_at.get(i, float("nan")) - returned[i] for i in indexes]
    return blocked_s, lat, indexes


def steady(src: str, uri: str, options: dict[str, Any], work: str, n: int) -> dict[str, Any]:
    """Reports every 1.2 x the upload time: report return -> durable, vs the upload time."""
    from checkpoint_store import Checkpoint
    from checkpoint_store.session import Session

    tier_dir = os.path.join(work, f"tier-steady-{uuid.uuid4().hex[:6]}")
    # The upload time: one synchronous report straight to S3, twice (median).
    ups = []
    for _ in range(2):
        s = Session(_storage(uri, options, f"up-{uuid.uuid4().hex[:6]}"))
        t0 = time.perf_counter()
        s.report({"step": 0}, checkpoint=Checkpoint.from_directory(src))
        ups.append(time.perf_counter() - t0)
        s.close()
    upload = statistics.median(ups)
    interval = max(1.2 * upload, 0.2)
    s = Session(_storage(uri, options, f"steady-{uuid.uuid4().hex[:6]}"),
                local_tier=_tier(tier_dir, num_to_keep=2))
    try:
        blocked_s, lat, _ = _durable_times(s, n, interval, src)
    finally:
        s.close()
        shutil.rmtree(tier_dir, ignore_errors=True)
    _log(f"  steady: upload {upload:.2f} s, interval {interval:.2f} s, durable after "
         + ", ".join(f"{x:.2f}" for x in lat))
    return {"upload_s": upload, "interval_s": interval, "durable_after_s": lat,
            "blocked_s": blocked_s, "worst_over_upload": max(lat) / upload}


def faults(src: str, uri: str, options: dict[str, Any], work: str, n: int) -> dict[str, Any]:
    """20 % transient faults on the durable tier: the longest report() against the
    budget (1.5 x the longest of the same reports without faults, measured first);
    every selected checkpoint durable once the copies are done."""
    from checkpoint_store.registry import register_backend
    from checkpoint_store.session import Session

    base_dir = os.path.join(work, f"tier-nofaults-{uuid.uuid4().hex[:6]}")
    s = Session(_storage(uri, options, f"nofaults-{uuid.uuid4().hex[:6]}"),
                local_tier=_tier(base_dir, num_to_keep=2))
    try:
        clean_blocked, _, _ = _durable_times(s, n, 0.5, src)
    finally:
        s.close()
        shutil.rmtree(base_dir, ignore_errors=True)
    budget_s = 1.5 * max(clean_blocked)

    register_backend("faulty+s3", "checkpoint_store.testing.faults:faulty_scheme_backend")
    tier_dir = os.path.join(work, f"tier-faults-{uuid.uuid4().hex[:6]}")
    trial = f"faults-{uuid.uuid4().hex[:6]}"
    faulty = {**options, "fault_transient_rate": 0.2, "fault_seed": 7}
    from checkpoint_store import LocalTier

    s = Session(_storage("faulty+" + uri, faulty, trial),
                local_tier=LocalTier(tier_dir, num_to_keep=2, persist_timeout_s=300))
    t0 = time.perf_counter()
    try:
        blocked_s, lat, indexes = _durable_times(s, n, 0.5, src)
        injected = dict(s.storage.backend.filesystem.handler.injected) if hasattr(
            s.storage.backend.filesystem, "handler") else {}
    finally:
        s.close()
        shutil.rmtree(tier_dir, ignore_errors=True)
    took = time.perf_counter() - t0
    clean = _storage(uri, options, trial)
    committed = {int(m["index"]) for _, m in clean.committed_checkpoints()}
    missing = [i for i in indexes if i not in committed]
    _log(f"  faults: blocked max {max(blocked_s):.2f} s (budget {budget_s:.2f} s), durable "
         f"{len(indexes) - len(missing)}/{len(indexes)} in {took:.1f} s, injected {injected}")
    return {"reports": len(indexes), "durable": len(indexes) - len(missing),
            "missing": missing, "blocked_max_s": max(blocked_s), "budget_s": budget_s,
            "blocked_s": blocked_s, "blocked_without_faults_s": clean_blocked,
            "durable_after_s": lat, "injected": injected, "seconds": took}


TIERED = "local tier + background S3"
TIERED_UNNICED = "local tier + background S3, copy not niced"
UPLOAD_NICE = "CHECKPOINT_STORE_UPLOAD_NICE"


def throughput(src: str, uri: str, options: dict[str, Any], work: str, interval_s: float,
               reports: int) -> dict[str, Any]:
    """numpy matmul steps/s with a tiered report every ``interval_s`` seconds of
    steps (``reports`` of them) vs the same steps without checkpoints."""
    import numpy as np

    from checkpoint_store import Checkpoint
    from checkpoint_store.session import Session

    rng = np.random.default_rng(0)
    a = rng.random((384, 384))

    def loop(s: Any) -> float:
        x = a
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            x = np.tanh(x @ a)
            if s is not None and i % every == 0:
                s.report({"step": i}, checkpoint=Checkpoint.from_directory(src))
        return steps / (time.perf_counter() - t0)

    steps, every = 200, 0
    t0 = time.perf_counter()
    for _ in range(steps):
        np.tanh(a @ a)
    every = max(1, int(steps / (time.perf_counter() - t0) * interval_s))
    steps = every * reports
    rates: dict[str, list[float]] = {"no checkpoints": [], TIERED: [], TIERED_UNNICED: []}
    for _ in range(2):
        rates["no checkpoints"].append(loop(None))
        for name in (TIERED, TIERED_UNNICED):
            # The background copy's priority (checkpoint_store/_util/background.py)
            # is read when the session's copy thread starts.
            before = os.environ.get(UPLOAD_NICE)
            if name == TIERED_UNNICED:
                os.environ[UPLOAD_NICE] = "0"
            tier_dir = os.path.join(work, f"tier-tp-{uuid.uuid4().hex[:6]}")
            s = Session(_storage(uri, options, f"tp-{uuid.uuid4().hex[:6]}"),
                        local_tier=_tier(tier_dir, num_to_keep=2))
            try:
                rates[name].append(loop(s))
                t0 = time.perf_counter()
                s.wait()
                rates.setdefault(f"{name}: wait() after the loop, s", []).append(
                    time.perf_counter() - t0)
            finally:
                s.close()
                shutil.rmtree(tier_dir, ignore_errors=True)
                if before is None:
                    os.environ.pop(UPLOAD_NICE, None)
                else:
                    os.environ[UPLOAD_NICE] = before
    out: dict[str, Any] = {k: statistics.median(v) for k, v in rates.items()}
    out["rates"] = rates
    out["ratio"] = out[TIERED] / out["no checkpoints"]
    out["ratio_unniced"] = out[TIERED_UNNICED] / out["no checkpoints"]
    out["steps"], out["report_every"] = steps, every
    _log(f"  throughput: {out}")
    return out


def eviction(work: str, files: int, reps: int) -> dict[str, Any]:
    """num_to_keep=1 reports of ``files`` small files: report() seconds with background
    deletes (the session's) and inline deletes (before), local disk and memory."""
    from checkpoint_store import Checkpoint, CheckpointConfig
    from checkpoint_store.session import Session

    src = os.path.join(work, "evict-src")
    for i in range(files):
        sub = os.path.join(src, f"d{i // 500}")
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, f"f{i}.bin"), "wb") as f:
            f.write(os.urandom(512))
    out: dict[str, Any] = {"files": files}
    for where in ("local", "memory"):
        cells: dict[str, list[float]] = {"background": [], "inline": []}
        for _ in range(2):
            for mode in ("background", "inline"):
                root = (os.path.join(work, f"ev-{uuid.uuid4().hex[:6]}") if where == "local"
                        else f"memory://ev-{uuid.uuid4().hex[:8]}")
                st = _storage(root, None, "t")
                s = Session(st, CheckpointConfig(num_to_keep=1))
                if mode == "inline":
                    s.manager._deleter = None  # the deletes inside register(), as before
                try:
                    s.report({"step": 0}, checkpoint=Checkpoint.from_directory(src))
                    for k in range(reps):
                        t0 = time.perf_counter()
                        s.report({"step": k + 1}, checkpoint=Checkpoint.from_directory(src))
                        cells[mode].append(time.perf_counter() - t0)
                        # The loop trains meanwhile (GIL released, as a GPU step does).
                        time.sleep(0.5)
                    s.wait()
                finally:
                    s.close()
                    try:
                        st.filesystem.delete_dir(st.storage_path)
                    except Exception:
                        pass
        row: dict[str, Any] = {k: statistics.median(v) for k, v in cells.items()}
        row["times_s"] = cells
        row["saved_s"] = row["inline"] - row["background"]
        out[where] = row
        _log(f"  eviction {where}: inline {row['inline']:.3f} s, background "
             f"{row['background']:.3f} s per report")
    shutil.rmtree(src, ignore_errors=True)
    return out


def main(argv: list[str] | None = None, s3: Any = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1/16 of the bytes, fewer reports")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--parts", default="blocked,restore,steady,faults,throughput,eviction")
    ap.add_argument("--link-rtt-ms", type=float, default=10.0)
    ap.add_argument("--link-mbit", type=float, default=1000.0)
    ap.add_argument("--store-nice", type=int, default=0, metavar="N",
                    help="run the S3 server this bench starts at nice N: stands for a "
                         "store on other machines, whose CPU is not the loop's")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--merge-into", default=None, metavar="JSON",
                    help="replace the parts run here in the tiers section of this "
                         "benchmarks JSON (docs/benchmarks.json) and render its page "
                         "(the .md beside it)")
    args = ap.parse_args(argv)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    parts = set(args.parts.split(","))
    quick = args.quick
    reps = args.reps or (1 if quick else 2)
    shape = QUICK if quick else FULL
    steady_shape = STEADY_QUICK if quick else STEADY_FULL
    data_root = os.path.join(tempfile.gettempdir(), "cs-bench-data")
    os.makedirs(data_root, exist_ok=True)
    src = make_tree(os.path.join(data_root, shape.name.replace(" ", "")), shape)
    steady_src = make_tree(os.path.join(data_root, steady_shape.name.replace(" ", "")),
                           steady_shape)
    work = tempfile.mkdtemp(prefix="cs-bench-tiers-")
    own = s3 is None
    if own:
        from checkpoint_store.testing.servers import S3Server

        s3 = S3Server.start()
        if args.store_nice and s3.process is not None:
            # Threads moto starts later (one per request) inherit it.
            os.setpriority(os.PRIO_PROCESS, s3.process.pid, args.store_nice)
    from benchmarks.latency_link import Link

    res: dict[str, Any] = {"machine": machine(), "quick": quick, "reps": reps,
                           "shape": shape.name, "steady_shape": steady_shape.name,
                           "storage": "S3 (moto on 127.0.0.1)", "errors": {},
                           "store_nice": args.store_nice if own else None,
                           "link": f"{args.link_rtt_ms:g} ms RTT, {args.link_mbit:g} Mbit/s"}
    t_start = time.time()

    def guarded(name: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:
            import traceback

            traceback.print_exc()
            res["errors"][name] = f"{type(exc).__name__}: {exc}"
            return None

    try:
        uri = f"s3://{s3.create_bucket()}/runs"
        opts = s3.storage_options()
        if "blocked" in parts:
            res["blocked"] = guarded("blocked", lambda: blocked(src, uri, opts, work, reps))
        if "restore" in parts:
            link = Link(s3.endpoint_url, rtt_ms=args.link_rtt_ms, mbit=args.link_mbit)
            try:
                res["restore"] = guarded("restore", lambda: restore(
                    src, uri, opts, link.url, work, reps))
            finally:
                link.stop()
        if "steady" in parts:
            res["steady"] = guarded("steady", lambda: steady(steady_src, uri, opts, work,
                                                             3 if quick else 5))
        if "faults" in parts:
            res["faults"] = guarded("faults", lambda: faults(steady_src, uri, opts, work,
                                                             4 if quick else 8))
        if "throughput" in parts:
            # A report interval at least the upload time, as in the steady state.
            up = (res.get("steady") or {}).get("interval_s") or 1.0
            res["throughput"] = guarded("throughput", lambda: throughput(
                steady_src, uri, opts, work, up, 3 if quick else 5))
        if "eviction" in parts:
            res["eviction"] = guarded("eviction", lambda: eviction(
                work, 2000, 2 if quick else 4))
    finally:
        if own:
            s3.stop()
        shutil.rmtree(work, ignore_errors=True)
    res["wall_s"] = time.time() - t_start
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
    if args.merge_into:
        merge_into(args.merge_into, res, parts)
    return res


def merge_into(path: str, res: dict[str, Any], parts: set[str]) -> None:
    """Put the parts of ``res`` into ``path``'s tiers section and render the page."""
    from benchmarks.report_md import render

    with open(path) as f:
        page = json.load(f)
    tiers = page.setdefault("tiers", {})
    for key in ("machine", "quick", "reps", "shape", "steady_shape", "storage", "link"):
        tiers.setdefault(key, res[key])
    for part in parts:
        if part in res:
            tiers[part] = res[part]
    tiers.setdefault("errors", {}).update(res["errors"])
    load = res["machine"].get("load_avg_at_start", "?")
    tiers.setdefault("notes", []).append(
        f"{', '.join(sorted(parts))} re-measured in a later run (load average at its start "
        f"{load}).")
    with open(path, "w") as f:
        json.dump(page, f, indent=1, sort_keys=True)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(render(page))


if __name__ == "__main__":
    print(json.dumps(main(), indent=1, sort_keys=True))
