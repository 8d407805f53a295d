"""The commands that delete: ``prune`` (retention after the fact) and ``gc``
(uncommitted directories our writers left).

Both decide with the library's rules, never their own: ``prune`` selects with
:func:`checkpoint_store.retention.select_kept` and deletes through
:meth:`StorageContext.delete_checkpoint` (commit marker first); ``gc``
classifies with :meth:`StorageContext.scan` and measures ages on the
storage's clock. Both refuse a trial whose running job holds the manager's
lease (:func:`checkpoint_store.retention.live_lease`) unless ``--force``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import click

from checkpoint_store._browse.live import refuse_if_live
from checkpoint_store._browse.locations import (
    TRIAL_FILES,
    Location,
    committed_checkpoints,
    list_entries,
    not_committed,
    require_trial,
    resolve_location,
    storage_context,
)
from checkpoint_store._browse.output import fmt_size, fmt_value, print_json
from checkpoint_store._format.layout import is_internal_name, is_legacy_temp_file_name
from checkpoint_store._util import clock as _clock
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.cli.chunks import collect_experiment_chunks
from checkpoint_store.cli.metrics import (
    metric_option,
    mode_option,
    refuse_unrecorded_metric,
    resolve_metric,
    stored_metrics,
    warn_unreadable_state,
)
from checkpoint_store.cli.options import NumberAtLeast, common_options, echo_info, storage_option
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.retention.recorded import (
    UnreadableStateError,
    metric_value,
    recorded_config,
    recorded_run_id,
    score_attribute,
    stored_score,
)

__all__ = ["gc_cmd", "prune_cmd", "refuse_if_live"]




# -- prune ----------------------------------------------------------------------------


def _select(committed: list[tuple[Location, dict[str, Any]]], config: Any,
            metric: str | None) -> tuple[list[int], list[int], dict[int, tuple[str, ...]]]:
    """Positions (into ``committed``) kept and evicted, and for each kept one the
    policies keeping it, decided by :func:`checkpoint_store.retention.explain_kept`:
    the manager's exact semantics."""
    from checkpoint_store.retention import CheckpointRecord, explain_kept

    records = [CheckpointRecord(int(meta["index"]), ckpt.name, stored_metrics(ckpt, meta),
                                _created_at(meta)) for ckpt, meta in committed]
    if metric is not None:  # a stored non-number is named here, not as a usage error
        for (ckpt, _), rec in zip(committed, records, strict=True):
            stored_score(ckpt, rec.metrics, metric)
    kept, evicted, why = explain_kept(records, config)
    position = {ckpt.name: i for i, (ckpt, _) in enumerate(committed)}
    return ([position[r.dir_name] for r in kept], [position[r.dir_name] for r in evicted],
            {position[name]: labels for name, labels in why.items()})


def _split_foreign(loc: Location, committed: list[tuple[Location, dict[str, Any]]]
                   ) -> tuple[list[tuple[Location, dict[str, Any]]],
                              list[tuple[Location, dict[str, Any]]]]:
    """``(ours, foreign)``: a checkpoint naming another run (its ``run_id`` is not
    the one the trial's retention state records) or, without run ids, another
    trial is never ranked or deleted, by the manager's own rule
    (docs/retention.md, "What may retention delete?")."""
    from checkpoint_store.retention.recorded import foreign_names

    try:
        run_id = recorded_run_id(loc)
    except UnreadableStateError:  # the caller was told how to rank
        run_id = None
    theirs = foreign_names([(c.name, m) for c, m in committed], loc.name, run_id)
    return ([(c, m) for c, m in committed if c.name not in theirs],
            [(c, m) for c, m in committed if c.name in theirs])


