"""Which chunk objects the checkpoints of an experiment reference.

Every ``.internal_metadata.json`` under the experiment dir counts, wherever
it lies: committed checkpoints of every trial, directories being deleted
(``.cs_deleting-*``), staged or half-committed ones, anything whose marker
parses. Being generous here only keeps garbage a while longer; missing
one marker would delete a kept checkpoint's bytes. So a marker that parses
but is not understood whole (a newer format version, a chunk reference of
another shape) makes the references unknown: a gc then deletes nothing.
"""

from __future__ import annotations

import json
import logging
import posixpath
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._chunks.store import check_object_name
from checkpoint_store._format.layout import (
    CHUNK_DIR,
    INTERNAL_METADATA,
    MARKER_FORMAT_VERSIONS,
    newer_format_version,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.retry import RetryPolicy

__all__ = ["MarkerChunks", "experiment_markers", "experiment_refs", "marker_chunks", "union"]

logger = logging.getLogger(__name__)

_CACHE_SIZE = 8192
_SETTLE_S = 60.0
"""A marker younger than this (by its mtime) is read again each time: a
store's mtime may be whole seconds, so a rewrite could keep size and mtime."""


@dataclass(frozen=True)
class MarkerChunks:
    """The chunks one marker references.

    Attributes:
        path: the marker's path.
        chunks: ``{object name: (logical bytes, stored bytes)}``.
        logical_bytes: bytes of every file the manifest lists, chunked or
            not, repeats included (what the checkpoint holds).
        chunked_bytes: of those, bytes of files stored as chunks.
        unknown: why the marker may reference chunks not in ``chunks`` (a
            newer format version, a chunk reference that does not parse), or
            None when ``chunks`` is all it references.
    """

    path: str
    chunks: Mapping[str, tuple[int, int]]
    logical_bytes: int
    chunked_bytes: int
    unknown: str | None = None


def _length(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def marker_chunks(path: str, body: Any) -> MarkerChunks:
    """The chunks a parsed marker ``body`` references. A reference is
    ``[object name, logical_len, stored_len, ...]``: its name counts even
    where its lengths do not parse (they count 0). A marker of a format
    version newer than this one reads, or with a reference or a ``chunks``
    list that does not parse, has :attr:`MarkerChunks.unknown` set."""
    chunks: dict[str, tuple[int, int]] = {}
    logical = chunked = 0
    unknown: str | None = None
    version = newer_format_version(body, max(MARKER_FORMAT_VERSIONS))
    if not isinstance(body, dict):
        unknown = "it is not a JSON object"
    elif version is not None:
        unknown = f"it has format_version {version}, newer than this checkpoint-store reads"
    manifest = body.get("manifest") if isinstance(body, dict) else None
    for entry in manifest if isinstance(manifest, list) else ():
        if not isinstance(entry, dict):
            continue
        size = _length(entry.get("size"))
        logical += size
        if "chunks" not in entry:
            continue
        refs = entry["chunks"]
        if not isinstance(refs, list):
            unknown = unknown or f"file {entry.get('path')!r} has a 'chunks' that is no list"
            continue
        chunked += size
        for ref in refs:
            name = ref[0] if isinstance(ref, list) and ref else None
            try:
                check_object_name(name)  # type: ignore[arg-type]
            except ValueError:
                unknown = unknown or (f"file {entry.get('path')!r} has a chunk reference "
                                      f"{str(ref)[:120]} that does not parse")
                continue
            assert isinstance(ref, list) and isinstance(name, str)
            chunks[name] = (_length(ref[1] if len(ref) > 1 else None),
                            _length(ref[2] if len(ref) > 2 else None))
    return MarkerChunks(path, chunks, logical, chunked, unknown)


_cache: OrderedDict[tuple[str, str, int, int], MarkerChunks] = OrderedDict()
_cache_lock = threading.Lock()


def _read_marker(fs: pafs.FileSystem, fi: pafs.FileInfo,
                 retry: RetryPolicy | None) -> MarkerChunks | None:
    mtime = fi.mtime_ns if fi.mtime_ns is not None else -1
    key = (fs.type_name, fi.path, fi.size, mtime)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    try:
        # Read again while torn: a marker being written in place (fsspec
        # directory filesystems) reads cut short, and a gc that took it for
        # "no references" deleted the chunks of a checkpoint being committed.
        body = _fsutil.read_control(fs, fi.path, json.loads, retry=retry)
    except FileNotFoundError:
        return None  # deleted since the listing: it references nothing now
    except ValueError:
        return None  # a marker that stays unparsable: that commit never finished
    found = marker_chunks(fi.path, body)
    if mtime >= 0 and mtime / 1e9 < time.time() - _SETTLE_S:
        with _cache_lock:
            _cache[key] = found
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return found


def experiment_markers(filesystem: pafs.FileSystem, experiment_dir: str, *,
                       retry: RetryPolicy | None = None,
                       workers: int = 16) -> list[MarkerChunks]:
    """Every marker under ``experiment_dir`` (any depth, the chunk root
    left out) and the chunks it references. One recursive listing per
    entry of the experiment dir, one read per marker not cached (cache key:
    path, size, mtime).

    Raises:
        TransientBackendError, PermanentBackendError: a listing or read failed
            (never a partial answer: a gc must not run on one).
    """
    exp = experiment_dir.rstrip("/")
    infos: list[pafs.FileInfo] = []
    for child in _fsutil.list_dir(filesystem, exp, retry=retry):
        if posixpath.basename(child.path) == CHUNK_DIR:
            continue
        if child.type == pafs.FileType.Directory:
            infos.extend(_fsutil.list_tree(filesystem, child.path, retry=retry))
        elif child.type == pafs.FileType.File:
            infos.append(child)
    markers = [fi for fi in infos if fi.type == pafs.FileType.File
               and posixpath.basename(fi.path) == INTERNAL_METADATA]
    if not markers:
        return []
    with ThreadPoolExecutor(min(workers, len(markers)), thread_name_prefix="cs-refs") as pool:
        read = list(pool.map(lambda fi: _read_marker(filesystem, fi, retry), markers))
    return [m for m in read if m is not None]


def experiment_refs(filesystem: pafs.FileSystem, experiment_dir: str, *,
                    retry: RetryPolicy | None = None) -> set[str] | None:
    """The object names referenced by any marker under ``experiment_dir``,
    or None when a marker may reference more than it says (see
    :func:`union`; :func:`experiment_markers` lists what it raises)."""
    return union(experiment_markers(filesystem, experiment_dir, retry=retry))


def union(markers: Iterable[MarkerChunks]) -> set[str] | None:
    """Every object name the ``markers`` reference, or None when one of them
    is not understood whole (:attr:`MarkerChunks.unknown`): the references
    are then unknown, and a gc must delete nothing. Such a marker is logged
    as a warning (a newer checkpoint-store wrote it: upgrade; or it is
    damaged: remove its checkpoint)."""
    out: set[str] = set()
    for m in markers:
        if m.unknown is not None:
            logger.warning(
                "chunk references unknown: %s cannot be read whole (%s); no chunk of its "
                "experiment is freed until it can (upgrade checkpoint-store, or remove that "
                "checkpoint if it is damaged)", m.path, m.unknown)
            return None
        out.update(m.chunks)
    return out
