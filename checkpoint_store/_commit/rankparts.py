"""Rank parts: each rank of one checkpoint writes its files, one writer commits their union.

This module owns the rank marker ``.cs_rank-<rank>.json`` (docs/format.md,
"Multi-rank commit") and every step that reads or writes it. Two callers
share it, so the format and the rules exist once:

* a multi-rank session (:class:`checkpoint_store.session._multirank.Coordinator`):
  every rank writes its part, rank 0 commits;
* Ray Train (:mod:`checkpoint_store.integrations.ray`): every worker writes
  its part in ``upload_fn``, the controller's ``CommitCallback`` commits.

The steps:

1. Every rank, :func:`write_rank_part`: copy its files into the shared
   directory under the include rule (:func:`rank_includes`: no internal
   file, and ``.user_metadata.json`` from rank 0 alone), then write its
   marker ``{"rank", "ok", "error", "files"}`` plus the caller's own fields
   (the session's ``attempt_id`` and ``index``, Ray's ``time``). A failed
   copy is recorded in the marker, so the committing writer learns of it.
2. The committing writer alone: :func:`rank_markers_present` and
   :func:`read_rank_marker`, :func:`failed_ranks`, :func:`merge_rank_files`
   (the union of the ranks' manifests; two ranks writing one path is a clash).
3. The committing writer, once every part is good: :func:`finalize_from_markers`
   (the commit protocol's ``finalize`` with the ``ranks`` field, then the
   markers deleted, :func:`delete_rank_markers`).

How the ranks meet (waiting, broadcasting, aborting) stays with each caller.
Layer: ``_commit``; it never imports the checkpoint, storage, session or
integration modules.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._commit.protocols import CommitProtocol
from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    USER_METADATA,
    is_internal_file,
    parse_rank_marker_name,
    rank_marker_name,
)
from checkpoint_store._transfer.trees import copy_tree
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend

__all__ = [
    "RankDir",
    "RankFiles",
    "RankPart",
    "RankSource",
    "delete_rank_markers",
    "failed_ranks",
    "finalize_from_markers",
    "merge_rank_files",
    "rank_includes",
    "rank_markers_present",
    "read_rank_marker",
    "write_rank_part",
]


@dataclass(frozen=True)
class RankSource:
    """What one rank contributes: the directory ``path`` on ``filesystem``."""

    filesystem: pafs.FileSystem
    path: str


@dataclass(frozen=True)
class RankDir:
    """The directory every rank of one checkpoint writes its part into.

    Attributes:
        backend: the storage (its filesystem is read on each use: a
            credentials rebuild may replace it).
        path: the directory (a session's ``checkpoint_<index>`` or its
            staging sibling; the directory Ray names).
        fsync: on local disks, fsync what is written.
        retry: retry policy for every storage call (None: the default).
    """

    backend: Backend
    path: str
    fsync: bool = True
    retry: RetryPolicy | None = None

    def marker_path(self, rank: int) -> str:
        """Where ``rank``'s marker goes."""
        return posixpath.join(self.path, rank_marker_name(rank))


@dataclass(frozen=True)
class RankPart:
    """What :func:`write_rank_part` did for one rank.

    Attributes:
        files: the manifest entries of the files it copied.
        error: this rank's failure (given, or of the copy), recorded in its marker.
        marker_error: the marker itself could not be written; the committing
            writer then finds this rank missing.
    """

    files: list[dict[str, Any]]
    error: BaseException | None
    marker_error: Exception | None


@dataclass(frozen=True)
class RankFiles:
    """The union of what every rank's marker says it wrote.

    Attributes:
        manifest: every rank's manifest entries, rank by rank.
        ranks: ``{str(rank): sorted relative paths}`` (the marker's ``ranks`` field).
        clash: ``(rank, other rank, path)`` when two ranks wrote one path, else None.
    """

    manifest: list[dict[str, Any]]
    ranks: dict[str, list[str]]
    clash: tuple[int, int, str] | None


# -- every rank ---------------------------------------------------------------


def rank_includes(rank: int, rel: str) -> bool:
    """Whether ``rank`` copies the file ``rel``: never an internal file, and
    ``.user_metadata.json`` (one file for the whole checkpoint) only from rank 0."""
    if is_internal_file(rel):
        return False
    return rank == 0 or rel != USER_METADATA


