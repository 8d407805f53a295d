"""``checkpoint-store plot``: a trial's curve with its checkpoints marked, as an image.

matplotlib's object API only (``Figure``, no ``pyplot``): no global state, no
display needed, PNG and SVG from the same code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.retention import score_or_none

# Marker per checkpoint kind (the same meaning as on the page).
MARKERS: dict[str, dict[str, Any]] = {
    "best": {"marker": "*", "s": 220, "color": "#1a9850", "label": "kept (best)"},
    "latest": {"marker": "^", "s": 120, "color": "#2166ac", "label": "kept (latest)"},
    "kept": {"marker": "D", "s": 70, "color": "#e08214", "label": "kept"},
    "evicted": {"marker": "x", "s": 60, "color": "#888888", "label": "reported, then evicted"},
    "uncommitted": {"marker": "_", "s": 90, "color": "#d6604d", "label": "not committed"},
}
FORMATS = (".png", ".svg", ".pdf")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _series(trial: Mapping[str, Any], metric: str, x_key: str) -> tuple[
        list[float], list[float], dict[str, list[tuple[float, float]]]]:
    kinds = {c["name"]: c["kind"] for c in trial["checkpoints"]}
    xs, ys = [], []
    marks: dict[str, list[tuple[float, float]]] = {k: [] for k in MARKERS}
    for row in trial["rows"]:
        # An ambiguous or non-numeric value is a gap, not an error.
        x, y = _number(row.get(x_key)), score_or_none(row, metric)
        if x is None or y is None:
            continue
        xs.append(x)
        ys.append(y)
        name = row.get("checkpoint_dir_name")
        if isinstance(name, str):
            marks[kinds.get(name, "evicted")].append((x, y))
    return xs, ys, marks


def plot_trials(trials: Sequence[Mapping[str, Any]], output: str, *, metric: str | None = None,
                x_key: str = "training_iteration") -> int:
    """Write one chart of ``metric`` for ``trials`` (``StoreView.trial`` answers) to ``output``.

    Returns:
        How many trials had the metric (and were drawn).

    Raises:
        InvalidConfigError: an extension other than .png/.svg/.pdf, no metric
            given nor recorded, or no trial reporting it (the message lists
            the metrics there are).
    """
    from matplotlib.figure import Figure

    ext = os.path.splitext(output)[1].lower()
    if ext not in FORMATS:
        raise InvalidConfigError(f"-o {output!r}: the image must end in {', '.join(FORMATS)}")
    metric = metric or next((t["metric"] for t in trials if t.get("metric")), None)
    if metric is None:
        raise InvalidConfigError("--metric is required: no trial records a score attribute")
    fig = Figure(figsize=(9, 4.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    drawn, seen_kinds = 0, set()
    for i, trial in enumerate(trials):
        xs, ys, marks = _series(trial, metric, x_key)
        if not xs:
            continue
        drawn += 1
        label = trial["trial"] if len(trials) > 1 else metric
        (line,) = ax.plot(xs, ys, "-", marker=".", lw=1.6, ms=4, label=label, zorder=1,
                          color=f"C{i % 10}")
        for kind, points in marks.items():
            if not points:
                continue
            style = dict(MARKERS[kind])
            ax.scatter([p[0] for p in points], [p[1] for p in points], marker=style["marker"],
                       s=style["s"], color=style["color"], zorder=3, linewidths=1.5,
                       label=style["label"] if kind not in seen_kinds else None,
                       edgecolors="black" if kind == "best" else None)
            seen_kinds.add(kind)
    if not drawn:
        have = sorted({m for t in trials for m in t.get("metrics", [])})
        raise InvalidConfigError(
            f"no report of these trials has metric {metric!r}; metrics there: "
            f"{', '.join(have) or '(none)'}")
    ax.set_xlabel("report (training_iteration)" if x_key == "training_iteration" else "time (s)")
    ax.set_ylabel(metric)
    title = (f"{trials[0]['experiment']}/{trials[0]['trial']}" if len(trials) == 1
             else f"{len(trials)} trials")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.savefig(output)
    return drawn
