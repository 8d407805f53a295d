"""The read-only commands that list: ``ls`` and ``show`` (``best`` is
:mod:`.best`, ``verify`` :mod:`.verify`).

Nothing here writes. What a location is comes from
:mod:`checkpoint_store._browse.locations`.
"""

from __future__ import annotations

import posixpath
import sys
from collections.abc import Mapping
from typing import Any

import click

from checkpoint_store._browse.experiment import summarize_trial, trial_checkpoints
from checkpoint_store._browse.locations import (
    Location,
    LocationKind,
    classify,
    committed_checkpoints,
    copy_of,
    list_entries,
    manifest_size,
    not_committed,
    not_walked_message,
    read_internal,
    recorded_checkpoints,
    require_checkpoint,
    resolve_location,
    storage_context,
    trials_under,
)
from checkpoint_store._browse.output import (
    fmt_size,
    fmt_time,
    fmt_value,
    print_json,
    shown,
    table,
)
from checkpoint_store._browse.status import (
    PREEMPTED,
    preemption_label,
    preemption_of,
    trial_status,
)
from checkpoint_store._format.layout import ERROR_FILE, is_internal_name, parse_checkpoint_dir_name
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.cli.metrics import (
    metric_option,
    refuse_unrecorded_metric,
    stored_metrics,
    warn_state_problem,
    warn_unreadable_state,
)
from checkpoint_store.cli.options import (
    common_options,
    quiet,
    storage_option,
)
from checkpoint_store.cli.tiers import annotate_rows, checkpoint_tiers, trial_tiers
from checkpoint_store.errors import (
    CheckpointNotFoundError,
    InvalidConfigError,
)
from checkpoint_store.retention.recorded import (
    UnreadableStateError,
    metric_value,
    monitored_attribute,
    score_attribute,
)

__all__ = ["ls_cmd", "show_cmd"]


# -- ls -----------------------------------------------------------------------------


def _listed_checkpoints(
    trial: Location, long: bool, problems: list[str] | None = None
) -> tuple[list[tuple[Location, dict[str, Any]]], list[tuple[str, bool]] | None, dict[str, str]]:
    """The trial's committed checkpoints with what ``ls`` shows of them, oldest first,
    but those its retention state records as invalid (``dir_name -> why``, the third).

    With ``long`` each one's internal metadata (its manifest: sizes, files) is
    read, about two requests per checkpoint. Without, the retention state
    names them (``index``, ``metrics``, ``created_at``) and one listing finds
    what it does not name, whatever the trial's history; a trial without a
    usable state (written without a manager, or by another tool) falls back
    to reading every checkpoint's metadata. Also the trial's listing when
    one was made that :func:`not_committed` may reuse. Why a retention state
    that is there cannot be used goes to ``problems``.
    """
    if not long:
        recorded = recorded_checkpoints(trial, problems)
        if recorded is not None:
            return recorded.checkpoints, recorded.entries, recorded.invalid
    invalid = _recorded_invalid(trial)
    return ([(c, m) for c, m in committed_checkpoints(trial) if c.name not in invalid], None,
            invalid)


def _recorded_invalid(trial: Location, *, warn: bool = False) -> dict[str, str]:
    """``dir_name -> why`` of the checkpoints of ``trial`` its retention state
    records as damaged: found by a read (a CRC32C that no listing shows) and
    never ranked, resumed from or deleted. With ``warn``, a state that is
    there but cannot be used (so cannot say) is named on stderr."""
    from checkpoint_store.retention.statelog import recorded_state

    ctx = storage_context(trial, strict=False)
    recorded, problem = recorded_state(ctx) if ctx is not None else ({}, None)
    if warn and problem is not None:
        warn_state_problem(trial, problem)
    return recorded


