"""The metric a command ranks by, and the metrics it reads, as a command line needs them.

What the trial's retention state records lives in
:mod:`checkpoint_store.retention.recorded`; this module adds the command
line's side: a usage error when no metric is given or recorded, a warning
naming a retention state that cannot be read, and a warning naming stored
metrics that are not a JSON object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from checkpoint_store._browse.locations import Location
from checkpoint_store._format.layout import MANAGER_STATE
from checkpoint_store.retention.recorded import (
    UnreadableStateError,
    recorded_run_id,
    score_attribute,
)

__all__ = ["resolve_metric", "stored_metrics", "warn_state_problem", "warn_unreadable_state"]


def warn_state_problem(trial: Location, problem: str) -> None:
    """Name on stderr the trial's retention state, there but unusable (``problem``)."""
    click.echo(f"warning: the retention state {trial.child(MANAGER_STATE).uri} is {problem}; "
               "it is not used here (what it records, such as checkpoints a read found "
               "damaged, is not known), and the trial's next session.start replaces it with "
               "one rebuilt from the checkpoints", err=True)


def warn_unreadable_state(trial: Location, *, deep: bool = False) -> bool:
    """Name on stderr a retention state that is there but cannot be read, for a
    command that goes on without it; True when it did. Reads the root (one
    request); ``deep`` also reads the log records after it (and lists the
    trial), as a restart does.

    Raises:
        CheckpointStoreError: the store refused the read.
    """
    try:
        recorded_run_id(trial)
    except UnreadableStateError as exc:
        click.echo(f"warning: {exc}", err=True)
        return True
    if not deep:
        return False
    from checkpoint_store._browse.locations import storage_context
    from checkpoint_store.retention.statelog import state_problem

    ctx = storage_context(trial, strict=False)
    problem = state_problem(ctx, lazy=True) if ctx is not None else None
    if problem is not None:
        warn_state_problem(trial, problem)
    return problem is not None


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
