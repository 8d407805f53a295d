"""The metric a command ranks by, and the metrics it reads, as a command line needs them.

What the trial's retention state records lives in
:mod:`checkpoint_store.retention.recorded`; this module adds the command
line's side: a usage error when no metric is given or recorded, one rule
for every ``--metric`` flag (an empty name, and a metric no checkpoint of the
trial records, are usage errors, exit 2), a warning naming a retention state
that cannot be read, and a warning naming stored metrics that are not a JSON
object.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import click

from checkpoint_store._browse.locations import Location
from checkpoint_store._format.layout import MANAGER_STATE
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.retention.recorded import (
    UnreadableStateError,
    metric_value,
    recorded_run_id,
    score_attribute,
)

__all__ = ["metric_option", "refuse_unrecorded_metric", "resolve_metric", "stored_metrics",
           "warn_state_problem", "warn_unreadable_state"]


def _named_metric(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and value == "":
        raise click.BadParameter("'' names no metric; give a metric's name (nested "
                                 "metrics use '/', e.g. eval/loss)")
    return value


def metric_option(*decls: str, help: str, metavar: str = "M") -> Any:
    """The ``--metric`` option of every command: an empty name is a usage
    error (exit 2), never taken for "no metric given"."""
    return click.option(*(decls or ("--metric",)), default=None, metavar=metavar, help=help,
                        callback=_named_metric)


def mode_option() -> Any:
    """The ``--mode`` option of the commands that rank by a metric (``best``,
    ``prune``): ``"min"``, ``"max"`` or None (the trial's recorded order)."""
    return click.option(
        "--mode", type=click.Choice(["min", "max"]), default=None,
        help="min: lower is better; max: higher is better (default: the trial's "
             "recorded order when ranking by its recorded metric, else max).")


def refuse_unrecorded_metric(loc: Location,
                             committed: Iterable[tuple[Location, Mapping[str, Any]]],
                             metric: str | None, consequence: str) -> None:
    """Refuse a ``--metric`` that no checkpoint of ``loc`` records (a typo,
    say): every score would be missing, so a ranking would name (or keep) the
    newest instead of the best. ``consequence`` says what the command would
    have done wrong and that it did nothing. Nothing to refuse without
    checkpoints.

    Raises:
        InvalidConfigError: (exit 2) naming the metric and those the
            checkpoints record.
    """
    committed = list(committed)
    if metric is None or not committed:
        return
    if any(metric_value(stored_metrics(c, m, warn=False), metric) is not None
           for c, m in committed):
        return
    known = sorted({k for c, m in committed for k in stored_metrics(c, m, warn=False)})
    shown = ", ".join(known[:40]) + (f" and {len(known) - 40} more" if len(known) > 40 else "")
    raise InvalidConfigError(
        f"no checkpoint of {loc.uri} records the metric {metric!r}, so every score would "
        f"be missing and {consequence}. The checkpoints record: {shown or '(no metrics)'}; "
        "nested metrics use '/'"
    )


def warn_state_problem(trial: Location, problem: str) -> None:
    """Name on stderr the trial's retention state, there but unusable (``problem``)."""
    # ``problem`` is a phrase ("corrupt (...)") or a whole sentence naming the
    # file (a newer format's refusal): quoted, never spliced into this one.
    click.echo(f"warning: the retention state {trial.child(MANAGER_STATE).uri} cannot be "
               f"used: {problem}. What it records (such as checkpoints a read found "
               "damaged) is not known here, and the trial's next session.start replaces "
               "it with one rebuilt from the checkpoints", err=True)


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