def _ls_trial(trial: Location, metric: str | None, long: bool) -> dict[str, Any]:
    explicit, warned = metric is not None, False
    if metric is None:
        try:
            metric, _ = score_attribute(trial)
        except UnreadableStateError as exc:  # a listing still helps; ranking commands refuse
            click.echo(f"warning: {exc}; scores not shown", err=True)
            warned = True
    else:
        warned = warn_unreadable_state(trial)
    rows = []
    problems: list[str] = []
    checkpoints, entries, invalid = _listed_checkpoints(trial, long, problems)
    if not warned and problems:  # a log record or chunk, the root being fine
        warn_state_problem(trial, problems[0])
    elif not warned and long:
        warn_unreadable_state(trial, deep=True)
    if explicit:
        refuse_unrecorded_metric(trial, checkpoints, metric,
                                 "every SCORE would be empty; nothing is listed")
    if metric is None:
        metric, _ = monitored_attribute(checkpoints)
    for ckpt, meta in checkpoints:
        metrics = stored_metrics(ckpt, meta)
        row = {
            "index": meta["index"],
            "name": ckpt.name,
            "uri": ckpt.uri,
            "created_at": meta.get("created_at"),
            "score": metric_value(metrics, metric) if metric else None,
        }
        if long:
            row.update(size=manifest_size(meta), files=len(meta.get("manifest", [])))
        row["preemption"] = preemption_of(meta)
        rows.append(row)
    corrupt, uncommitted = not_committed(trial, (r["name"] for r in rows), entries)
    shown = {n for n, _ in corrupt}
    # With a local tier: on which tiers each one is, whether its durable copy is pending.
    tiers, own = trial_tiers(trial, None if entries is None else (n for n, _ in entries))
    annotate_rows(trial, rows, tiers, own, metric)
    error = _last_error(trial)
    status, stop = trial_status(trial, None if entries is None else (n for n, _ in entries),
                                error)
    if status == PREEMPTED and rows and rows[-1]["preemption"] is None and not long:
        # The retention state records no preemption: the newest checkpoint's
        # metadata says whether the preempted run's last report committed it
        # (one read; --long reads every checkpoint's).
        rows[-1]["preemption"] = preemption_of(read_internal(trial.child(rows[-1]["name"])))
    return {"kind": "trial", "uri": trial.uri, "metric": metric, "checkpoints": rows,
            "status": status, "stop": stop,
            "error": error, "uncommitted": len(uncommitted),
            "corrupt": [{"name": n, "file": st.file, "reason": st.reason} for n, st in corrupt],
            "invalid": [{"name": n, "reason": why} for n, why in sorted(invalid.items())
                        if n not in shown]}


def _last_error(trial: Location) -> str | None:
    """The last line of the trial's ``error.txt`` (its last run's exception), or None."""
    try:
        text = _fsutil.read_bytes(trial.fs, posixpath.join(trial.path, ERROR_FILE))
    except (FileNotFoundError, OSError):
        return None
    lines = [line.strip() for line in text.decode("utf-8", "replace").splitlines()
             if line.strip()]
    return lines[-1] if lines else None


def _ls_experiment(exp: Location, long: bool) -> dict[str, Any]:
    """Each trial of ``exp`` with its status, the metric and order it records,
    its best score and checkpoint, and its parameters (:func:`summarize_trial`);
    with ``long`` its size (every checkpoint's metadata read)."""
    rows = []
    skipped: list[Location] = []
    trials = trials_under(exp, "experiment", skipped)
    if skipped:
        click.echo(f"warning: {not_walked_message(skipped, exp, 'experiment')}", err=True)
    for trial in trials:
        # Another run's checkpoints (copied in) left out: never the trial's best.
        listed, entries = trial_checkpoints(trial)
        summary = summarize_trial(trial, listed, entries)
        row = summary.to_dict()
        if long:
            committed, _, _ = _listed_checkpoints(trial, long)
            row["size"] = sum(manifest_size(m) for _, m in committed)
        rows.append(row)
    return {"kind": "experiment", "uri": exp.uri, "trials": rows}


def _ls_root(root: Location) -> dict[str, Any]:
    rows = []
    skipped: list[Location] = []
    for name, is_dir in list_entries(root):
        if not is_dir or is_internal_name(name):
            continue
        exp = root.child(name)
        trials = trials_under(exp, "experiment", skipped)
        if trials:
            rows.append({"name": name, "uri": exp.uri, "trials": len(trials)})
    if skipped:
        click.echo(f"warning: {not_walked_message(skipped, root, 'root')}", err=True)
    return {"kind": "root", "uri": root.uri, "experiments": rows}


def _ls_checkpoint(loc: Location, meta: Mapping[str, Any]) -> dict[str, Any]:
    files = [dict(e) for e in meta.get("manifest", [])]
    return {"kind": "checkpoint", "uri": loc.uri, "index": meta.get("index"),
            "created_at": meta.get("created_at"), "size": manifest_size(meta),
            "files": files}


