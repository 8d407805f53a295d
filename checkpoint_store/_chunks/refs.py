"""Which chunk objects the checkpoints of an experiment reference.

Every ``.internal_metadata.json`` under the experiment dir counts, wherever
it lies: committed checkpoints of every trial, directories being deleted
(``.cs_deleting-*``), staged or half-committed ones, anything whose marker
parses. Being generous here only keeps garbage a while longer; missing
one marker would delete a kept checkpoint's bytes.
"""

from __future__ import annotations

import json
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
from checkpoint_store._format.layout import CHUNK_DIR, INTERNAL_METADATA
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.retry import RetryPolicy

__all__ = ["MarkerChunks", "experiment_markers", "experiment_refs", "marker_chunks", "union"]

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
    """

    path: str
    chunks: Mapping[str, tuple[int, int]]
    logical_bytes: int
    chunked_bytes: int


def marker_chunks(path: str, body: Any) -> MarkerChunks:
    """The chunks a parsed marker ``body`` references; entries that are not
    ``[object name, logical_len, stored_len]`` are left out."""
    chunks: dict[str, tuple[int, int]] = {}
    logical = chunked = 0
    manifest = body.get("manifest") if isinstance(body, dict) else None
    for entry in manifest if isinstance(manifest, list) else ():
        if not isinstance(entry, dict):
            continue
        size = entry.get("size")
        logical += size if isinstance(size, int) else 0
        refs = entry.get("chunks")
        if not isinstance(refs, list):
            continue
        chunked += size if isinstance(size, int) else 0
        for ref in refs:
            try:
                name, llen, slen = ref
                chunks[check_object_name(name)] = (int(llen), int(slen))
            except (TypeError, ValueError):
                continue
    return MarkerChunks(path, chunks, logical, chunked)


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
                    retry: RetryPolicy | None = None) -> set[str]:
    """The object names referenced by any marker under ``experiment_dir``
    (see :func:`experiment_markers`, which lists what it raises)."""
    return union(experiment_markers(filesystem, experiment_dir, retry=retry))


def union(markers: Iterable[MarkerChunks]) -> set[str]:
    """Every object name the ``markers`` reference."""
    out: set[str] = set()
    for m in markers:
        out.update(m.chunks)
    return out