def _without_invalid(loc: Location, committed: list[tuple[Location, dict[str, Any]]]
                     ) -> tuple[list[tuple[Location, dict[str, Any]]], dict[str, str]]:
    """``(committed, invalid)``: the checkpoints the trial's retention state
    records as found damaged by a read (a CRC32C no listing shows) are taken
    out, and with them every entry a listing finds invalid (a marker naming
    another index, a link or a file in a checkpoint's place, files not
    matching the manifest): ``name -> why``, sorted. None of them is ranked
    or deleted, by the manager's own rule (docs/retention.md)."""
    from checkpoint_store.retention import recorded_invalid

    ctx = storage_context(loc, strict=False)
    names = {c.name for c, _ in committed}
    invalid = {n: why for n, why in (recorded_invalid(ctx) if ctx is not None else {}).items()
               if n in names}
    corrupt, _ = not_committed(loc, names)
    invalid.update((name, found.reason or "invalid") for name, found in corrupt)
    return ([(c, m) for c, m in committed if c.name not in invalid],
            dict(sorted(invalid.items())))


def _created_at(meta: dict[str, Any]) -> float | None:
    value = meta.get("created_at")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def _prune_config(loc: Location, keep: int | None, metric: str | None, mode: str | None,
                  keep_latest: bool) -> tuple[Any, str | None, str]:
    """``(config, metric, order)``: the shorthand from ``--keep``, else the trial's
    recorded retention config (its policy included).

    Raises:
        click.UsageError: no ``--keep`` and nothing recorded to apply.
    """
    from checkpoint_store.retention import CheckpointConfig

    if keep is None and (metric is not None or mode is not None):
        # The recorded policy ranks by its own attribute: a flag taken and
        # then ignored would prune by another ranking than the one asked for.
        raise click.UsageError(
            "--metric and --mode rank with --keep; without --keep the trial's recorded "
            "retention policy is applied as recorded")
    if keep is None:
        config = recorded_config(loc)
        if config is None or (config.policy is None and config.num_to_keep is None):
            raise click.UsageError(
                "--keep is required: this trial records no retention policy to apply"
            )
        return config, config.checkpoint_score_attribute, config.checkpoint_score_order
    metric, order = resolve_metric(loc, metric, mode, required=False)
    config = CheckpointConfig(num_to_keep=keep, checkpoint_score_attribute=metric,
                              checkpoint_score_order=order, keep_latest=keep_latest)  # type: ignore[arg-type]
    return config, metric, order


def _check_rerank(loc: Location, metric: str | None, order: str, allowed: bool) -> None:
    """Refuse a ranking other than the one the trial recorded, or with
    ``allowed`` (a dry run, ``--rerank``) name it on stderr: a prune by
    another metric or order deletes what the trial's own ranking calls its best.

    Raises:
        InvalidConfigError: (exit 2) the rankings differ and not ``allowed``.
    """
    try:
        recorded, recorded_order = score_attribute(loc)
    except UnreadableStateError:
        return  # named by the prune itself: nothing recorded to compare with
    if recorded is None or (metric, order) == (recorded, recorded_order or "max"):
        return
    given = f"{metric!r} ({order})" if metric is not None else "recency"
    text = (f"{loc.uri} records ranking by {recorded!r} ({recorded_order}), but this prune "
            f"ranks by {given}")
    if allowed:
        click.echo(f"warning: {text}", err=True)
        return
    raise InvalidConfigError(
        f"{text}: it could delete the trial's best by its own ranking; nothing was deleted. "
        f"Pass --metric {recorded} --mode {recorded_order}, or --rerank to prune by the "
        "given ranking anyway (--dry-run shows what it would delete)")


def _print_prune(verb: str, metric: str | None, evicted: Iterable[dict[str, Any]],
                 kept: Iterable[dict[str, Any]]) -> None:
    label = f" ({metric}=" if metric else ""

    def suffix(d: dict[str, Any]) -> str:
        return f"{label}{fmt_value(d['score'])})" if metric else ""

    n_evicted = n_kept = 0
    for d in evicted:
        click.echo(f"{verb}  {d['uri']}{suffix(d)}")
        n_evicted += 1
    pad = " " * (len(verb) - len("kept"))
    for d in kept:
        echo_info(f"kept{pad}  {d['uri']}{suffix(d)}  by {', '.join(d['kept_by'])}")
        n_kept += 1
    echo_info(f"{n_evicted} {verb}, {n_kept} kept")


