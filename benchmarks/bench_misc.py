"""report() overhead (ours vs Ray Tune's function trainable), async blocked
time, peak RSS during 1 GiB transfers, import time, retention at scale."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import pyarrow.fs as pafs

from benchmarks._common import _hwm_growth, _hwm_reset, _status_kib, run_json_subprocess

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -- report() overhead -------------------------------------------------------------


def ours_report(n_metrics: int, n_ckpt: int) -> dict[str, Any]:
    """Median seconds per ``report()`` on a local trial: metrics only, then
    with a 1 KiB checkpoint (committed synchronously, fsync on)."""
    from checkpoint_store import Checkpoint, session

    with tempfile.TemporaryDirectory() as d:
        with session.start(storage_path=os.path.join(d, "runs"), experiment_name="e",
                           trial_name="t") as s:
            for i in range(50):  # warm-up
                s.report({"loss": float(i)})
            times = []
            for i in range(n_metrics):
                t0 = time.perf_counter()
                s.report({"loss": float(i), "step": i})
                times.append(time.perf_counter() - t0)
            ck = os.path.join(d, "ck")
            os.makedirs(ck)
            with open(os.path.join(ck, "w.bin"), "wb") as f:
                f.write(os.urandom(1024))
            ctimes = []
            for i in range(n_ckpt):
                t0 = time.perf_counter()
                s.report({"loss": float(i)}, checkpoint=Checkpoint.from_directory(ck))
                ctimes.append(time.perf_counter() - t0)
    return {"metrics_only_s": statistics.median(times), "small_checkpoint_s":
            statistics.median(ctimes), "n_metrics": n_metrics, "n_ckpt": n_ckpt}


_RAY_REPORT = r'''
import json, os, statistics, sys, tempfile, time
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray
from ray import tune
ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2,
         log_to_driver=False, configure_logging=False)

def trainable(config):
    import json, os, tempfile, time
    from ray import tune
    report = getattr(tune, "report", None)
    if report is None:
        from ray import train
        report = train.report
    ckpt_cls = getattr(tune, "Checkpoint", None)
    if ckpt_cls is None:
        from ray.train import Checkpoint as ckpt_cls
    for i in range(50):
        report({"loss": float(i)})
    times = []
    for i in range(config["n"]):
        t0 = time.perf_counter()
        report({"loss": float(i), "step": i})
        times.append(time.perf_counter() - t0)
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "w.bin"), "wb") as f:
        f.write(os.urandom(1024))
    ctimes = []
    for i in range(config["nc"]):
        t0 = time.perf_counter()
        report({"loss": float(i)}, checkpoint=ckpt_cls.from_directory(d))
        ctimes.append(time.perf_counter() - t0)
    with open(config["out"], "w") as f:
        json.dump({"metrics": times, "ckpt": ctimes}, f)

out = tempfile.mktemp()
run_config_cls = getattr(tune, "RunConfig", None)
if run_config_cls is None:
    from ray.train import RunConfig as run_config_cls
tuner = tune.Tuner(trainable, param_space={"n": int(sys.argv[1]), "nc": int(sys.argv[2]),
                                          "out": out},
                   run_config=run_config_cls(storage_path=tempfile.mkdtemp(), name="bench",
                                             verbose=0))
tuner.fit()
r = json.load(open(out))
ray.shutdown()
print(json.dumps({"metrics_only_s": statistics.median(r["metrics"]),
                  "small_checkpoint_s": statistics.median(r["ckpt"])}))
'''


def ray_report(n_metrics: int, n_ckpt: int) -> dict[str, Any]:
    """The same loop inside a Ray Tune function trainable (``tune.report``)."""
    proc = subprocess.run(
        [sys.executable, "-c", _RAY_REPORT, str(n_metrics), str(n_ckpt)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
    )
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"Ray run failed ({proc.returncode}): {proc.stderr[-600:]}")
    return json.loads(lines[-1])


# -- async blocked time ---------------------------------------------------------------


def async_blocked(src: str, uri: str, options: dict[str, Any], reps: int, log) -> dict[str, Any]:
    """Seconds ``report()`` blocks the loop for one checkpoint of ``src``:
    sync (upload + commit), async with a staged copy, async with hard links.
    Candidates alternate; each async report is followed by ``wait()`` (not
    counted as blocked: the loop would be training meanwhile)."""
    from checkpoint_store import Checkpoint, CheckpointConfig
    from checkpoint_store.session import Session
    from checkpoint_store.storage import StorageContext

    res: dict[str, list[float]] = {"sync": [], "async (copy)": [], "async (hardlink)": [],
                                   "async wait() after": []}
    counter = [0]
    for rep in range(reps):
        for mode in ("sync", "async (copy)", "async (hardlink)"):
            counter[0] += 1
            st = StorageContext(f"{uri}/async{counter[0]}-{os.getpid()}", "exp", "t",
                                storage_options=options)
            upload_mode = "sync" if mode == "sync" else "async"
            staging = "hardlink" if "hardlink" in mode else "copy"
            s = Session(st, CheckpointConfig(upload_mode=upload_mode, staging=staging))
            t0 = time.perf_counter()
            s.report({"step": rep}, checkpoint=Checkpoint.from_directory(src))
            blocked = time.perf_counter() - t0
            t1 = time.perf_counter()
            s.wait()
            waited = time.perf_counter() - t1
            s.close()
            res[mode].append(blocked)
            if mode != "sync":
                res["async wait() after"].append(waited)
            log(f"  async {mode} rep {rep}: blocked {blocked:.3f} s (then wait {waited:.3f} s)")
            try:
                for c, _ in st.committed_checkpoints():
                    st.filesystem.delete_dir(c.path)
            except Exception:
                pass
    return {k: statistics.median(v) for k, v in res.items() if v}


# -- peak RSS, each candidate in a fresh interpreter ---------------------------------------
#
# In the timed rows every candidate runs in one process, one after the other; an
# allocator that keeps freed memory (pyarrow's jemalloc/mimalloc pool) shows
# little growth on its later runs there. Here each candidate moves the bytes once
# in an interpreter of its own: imports, clients and set-up first, then the
# baseline, then the transfer.

# cp (and cp + sync) are left out: they run as a child process, and a child
# forked from this interpreter carries the interpreter's RSS into its
# ``getrusage(RUSAGE_CHILDREN).ru_maxrss`` (176-178 MiB for cp of 3 MiB here,
# the parent's size, not cp's).


def fresh_rss(backend: str, direction: str, src: str, work: str,
              remote_spec: dict[str, str] | None, log) -> dict[str, dict[str, Any]]:
    """Peak RSS of one transfer of ``src`` by our headline candidate and each
    in-process raw client of the ``backend`` row (bench_transfer's candidates, same calls), each
    in a fresh interpreter.

    Args:
        backend: ``local``, or the kind of ``remote_spec`` (see bench_transfer.connect).
        direction: ``upload`` or ``download`` (a committed checkpoint of ``src``,
            written here first, is the source).
        work: a local scratch directory.

    Returns:
        Candidate name -> ``{"baseline_mib", "peak_mib", "delta_mib", "seconds",
        "bytes"}`` (``bytes``: what arrived at the destination), or
        ``{"error": ...}``. Tools run as a child process (cp) are left out.
    """
    from benchmarks import bench_transfer as bt

    remote = bt.connect(remote_spec) if remote_spec else None
    ckpt, store = None, None
    if direction == bt.DOWNLOAD:
        if remote is None:
            store = tempfile.mkdtemp(prefix="rss-store-", dir=work)
            ckpt = bt.committed_checkpoint(src, store, fsync=False)
        else:
            store = bt.new_name()
            ckpt = bt.committed_checkpoint(src, f"{remote.uri_root}/{store}",
                                           storage_options=remote.options)
    cands = (bt.local_candidates(direction, ckpt) if remote is None
             else bt.remote_candidates(remote, direction, ckpt))
    names = list(cands)
    wanted = [names[0]] + [n for n, prep in cands.items() if not n.startswith("checkpoint-store")
                           and not getattr(prep, bt.SUBPROCESS, False)]
    job = {"backend": backend, "direction": direction, "source": src, "work": work,
           "remote": remote_spec, "checkpoint": ckpt.uri if ckpt else None}
    out: dict[str, dict[str, Any]] = {}
    try:
        for name in wanted:
            try:
                out[name] = _run_fresh({**job, "candidate": name})
            except Exception as exc:  # a failing tool is a cell note, not a lost table
                out[name] = {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}
            log(f"  rss {backend} {direction} {name}: {out[name]}")
    finally:
        if store and remote is None:
            shutil.rmtree(store, ignore_errors=True)
        elif store and remote is not None:
            remote.drop(remote.path(store))
    return out


def _run_fresh(job: dict[str, Any]) -> dict[str, Any]:
    # The job travels in the environment: it may hold the test server's keys.
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_misc", "--fresh-rss"], capture_output=True,
        text=True, timeout=900, cwd=_ROOT, env={**os.environ, "BENCH_RSS_JOB": json.dumps(job)})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"exit {proc.returncode}, no result: {proc.stderr[-600:]}")
    return json.loads(lines[-1])


def _fresh_child(job: dict[str, Any]) -> dict[str, Any]:
    """One transfer by ``job["candidate"]`` in this (fresh) interpreter."""
    from benchmarks import bench_transfer as bt
    from checkpoint_store import Checkpoint

    remote = bt.connect(job["remote"]) if job["remote"] else None
    ckpt, source = None, job["source"]
    if job["direction"] == bt.DOWNLOAD:
        ckpt = Checkpoint(job["checkpoint"], storage_options=remote.options if remote else None)
        source = ckpt.path
    cands = (bt.local_candidates(job["direction"], ckpt) if remote is None
             else bt.remote_candidates(remote, job["direction"], ckpt))
    prepare = cands[job["candidate"]]
    to_remote = remote is not None and job["direction"] == bt.UPLOAD
    scratch = tempfile.mkdtemp(prefix="rss-", dir=job["work"])
    dst = bt.new_name() if to_remote else os.path.join(scratch, "d")
    transfer = prepare(source, dst)
    base = _hwm_reset()
    t0 = time.perf_counter()
    transfer()
    seconds = time.perf_counter() - t0
    grew = _hwm_growth(base)
    peak = _status_kib("VmHWM")
    if base is None or grew is None or peak is None:
        raise RuntimeError("peak RSS needs Linux /proc/self/clear_refs and VmHWM")
    res: dict[str, Any] = {"baseline_mib": base / 1024, "peak_mib": peak / 1024,
                           "delta_mib": grew, "seconds": seconds}
    if to_remote:
        assert remote is not None
        infos = remote.raw_pyarrow.get_file_info(
            pafs.FileSelector(remote.path(dst), recursive=True))
        res["bytes"] = sum(i.size for i in infos if i.type == pafs.FileType.File)
        remote.drop(remote.path(dst))
    else:
        res["bytes"] = sum(os.path.getsize(os.path.join(d, n))
                           for d, _, ns in os.walk(dst) for n in ns)
    shutil.rmtree(scratch, ignore_errors=True)
    return res


# -- import time ------------------------------------------------------------------------


def import_time(reps: int = 7) -> dict[str, float]:
    """Median wall time of ``import checkpoint_store`` in a fresh interpreter,
    and of ``import pyarrow.fs`` alone (its floor)."""
    code = ("import time; t=time.perf_counter(); import {m}; "
            "import json; print(json.dumps(time.perf_counter()-t))")
    ours, floor = [], []
    for _ in range(reps):  # alternate
        ours.append(run_json_subprocess(code.format(m="checkpoint_store")))
        floor.append(run_json_subprocess(code.format(m="pyarrow.fs")))
    return {"checkpoint_store_s": statistics.median(ours),
            "pyarrow_fs_alone_s": statistics.median(floor)}


# -- retention ------------------------------------------------------------------------------


def retention(quick: bool) -> dict[str, Any]:
    """100k registrations with K=3, from benchmarks/bench_retention.py (the
    retention benchmark); its last stdout line is JSON."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "bench_retention.py")
    if not os.path.exists(script):
        raise RuntimeError("benchmarks/bench_retention.py is not there")
    args = [sys.executable, script]
    if quick:
        args += ["--n", "20000"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(here))
    if proc.returncode != 0:
        raise RuntimeError(f"bench_retention failed: {proc.stderr[-600:]}")
    try:
        return json.loads(proc.stdout)
    except ValueError:
        lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
        return {"output": "\n".join(lines[-20:])}


if __name__ == "__main__" and sys.argv[1:] == ["--fresh-rss"]:
    print(json.dumps(_fresh_child(json.loads(os.environ["BENCH_RSS_JOB"]))))
