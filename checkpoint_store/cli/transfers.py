"""The commands that move checkpoints: ``download``, ``upload`` and ``cp``.

Every write goes through the library's commit
(:func:`checkpoint_store._commit.commit.commit_checkpoint`: files first, the commit
marker last), so a reader never sees a partial copy. This module decides
*where* a checkpoint lands (:func:`checkpoint_destination`) and checks the
source against its manifest while it streams, so a corrupt source is never
committed at the destination.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import click

from checkpoint_store._browse.live import refuse_if_live
from checkpoint_store._browse.locations import (
    TRIAL_FILES,
    Location,
    LocationKind,
    classify,
    committed_checkpoints,
    list_entries,
    manifest_size,
    not_committed,
    not_walked_message,
    read_internal,
    require_checkpoint,
    resolve_location,
    storage_context,
    trials_under,
)
from checkpoint_store._browse.output import fmt_size, one_line
from checkpoint_store._commit.nesting import refuse_inside_checkpoint
from checkpoint_store._format.layout import (
    INTERNAL_METADATA,
    MANAGER_STATE,
    RESULT_FILE,
    check_name_length,
    checkpoint_dir_name,
    is_internal_file,
    parse_checkpoint_dir_name,
    refuse_reserved,
)
from checkpoint_store._results.reader import assembled_result_bytes
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.cli.options import common_options, echo_info, storage_option
from checkpoint_store.cli.progress import counting_location, expected_files, progress_bar
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointStoreError,
    InvalidConfigError,
)

__all__ = ["CopyOutcome", "checkpoint_destination", "cp_cmd", "download_cmd", "upload_cmd"]

#: What copying one checkpoint did: committed it, or found it already there.
CopyOutcome = Literal["copied", "skipped"]


# -- where a checkpoint lands ------------------------------------------------------------


def _checkpoint_meta_for(dest: Location, base: Mapping[str, Any] | None,
                         index: int) -> dict[str, Any]:
    """Internal metadata fields for a checkpoint committed at ``dest`` by this tool."""
    meta = {k: v for k, v in (base or {}).items()
            if k not in ("manifest", "format_version", "chunk_root")}
    trial_path = posixpath.dirname(dest.path.rstrip("/"))
    meta["index"] = index
    meta.setdefault("created_at", time.time())
    trial_name = posixpath.basename(trial_path)
    experiment_name = posixpath.basename(posixpath.dirname(trial_path))
    if trial_name:
        meta["trial_name"] = trial_name
    if experiment_name:
        meta["experiment_name"] = experiment_name
    return meta


def checkpoint_destination(
    dst: Location, default_name: str | None, recorded_index: int | None = None
) -> tuple[Location, int]:
    """``dst`` itself when named ``checkpoint_NNNNNN``, else a checkpoint inside the
    trial directory ``dst`` (``default_name``, or the next free index). A
    ``default_name`` of another form (Ray Train's ``checkpoint_<time>``) keeps
    the source's ``recorded_index``.

    Returns:
        ``(checkpoint location, its index)``.

    Raises:
        click.UsageError: ``dst`` cannot be made a trial (see :func:`_require_trial_target`),
            or is named ``checkpoint_NNNNNN`` but not as its index is
            (``checkpoint_0000007``): every reader would take it for invalid.
    """
    index = parse_checkpoint_dir_name(dst.name)
    if index is not None:
        if dst.name != checkpoint_dir_name(index):
            raise click.UsageError(
                f"{dst.uri}: {dst.name!r} is not how index {index} is named; a checkpoint "
                f"there would be invalid (its name is its identity): name it "
                f"{checkpoint_dir_name(index)!r}")
        return dst, index
    if default_name is not None:
        parsed = parse_checkpoint_dir_name(default_name)
        if parsed is None:
            assert recorded_index is not None
            parsed = recorded_index
        return dst.child(default_name), parsed
    _require_trial_target(dst)
    dirs = [parse_checkpoint_dir_name(n) for n, d in list_entries(dst)]
    taken = [i for i in dirs if i is not None]
    index = max(taken) + 1 if taken else 0
    return dst.child(checkpoint_dir_name(index)), index


def _require_fitting_names(dst: Location, trial: Location,
                            files: Iterable[str] = ()) -> None:
    """Refuse, before anything is written, a destination whose name has a
    component no local disk keeps (over 255 bytes: a checkpoint must stay
    copyable anywhere) or a character its store cannot keep; whose ``trial``
    or experiment (the trial's parent) takes a name our layout reserves
    (it would make the experiment look like a trial); or a checkpoint file
    name in ``files`` that the destination store cannot keep.

    Raises:
        InvalidConfigError: naming the name and what to do.
    """
    for part in dst.path.split("/"):
        check_name_length(part, "destination name")
        dst.backend.check_name(part, "destination name")
    refuse_reserved(trial.name, "destination trial name")
    refuse_reserved(trial.parent.name, "destination experiment name")
    for rel in files:
        dst.backend.check_name(rel, f"file of the checkpoint copied to {dst.uri}:")


def _kind_or_none(loc: Location) -> LocationKind | None:
    try:
        return classify(loc)
    except CheckpointNotFoundError:
        return None


def _require_trial_target(dst: Location) -> None:
    """Refuse to make ``dst`` a trial where that would hide or nest trials: it
    must be a trial already, empty, or new, and not inside another trial."""
    kind = _kind_or_none(dst)
    if kind not in (None, "empty", "trial"):
        what = {"experiment": "an experiment (it holds trials)", "file": "a file"}.get(
            kind or "", "a directory that holds other data, not checkpoints")
        raise click.UsageError(
            f"{dst.uri} is {what}, not a trial directory; give a trial directory "
            "(e.g. .../<experiment>/<trial>) or a .../checkpoint_NNNNNN path"
        )
    parent = dst.parent
    if kind is None and parent.path != dst.path and _kind_or_none(parent) == "trial":
        raise click.UsageError(
            f"{parent.uri} is a trial: a trial inside it would be hidden. Upload into "
            f"the trial itself, or name the checkpoint {parent.uri}/checkpoint_NNNNNN"
        )


def _place(loc: Location) -> str:
    """One spelling of where ``loc`` is, for overlap checks: the real path on a
    local disk (symlinks and ``..`` resolved), else the URI."""
    local = _fsutil.local_path(loc.fs, loc.path)
    return os.path.realpath(local) if local is not None else loc.uri.rstrip("/")


def _inside(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip("/") + "/")


def refuse_overlap(src: Location, dst: Location, verb: str) -> None:
    """Refuse, before the first write, a destination inside the source or a
    source inside the destination: the write would change the source while it
    is read (a committed checkpoint would no longer match its manifest).

    Raises:
        InvalidConfigError: the two overlap (exit code 2, a usage error).
    """
    s, d = _place(src), _place(dst)
    if not (_inside(d, s) or _inside(s, d)):
        return
    how = ("is the source" if s == d else "lies inside the source" if _inside(d, s)
           else "holds the source")
    raise InvalidConfigError(
        f"cannot {verb} {src.uri} to {dst.uri}: the destination {how}; choose a "
        "destination outside it (nothing was written)"
    )


# -- download -------------------------------------------------------------------------


@click.command("download")
@click.argument("checkpoint")
@click.argument("dest", type=click.Path(file_okay=False))
@storage_option()
@click.option("--no-verify", is_flag=True,
              help="Skip the size and CRC32C check of each file against the manifest.")
@common_options
def download_cmd(checkpoint: str, dest: str, storage_options: dict[str, Any],
                 no_verify: bool) -> None:
    """Download CHECKPOINT's files into the local directory DEST, checking each file.

    DEST is created if needed. Internal files (.internal_metadata.json) are
    not copied; .user_metadata.json is.

    \b
    Examples:
      checkpoint-store download s3://bucket/runs/exp/t1/checkpoint_000007 ./ckpt
      checkpoint-store download az://c/runs/exp/t1/checkpoint_000007 ./ckpt -q
    """
    from checkpoint_store.checkpoint import Checkpoint

    loc = resolve_location(checkpoint, storage_options)
    refuse_overlap(loc, resolve_location(os.path.abspath(dest), {}), "download")
    meta = require_checkpoint(loc)
    total = manifest_size(meta)
    tracked = set(expected_files(loc, meta))
    with progress_bar(f"download {loc.name}", total, finishing="finishing") as bar:
        # Counting costs a copy per read: only when a bar shows the count.
        src = counting_location(loc, bar.advance, track=tracked.__contains__) \
            if bar.enabled else loc
        target = Checkpoint._from_backend(src.backend, loc.path).to_directory(
            dest, verify=not no_verify)
    echo_info(f"downloaded {len(tracked)} files ({fmt_size(total)}) of {loc.uri} to {target}")


# -- upload ---------------------------------------------------------------------------


def _parse_metrics(metrics_json: str | None) -> dict[str, Any]:
    from checkpoint_store._format import jsonrules as _json

    if metrics_json is None:
        return {}
    try:
        return _json.to_json_object(_json.loads(metrics_json), "metrics")
    except ValueError as exc:
        raise click.BadParameter(f"not a JSON object: {exc}", param_hint="--metrics") from None


@click.command("upload")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.argument("uri")
@storage_option()
@click.option("--metrics", "metrics_json", default=None, metavar="JSON",
              help='Metrics recorded with the checkpoint, e.g. \'{"loss": 0.12}\'.')
@common_options
def upload_cmd(directory: str, uri: str, storage_options: dict[str, Any],
               metrics_json: str | None) -> None:
    """Upload a local DIRECTORY as a committed checkpoint at URI.

    URI is either a checkpoint path (.../checkpoint_000012) or a trial
    directory, where the next free index is used. The checkpoint is
    committed the usual way (manifest with CRC32C, internal metadata last),
    so readers never see a partial upload. Prints the checkpoint's URI.

    \b
    Examples:
      checkpoint-store upload ./model_dir s3://bucket/runs/exp/trial1
      checkpoint-store upload ./model_dir ./results/exp/t1/checkpoint_000003 \\
          --metrics '{"loss": 0.12}'
    """

    from checkpoint_store._commit.commit import commit_checkpoint
    from checkpoint_store._transfer.trees import source_files

    metrics = _parse_metrics(metrics_json)
    src = resolve_location(os.path.abspath(directory), {})
    target = resolve_location(uri, storage_options)
    refuse_overlap(src, target, "upload")
    dst, index = checkpoint_destination(target, None)
    refuse_inside_checkpoint(dst.backend, dst.parent.path, "upload destination")
    _require_fitting_names(dst, dst.parent)
    # The running job's next report would take the same index: refused, and
    # no --force, since a write into a live trial is never safe.
    refuse_if_live(dst.parent, None, "upload a checkpoint into it")
    # Every name checked before the first write.
    files = source_files(src.fs, src.path, dest_caps=dst.backend.capabilities,
                         dest_name=dst.backend.name or dst.backend.scheme)
    total = sum(size for rel, size in files if not is_internal_file(rel))
    meta = _checkpoint_meta_for(dst, {"metrics": metrics, "world_size": 1}, index)
    with progress_bar(f"upload {dst.name}", total, finishing="committing") as bar:
        source = counting_location(src, bar.advance) if bar.enabled else src
        written = commit_checkpoint(source.fs, src.path, dst.backend, dst.path, meta)
    echo_info(f"uploaded {len(written['manifest'])} files ({fmt_size(total)}) as:")
    click.echo(dst.uri)


# -- cp -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _CopyJob:
    """One committed checkpoint to copy: ``src`` (metadata ``meta``) to ``dst`` as ``index``."""

    src: Location
    meta: dict[str, Any]
    dst: Location
    index: int


@dataclasses.dataclass
class _CopyTally:
    copied: int = 0
    skipped: int = 0
    copied_bytes: int = 0
    corrupt: list[CheckpointCorruptError] = dataclasses.field(default_factory=list)


def _manifest_key(m: Mapping[str, Any]) -> set[tuple[str, int, str]]:
    return {(e["path"], int(e["size"]), e["crc32c"]) for e in m.get("manifest", [])}


def _same_manifest(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return _manifest_key(a) == _manifest_key(b)


def _first_difference(want: Mapping[str, Any], got: Mapping[str, Any]) -> str | None:
    have = {e["path"]: (int(e["size"]), e["crc32c"]) for e in got.get("manifest", [])}
    for e in sorted(want.get("manifest", []), key=lambda e: e["path"]):
        if have.get(e["path"]) != (int(e["size"]), e["crc32c"]):
            return str(e["path"])
    extra = sorted(set(have) - {e["path"] for e in want.get("manifest", [])})
    return extra[0] if extra else None


def _copy_checkpoint(job: _CopyJob, on_bytes: Callable[[int], None]) -> CopyOutcome:
    """Copy one committed checkpoint; "skipped" when an identical one is there.

    The source is checked against its manifest while it streams, so a corrupt
    source fails before the destination is committed.

    Raises:
        CheckpointConflictError: a different committed checkpoint is at the destination.
        CheckpointCorruptError: the source does not match its manifest; nothing
            stays committed at the destination.
    """
    import pyarrow.fs as pafs

    from checkpoint_store._chunks.files import chunked_entries
    from checkpoint_store._chunks.read import materialized
    from checkpoint_store._commit.commit import commit_checkpoint
    from checkpoint_store._transfer.trees import source_files

    src, dst = job.src, job.dst
    existing = read_internal(dst)
    if existing is not None:
        if _same_manifest(existing, job.meta):
            on_bytes(manifest_size(job.meta))
            return "skipped"
        raise CheckpointConflictError(
            f"{dst.uri} is already a committed checkpoint with different contents"
        )
    if chunked_entries(job.meta):  # the copy holds real files: read its chunks first
        with materialized(src.fs, src.path, src.backend.capabilities, job.meta) as local:
            written = commit_checkpoint(pafs.LocalFileSystem(), local, dst.backend, dst.path,
                                        _checkpoint_meta_for(dst, job.meta, job.index))
        on_bytes(manifest_size(job.meta))
        return "copied"
    # A checkpoint's files are its own: a symlink leading out of it is refused
    # here, on the unwrapped source, before the first write.
    source_files(src.fs, src.path, confine_links=True)
    counted = counting_location(src, on_bytes, expected=expected_files(src, job.meta))
    try:
        written = commit_checkpoint(counted.fs, src.path, dst.backend, dst.path,
                                    _checkpoint_meta_for(dst, job.meta, job.index),
                                    confine_links=True)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(
            f"source {src.uri} is corrupt: {exc}; nothing was committed at {dst.uri}",
            path=src.path, file=exc.file,
        ) from None
    # Ranged reads of large files are not checksummed while they stream; the
    # manifest computed on the bytes that arrived must equal the source's.
    if not _same_manifest(written, job.meta):
        bad = _first_difference(job.meta, written)
        _fsutil.delete_file(dst.fs, posixpath.join(dst.path, INTERNAL_METADATA))
        _fsutil.delete_dir(dst.fs, dst.path)
        raise CheckpointCorruptError(
            f"source {src.uri} is corrupt: file {bad!r} does not match its manifest; "
            f"the copy at {dst.uri} was removed", path=src.path, file=bad,
        )
    return "copied"


def _copy_trial_files(src: Location, dst: Location) -> None:
    """Copy the trial files; ``result.json`` goes out assembled with the rows a
    live or killed run left in segments (object stores), which are not copied,
    and the retention state whole (:func:`_copy_state`)."""
    state_copied = _copy_state(src, dst)
    for name in sorted(TRIAL_FILES):
        if name == MANAGER_STATE and state_copied:
            continue
        path = posixpath.join(src.path, name)
        try:
            if name == RESULT_FILE:
                data = assembled_result_bytes(src.fs, src.path)[0]
                if data is None:
                    continue
            else:
                data = _fsutil.read_bytes(src.fs, path)
        except (FileNotFoundError, OSError):
            if _fsutil.exists(src.fs, path):
                raise
            continue
        _fsutil.write_bytes(dst.fs, posixpath.join(dst.path, name), data,
                            dst.backend.capabilities)


def _copy_state(src: Location, dst: Location) -> bool:
    """Copy the source trial's retention state as one snapshot at ``dst``; False
    when there is none to read that way (then its root is copied as stored).

    The state is a root plus the log records and chunks after it
    (docs/format.md, "Retention state"); the root alone is the state as of its
    last snapshot, up to 16 reports old, and a run resumed from such a copy
    numbered its next checkpoint with an index the source had already used.
    The destination's own parts from an earlier copy are replaced.
    """
    from checkpoint_store.retention.statelog import StateLog

    src_ctx = storage_context(src, strict=False)
    dst_ctx = storage_context(dst, strict=False)
    if src_ctx is None or dst_ctx is None:
        return False
    state, _ = StateLog(src_ctx).load()
    if state is None:
        return False
    log = StateLog(dst_ctx)
    log.load()  # numbering past the destination's parts; they go after the snapshot
    if not log.compact(state):
        raise CheckpointStoreError(f"could not write the retention state of {dst.uri}")
    return True


@dataclasses.dataclass
class _CopyPlan:
    """What ``cp s d`` does: the checkpoints to copy, the (source trial,
    destination trial) pairs whose trial files follow, and the corrupt source
    checkpoints (a marker whose files do not match it) that fail the copy."""

    jobs: list[_CopyJob]
    trial_pairs: list[tuple[Location, Location]]
    corrupt: list[CheckpointCorruptError]
    unreached: str = ""  # directories holding trials a walk passed over (trials_under)


def _plan_copy(s: Location, d: Location) -> _CopyPlan:
    """What ``cp s d`` copies; nothing is written yet.

    Raises:
        CheckpointNotFoundError: nothing to copy under ``s``.
        CheckpointCorruptError: ``s`` is a single corrupt checkpoint.
        InvalidConfigError: a destination name no local disk or the destination store
            keeps, a reserved trial or experiment name (nothing written yet).
    """
    kind = classify(s)
    jobs: list[_CopyJob] = []
    trial_pairs: list[tuple[Location, Location]] = []
    corrupt: list[CheckpointCorruptError] = []
    skipped: list[Location] = []
    if kind == "checkpoint":
        meta = require_checkpoint(s)
        target, index = checkpoint_destination(d, s.name, int(meta["index"]))
        jobs.append(_CopyJob(s, meta, target, index))
    elif kind in ("trial", "experiment", "root"):
        for trial in trials_under(s, kind, skipped):
            rel = posixpath.relpath(trial.path, s.path)
            dt = d if rel == "." else d.child(rel)
            trial_pairs.append((trial, dt))
            committed = committed_checkpoints(trial)
            for ckpt, cmeta in committed:
                jobs.append(_CopyJob(ckpt, cmeta, dt.child(ckpt.name), int(cmeta["index"])))
            # A marker whose files do not match it (say one extra file) is not
            # committed, but it is not an unfinished write either: a backup
            # that left it out silently would lose it.
            bad, _ = not_committed(trial, [c.name for c, _ in committed])
            corrupt.extend(CheckpointCorruptError(
                f"checkpoint {trial.child(name).uri} is corrupt: {found.reason}",
                path=trial.child(name).path, file=found.file) for name, found in bad)
    elif kind in ("uncommitted", "corrupt", "file"):
        require_checkpoint(s)  # raises, saying which
    else:
        raise CheckpointNotFoundError(f"no checkpoints under {s.uri}")
    unreached = f"not copied: {not_walked_message(skipped, s, kind)}" if skipped else ""
    if not jobs and not trial_pairs:
        raise CheckpointNotFoundError("; ".join(filter(None, [f"no checkpoints under {s.uri}",
                                                              unreached])))
    for job in jobs:
        _require_fitting_names(job.dst, job.dst.parent,
                               (str(e["path"]) for e in job.meta.get("manifest", [])))
    for _, dt in trial_pairs:
        _require_fitting_names(dt, dt)
    return _CopyPlan(jobs, trial_pairs, corrupt, unreached)


def _refuse_live_targets(plan: _CopyPlan) -> None:
    """Refuse a copy into any trial whose running job holds the lease: its next
    report would meet a checkpoint it did not write (and `best` would pick it)."""
    trials = {j.dst.parent.path: j.dst.parent for j in plan.jobs}
    trials.update((dt.path, dt) for _, dt in plan.trial_pairs)
    for trial in trials.values():
        refuse_if_live(trial, None, "copy checkpoints into it")


def _copy_all(jobs: list[_CopyJob], on_bytes: Callable[[int], None]) -> _CopyTally:
    """Copy every job. A corrupt source fails a single-checkpoint copy at once;
    in a larger copy it is skipped, named, and counted in the tally."""
    tally = _CopyTally()
    for job in jobs:
        try:
            outcome = _copy_checkpoint(job, on_bytes)
        except CheckpointCorruptError as exc:
            if len(jobs) == 1:
                raise
            # A backup copies every good checkpoint; the bad ones fail the
            # command at the end, each named, and are never committed there.
            tally.corrupt.append(exc)
            echo_info(f"skipped corrupt {job.src.uri}: {one_line(str(exc))}")
            continue
        if outcome == "copied":
            tally.copied += 1
            tally.copied_bytes += manifest_size(job.meta)
        else:
            tally.skipped += 1
    return tally


@click.command("cp")
@click.argument("src")
@click.argument("dst")
@storage_option(help_text="Backend option for both SRC and DST when they are not local; "
                          "repeatable.")
@storage_option("--src-option", "src_options",
                help_text="Backend option for SRC only (overrides -o); repeatable.")
@storage_option("--dst-option", "dst_options",
                help_text="Backend option for DST only (overrides -o); repeatable.")
@common_options
def cp_cmd(src: str, dst: str, storage_options: dict[str, Any], src_options: dict[str, Any],
           dst_options: dict[str, Any]) -> None:
    """Copy checkpoints from SRC to DST, between any two backends.

    \b
    SRC may be:
      a checkpoint   copied to DST if DST is named checkpoint_NNNNNN,
                     else into the directory DST under its own name, as
                     `cp -r` copies into a directory: DST/checkpoint_NNNNNN
                     (DST is taken as a trial directory, and created if
                     absent; `download` puts the files themselves in DST);
      a trial        every committed checkpoint plus result.json, params.json
                     and the retention state, into the trial directory DST;
      an experiment  or a storage root: every trial under it, same layout.

    Each file is checked against the source manifest while it streams and the
    destination is committed only after all its files arrived. Checkpoints
    already present with identical contents are skipped, so an interrupted
    cp can be rerun. Uncommitted directories are not copied.

    \b
    Examples:
      checkpoint-store cp ./results/exp/t1 s3://bucket/runs/exp/t1
      checkpoint-store cp s3://bucket/runs/exp/t1/checkpoint_000004 ./restore/exp/t1
      checkpoint-store cp s3://a/runs az://b/runs --src-option endpoint_url=http://...
    """
    s = resolve_location(src, {**storage_options, **src_options}, options_if_remote=True)
    d = resolve_location(dst, {**storage_options, **dst_options}, options_if_remote=True)
    refuse_overlap(s, d, "copy")
    # Above d only: d itself may be a committed checkpoint a rerun skips.
    refuse_inside_checkpoint(d.backend, posixpath.dirname(d.path), "copy destination")
    plan = _plan_copy(s, d)
    _refuse_live_targets(plan)
    total = sum(manifest_size(j.meta) for j in plan.jobs)
    with progress_bar(f"cp {s.name}", total, finishing="committing") as bar:
        tally = _copy_all(plan.jobs, bar.advance)
    for trial, dt in plan.trial_pairs:
        _copy_trial_files(trial, dt)
    for exc in plan.corrupt:
        echo_info(f"skipped corrupt {one_line(str(exc))}")
    tally.corrupt[:0] = plan.corrupt
    echo_info(f"copied {tally.copied} checkpoints ({fmt_size(tally.copied_bytes)}) to {d.uri}"
              + (f", {tally.skipped} already there" if tally.skipped else ""))
    bad = [f"{len(tally.corrupt)} source checkpoint(s) failed their manifest and were not "
           "copied: " + "; ".join(one_line(str(e)) for e in tally.corrupt)] if tally.corrupt else []
    if bad or plan.unreached:
        error = CheckpointCorruptError if bad else CheckpointNotFoundError
        raise error("; ".join(filter(None, [*bad, plan.unreached])))
