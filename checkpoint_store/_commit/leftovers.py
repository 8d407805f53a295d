"""What a trial directory holds: committed checkpoints, our unfinished
leftovers (those of the current run kept apart), and foreign directories.

Owns the rules cleanup follows (docs/format.md, "Cleanup"): a name is ours
when :mod:`checkpoint_store._format.layout` built it, a directory is an unfinished
one of ours when it holds a trace of our writers. Called by rank 0 (the
session's start, after it holds the trial's lease) and by ``gc``; it only
reads, so any thread may call it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from checkpoint_store._commit.pointer import POINTER_FILE, pointed_path
from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    DELETE_TOMBSTONE,
    INTERNAL_METADATA,
    is_deleting_dir_name,
    is_internal_name,
    parse_claim_name,
    parse_rank_marker_name,
    parse_staging_dir_name,
    parse_temp_file_name,
    temp_file_base,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.ids import run_of_writer
from checkpoint_store._util.inspect import Inspection, inspect_checkpoint
from checkpoint_store._util.liveness import writer_tag_alive
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.errors import CheckpointCorruptError

__all__ = ["ScanResult", "scan_trial", "writer_in"]


@dataclass(frozen=True)
class ScanResult:
    """What :meth:`StorageContext.scan` found in a trial directory (names only).

    Attributes:
        committed: committed checkpoint directories, by recorded index.
        uncommitted: directories this tool's writers left unfinished (staging
            and deleting directories, partial uploads), ``active`` included,
            and temporary files of writers that died (``.cs_tmp-*``).
        active: the subset of ``uncommitted`` that belongs to the current run
            (another rank may still be writing it): never removed.
        foreign: directories that are neither committed nor ours (copied in
            by hand, or a marker we cannot read): never removed by cleanup;
            :meth:`StorageContext.adopt` turns a complete one into a
            checkpoint. One without a marker does not block a commit to its
            index, which replaces it (:mod:`checkpoint_store._commit.protocols`); our
            writers and removals keep a trace until their last data file is
            written or gone, so no leftover of theirs lands here.
    """

    committed: list[str] = field(default_factory=list)
    uncommitted: list[str] = field(default_factory=list)
    active: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)


def scan_trial(
    fs: pafs.FileSystem, trial_path: str, runs: set[str], *, retry: RetryPolicy | None = None,
    known: Mapping[str, int] | None = None, listing: list[pafs.FileInfo] | None = None,
) -> ScanResult:
    """Classify every entry of the trial directory ``trial_path``: committed,
    uncommitted (ours), active (ours, of one of ``runs``) or foreign.

    Args:
        runs: run ids whose writers may still be writing (their leftovers are
            ``active``).
        known: committed checkpoints the caller already knows (directory name
            to index, say from the retention state): taken as committed
            without being inspected.
        listing: the trial directory's listing, if the caller just made it
            (else listed here).

    Costs one listing of the trial directory plus one recursive listing
    (and at most one small read) per directory not in ``known``.
    """
    known = known or {}
    result = ScanResult()
    committed: list[tuple[int, str]] = []
    entries = listing if listing is not None else _fsutil.list_dir(fs, trial_path, retry=retry)
    for fi in entries:
        name = posixpath.basename(fi.path.rstrip("/"))
        if fi.type != pafs.FileType.Directory:
            if _dead_writer_tmp(name):
                result.uncommitted.append(name)  # a write_bytes() cut short
            continue
        staging_writer = parse_staging_dir_name(name)
        if name not in known and _fsutil.link_target(fs, fi.path) is not None:
            # A symbolic link (local disks): none of ours ever is one, and a
            # removal must never reach through it.
            result.foreign.append(name)
        elif is_deleting_dir_name(name):
            # Renamed away by a delete: nobody writes there any more.
            result.uncommitted.append(name)
        elif staging_writer is not None:
            (result.active if writer_in(staging_writer, runs) else result.uncommitted
             ).append(name)
        else:
            if is_internal_name(name):
                continue  # some other internal directory: not a checkpoint candidate
            if name in known:
                committed.append((known[name], name))
                continue
            path = posixpath.join(trial_path, name)
            insp = inspect_checkpoint(fs, path, retry=retry)
            if insp.state == "absent" and POINTER_FILE in (insp.files or {}):
                # A re-saved path (Lightning's last.ckpt): its checkpoint is
                # the sibling the pointer names, committed (never ours to
                # remove, and the .cs_replace-* sibling is never scanned).
                try:
                    target = pointed_path(fs, path, retry) or path
                except CheckpointCorruptError:  # a pointer we did not write: not ours
                    result.foreign.append(name)
                    continue
                insp = inspect_checkpoint(fs, target, retry=retry)
                if insp.state == "committed":
                    assert insp.meta is not None
                    committed.append((insp.meta["index"], name))
                else:
                    result.foreign.append(name)
                continue
            if insp.state == "committed":
                assert insp.meta is not None
                committed.append((insp.meta["index"], name))
            elif insp.state in ("absent", "missing") and _looks_ours(insp):
                (result.active if _partial_is_active(fs, path, insp, runs, retry)
                 else result.uncommitted).append(name)
            else:
                result.foreign.append(name)
    result.committed.extend(n for _, n in sorted(committed))
    result.uncommitted.extend(result.active)
    result.uncommitted.sort()
    result.active.sort()
    result.foreign.sort()
    return result


def writer_in(writer: str, runs: set[str]) -> bool:
    """True when ``writer`` (a writer or attempt id) belongs to one of ``runs``."""
    return any(writer == r or writer.startswith(r + ".") or run_of_writer(writer) == r
               for r in runs)


def _partial_is_active(
    fs: pafs.FileSystem, path: str, insp: Inspection, runs: set[str], retry: RetryPolicy | None
) -> bool:
    """A partial upload (marker-last) of the current run: a claim of ours, a
    per-rank marker naming the current attempt, or a trace's temporary file
    whose writer process is alive."""
    names = [rel.rsplit("/", 1)[-1] for rel in (insp.files or {})]
    for n in names:
        claim = parse_claim_name(n)
        if claim is not None and writer_in(claim[1], runs):
            return True
        if parse_temp_file_name(n) is not None and _is_writer_trace(n) \
                and not _dead_writer_tmp(n):
            return True  # a trace a live process is writing (renamed in a moment)
    for n in names:
        if parse_rank_marker_name(n) is not None:
            try:
                body = _json.loads(_fsutil.read_bytes(fs, posixpath.join(path, n), retry=retry))
            except (FileNotFoundError, ValueError):
                continue
            attempt = body.get("attempt_id") if isinstance(body, dict) else None
            if isinstance(attempt, str) and writer_in(attempt, runs):
                return True
    return False


def _dead_writer_tmp(name: str) -> bool:
    """A ``.cs_tmp-<file>-<pid>_<start ticks>-<random>`` file (local disks only;
    older versions wrote ``<pid>`` alone) whose writer process is gone, or whose
    pid now belongs to a newer process. A live writer, ours or another's,
    keeps it: never remove a file that may be renamed into place a moment later."""
    tag = parse_temp_file_name(name)
    return tag is not None and writer_tag_alive(tag) is False


def _looks_ours(insp: Inspection) -> bool:
    """Empty, or holding a trace of our writers (an upload claim, a per-rank
    marker, a delete tombstone, an empty marker: a commit killed as it wrote
    it): an uncommitted directory this tool left. A download marker is no
    such trace: users copy downloaded directories."""
    files = insp.files or {}
    return (not files or files.get(INTERNAL_METADATA) == 0
            or any(_is_writer_trace(rel.rsplit("/", 1)[-1]) for rel in files))


def _is_writer_trace(name: str) -> bool:
    base = temp_file_base(name)
    if base is not None:
        # The atomic write of a trace cut short (a kill between the temporary
        # file and its rename, on a local disk): ``.cs_tmp-<trace>-<tag>-<token>``.
        # A directory holding only that is ours as much as one with the trace.
        name = base
    return (
        parse_claim_name(name) is not None
        or parse_rank_marker_name(name) is not None
        or name == DELETE_TOMBSTONE
    )
