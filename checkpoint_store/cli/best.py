"""``best``: the best checkpoint of a trial, or of an experiment's best trial.

Nothing here writes. The ranking is the retention manager's
(:func:`checkpoint_store.retention.rank_key`); an experiment's is
:class:`checkpoint_store.Experiment`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from checkpoint_store._browse.experiment import experiment_of
from checkpoint_store._browse.locations import (
    Location,
    classify,
    committed_checkpoints,
    foreign_of,
    list_entries,
    not_committed,
    read_internal,
    recorded_checkpoints,
    require_trial,
    resolve_location,
)
from checkpoint_store._browse.output import fmt_value, print_json, shown
from checkpoint_store.cli.inspection import _recorded_invalid
from checkpoint_store.cli.metrics import (
    metric_option,
    mode_option,
    refuse_unrecorded_metric,
    resolve_metric,
    stored_metrics,
    warn_state_problem,
    warn_unreadable_state,
)
from checkpoint_store.cli.options import common_options, storage_option
from checkpoint_store.cli.tiers import local_history
from checkpoint_store.errors import CheckpointNotFoundError, InvalidConfigError
from checkpoint_store.retention.recorded import monitored_attribute, stored_score

__all__ = ["best_cmd"]

#: A checkpoint, its metadata and its score (None: not numeric or absent).
_Scored = tuple[Location, Mapping[str, Any], float | None]


# -- best ---------------------------------------------------------------------------


@click.command("best")
@click.argument("trial", metavar="TRIAL|EXPERIMENT")
@storage_option()
@metric_option(help="Metric to rank by; nested metrics use '/'. Default: the trial's "
                    "retention score attribute. One no checkpoint of the trial records is "
                    "refused.")
@mode_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@common_options
def best_cmd(trial: str, storage_options: dict[str, Any], metric: str | None, mode: str | None,
             as_json: bool) -> None:
    """Print the best checkpoint of TRIAL (its URI on the first line) and its metrics.

    Given an EXPERIMENT (a directory of trials), the best checkpoint of its
    best trial, then the trial, its parameters and the checkpoint's metrics.
    Trials that recorded different metrics or orders are refused (exit 2):
    pass --metric and --mode.

    Ranking is the retention manager's: NaN or missing scores rank last, ties
    go to the newer checkpoint; a checkpoint the trial's retention state
    records as invalid (found damaged by a read) is left out, with a warning.

    \b
    Examples:
      checkpoint-store best ./results/exp/trial1 --metric loss --mode min
      checkpoint-store best s3://bucket/runs/exp/trial1 --metric eval/accuracy --mode max
      checkpoint-store best ./results/exp
      checkpoint-store download "$(checkpoint-store best ./results/exp/t1 --metric loss \\
          --mode min | head -n1)" ./best
    """
    from checkpoint_store.retention import rank_key

    loc = resolve_location(trial, storage_options)
    if classify(loc) == "experiment":
        _best_of_experiment(loc, metric, mode, as_json)
        return
    require_trial(loc)
    explicit, warned = metric is not None, False
    if metric is not None and mode is not None:  # else the state is read, and refused
        warned = warn_unreadable_state(loc)
    metric, order = resolve_metric(loc, metric, mode, required=False)
    # The retention state records every kept checkpoint's metrics: no need to
    # read each one's metadata (the full walk is for trials without a state).
    problems: list[str] = []
    recorded = recorded_checkpoints(loc, problems)
    if problems and not warned:
        warn_state_problem(loc, problems[0])
    committed = recorded.checkpoints if recorded is not None else committed_checkpoints(loc)
    invalid = dict(recorded.invalid if recorded is not None else _recorded_invalid(loc))
    # What a listing finds invalid (a marker naming another index, a link or a
    # file in a checkpoint's place, files not matching the manifest): named too.
    entries = recorded.entries if recorded is not None else None
    if entries is None:
        entries = list_entries(loc)
    corrupt, _ = not_committed(loc, (c.name for c, _ in committed), entries)
    invalid.update((name, found.reason or "invalid") for name, found in corrupt
                   if name not in invalid)
    for name, why in sorted(invalid.items()):
        click.echo(f"warning: {shown(name)} is invalid ({why}); not ranked", err=True)
    # Another run's or trial's (copied in): never ranked, as the manager ranks.
    foreign = foreign_of(loc, committed, recorded)
    for name in sorted(foreign):
        click.echo(f"warning: {loc.child(name).uri} was written by another run or trial "
                   "(copied in?): not ranked, as the retention manager does", err=True)
    # With a local tier on this host: its copies of the trial's history too.
    local = local_history(loc, committed, [name for name, _ in entries])
    committed = [(c, m) for c, m in committed
                 if c.name not in invalid and c.name not in foreign] + local
    if metric is None:  # no retention state: the framework's monitored metric, if recorded
        metric, monitored_mode = monitored_attribute(committed)
        if metric is None:
            raise click.UsageError(
                "--metric is required: this trial records no retention score attribute")
        order = mode or monitored_mode or "max"
    if not committed:
        raise CheckpointNotFoundError(f"trial {loc.uri} has no committed checkpoint")
    if explicit:
        try:
            refuse_unrecorded_metric(loc, committed, metric,
                                     "the newest checkpoint would be named instead of the "
                                     "best; nothing is printed")
        except InvalidConfigError as exc:
            # A metric no checkpoint records names no best: not found (exit 1).
            raise CheckpointNotFoundError(str(exc)) from exc
    scored: list[_Scored] = [
        (ckpt, meta, stored_score(ckpt, stored_metrics(ckpt, meta), metric))
        for ckpt, meta in committed]
    scored.sort(key=lambda t: rank_key(t[2], t[1]["index"], order), reverse=True)
    if recorded is not None:
        scored = _still_committed(scored)
    if not scored:
        raise CheckpointNotFoundError(f"trial {loc.uri} has no committed checkpoint")
    best_ckpt, best_meta, best_score = scored[0]
    if best_score is None:
        click.echo(f"warning: no checkpoint of {loc.uri} has a numeric {metric!r}; "
                   "picked the newest", err=True)
    metrics = stored_metrics(best_ckpt, best_meta, warn=False)
    if as_json:
        print_json({"uri": best_ckpt.uri, "index": best_meta["index"], "metric": metric,
                    "mode": order, "score": best_score, "metrics": metrics})
        return
    click.echo(best_ckpt.uri)
    for key, value in sorted(metrics.items()):
        click.echo(f"  {key}: {fmt_value(value)}")


def _best_of_experiment(loc: Location, metric: str | None, mode: str | None,
                        as_json: bool) -> None:
    """``best`` of an experiment: :meth:`Experiment.best_trial` and its checkpoint."""
    exp = experiment_of(loc)
    from checkpoint_store.retention import score_of

    trial = exp.best_trial(metric, mode)
    ckpt = exp.best_checkpoint(metric, mode)
    metric, mode = exp.ranking(metric, mode)
    meta = ckpt.internal_metadata
    stored = meta.get("metrics")
    metrics: Mapping[str, Any] = stored if isinstance(stored, Mapping) else {}
    score = score_of(metrics, metric)
    if as_json:
        print_json({"uri": ckpt.uri, "index": meta.get("index"), "trial": trial.name,
                    "trial_uri": trial.uri, "metric": metric, "mode": mode, "score": score,
                    "params": trial.params, "metrics": metrics})
        return
    click.echo(ckpt.uri)
    click.echo(f"  trial: {shown(trial.name)} ({trial.status})")
    click.echo(f"  {metric} ({mode}): {fmt_value(score)}")
    from checkpoint_store._browse.experiment import flatten

    for key, value in sorted(flatten(trial.params).items()):
        click.echo(f"  param {key}: {fmt_value(value)}")
    for key, value in sorted(metrics.items()):
        if key != metric:
            click.echo(f"  {key}: {fmt_value(value)}")


def _still_committed(ranked: list[_Scored]) -> list[_Scored]:
    """``ranked`` from the first whose commit marker is still there: the state
    records what was committed, and a marker deleted by hand since (the
    directory is uncommitted now) must not be the answer. One read in the
    usual case, not one per checkpoint."""
    for i, (ckpt, _meta, _score) in enumerate(ranked):
        if read_internal(ckpt) is not None:
            return ranked[i:]
        click.echo(f"warning: {ckpt.uri} is in the retention state but has no valid "
                   "commit marker now (changed by hand?); skipped", err=True)
    return []
