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
    "invalid": {"marker": "X", "s": 90, "color": "#b2182b", "label": "committed, invalid"},
}
#: A ring around a checkpoint committed on a preemption signal (any kind).
PREEMPTION: dict[str, Any] = {"marker": "o", "s": 320, "color": "#cc8a00",
                              "label": "preemption checkpoint"}
FORMATS = (".png", ".svg", ".pdf")
# The page's trial colours (app.js trialColor): ten categorical ones, then hues a
# golden angle apart at three lightnesses and two saturations: no two of 50 trials
# share a colour (the closest two are 32 apart in RGB).
BASE_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
               "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


def trial_color(i: int) -> str:
    """The colour of the ``i``-th trial of a comparison, as ``#rrggbb``."""
    import colorsys

    if i < len(BASE_COLORS):
        return BASE_COLORS[i]
    hue = (i * 137.508) % 360
    # Hues come back near each other every 34 and 55 steps: lightness and
    # saturation cycle on other periods, so such neighbours still differ.
    light = (50, 32, 66)[i % 3] / 100
    sat = (0.8, 0.5)[(i // 3) % 2]
    r, g, b = colorsys.hls_to_rgb(hue / 360, light, sat)
    return "#" + "".join(f"{round(c * 255):02x}" for c in (r, g, b))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _series(trial: Mapping[str, Any], metric: str, x_key: str) -> tuple[
        list[float], list[float], dict[str, list[tuple[float, float]]]]:
    kinds = {c["name"]: c["kind"] for c in trial["checkpoints"]}
    preempted = {c["name"] for c in trial["checkpoints"] if c.get("preemption")}
    xs, ys = [], []
    marks: dict[str, list[tuple[float, float]]] = {k: [] for k in (*MARKERS, "preemption")}
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
            if name in preempted:
                marks["preemption"].append((x, y))
    return xs, ys, marks


def plot_trials(trials: Sequence[Mapping[str, Any]], output: str, *, metric: str | None = None,
                x_key: str = "training_iteration") -> int:
    """Write one chart of ``metric`` for ``trials`` (``StoreView.trial`` answers) to ``output``.

    One trial: its curve, and each checkpoint marked by kind (shape and colour);
    a checkpoint committed on a preemption signal has a ring around its marker.
    Several: one colour per trial (its curve and its markers; the shape says the
    kind), one legend entry per trial, outside the axes so it hides no point.

    Returns:
        How many trials had the metric (and were drawn).

    Raises:
        InvalidConfigError: an extension other than .png/.svg/.pdf, no metric
            given nor recorded, or no trial reporting it (the message lists
            the metrics there are).
    """
    ext = os.path.splitext(output)[1].lower()
    if ext not in FORMATS:
        raise InvalidConfigError(f"-o {output!r}: the image must end in {', '.join(FORMATS)}")
    fig, drawn = figure(trials, metric=metric, x_key=x_key)
    fig.savefig(output)
    return drawn


def figure(trials: Sequence[Mapping[str, Any]], *, metric: str | None = None,
           x_key: str = "training_iteration") -> tuple[Any, int]:
    """The matplotlib ``Figure`` of :func:`plot_trials` and how many trials it drew.

    Raises:
        InvalidConfigError: as :func:`plot_trials`, but for the extension.
    """
    from matplotlib.figure import Figure

    metric = metric or next((t["metric"] for t in trials if t.get("metric")), None)
    if metric is None:
        raise InvalidConfigError("--metric is required: no trial records a score attribute")
    several = len(trials) > 1
    # Several trials: one legend entry each, in columns of at most 25 rows, the
    # figure as tall as the longest column (0.19 in a row at the small font):
    # every trial keeps its entry, the 50th as the first.
    ncols = 1 if len(trials) <= 20 else 2
    rows = -(-len(trials) // ncols)
    height = max(4.8, 0.19 * rows + 1.0) if several else 4.8
    fig = Figure(figsize=(9 + (2.4 * ncols if several else 0), height), dpi=100,
                 layout="constrained")
    ax = fig.add_subplot()
    drawn, seen_kinds = 0, set()
    for i, trial in enumerate(trials):
        xs, ys, marks = _series(trial, metric, x_key)
        if not xs:
            continue
        drawn += 1
        color = trial_color(i) if several else "C0"
        ax.plot(xs, ys, "-", marker="." if len(xs) <= 200 else None, lw=1.6, ms=4,
                label=trial["trial"] if several else metric, zorder=1, color=color)
        for kind, points in marks.items():
            if not points:
                continue
            if kind == "preemption":  # a ring around the kind's marker, in any trial's plot
                ax.scatter([p[0] for p in points], [p[1] for p in points],
                           marker=PREEMPTION["marker"], s=PREEMPTION["s"], facecolors="none",
                           edgecolors=PREEMPTION["color"], linewidths=1.8, zorder=4,
                           label=None if kind in seen_kinds else PREEMPTION["label"])
                seen_kinds.add(kind)
                continue
            style = dict(MARKERS[kind])
            # Several trials: the marker takes its trial's colour; one trial: its kind's.
            label = None if several or kind in seen_kinds else style["label"]
            ax.scatter([p[0] for p in points], [p[1] for p in points], marker=style["marker"],
                       s=style["s"], color=color if several else style["color"], zorder=3,
                       linewidths=1.5 if kind != "best" else 0.8, label=label,
                       edgecolors="black" if kind == "best" else None)
            seen_kinds.add(kind)
    if not drawn:
        have = sorted({m for t in trials for m in t.get("metrics", [])})
        raise InvalidConfigError(
            f"no report of these trials has metric {metric!r}; metrics there: "
            f"{', '.join(have) or '(none)'}")
    ax.set_xlabel("report (training_iteration)" if x_key == "training_iteration" else "time (s)")
    ax.set_ylabel(metric)
    title = (f"{trials[0]['experiment']}/{trials[0]['trial']}" if not several
             else f"{len(trials)} trials (star: best, triangle: latest, diamond: kept)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if several:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
                  ncols=ncols, frameon=False)
    else:
        ax.legend(loc="best", fontsize="small")
    return fig, drawn