@click.command("prune")
@click.argument("trial")
@storage_option()
@click.option("--keep", type=click.IntRange(min=1), default=None, metavar="N",
              help="How many best checkpoints to keep. Without it, the retention policy "
                   "the trial's manager recorded is applied.")
@metric_option(help="Metric to rank by, with --keep; nested metrics use '/'. Without it "
                    "(and without a recorded retention attribute) the N most recent are "
                    "kept. One no checkpoint of the trial records is refused.")
@mode_option()
@click.option("--keep-latest/--no-keep-latest", default=True, show_default=True,
              help="Also keep the newest checkpoint (resume needs it), as the manager does.")
@click.option("--dry-run", is_flag=True, help="Print what would be deleted; delete nothing.")
@click.option("--force", is_flag=True,
              help="Prune even while a running job's checkpoint manager holds the trial.")
@click.option("--rerank", is_flag=True,
              help="Prune by --metric/--mode even where they differ from the metric and "
                   "order the trial recorded (refused without it: its best by the "
                   "recorded ranking could be deleted).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@common_options
def prune_cmd(trial: str, storage_options: dict[str, Any], keep: int | None,
              metric: str | None,
              mode: str | None, keep_latest: bool, dry_run: bool, force: bool,
              rerank: bool, as_json: bool) -> None:
    """Apply retention to TRIAL after the fact: keep the best N, delete the rest.

    Without --keep, the retention policy the trial's manager recorded (any
    CheckpointConfig(policy=...)) is applied. Each kept checkpoint is printed
    with the policies that keep it (for example "by BestN(1, 'loss', 'min'),
    LatestN(1)"); a stored user callable cannot be re-run and keeps everything.

    Same semantics as CheckpointManager (CheckpointConfig(num_to_keep=N,
    checkpoint_score_attribute=M, checkpoint_score_order=MODE)): NaN or
    missing scores rank last, ties go to the newer checkpoint, and the newest
    checkpoint is kept besides the best N unless --no-keep-latest. Each
    deletion removes the commit marker first, so an interrupted prune never
    leaves a half-deleted checkpoint that still lists as committed. A trial
    whose running job holds the manager's lease is refused (--force overrides).
    As after retention's evictions, the chunks (docs/dedup.md) that no
    checkpoint of the experiment uses any more are deleted.
    A --metric or --mode other than the metric and order the trial recorded
    is refused (exit 2; --dry-run shows it with a warning, --rerank prunes by
    it anyway): best means the recorded metric unless said otherwise.

    \b
    Examples:
      checkpoint-store prune ./results/exp/t1 --keep 3 --metric loss --mode min --dry-run
      checkpoint-store prune s3://bucket/runs/exp/t1 --keep 1 --metric acc --mode max
    """
    loc = resolve_location(trial, storage_options)
    require_trial(loc)
    config, metric, order = _prune_config(loc, keep, metric, mode, keep_latest)
    _check_rerank(loc, metric, order, dry_run or rerank)
    # Told how to rank: a state that cannot be read is named (and its record
    # of damaged checkpoints is lost to this ranking).
    warn_unreadable_state(loc, deep=True)
    committed, invalid = _without_invalid(loc, committed_checkpoints(loc))
    committed, foreign = _split_foreign(loc, committed)
    for ckpt, _ in foreign:
        click.echo(f"warning: {ckpt.uri} was written by another run or trial (copied in?): "
                   "left alone and not ranked, as the retention manager does", err=True)
    for name, reason in invalid.items():
        click.echo(f"warning: {loc.child(name).uri} is invalid ({reason}): left alone and "
                   "not ranked, as the retention manager does", err=True)
    refuse_unrecorded_metric(loc, committed, metric,
                             "pruning would delete the best ones; nothing was deleted")
    kept, evicted, why = _select(committed, config, metric)

    def describe(i: int) -> dict[str, Any]:
        ckpt, meta = committed[i]
        metrics = stored_metrics(ckpt, meta, warn=False)
        return {"name": ckpt.name, "uri": ckpt.uri, "index": meta["index"],
                "score": metric_value(metrics, metric) if metric else None,
                "kept_by": list(why.get(i, ()))}

    ctx = storage_context(loc)
    deleted = []
    chunks = None
    if not dry_run:
        refuse_if_live(loc, force, "prune it")
        for i in evicted:
            _delete(ctx, committed[i][0])
            deleted.append(describe(i))
        if deleted:
            # As retention does after each eviction: the chunks (docs/dedup.md)
            # no checkpoint of the experiment uses any more go too.
            chunks = collect_experiment_chunks(loc.parent, dry_run=False)
    if as_json:
        print_json({"uri": loc.uri, "dry_run": dry_run, "metric": metric, "mode": order,
                    "kept": [describe(i) for i in kept],
                    "evicted": [describe(i) for i in evicted],
                    "deleted": deleted, "foreign": [c.uri for c, _ in foreign],
                    "invalid": [{"name": n, "uri": loc.child(n).uri, "reason": reason}
                                for n, reason in invalid.items()],
                    "unused_chunks": None if chunks is None else {
                        "chunks": len(chunks.deleted), "bytes": chunks.bytes_freed}})
        return
    if chunks is not None:
        echo_info(f"freed {len(chunks.deleted)} unused chunk(s) of the experiment, "
                  f"{fmt_size(chunks.bytes_freed)}")
    _print_prune("would delete" if dry_run else "deleted", metric,
                 (describe(i) for i in evicted), (describe(i) for i in kept))


def _delete(ctx: Any, ckpt: Location) -> None:
    """Delete one evicted checkpoint, marker first. A re-saved path
    (Lightning's ``last.ckpt``, see :func:`~checkpoint_store._browse.locations.follow`)
    goes as the Lightning plugin removes it: the pointed sibling, then the
    pointer; deleting the pointer alone would let readers fall back to the
    sibling and bring the checkpoint back."""
    if ckpt.shown_as is None:
        ctx.delete_checkpoint(ckpt.name)
        return
    from checkpoint_store._commit.commit import delete_checkpoint_dir
    from checkpoint_store._util.ids import new_writer_id

    delete_checkpoint_dir(ckpt.backend, ckpt.path, writer_id=new_writer_id())
    _fsutil.delete_dir(ckpt.fs, ckpt.shown_as)


# -- gc -------------------------------------------------------------------------------


def _newest_mtime(loc: Location) -> float | None:
    newest = None
    for fi in loc.fs.get_file_info(_fsutil.pafs.FileSelector(loc.path, allow_not_found=True,
                                                             recursive=True)):
        if fi.mtime is not None:
            ts = fi.mtime.timestamp()
            newest = ts if newest is None else max(newest, ts)
    if newest is None:
        fi = _fsutil.info(loc.fs, loc.path)
        if fi.mtime is not None:
            newest = fi.mtime.timestamp()
    return newest


def _scan(trial: Location) -> tuple[list[str], list[str], list[str], list[str]]:
    """``(committed, uncommitted ours, active, foreign)`` entry names of a trial.

    Directories are classified by :meth:`StorageContext.scan` (a partial upload
    is ours only when it carries a trace of our writers); plain files that are
    neither trial files nor ours are reported as foreign too.
    """
    ctx = storage_context(trial)
    found = ctx.scan()
    entries = list_entries(trial)
    # Only direct children: some stores (adlfs) answer a shallow listing with deeper entries.
    children = {name for name, is_dir in entries if is_dir}
    active = [n for n in found.active if n in children]
    ours = [n for n in found.uncommitted if n not in set(active) and n in children]
    foreign = [n for n in found.foreign if n in children]
    for name, is_dir in entries:
        if not is_dir and name not in TRIAL_FILES and not is_internal_name(name) \
                and not is_legacy_temp_file_name(name):
            foreign.append(name)
    return [n for n in found.committed if n in children], ours, active, sorted(foreign)


def _collect(loc: Location, ours: list[str], min_age: float,
             dry_run: bool) -> tuple[list[str], list[str]]:
    """Remove (unless ``dry_run``) the directories in ``ours`` untouched for
    ``min_age`` seconds; returns ``(removed, too young)``."""
    from checkpoint_store._commit.protocols import protocol_for

    removed, too_young = [], []
    # Ages on the storage's clock, never this machine's: a clock running ahead
    # would make a live upload look abandoned.
    ages = _clock.age_on_storage(
        loc.fs, loc.path, loc.backend.capabilities,
        {name: _newest_mtime(loc.child(name)) for name in ours},
    ) if min_age > 0 and ours else {}
    for name in ours:
        age = ages.get(name)
        # An unknown age (stores without modification times) counts as recent.
        if min_age > 0 and (age is None or age < min_age):
            too_young.append(name)
            continue
        if not dry_run:
            # Traces (claims, markers) last: a gc cut short leaves a leftover, never foreign data.
            protocol_for(loc.backend).remove_leftover(loc.child(name).path)
        removed.append(name)
    return removed, too_young


@click.command("gc")
@click.argument("trial")
@storage_option()
@click.option("--min-age", type=NumberAtLeast(min=0), default=3600.0, show_default=True,
              metavar="SECONDS",
              help="Only remove directories untouched for this long, so a checkpoint still "
                   "being written by a running job is left alone.")
@click.option("--dry-run", is_flag=True, help="Print what would be removed; remove nothing.")
@click.option("--force", is_flag=True,
              help="Remove even while a running job's checkpoint manager holds the trial.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@common_options
def gc_cmd(trial: str, storage_options: dict[str, Any], min_age: float, dry_run: bool,
           force: bool, as_json: bool) -> None:
    """Remove the uncommitted directories this tool's writers left in TRIAL,
    and the chunks no checkpoint of its experiment uses any more.

    Removes staging directories, deletions cut short and partial uploads that
    carry a trace of our writers (see docs/format.md). Chunks (docs/dedup.md)
    that no checkpoint of any trial of the experiment references, committed
    or still being written, are deleted; retention does the same after each
    eviction, so this finds only what a crash left. Anything else that is
    not a committed checkpoint (a directory copied in by hand, a checkpoint
    whose marker we cannot read) is reported as foreign and never deleted.
    Committed checkpoints are never touched.

    \b
    Examples:
      checkpoint-store gc ./results/exp/t1 --dry-run
      checkpoint-store gc s3://bucket/runs/exp/t1 --min-age 0
    """
    loc = resolve_location(trial, storage_options)
    require_trial(loc)
    if not dry_run:
        refuse_if_live(loc, force, "remove directories from it")
    committed, ours, active, foreign = _scan(loc)
    removed, too_young = _collect(loc, ours, min_age, dry_run)
    too_young.extend(active)
    chunks = collect_experiment_chunks(loc.parent, dry_run=dry_run)
    freed = None if chunks is None else {"chunks": len(chunks.deleted),
                                         "bytes": chunks.bytes_freed}
    if as_json:
        print_json({"uri": loc.uri, "dry_run": dry_run, "committed": committed,
                    "removed": removed, "skipped_recent": sorted(too_young),
                    "foreign": foreign, "unused_chunks": freed})
        return
    verb = "would remove" if dry_run else "removed"
    if chunks is not None:
        echo_info(f"{'would free' if dry_run else 'freed'} {len(chunks.deleted)} unused "
                  f"chunk(s) of the experiment, {fmt_size(chunks.bytes_freed)}")
    for name in removed:
        click.echo(f"{verb}  {loc.child(name).uri}")
    for name in sorted(too_young):
        echo_info(f"skipped (in use or modified less than {min_age:g}s ago)  "
                  f"{loc.child(name).uri}")
    for name in foreign:
        click.echo(f"foreign (not ours, left alone)  {loc.child(name).uri}")
    echo_info(f"{len(removed)} {verb}, {len(too_young)} too recent, {len(foreign)} foreign, "
              f"{len(committed)} committed checkpoints untouched")
