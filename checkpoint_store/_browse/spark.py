"""A one-line sparkline of a trial's score, for ``checkpoint-store show`` on a terminal.

No dependency beyond the standard library: ``show`` must work without the ``[ui]`` extra.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

BARS = "▁▂▃▄▅▆▇█"
ASCII_BARS = "_.-=+*#@"


def sparkline(values: Sequence[float | None], *, width: int = 48, bars: str = BARS) -> str:
    """``values`` as one character each (bucket means when more than ``width``).

    Missing or non-finite values are blanks; a flat series is the middle bar.
    Returns ``""`` for no values.
    """
    if not values:
        return ""
    buckets: list[float | None] = []
    n = len(values)
    step = max(1, math.ceil(n / width))
    for start in range(0, n, step):
        chunk = [v for v in values[start:start + step]
                 if isinstance(v, (int, float)) and math.isfinite(v)]
        buckets.append(sum(chunk) / len(chunk) if chunk else None)
    finite = [v for v in buckets if v is not None]
    if not finite:
        return " " * len(buckets)
    lo, hi = min(finite), max(finite)
    top = len(bars) - 1
    out = []
    for v in buckets:
        if v is None:
            out.append(" ")
        elif hi == lo:
            out.append(bars[top // 2])
        else:
            out.append(bars[round((v - lo) / (hi - lo) * top)])
    return "".join(out)


def score_line(rows: Sequence[Mapping[str, Any]], metric: str, checkpoint_name: str, *,
               bars: str = BARS) -> str | None:
    """``score <metric>  <sparkline>  first -> last over N reports; this checkpoint: ...``,
    or None when no report has a numeric ``metric``."""
    from checkpoint_store.retention import score_or_none

    def score(row: Mapping[str, Any]) -> float | None:
        return score_or_none(row, metric)  # a non-numeric value: a blank

    values = [score(r) for r in rows]
    finite = [v for v in values if v is not None]
    if not finite:
        return None
    line = (f"score {metric}  {sparkline(values, bars=bars)}  {finite[0]:.4g} -> "
            f"{finite[-1]:.4g} over {len(values)} reports")
    for row in rows:
        if row.get("checkpoint_dir_name") == checkpoint_name:
            mine = score(row)
            at = row.get("training_iteration")
            line += (f"; this checkpoint {mine:.4g}" if mine is not None else
                     "; this checkpoint has no score") + (f" at report {at}" if at else "")
    return line


def checkpoint_score_line(backend: Any, checkpoint_path: str, *,
                          unicode: bool = True) -> str | None:
    """The :func:`score_line` of the trial holding the checkpoint at ``checkpoint_path``,
    by the trial's recorded score attribute; None when there is none or no report."""
    from checkpoint_store._browse.locations import Location, storage_context
    from checkpoint_store.retention.recorded import UnreadableStateError, score_attribute

    trial = Location(backend, posixpath.dirname(checkpoint_path.rstrip("/")))
    try:
        metric, _ = score_attribute(trial)
    except UnreadableStateError:  # a decoration: `ls` and `best` name the fault
        return None
    ctx = storage_context(trial, strict=False)
    if metric is None or ctx is None:
        return None
    rows = ctx.read_results()
    name = posixpath.basename(checkpoint_path.rstrip("/"))
    return score_line(rows, metric, name, bars=BARS if unicode else ASCII_BARS)