def _ls_data(loc: Location, kind: LocationKind, metric: str | None,
             long: bool = False) -> dict[str, Any]:
    """What ``ls`` lists at ``loc``, as the JSON it prints with ``--json``; sizes
    and file counts of checkpoints only with ``long``."""
    if kind in ("checkpoint", "corrupt"):
        return _ls_checkpoint(loc, require_checkpoint(loc))
    if kind == "trial":
        return _ls_trial(loc, metric, long)
    if kind == "experiment":
        return _ls_experiment(loc, long)
    if kind in ("root", "empty"):
        return _ls_root(loc)
    if kind == "uncommitted":
        raise CheckpointNotFoundError(
            f"{loc.uri} is an uncommitted checkpoint directory (an interrupted write); "
            "`checkpoint-store gc` on its trial removes it"
        )
    raise InvalidConfigError(f"{loc.uri} is a file, not a directory of checkpoints")


def _print_ls_trial(trial: Location, data: Mapping[str, Any], long: bool) -> None:
    score_header = f"SCORE ({data['metric']})" if data["metric"] else "SCORE"
    rows = data["checkpoints"]
    if any(r.get("preemption") for r in rows):
        # A checkpoint committed on a preemption signal: marked in a NOTE column.
        table(["INDEX", "CHECKPOINT", "CREATED (UTC)", *(["SIZE"] if long else []),
               score_header, *(["TIERS", "DURABLE"] if any("tiers" in r for r in rows) else []),
               "NOTE"],
              [[str(r["index"]), r["name"], fmt_time(r["created_at"]),
                *([fmt_size(r.get("size"))] if long else []), fmt_value(r["score"]),
                *([",".join(r.get("tiers") or []) or "-", r.get("durable") or "-"]
                  if any("tiers" in r for r in rows) else []),
                preemption_label(r["preemption"]) if r.get("preemption") else "-"]
               for r in rows],
              right=[0, 3] if long else [0])
    elif any("tiers" in r for r in rows):
        table(["INDEX", "CHECKPOINT", "CREATED (UTC)", *(["SIZE"] if long else []),
               score_header, "TIERS", "DURABLE"],
              [[str(r["index"]), r["name"], fmt_time(r["created_at"]),
                *([fmt_size(r.get("size"))] if long else []), fmt_value(r["score"]),
                ",".join(r.get("tiers") or []) or "-", r.get("durable") or "-"] for r in rows],
              right=[0, 3] if long else [0])
    elif long:
        table(["INDEX", "CHECKPOINT", "CREATED (UTC)", "SIZE", score_header],
              [[str(r["index"]), r["name"], fmt_time(r["created_at"]), fmt_size(r["size"]),
                fmt_value(r["score"])] for r in data["checkpoints"]],
              right=[0, 3])
    else:
        table(["INDEX", "CHECKPOINT", "CREATED (UTC)", score_header],
              [[str(r["index"]), r["name"], fmt_time(r["created_at"]), fmt_value(r["score"])]
               for r in data["checkpoints"]],
              right=[0])
    if data["uncommitted"] and not quiet():
        click.echo(f"({data['uncommitted']} uncommitted directories not listed; "
                   "`checkpoint-store gc` removes those this tool left and reports "
                   "the rest)", err=True)
    for c in data["corrupt"]:
        click.echo(f"(corrupt, not listed: {shown(c['name'])}: {c['reason']}; "
                   "`checkpoint-store verify` checks the others)", err=True)
    for c in data["invalid"]:
        click.echo(f"(invalid, not listed: {shown(c['name'])}: {c['reason']}; found damaged by a "
                   "read, never ranked, resumed from or deleted by retention)", err=True)
    if data["error"] is not None:
        click.echo(f"(the trial's last run ended with an error: {data['error']}; "
                   f"its traceback is in {trial.child(ERROR_FILE).uri})", err=True)
    elif data["status"] == PREEMPTED and data["stop"] is not None:
        resume = (f"a new run resumes from {rows[-1]['name']}" if rows
                  else "no checkpoint was committed: a new run starts over")
        click.echo(f"(the trial's last run was preempted: {data['stop']['reason']}; "
                   f"resumable: {resume})", err=True)
    elif data["stop"] is not None:
        click.echo(f"(the trial's last run was {data['stop']['status']}: "
                   f"{data['stop']['reason']})", err=True)


def _fmt_params(params: Mapping[str, Any], width: int = 40) -> str:
    """``k=v,k=v`` of a trial's parameters (nested keys joined by ``/``), cut at ``width``."""
    from checkpoint_store._browse.experiment import flatten

    text = ",".join(f"{k}={fmt_value(v)}" for k, v in flatten(params).items()) or "-"
    return text if len(text) <= width else text[:width - 3] + "..."


