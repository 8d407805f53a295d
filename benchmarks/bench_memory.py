"""Memory of the training and persist processes over many ``report(state=...)``.

Standalone: ``python -m benchmarks.bench_memory [--saves 50] [--state-mib 2048]
[--budget-mib 256] [--modes wait,nowait]`` prints one JSON object and the
markdown rows of docs/benchmarks.md ("Memory over many saves").

For each mode a fresh child process (the training process) builds a state of
``--state-mib`` MiB (16 float32 torch tensors), starts a session on a local
temporary trial (``CheckpointConfig(num_to_keep=1)``,
``UploadConfig(staging_budget=--budget-mib)``), takes its baseline (Linux
``VmRSS``, ``RssAnon``, ``RssShmem``; ``VmHWM`` reset through
``/proc/self/clear_refs``), then reports the state ``--saves`` times, each
tensor changed a little before each save. Mode ``wait`` calls ``s.wait()``
after each report (the save is on disk); ``nowait`` does not (the next
report stages while the last one is written).

This process samples ``/proc/PID/status`` of the training process and of its
persist process (the child running ``checkpoint_store.state._persist``)
every 20 ms, and, after each save (a line the child prints), records both
processes' RSS split into anonymous and shared-memory pages, and their
``VmHWM``. The staging area is shared memory mapped by both processes: its
pages count in the ``RssShmem`` of each, once (it is one area of at most
the budget, not two copies).

Measured per process:

* peak growth: the most ``RssAnon`` above the baseline (the persist process
  has none: it did not exist, so its whole ``RssAnon``), the most
  ``RssShmem``, the most ``RssFile`` (the persist process's interpreter and
  its libraries, pages shared with every Python process), and ``VmHWM``
  (all three together) above the baseline ``VmRSS``;
* drift: (mean ``VmRSS`` after the last 10 saves - mean after saves 2-11) /
  the latter, and the same difference in MiB.

Target (issue "At the limit"): peak growth of the memory a process holds
(``RssAnon`` + ``RssShmem``) <= budget + 64 MiB in each process, drift of
``VmRSS`` <= 1 %.
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
import threading
import time
from typing import Any

from benchmarks._common import MiB

FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
PERSIST_MODULE = "checkpoint_store.state._persist"


def read_status(pid: int) -> dict[str, int] | None:
    """``FIELDS`` of ``/proc/PID/status`` in bytes; None once the process is gone."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in FIELDS:
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        return None
    return out


