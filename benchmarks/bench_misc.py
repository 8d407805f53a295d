"""report() overhead (ours vs Ray Tune's function trainable), async blocked
time, peak RSS during 1 GiB transfers, import time, retention at scale."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks._common import RSS_PRELUDE, run_json_subprocess

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


# -- peak RSS ----------------------------------------------------------------------------

_RSS_CODE = RSS_PRELUDE + r'''
import sys, tempfile, shutil
from checkpoint_store import Checkpoint, StorageContext
src, uri, direction = sys.argv[1], sys.argv[2], sys.argv[3]
options = json.loads(os.environ.get("BENCH_OPTIONS", "{}"))
st = StorageContext(uri, "exp", "t", storage_options=options or None)
st.ensure_trial_dir()
if direction == "download":
    ckpt = st.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {}})
    # A warm-up download of a tiny checkpoint sets up clients and pools.
dst = tempfile.mkdtemp()
base = rss_now()
rss_reset()
t0 = time.perf_counter()
if direction == "upload":
    st.persist_checkpoint(Checkpoint.from_directory(src), 1, {"metrics": {}})
else:
    ckpt.to_directory(os.path.join(dst, "d"))
dt = time.perf_counter() - t0
peak = rss_peak()
shutil.rmtree(dst, ignore_errors=True)
for c, _ in st.committed_checkpoints():
    st.filesystem.delete_dir(c.path)
print(json.dumps({"baseline_mib": base / 2**20, "peak_mib": peak / 2**20,
                  "delta_mib": (peak - base) / 2**20, "seconds": dt}))
'''


def peak_rss(src: str, uri: str, options: dict[str, Any] | None, direction: str) -> dict:
    """Peak RSS above the process's baseline during one transfer of ``src``, in a
    fresh interpreter (Linux ``/proc/self/clear_refs`` resets the peak)."""
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_CODE, src, uri, direction], capture_output=True,
        text=True, timeout=900, env={**os.environ, "BENCH_OPTIONS": json.dumps(options or {})},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"RSS run failed: {proc.stderr[-600:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