def _print_ls_experiment(data: Mapping[str, Any], long: bool) -> None:
    header = ["TRIAL", "STATUS", "METRIC", "BEST", "PARAMS", "CHECKPOINTS", "LATEST",
              "LATEST CREATED (UTC)"]
    rows = [[r["name"], r["status"],
             f"{r['metric']} ({r['mode']})" if r["metric"] else "-",
             fmt_value(r["best_score"]), _fmt_params(r["params"]),
             str(r["checkpoints"]), fmt_value(r["latest_index"]),
             fmt_time(r["latest_created_at"])] for r in data["trials"]]
    if long:
        header.append("SIZE")
        for row, r in zip(rows, data["trials"], strict=True):
            row.append(fmt_size(r["size"]))
    table(header, rows, right=[3, 5, 6, 8] if long else [3, 5, 6])
    for r in data["trials"]:
        if r["status"] == PREEMPTED:
            click.echo(f"({shown(r['name'])} was preempted: {r['reason']}; resumable from its "
                       "newest checkpoint)", err=True)


def _print_ls(loc: Location, kind: LocationKind, data: Mapping[str, Any], long: bool) -> None:
    if kind == "checkpoint":
        table(["SIZE", "CRC32C", "FILE"],
              [[fmt_size(f["size"]), f.get("crc32c", "-"), f["path"]] for f in data["files"]],
              right=[0])
    elif kind == "trial":
        _print_ls_trial(loc, data, long)
    elif kind == "experiment":
        _print_ls_experiment(data, long)
    else:
        table(["EXPERIMENT", "TRIALS"],
              [[r["name"], str(r["trials"])] for r in data["experiments"]], right=[1])


@click.command("ls")
@click.argument("uri")
@storage_option()
@metric_option(help="Metric shown as SCORE for checkpoints (default: the trial's retention "
                    "score attribute). Nested metrics use '/', e.g. eval/loss. One no "
                    "checkpoint of the trial records is refused.")