def find_persist(parent: int) -> int | None:
    """The pid of ``parent``'s persist process, or None."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            if int(stat.rsplit(")", 1)[1].split()[1]) != parent:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if PERSIST_MODULE.encode() in f.read():
                    return int(name)
        except (OSError, ValueError, IndexError):
            continue
    return None


# -- the training process (a child) ---------------------------------------------


def child(saves: int, state_mib: int, budget_mib: int, wait: bool, root: str) -> None:
    """Build the state, print ``baseline``, then report it ``saves`` times,
    printing ``saved <i>`` after each (stdout lines)."""
    import torch

    from checkpoint_store import CheckpointConfig
    from checkpoint_store import session as cs
    from checkpoint_store.session import UploadConfig

    torch.set_num_threads(1)
    n = 16
    numel = state_mib * MiB // n // 4
    state = {f"layer{i}.weight": torch.rand(numel, dtype=torch.float32) for i in range(n)}
    with cs.start(storage_path=root, experiment_name="mem", trial_name="t",
                  checkpoint_config=CheckpointConfig(num_to_keep=1),
                  upload_config=UploadConfig(staging_budget=budget_mib * MiB)) as s:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM = VmRSS from here
        print("baseline", flush=True)
        for i in range(saves):
            for t in state.values():  # a training step: every tensor changes a little
                t[i % numel] += 1.0
            s.report({"step": i}, state=state)
            if wait:
                s.wait()
            print(f"saved {i}", flush=True)
        s.wait()
    print("done", flush=True)


# -- the measuring process ------------------------------------------------------


class _Watch:
    """Samples the training process and its persist process every ``period`` s,
    keeping the most of each field since the last :meth:`take`."""

    def __init__(self, pid: int, period: float = 0.02):
        self.pid = pid
        self.persist: int | None = None
        self._lock = threading.Lock()
        self._most: dict[str, dict[str, int]] = {"train": {}, "persist": {}}
        self._stop = threading.Event()
        self._period = period
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _sample(self) -> dict[str, dict[str, int] | None]:
        if self.persist is None:
            self.persist = find_persist(self.pid)
        return {"train": read_status(self.pid),
                "persist": read_status(self.persist) if self.persist else None}

    def _run(self) -> None:
        while not self._stop.is_set():
            self._fold(self._sample())
            time.sleep(self._period)

    def _fold(self, now: dict[str, dict[str, int] | None]) -> None:
        with self._lock:
            for proc, st in now.items():
                if st is None:
                    continue
                most = self._most[proc]
                for k, v in st.items():
                    most[k] = max(most.get(k, 0), v)

    def take(self) -> dict[str, Any]:
        """Now and the most since the last take, per process."""
        now = self._sample()
        self._fold(now)
        with self._lock:
            most, self._most = self._most, {"train": {}, "persist": {}}
        return {"now": now, "most": most}

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def _drift(values: list[int]) -> tuple[float | None, float | None]:
    """(relative, MiB) drift: mean of the last 10 against saves 2-11."""
    if len(values) < 12:
        early, late = values[1:2], values[-1:]
    else:
        early, late = values[1:11], values[-10:]
    if not early or not late:
        return None, None
    a, b = statistics.fmean(early), statistics.fmean(late)
    return (b - a) / a, (b - a) / MiB


def run_mode(saves: int, state_mib: int, budget_mib: int, wait: bool,
             log: Any = print) -> dict[str, Any]:
    """One training child; the measured rows of both processes."""
    root = tempfile.mkdtemp(prefix="bench-mem-")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    cmd = [sys.executable, "-m", "benchmarks.bench_memory", "--child", "--saves", str(saves),
           "--state-mib", str(state_mib), "--budget-mib", str(budget_mib),
           "--root", root] + (["--wait"] if wait else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    watch: _Watch | None = None
    per_save: list[dict[str, Any]] = []
    base: dict[str, int] | None = None
    t0 = time.perf_counter()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            word = line.split()
            if not word:
                continue
            if word[0] == "baseline":
                base = read_status(proc.pid)
                watch = _Watch(proc.pid)
                watch.take()
                t0 = time.perf_counter()
            elif word[0] == "saved" and watch is not None:
                per_save.append(watch.take())
                i = len(per_save)
                if i == 1 or i % 10 == 0 or i == saves:
                    tr = per_save[-1]["now"]["train"] or {}
                    pe = per_save[-1]["now"]["persist"] or {}
                    log(f"  {'wait' if wait else 'nowait'} save {i}: train RSS "
                        f"{tr.get('VmRSS', 0) / MiB:.0f} MiB (shmem "
                        f"{tr.get('RssShmem', 0) / MiB:.0f}), persist RSS "
                        f"{pe.get('VmRSS', 0) / MiB:.0f} MiB (anon {pe.get('RssAnon', 0) / MiB:.0f}"
                        f", shmem {pe.get('RssShmem', 0) / MiB:.0f})")
        code = proc.wait()
        if code != 0:
            raise RuntimeError(f"the training child exited with {code}")
    finally:
        if watch is not None:
            watch.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    assert base is not None
    rows: dict[str, Any] = {}
    for name in ("train", "persist"):
        b = base if name == "train" else {k: 0 for k in FIELDS}
        most = {k: max((p["most"][name].get(k, 0) for p in per_save), default=0)
                for k in FIELDS}
        rss = [(p["now"][name] or {}).get("VmRSS", 0) for p in per_save]
        anon = [(p["now"][name] or {}).get("RssAnon", 0) for p in per_save]
        rel, mib = _drift(rss)
        anon_rel, anon_mib = _drift(anon)
        rows[name] = {
            "base_rss_mib": b["VmRSS"] / MiB,
            "peak_anon_growth_mib": (most["RssAnon"] - b["RssAnon"]) / MiB,
            "peak_shmem_mib": most["RssShmem"] / MiB,
            "peak_shmem_growth_mib": (most["RssShmem"] - b["RssShmem"]) / MiB,
            "peak_file_growth_mib": (most["RssFile"] - b["RssFile"]) / MiB,
            "hwm_growth_mib": (most["VmHWM"] - b["VmRSS"]) / MiB,
            "rss_after_save_mib": [round(x / MiB, 1) for x in rss],
            "anon_after_save_mib": [round(x / MiB, 1) for x in anon],
            "drift": rel, "drift_mib": mib, "anon_drift": anon_rel, "anon_drift_mib": anon_mib,
        }
    return {"mode": "wait" if wait else "nowait", "saves": len(per_save),
            "seconds": elapsed, "processes": rows}


def run(saves: int = 50, state_mib: int = 2048, budget_mib: int = 256,
        modes: tuple[str, ...] = ("wait", "nowait"), log: Any = print) -> dict[str, Any]:
    out: dict[str, Any] = {"saves": saves, "state_mib": state_mib, "budget_mib": budget_mib,
                           "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "runs": []}
    for mode in modes:
        out["runs"].append(run_mode(saves, state_mib, budget_mib, mode == "wait", log))
    out["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


def met(b: dict[str, Any], p: dict[str, Any]) -> bool:
    """Growth of anonymous plus shared-memory pages within budget + 64 MiB,
    drift of VmRSS within 1 %."""
    grow = p["peak_anon_growth_mib"] + p["peak_shmem_growth_mib"]
    return grow <= b["budget_mib"] + 64 and p["drift"] is not None and abs(p["drift"]) <= 0.01


def markdown(b: dict[str, Any]) -> str:
    bound = b["budget_mib"] + 64
    rows = [
        "| process | mode | budget | state | saves | peak growth anon / shmem "
        "| file pages | VmHWM growth | drift (VmRSS) | target | met |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in b["runs"]:
        for name, label in (("train", "training"), ("persist", "persist")):
            p = r["processes"][name]
            drift = "n/a" if p["drift"] is None else \
                f"{p['drift'] * 100:+.2f} % ({p['drift_mib']:+.1f} MiB)"
            rows.append(
                f"| {label} | {r['mode']} | {b['budget_mib']} MiB | {b['state_mib']} MiB "
                f"| {r['saves']} | {p['peak_anon_growth_mib']:.0f} / "
                f"{p['peak_shmem_growth_mib']:.0f} MiB | {p['peak_file_growth_mib']:.0f} MiB "
                f"| {p['hwm_growth_mib']:.0f} MiB | {drift} | anon + shmem <= {bound} MiB, "
                f"drift <= 1 % | {'met' if met(b, p) else 'missed'} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--saves", type=int, default=50)
    ap.add_argument("--state-mib", type=int, default=2048)
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--modes", default="wait,nowait")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--wait", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.saves, args.state_mib, args.budget_mib, args.wait, args.root)
        return 0
    b = run(args.saves, args.state_mib, args.budget_mib, tuple(args.modes.split(",")),
            log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(b, indent=1))
    print(markdown(b))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
