"""The metric a command ranks by, and the metrics it reads, as a command line needs them.

What the trial's retention state records lives in
:mod:`checkpoint_store.retention.recorded`; this module adds the command
line's side: a usage error when no metric is given or recorded, and a
warning naming stored metrics that are not a JSON object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from checkpoint_store._browse.locations import Location
from checkpoint_store.retention.recorded import score_attribute

__all__ = ["resolve_metric", "stored_metrics"]


def resolve_metric(trial: Location, metric: str | None, mode: str | None,
                   required: bool) -> tuple[str | None, str]:
    """``(metric, mode)`` from the arguments, else the trial's recorded score
    attribute and order. Without ``mode``, the recorded order applies to the
    recorded attribute (``--metric loss`` on a trial ranking ``loss`` by
    ``min`` ranks by ``min``), else ``"max"``. A recorded order is passed on as
    stored: the retention layer names a bad one.

    Raises:
        click.UsageError: ``required`` and neither gives a metric.
        UnreadableStateError: the state that would decide is unreadable.
    """
    if metric is None or mode is None:
        recorded, recorded_mode = score_attribute(trial)
        if metric is None:
            metric = recorded
        if mode is None and metric is not None and metric == recorded:
            mode = recorded_mode
        if metric is None and required:
            raise click.UsageError(
                "--metric is required: this trial records no retention score attribute"
            )
    return metric, (mode or "max")


def stored_metrics(ckpt: Location, meta: Mapping[str, Any], *,
                   warn: bool = True) -> Mapping[str, Any]:
    """The metrics recorded with ``ckpt``; ``{}`` (with a warning naming it) when
    what is stored is not a JSON object: another tool or a hand edit wrote it."""
    metrics = meta.get("metrics")
    if metrics is None or isinstance(metrics, Mapping):
        return metrics or {}
    if warn:
        click.echo(f"warning: {ckpt.uri} records 'metrics' as a {type(metrics).__name__}, "
                   "not an object; treating it as no metrics", err=True)
    return {}