@click.option("-l", "--long", "long", is_flag=True,
              help="Also show each checkpoint's size (and, with --json, its file count); "
                   "reads every checkpoint's metadata.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@common_options
def ls_cmd(uri: str, storage_options: dict[str, Any], metric: str | None, long: bool,
           as_json: bool) -> None:
    """List experiments, trials or checkpoints under URI.

    What is listed depends on what URI is: a storage root lists its
    experiments, an experiment its trials (with their status: running,
    interrupted, errored, pruned, stopped, preempted or finished), a trial
    its committed checkpoints (index, creation time in UTC, score; NOTE marks
    one committed on a preemption signal), a checkpoint its files.
    Uncommitted directories (interrupted writes) are never listed as
    checkpoints; their count is reported on stderr. Nor are corrupt or
    invalid ones (a checkpoint its retention state records as found damaged
    by a read); each is named on stderr.

    A trial's checkpoints come from its retention state and one listing, at a
    cost that does not grow with the number of checkpoints; --long adds their
    sizes by reading each one's metadata (about two requests per checkpoint).

    \b
    Examples:
      checkpoint-store ls ./results
      checkpoint-store ls ./results/exp/trial1 --metric val/accuracy
      checkpoint-store ls ./results/exp/trial1 --long
      checkpoint-store ls s3://bucket/runs -o endpoint_url=http://127.0.0.1:9000
      checkpoint-store ls az://container/runs/exp --json
    """
    loc = resolve_location(uri, storage_options)
    kind = classify(loc)
    data = _ls_data(loc, kind, metric, long)
    if as_json:
        print_json(data)
    else:
        _print_ls(loc, kind, data, long)


# -- show ---------------------------------------------------------------------------


def _print_show(loc: Location, meta: Mapping[str, Any], user: Mapping[str, Any],
                invalid: str | None) -> None:
    manifest = list(meta.get("manifest", []))
    click.echo(f"checkpoint      {loc.uri}")
    click.echo(f"state           {'committed' if invalid is None else 'invalid: ' + invalid}")
    click.echo(f"index           {meta.get('index')}")
    click.echo(f"created (UTC)   {fmt_time(meta.get('created_at'))}")
    click.echo(f"format          {meta.get('format_version')}")
    preemption = preemption_of(meta)
    if preemption is not None:
        grace = preemption["grace_period_s"]
        click.echo(f"{'preemption':<15} {preemption['signal']} at "
                   f"{fmt_time(preemption['signalled_at'])} UTC"
                   + (f" (grace {fmt_value(grace)} s)" if grace is not None else "")
                   + ", committed on the signal")
    for key in sorted(meta):
        if key not in ("index", "created_at", "format_version", "metrics", "manifest",
                       "tensors", *(("preemption",) if preemption is not None else ())):
            click.echo(f"{key:<15} {fmt_value(meta[key])}")
    tensors = meta.get("tensors")
    if isinstance(tensors, Mapping):  # a state's index (docs/state.md): its size, not its body
        from checkpoint_store.state._shards import stored_bytes

        data = stored_bytes({k: e for k, e in tensors.items() if isinstance(e, Mapping)})
        click.echo(f"tensors         {len(tensors)} ({fmt_size(data)})")
    click.echo(f"files           {len(manifest)} ({fmt_size(manifest_size(meta))})")
    for e in _largest(manifest):
        click.echo(f"  {fmt_size(e['size']):>10}  {e['path']}")
    click.echo("metrics")
    metrics = meta.get("metrics") or {}
    if not isinstance(metrics, Mapping):  # not ours to fix: show what is stored
        click.echo(f"  (not an object) {fmt_value(metrics)}")
        metrics = {}
    for key, value in sorted(metrics.items()):
        click.echo(f"  {key}: {fmt_value(value)}")
    tiers = checkpoint_tiers(loc, meta.get("index"))
    if tiers is not None:
        click.echo(f"tiers           {', '.join(tiers['tiers']) or '-'}")
        click.echo(f"durable copy    {tiers['durable'] or '-'}")
        for t in tiers["local_tiers"]:
            seen = "" if t["visible"] else " (not readable on this host)"
            click.echo(f"  local tier    {t['path']} (host {t['host']}, rank {t['rank']}){seen}")
    spark = _score_line(loc)
    if spark:
        click.echo(spark)
    click.echo("user metadata")
    if not user:
        click.echo("  (none)")
    for key, value in sorted(user.items()):
        click.echo(f"  {key}: {fmt_value(value)}")


def _largest(manifest: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(manifest, key=lambda e: -int(e.get("size", 0)))[:5]


def _score_line(loc: Location) -> str | None:
    """The trial's score sparkline, in block characters when stdout can print them."""
    from checkpoint_store._browse.spark import BARS, checkpoint_score_line

    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    unicode = BARS.encode(encoding, "replace").decode(encoding) == BARS
    return checkpoint_score_line(loc.backend, loc.path, unicode=unicode)


@click.command("show")
@click.argument("checkpoint")
@storage_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@common_options
def show_cmd(checkpoint: str, storage_options: dict[str, Any], as_json: bool) -> None:
    """Show a checkpoint's user and internal metadata and a manifest summary.

    Its state is ``committed``, or ``invalid`` with why when the trial's
    retention state records it as found damaged by a read, or when it is a
    copy of one of the trial's checkpoint_NNNNNN directories under another name.

    \b
    Examples:
      checkpoint-store show ./results/exp/trial1/checkpoint_000004
      checkpoint-store show s3://bucket/runs/exp/trial1/checkpoint_000004 --json
    """
    from checkpoint_store.checkpoint import Checkpoint

    loc = resolve_location(checkpoint, storage_options)
    meta = require_checkpoint(loc)
    user = Checkpoint._from_backend(loc.backend, loc.path).get_metadata()
    # Damage a read found (a CRC32C) shows in no listing: the trial's state says so.
    invalid = _recorded_invalid(loc.parent, warn=True).get(loc.name)
    if invalid is None and parse_checkpoint_dir_name(loc.name) is None:
        # A copy under another name (`cp -r checkpoint_000001 backup`) is not
        # the checkpoint of its index: ls, best and prune leave it out.
        invalid = copy_of(loc.name, meta, (n for n, _ in list_entries(loc.parent)))
    if not as_json:
        _print_show(loc, meta, user, invalid)
        return
    manifest = list(meta.get("manifest", []))
    internal = {k: v for k, v in meta.items() if k != "manifest"}
    summary = {"files": len(manifest), "bytes": manifest_size(meta),
               "largest": [{"path": e["path"], "size": e["size"]} for e in _largest(manifest)]}
    out = {"uri": loc.uri, "state": "committed" if invalid is None else "invalid",
           "reason": invalid, "preemption": preemption_of(meta),
           "internal_metadata": internal, "user_metadata": user, "manifest": summary}
    tiers = checkpoint_tiers(loc, meta.get("index"))
    if tiers is not None:
        out.update(tiers)
    print_json(out)
