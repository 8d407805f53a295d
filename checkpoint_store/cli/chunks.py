"""``du``: logical against stored bytes of the checkpoints of an experiment,
and the collection of chunks no checkpoint uses (``gc`` calls it).

A checkpoint written with dedup on (``UploadConfig(dedup=True)``) keeps its
large files as chunks in its experiment's chunk store (docs/dedup.md); ``du``
reads every marker of the experiment (no chunk is read) and sums what the
checkpoints hold against what the store keeps.
"""

from __future__ import annotations

import posixpath
from dataclasses import asdict
from typing import Any

import click

from checkpoint_store._browse.locations import (
    Location,
    classify,
    describe_kind,
    resolve_location,
    trials_under,
)
from checkpoint_store._browse.output import fmt_size, print_json
from checkpoint_store._chunks.gc import GcReport, Usage, collect, usage
from checkpoint_store._chunks.refs import experiment_markers, union
from checkpoint_store._chunks.store import ChunkStore
from checkpoint_store._format.layout import CHUNK_DIR
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.cli.options import common_options, echo_info, storage_option
from checkpoint_store.errors import InvalidConfigError

__all__ = ["collect_experiment_chunks", "du_cmd"]


def _experiments(loc: Location) -> list[tuple[Location, str | None]]:
    """``(experiment dir, trial name or None)`` for each experiment at or under ``loc``."""
    kind = classify(loc)
    if kind == "trial":
        return [(loc.parent, loc.name)]
    if kind not in ("experiment", "root", "empty"):
        raise InvalidConfigError(
            f"{loc.uri} is {describe_kind(kind)}; du takes a storage root, an experiment "
            "or a trial directory")
    seen: dict[str, Location] = {}
    for trial in trials_under(loc, kind):
        seen.setdefault(trial.parent.path, trial.parent)
    return [(exp, None) for exp in seen.values()]


def _usage_json(u: Usage) -> dict[str, Any]:
    return {**asdict(u), "dedup_ratio": round(u.dedup_ratio, 4),
            "compression_ratio": round(u.compression_ratio, 4),
            "plain_bytes": u.logical_bytes - u.chunked_bytes}


def _row(name: str, u: Usage) -> str:
    plain = u.logical_bytes - u.chunked_bytes
    return (f"{name:<24} {u.checkpoints:>5}  {fmt_size(u.logical_bytes):>11}  "
            f"{fmt_size(plain + u.stored_bytes):>11}  {u.dedup_ratio:>6.2f}x  "
            f"{u.compression_ratio:>6.2f}x")


@click.command("du")
@click.argument("location")
@storage_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@common_options
def du_cmd(location: str, storage_options: dict[str, Any], as_json: bool) -> None:
    """Bytes the checkpoints under LOCATION hold against bytes stored.

    LOCATION is a storage root, an experiment or a trial. Per trial: its
    checkpoints, their logical bytes (every file as loaded, repeats
    included), the bytes stored for them (files kept whole, plus each chunk
    they use once, after compression), the dedup ratio (chunked bytes over
    distinct chunk bytes) and the compression ratio (distinct chunk bytes
    over their stored bytes). A chunk two trials share counts in each trial
    and once in the experiment's total; for a trial, the total is the
    trial's.

    \b
    Examples:
      checkpoint-store du ./results/exp
      checkpoint-store du s3://bucket/runs/exp/t1 --json
    """
    loc = resolve_location(location, storage_options)
    out = []
    for exp, only in _experiments(loc):
        report = usage(exp.path, experiment_markers(exp.fs, exp.path))
        trials = {t: u for t, u in report.trials.items() if only is None or t == only}
        # A trial asked for alone: its own total, not its experiment's.
        total = report.total if only is None else trials.get(only, Usage())
        out.append((exp, trials, total))
    if as_json:
        print_json([{"experiment": exp.uri,
                     "trials": {t: _usage_json(u) for t, u in trials.items()},
                     "total": _usage_json(total)} for exp, trials, total in out])
        return
    click.echo(f"{'trial':<24} {'ckpts':>5}  {'logical':>11}  {'stored':>11}  "
               f"{'dedup':>7}  {'codec':>7}")
    for exp, trials, total in out:
        echo_info(exp.uri)
        for name, u in trials.items():
            click.echo(_row(name, u))
        if len(trials) > 1:
            click.echo(_row("(experiment)", total))


def collect_experiment_chunks(exp: Location, *, dry_run: bool) -> GcReport | None:
    """Collect the unused chunks of experiment dir ``exp`` (None: it has no
    chunk store). With ``dry_run`` nothing is deleted or written."""
    root = posixpath.join(exp.path, CHUNK_DIR)
    if not _fsutil.is_dir(exp.fs, root):
        return None
    store = ChunkStore(exp.fs, root, capabilities=exp.backend.capabilities)
    return collect(store, lambda: union(experiment_markers(exp.fs, exp.path)),
                   dry_run=dry_run)
