"""The "Tiered checkpoints" section of docs/benchmarks.md, from bench_tiers' result."""

from __future__ import annotations

import math
from typing import Any


def _s(x: Any) -> str:
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return "n/a"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def _r(x: Any) -> str:
    return f"{x:.2f}×" if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def _ok(good: bool | None) -> str:
    return "n/a" if good is None else ("met" if good else "**missed**")


def targets(t: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(target, measured, met?)`` rows of the issue's targets."""
    rows: list[tuple[str, str, str]] = []
    b = t.get("blocked") or {}
    if b:
        v = b.get("vs_cp_sync")
        rows.append(("report() blocked ≤ 1.2× `cp -r` + `sync`",
                     f"{_r(v)} ({_s(b.get('local tier report'))} vs {_s(b.get('cp -r + sync'))})",
                     _ok(v is not None and v <= 1.2)))
        v = b.get("sync_s3_over_tier")
        rows.append(("report() blocked ≥ 10× less than a sync report to S3",
                     f"{_r(v)} ({_s(b.get('sync report to S3'))} vs "
                     f"{_s(b.get('local tier report'))})", _ok(v is not None and v >= 10)))
    r = t.get("restore") or {}
    if r:
        v = r.get("loopback_over_tier")
        rows.append(("restore after kill -9 ≥ 5× faster than the download from moto (loopback)",
                     f"{_r(v)} ({_s(r.get('local tier'))} vs "
                     f"{_s(r.get('download from moto (loopback)'))})",
                     _ok(v is not None and v >= 5)))
        v = r.get("link_over_tier")
        rows.append((f"… ≥ 20× faster than through the {t.get('link', 'link')}",
                     f"{_r(v)} ({_s(r.get('local tier'))} vs "
                     f"{_s(r.get('download through the link'))})",
                     _ok(v is not None and v >= 20)))
    st = t.get("steady") or {}
    if st:
        v = st.get("worst_over_upload")
        rows.append(("steady state: each checkpoint durable within 1.5× its upload time",
                     f"worst {_r(v)} (upload {_s(st.get('upload_s'))}, every "
                     f"{_s(st.get('interval_s'))})", _ok(v is not None and v <= 1.5)))
    f = t.get("faults") or {}
    if f:
        good = f.get("blocked_max_s", math.inf) <= f.get("budget_s", 0)
        rows.append(("20 % transient faults: report() never blocked beyond the budget "
                     "(1.5× the longest report() without faults)",
                     f"longest {_s(f.get('blocked_max_s'))} vs {_s(f.get('budget_s'))}",
                     _ok(good)))
        rows.append(("… every selected checkpoint durable once the faults stop",
                     f"{f.get('durable')}/{f.get('reports')} ({f.get('injected')})",
                     _ok(f.get("durable") == f.get("reports"))))
    tp = t.get("throughput") or {}
    if tp:
        v = tp.get("ratio")
        measured = f"{_r(v)}"
        if tp.get("ratio_unniced") is not None:
            measured += f" (the copy at the loop's priority: {_r(tp['ratio_unniced'])})"
        rows.append(("numpy loop throughput while persisting ≥ 0.9× no checkpointing",
                     measured, _ok(v is not None and v >= 0.9)))
    return rows


def tiers_section(t: dict[str, Any]) -> str:
    out: list[str] = []
    w = out.append
    w("## Tiered checkpoints (local tier in front of S3)\n")
    w(f"`benchmarks/bench_tiers.py`: `LocalTier` on the local disk, the storage_path on "
      f"{t.get('storage', 'S3 (moto)')}; checkpoint {t.get('shape')} (steady state, faults "
      f"and throughput: {t.get('steady_shape')}); medians of {t.get('reps')} repetitions. "
      "moto runs on the same cores as the training loop and the background copy.\n")
    rows = targets(t)
    if rows:
        w("| target | measured | |")
        w("|---|---|---|")
        for name, got, ok in rows:
            w(f"| {name} | {got} | {ok} |")
        w("")
    b = t.get("blocked") or {}
    if b.get("local tier wait() after") is not None:
        w(f"After the local tier's `report()`, the background copy to S3 took "
          f"{_s(b['local tier wait() after'])} until `wait()` returned.\n")
    ev = t.get("eviction") or {}
    if ev:
        w(f"Eviction with `num_to_keep=1`, {ev.get('files')} small files per checkpoint: "
          "`report()` seconds with the deletes of evicted checkpoints in the background "
          "(the session's default) and inside `report()` (before), side by side, 0.5 s "
          "of GIL-free \"training\" between reports.\n")
        w("| storage | deletes inline | background | saved per report |")
        w("|---|---|---|---|")
        for where in ("local", "memory"):
            row = ev.get(where)
            if row:
                w(f"| {where} | {_s(row.get('inline'))} | {_s(row.get('background'))} | "
                  f"{_s(row.get('saved_s'))} |")
        w("")
    for name, err in (t.get("errors") or {}).items():
        w(f"> {name} failed: {err}\n")
    for note in t.get("notes") or []:
        w(f"> Note: {note}\n")
    return "\n".join(out) + "\n"
