"""``verify``: every byte of the checkpoints under a location read and checked,
and the damage found without reading named too.

Nothing here writes. Each checkpoint's files are read through
:meth:`Checkpoint.verify` (sizes and CRC32C); entries a listing finds invalid
(files not matching the manifest, a marker naming another index, a link or a
file in a checkpoint's place) are named without reading, as is a trial's
retention state that cannot be read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import click

from checkpoint_store._browse.locations import (
    Location,
    LocationKind,
    classify,
    committed_checkpoints,
    inspect_location,
    manifest_size,
    not_committed,
    not_walked_message,
    require_checkpoint,
    resolve_location,
    storage_context,
    trials_under,
)
from checkpoint_store._browse.output import one_line, print_json
from checkpoint_store._format.layout import MANAGER_STATE
from checkpoint_store.cli.options import (
    EXIT_FAILURE,
    common_options,
    echo_info,
    quiet,
    storage_option,
)
from checkpoint_store.cli.progress import counting_location, expected_files, progress_bar
from checkpoint_store.errors import CheckpointCorruptError, CheckpointNotFoundError

__all__ = ["verify_cmd"]


# -- verify -------------------------------------------------------------------------


def _verify_one(ckpt: Location, meta: Mapping[str, Any], on_bytes: Callable[[int], None],
                counting: bool = True) -> None:
    """Read every manifest file of one checkpoint and check its size and CRC32C
    (:meth:`Checkpoint.verify`), counting the bytes for the progress bar.

    Raises:
        CheckpointCorruptError: naming the first bad or missing file.
    """
    from checkpoint_store.checkpoint import Checkpoint

    expected = expected_files(ckpt, meta)
    counted = counting_location(ckpt, on_bytes, track=expected.__contains__) if counting else ckpt
    Checkpoint._from_backend(counted.backend, ckpt.path).verify()


def _corrupt_row(uri: str, file: str | None, error: str) -> dict[str, Any]:
    return {"uri": uri, "ok": False, "file": file, "error": error}


def _state_faults(trials: list[Location]) -> list[dict[str, Any]]:
    """``{"uri", "error"}`` of each trial whose retention state is there but
    cannot be used: a session would replace it, and with it what it recorded
    (the config, the checkpoints a read found damaged)."""
    from checkpoint_store.retention.statelog import state_problem

    out = []
    for trial in trials:
        ctx = storage_context(trial, strict=False)
        problem = state_problem(ctx) if ctx is not None else None
        if problem is not None:
            uri = trial.child(MANAGER_STATE).uri
            out.append({"uri": uri, "error": f"the retention state {uri} cannot be used: "
                                             f"{problem}. The trial's next session.start "
                                             "replaces it with one rebuilt from the "
                                             "checkpoints"})
    return out


def _verify_targets(
    loc: Location, kind: LocationKind, skipped: list[Location]
) -> tuple[list[tuple[Location, dict[str, Any]]], list[dict[str, Any]], list[Location]]:
    """``(checkpoints to read, report rows of corrupt ones found without reading,
    the trials walked)``; ``skipped`` receives the directories holding trials
    the walk did not reach (:func:`trials_under`)."""
    if kind == "checkpoint":
        return [(loc, require_checkpoint(loc))], [], []
    if kind == "corrupt":
        found = inspect_location(loc)
        return [], [_corrupt_row(loc.uri, found.file,
                                 f"checkpoint {loc.uri} is corrupt: {found.reason}")], []
    if kind == "uncommitted":
        require_checkpoint(loc)  # raises, saying why
    targets: list[tuple[Location, dict[str, Any]]] = []
    report: list[dict[str, Any]] = []
    trials = trials_under(loc, kind, skipped)
    for trial in trials:
        committed = committed_checkpoints(trial)
        targets.extend(committed)
        corrupt, _ = not_committed(trial, (c.name for c, _ in committed))
        for name, found in corrupt:
            uri = trial.child(name).uri
            report.append(_corrupt_row(uri, found.file,
                                       f"checkpoint {uri} is corrupt: {found.reason}"))
    return targets, report, trials


def _print_verify(report: list[dict[str, Any]], bad: int,
                  states: list[dict[str, Any]]) -> None:
    for r in report:
        if r["ok"]:
            if not quiet():
                click.echo(f"OK       {r['uri']}")
        else:
            click.echo(f"CORRUPT  {r['uri']}: {r['error']}")
    for r in states:
        click.echo(f"CORRUPT  {r['uri']}: {r['error']}")
    echo_info(f"{len(report)} checkpoints checked, {bad} corrupt"
              + (f"; {len(states)} unusable retention state(s)" if states else ""))


@click.command("verify")
@click.argument("uri")
@storage_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@common_options
def verify_cmd(uri: str, storage_options: dict[str, Any], as_json: bool) -> None:
    """Check the sizes and CRC32C checksums of one checkpoint, or of every checkpoint
    under URI (a trial, an experiment or a storage root).

    Exits 1 if any checkpoint is corrupt (each one is named with its first bad
    file; a marker naming another index, a link or a file in a checkpoint's
    place too), if a trial's retention state is there but cannot be read, if
    directories holding trials at another depth were not walked (a stray
    trial beside experiments), or if there is no committed checkpoint under URI.

    \b
    Examples:
      checkpoint-store verify ./results/exp/t1/checkpoint_000004
      checkpoint-store verify s3://bucket/runs
    """
    loc = resolve_location(uri, storage_options)
    kind = classify(loc)
    skipped: list[Location] = []
    targets, report, trials = _verify_targets(loc, kind, skipped)
    states = _state_faults(trials)
    # Not read is not checked: a verify that passed over them must not pass.
    unreached = [not_walked_message(skipped, loc, kind)] if skipped else []
    if not targets and not report and not states:
        raise CheckpointNotFoundError(f"no committed checkpoint under {loc.uri}"
                                      + "".join(f"; {why}" for why in unreached))
    total = sum(manifest_size(m) for _, m in targets)
    with progress_bar(f"verify {loc.name}", total) as bar:
        for ckpt, cmeta in targets:
            try:
                _verify_one(ckpt, cmeta, bar.advance, bar.enabled)
            except CheckpointCorruptError as exc:
                report.append(_corrupt_row(ckpt.uri, exc.file, one_line(str(exc))))
            else:
                report.append({"uri": ckpt.uri, "ok": True, "file": None, "error": None})
    bad = [r for r in report if not r["ok"]]
    if as_json:
        print_json({"uri": loc.uri, "checked": len(report), "corrupt": len(bad),
                    "checkpoints": report, "retention_states": states,
                    "not_walked": [s.uri for s in skipped]})
    else:
        _print_verify(report, len(bad), states)
        for why in unreached:
            click.echo(f"NOT WALKED  {why}")
    if bad or states or unreached:
        click.get_current_context().exit(EXIT_FAILURE)