def write_rank_part(
    dest: RankDir,
    rank: int,
    source: RankSource | None,
    *,
    error: BaseException | None = None,
    fields: Callable[[], Mapping[str, Any]] = dict,
    wrap_error: Callable[[Exception], BaseException] | None = None,
) -> RankPart:
    """Every rank (the thread that reports, or a Ray Train worker): copy
    ``source`` into ``dest``, then write this rank's marker there.

    Nothing is copied when ``source`` is None or ``error`` (this rank's
    failure, already known) is given; the marker is written in every case.
    Never raises an ``Exception``: the caller decides what to raise.

    Args:
        fields: the caller's own marker fields, asked for once the copy is done.
        wrap_error: turns a failed copy's exception into the one recorded
            and returned (default: as it is).
    """
    files: list[dict[str, Any]] = []
    if error is None and source is not None:
        try:
            files = _copy_part(dest, rank, source)
        except Exception as exc:  # recorded in the marker, returned to the caller
            error = exc if wrap_error is None else wrap_error(exc)
    marker = {
        **fields(),
        "rank": rank,
        "ok": error is None,
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "files": files,
    }
    try:
        _fsutil.write_bytes(dest.backend.filesystem, dest.marker_path(rank), _json.dumps(marker),
                            dest.backend.capabilities, fsync=dest.fsync, retry=dest.retry)
    except Exception as exc:
        return RankPart(files, error, exc)
    return RankPart(files, error, None)


def _copy_part(dest: RankDir, rank: int, source: RankSource) -> list[dict[str, Any]]:
    """One rank's files under the include rule; their manifest entries."""
    entries = copy_tree(
        source.filesystem, source.path, dest.backend.filesystem, dest.path,
        dest.backend.capabilities, include=lambda rel: rank_includes(rank, rel),
        fsync=dest.fsync, retry=dest.retry,
    )
    return [e.to_json() for e in entries]


# -- the committing writer ----------------------------------------------------


def rank_markers_present(dest: RankDir) -> list[int]:
    """The ranks whose marker is in ``dest``, from one listing (the committing writer)."""
    present = []
    for fi in _fsutil.list_dir(dest.backend.filesystem, dest.path, retry=dest.retry):
        rank = parse_rank_marker_name(posixpath.basename(fi.path))
        if rank is not None and fi.type == pafs.FileType.File:
            present.append(rank)
    return sorted(present)


def read_rank_marker(dest: RankDir, rank: int) -> Any:
    """``rank``'s marker as parsed JSON (the committing writer checks its shape).

    Raises:
        ValueError: not JSON.
    """
    return _json.loads(_fsutil.read_bytes(dest.backend.filesystem, dest.marker_path(rank),
                                          retry=dest.retry))


def failed_ranks(markers: Mapping[int, Mapping[str, Any]]) -> dict[int, Any]:
    """The ranks whose marker records a failure: rank -> its ``error`` text."""
    return {r: m.get("error") for r, m in markers.items() if not m.get("ok")}


def merge_rank_files(markers: Mapping[int, Mapping[str, Any]]) -> RankFiles:
    """Merge the ``files`` of every rank marker (the committing writer: rank 0,
    or Ray's controller)."""
    owners: dict[str, int] = {}
    manifest: list[dict[str, Any]] = []
    for r in sorted(markers):
        for entry in markers[r].get("files", []):
            path = entry["path"]
            if path in owners:
                return RankFiles([], {}, (owners[path], r, path))
            owners[path] = r
            manifest.append(entry)
    ranks = {str(r): sorted(e["path"] for e in m.get("files", []))
             for r, m in sorted(markers.items())}
    return RankFiles(manifest, ranks, None)


def finalize_from_markers(
    protocol: CommitProtocol,
    workdir: str,
    final: str,
    internal: Mapping[str, Any],
    merged: RankFiles,
    *,
    writer: str | None = None,
    retry: RetryPolicy | None = None,
) -> dict[str, Any]:
    """The committing writer alone, once every rank succeeded and no two
    clashed: commit the parts in ``workdir`` as ``final`` (the union of the
    ranks' files in the manifest, ``ranks`` added to ``internal``), then
    delete the rank markers.

    Args:
        writer: names the committing writer in a leftover's tombstone name
            (:meth:`CommitProtocol.finalize`).
        retry: retry policy for the marker deletes.

    Returns:
        The internal metadata as written.

    Raises:
        CheckpointConflictError: ``final`` is already committed, or is
            somebody else's directory.
    """
    if merged.clash is not None:
        raise ValueError(f"finalize_from_markers: ranks clash on {merged.clash[2]!r}")
    meta = dict(internal)
    meta["ranks"] = merged.ranks
    written = protocol.finalize(workdir, final, meta, merged.manifest, writer)
    delete_rank_markers(protocol.fs, final, (int(r) for r in merged.ranks), retry)
    return written


def delete_rank_markers(
    fs: pafs.FileSystem, directory: str, ranks: Iterable[int], retry: RetryPolicy | None = None,
) -> None:
    """The committing writer, after the commit: delete the markers of ``ranks``.

    Markers go only after the commit: until then they tell cleanup that an
    object-store directory is ours, not foreign data. They are internal
    files, so one left behind (a failed delete) changes nothing.
    """
    for r in ranks:
        try:
            _fsutil.delete_file(fs, posixpath.join(directory, rank_marker_name(r)), retry=retry)
        except OSError:
            pass
