"""Shared helpers of the benchmarks: data sets, timing, peak RSS, the machine.

Every benchmark measures public tools only (cp, pyarrow, fsspec, s3fs, adlfs,
Ray) against checkpoint-store on the same data, alternating candidates within
one run so that load from other processes hits all of them alike.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

MiB = 1024 * 1024
GiB = 1024 * MiB


@dataclass(frozen=True)
class Shape:
    """A checkpoint shape: ``count`` files of ``size`` bytes."""

    name: str
    count: int
    size: int

    @property
    def total(self) -> int:
        return self.count * self.size


FULL_SHAPES = [
    Shape("4 x 256 MiB", 4, 256 * MiB),
    Shape("2000 x 64 KiB", 2000, 64 * 1024),
    Shape("1 x 1 GiB", 1, GiB),
]
# --quick: the same file counts' spirit at 1/16 of the bytes.
QUICK_SHAPES = [
    Shape("4 x 16 MiB", 4, 16 * MiB),
    Shape("200 x 64 KiB", 200, 64 * 1024),
    Shape("1 x 64 MiB", 1, 64 * MiB),
]


# Incremental rows: a 1 GiB checkpoint of which one 64 MiB file changes.
FULL_INCREMENTAL = Shape("16 x 64 MiB", 16, 64 * MiB)
QUICK_INCREMENTAL = Shape("16 x 4 MiB", 16, 4 * MiB)


def make_tree(root: str, shape: Shape) -> str:
    """Write ``shape`` as random data under ``root`` (once; reused when the
    marker ``<root>.complete`` is there) and warm the page cache."""
    marker = root.rstrip("/") + ".complete"
    if not os.path.exists(marker):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        block = os.urandom(min(shape.size, 64 * MiB))
        for i in range(shape.count):
            sub = os.path.join(root, f"shard{i // 500:02d}") if shape.count > 500 else root
            os.makedirs(sub, exist_ok=True)
            with open(os.path.join(sub, f"file{i:05d}.bin"), "wb") as f:
                # Each file differs (its index first), so no layer can dedupe.
                f.write(i.to_bytes(8, "little"))
                left = shape.size - 8
                while left > 0:
                    n = min(left, len(block))
                    f.write(block[:n])
                    left -= n
        open(marker, "w").close()
    # The numbers are for a warm page cache, as the were.
    paths = [os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns]
    for i in range(0, len(paths), 500):
        subprocess.run(["cat", *paths[i:i + 500]], stdout=subprocess.DEVNULL, check=False)
    return root


@dataclass
class Cell:
    """Timings of one candidate on one row, in seconds."""

    candidate: str
    times: list[float] = field(default_factory=list)
    error: str | None = None
    note: str | None = None
    #: Growth of this process's peak RSS during each run, in MiB (Linux
    #: VmHWM reset before the run); None for tools run as a child process.
    rss_mib: list[float] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """This process's resident set size in bytes (Linux ``VmRSS``; 0 where unknown)."""
    kib = _status_kib("VmRSS")
    return 0 if kib is None else kib * 1024


def _hwm_reset() -> int | None:
    """Reset this process's peak RSS to its current RSS (Linux); the RSS in KiB."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_kib("VmRSS")


def _hwm_growth(base: int | None) -> float | None:
    peak = _status_kib("VmHWM")
    if base is None or peak is None:
        return None
    return max(0, peak - base) / 1024


def alternate(
    candidates: Mapping[str, Callable[[int], float | None]],
    reps: int,
    *,
    budget_s: float | None = None,
    log: Callable[[str], None] = print,
    label: str = "",
) -> dict[str, Cell]:
    """Run each candidate ``reps`` times, round-robin, each round starting one
    candidate later (A B C, B C A, C A B, ...): no candidate always runs first,
    right after the set-up or the last round's clean-up (an emulator's garbage
    collection, writeback of a deleted destination), whose cost otherwise
    falls on the same candidate in every round.

    A candidate is ``fn(rep) -> seconds`` (it times its own critical part and
    cleans up outside it). An exception marks the candidate failed for the
    rest of the run. Stops early (at least one round) once ``budget_s`` passed.
    """
    cells = {name: Cell(name) for name in candidates}
    t_start = time.perf_counter()
    names = list(candidates)
    for rep in range(reps):
        shift = rep % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            fn = candidates[name]
            cell = cells[name]
            if cell.error is not None:
                continue
            base = _hwm_reset()
            try:
                dt = fn(rep)
            except Exception as exc:  # a failing tool is a row note, not a crash
                cell.error = f"{type(exc).__name__}: {str(exc)[:200]}"
                log(f"  {label} {name}: FAILED {cell.error}")
                continue
            if dt is None:
                continue
            cell.times.append(dt)
            grew = _hwm_growth(base)
            if grew is not None and not getattr(fn, "subprocess", False):
                cell.rss_mib.append(grew)
            log(f"  {label} {name} rep {rep}: {dt:.3f} s")
        if budget_s is not None and time.perf_counter() - t_start > budget_s and rep >= 0:
            if rep + 1 < reps:
                log(f"  {label}: time budget reached after {rep + 1} round(s)")
            break
    return cells


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 1024 / 1024, 1)
        info["load_avg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    versions = {}
    for mod in ("pyarrow", "fsspec", "s3fs", "adlfs", "ray", "moto", "google_crc32c"):
        try:
            m = __import__(mod)
            versions[mod] = getattr(m, "__version__", "?")
        except Exception:
            versions[mod] = None
    info["versions"] = versions
    try:
        out = subprocess.run(["df", "-T", tempfile.gettempdir()], capture_output=True, text=True)
        info["tmp_filesystem"] = out.stdout.splitlines()[-1].split()[1]
    except Exception:
        pass
    return info


def run_json_subprocess(code: str, env: dict[str, str] | None = None, timeout: float = 600) -> Any:
    """Run ``code`` in a fresh interpreter; its last stdout line is JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"subprocess failed ({proc.returncode}): {proc.stderr[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])

