"""Reading a trial's ``result.json`` rows and folding its segments into it.

What a row is (:func:`parse_result_rows`, :func:`valid_iteration`), the
segments a writer on an object store leaves (:func:`list_segments`), every
row of a trial as of one moment (:func:`read_results`), the fold of the
segments into ``result.json`` (:func:`assemble_results`) and the tail a new
session continues from (:func:`last_result_rows`). The writer and its exit
flush are in :mod:`checkpoint_store._results.writer`, whose docstring gives the
segment rules; the layout is documented in docs/format.md ("result.json
segments").
"""

from __future__ import annotations

import logging
import math
import posixpath
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    RESULT_FILE,
    RESULT_SEGMENTS_DIR,
    parse_result_segment_name,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.retry import RetryPolicy

if TYPE_CHECKING:
    import pyarrow.fs as pafs

    from checkpoint_store.backends.base import Backend


class TrialStorage(Protocol):
    """What the result log uses of a trial's storage: a
    :class:`~checkpoint_store.storage.StorageContext` is one (named by this
    protocol so the result log does not import the storage layer above it)."""

    @property
    def backend(self) -> Backend: ...

    @property
    def filesystem(self) -> Any: ...

    @property
    def fsync(self) -> bool: ...

    @property
    def retry(self) -> RetryPolicy | None: ...

    @property
    def trial_path(self) -> str: ...

    def uri(self, path: str) -> str: ...

__all__ = [
    "Segment",
    "TrialStorage",
    "assemble_results",
    "assembled_result_bytes",
    "last_result_rows",
    "list_segments",
    "parse_result_rows",
    "read_results",
    "row_iteration",
    "unfolded_rows",
    "valid_iteration",
]

logger = logging.getLogger(__name__)

# First tail read; doubled while the bytes read hold no row with an iteration.
_TAIL_CHUNK = 8192


def valid_iteration(value: Any) -> int | None:
    """``value`` as a ``training_iteration`` count (an int >= 0, or a float
    equal to one), else None (``"abc"``, ``True``, ``-3``, ``[1]``)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and value >= 0 else None


def row_iteration(row: Mapping[str, Any]) -> int | None:
    """The row's ``training_iteration`` if valid (:func:`valid_iteration`), else None."""
    return valid_iteration(row.get("training_iteration"))


def parse_result_rows(raw: bytes) -> list[dict[str, Any]]:
    """The JSON-object rows of ``result.json`` bytes; lines that are blank, torn or
    not an object are skipped (a reader of a growing file may pass it any whole
    lines, e.g. only the ones appended since its last read).

    Every line is parsed in one ``json.loads`` of ``[[line], [line], ...]`` (a
    20,000-row file in about 40% of the time of one call per line); where that
    fails or a line is not exactly one object (a torn line, a stray value), the
    lines are parsed one by one instead. Wrapping each line in its own list keeps
    the two equal: a JSON string cannot hold a raw newline, so no value spans two
    lines' lists unnoticed, and a line of two values makes a list of two.
    """
    # Rows end at b"\n" only: str.splitlines() would also cut a row at a
    # U+0085 or U+2028 inside a metric's string, which JSON writes unescaped.
    lines = [line for line in raw.decode("utf-8", errors="replace").split("\n")
             if line and not line.isspace()]
    if not lines:
        return []
    try:
        wrapped = _json.loads("[[" + "],\n[".join(lines) + "]]")
    except ValueError:
        wrapped = None
    if isinstance(wrapped, list) and len(wrapped) == len(lines):
        rows = [w[0] for w in wrapped
                if isinstance(w, list) and len(w) == 1 and isinstance(w[0], dict)]
        if len(rows) == len(lines):
            return rows
    rows = []
    for line in lines:
        try:
            row = _json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _last_iteration(rows: Iterable[Mapping[str, Any]]) -> int:
    """The ``training_iteration`` of the last row holding a valid one; 0 if none."""
    for row in reversed(list(rows)):
        it = row_iteration(row)
        if it is not None:
            return it
    return 0


# -- segments ----------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """One segment object: its name, path and the iterations it spans."""

    name: str
    path: str
    first: int
    last: int


def list_segments(fs: pafs.FileSystem, trial_path: str, *,
                  retry: RetryPolicy | None = None) -> list[Segment]:
    """The trial's segments in row order (by first iteration, then the widest
    first); one listing. Names that are not segments are ignored (a newer
    format's, or a local disk's ``.cs_tmp-*``)."""
    out = []
    for fi in _fsutil.list_dir(fs, posixpath.join(trial_path, RESULT_SEGMENTS_DIR), retry=retry):
        name = posixpath.basename(fi.path.rstrip("/"))
        span = parse_result_segment_name(name)
        if span is not None and fi.type == _fsutil.pafs.FileType.File:
            out.append(Segment(name, fi.path, span[0], span[1]))
    return sorted(out, key=lambda s: (s.first, -s.last, s.name))


def _read_or_empty(fs: pafs.FileSystem, path: str, retry: RetryPolicy | None) -> bytes:
    try:
        return _fsutil.read_bytes(fs, path, retry=retry)
    except FileNotFoundError:
        return b""


def _unfolded_lines(fs: pafs.FileSystem, segments: list[Segment], after: int,
                    retry: RetryPolicy | None) -> list[tuple[bytes, dict[str, Any]]]:
    """``(line, row)`` of the segments' rows not yet in ``result.json``, whose
    last row with an iteration has ``after``.

    Raises:
        FileNotFoundError: a segment was deleted since it was listed (its
            writer assembled it meanwhile).
    """
    # Which segments to read (and the R each is read against) follows from
    # the names alone, so they can be fetched at once.
    todo: list[tuple[Segment, int]] = []
    for seg in segments:
        if seg.last <= after:
            continue  # folded into result.json already (a crash before its delete)
        todo.append((seg, after))
        after = max(after, seg.last)
    def read(item: tuple[Segment, int]) -> bytes:
        return _fsutil.read_bytes(fs, item[0].path, retry=retry)

    if len(todo) > 1:
        with ThreadPoolExecutor(max_workers=min(8, len(todo))) as pool:
            blobs = list(pool.map(read, todo))
    else:
        blobs = [read(t) for t in todo]
    out = []
    for (_, before), blob in zip(todo, blobs, strict=True):
        for line in blob.splitlines(keepends=True):
            rows = parse_result_rows(line)
            if not rows:
                continue
            it = row_iteration(rows[0])
            if it is None or it > before:
                out.append((line if line.endswith(b"\n") else line + b"\n", rows[0]))
    return out


def _snapshot(fs: pafs.FileSystem, trial_path: str, retry: RetryPolicy | None
              ) -> tuple[bytes | None, list[Segment], list[tuple[bytes, dict[str, Any]]]]:
    """``(result.json's bytes or None, the segments, their unfolded lines)``, as
    of one moment.

    The segments are listed *before* ``result.json`` is read: an assembly
    writes ``result.json`` before it deletes, so a listed segment that is gone
    when read means the file read may predate the assembly, and the whole
    read starts again (three tries; then the segment's rows are left out of
    this answer, to be found in ``result.json`` by the next read).
    """
    for attempt in range(3):
        segments = list_segments(fs, trial_path, retry=retry)
        try:
            raw: bytes | None = _fsutil.read_bytes(
                fs, posixpath.join(trial_path, RESULT_FILE), retry=retry)
        except FileNotFoundError:
            raw = None
        after = _last_iteration(_tail_rows_of(raw or b""))
        try:
            return raw, segments, _unfolded_lines(fs, segments, after, retry)
        except FileNotFoundError:
            if attempt == 2:
                live = {s.name for s in list_segments(fs, trial_path, retry=retry)}
                kept = [s for s in segments if s.name in live]
                return raw, kept, _unfolded_lines(fs, kept, after, retry)
    raise AssertionError("unreachable")


def unfolded_rows(
    segments: Iterable[tuple[Segment, list[dict[str, Any]]]], rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The rows of ``segments`` (in :func:`list_segments` order, each with its
    parsed rows) that ``result.json``, whose rows are ``rows``, does not hold
    yet: the same rule as :func:`read_results`, for a reader that caches
    what it read (the UI's live refresh)."""
    after, out = _last_iteration(rows), []
    for seg, seg_rows in segments:
        if seg.last <= after:
            continue
        for row in seg_rows:
            it = row_iteration(row)
            if it is None or it > after:
                out.append(row)
        after = max(after, seg.last)
    return out


def read_results(fs: pafs.FileSystem, trial_path: str, *,
                 retry: RetryPolicy | None = None) -> list[dict[str, Any]]:
    """Every row of the trial: ``result.json``'s, then those of segments not
    yet assembled into it (a live run's, or a killed run's). ``[]`` when the
    trial has none. Costs one listing, one read of ``result.json`` and one
    read per segment; a live run's assembly in between never hides or
    doubles a row (:func:`_snapshot`)."""
    raw, _, lines = _snapshot(fs, trial_path, retry)
    return parse_result_rows(raw or b"") + [row for _, row in lines]


def assembled_result_bytes(fs: pafs.FileSystem, trial_path: str, *,
                           retry: RetryPolicy | None = None) -> tuple[bytes | None, list[Segment]]:
    """``(bytes, segments)``: ``result.json``'s bytes with the rows of the
    segments not yet in it appended, and the segments read (None and ``[]``
    when the trial has neither). ``result.json``'s own bytes are kept as they
    are, odd lines included."""
    raw, segments, lines = _snapshot(fs, trial_path, retry)
    if not segments:
        return raw, []
    base = raw or b""
    if base and not base.endswith(b"\n"):
        base += b"\n"  # end a torn last line: the next row starts a line of its own
    return base + b"".join(line for line, _ in lines), segments


def assemble_results(storage: TrialStorage) -> int:
    """Fold the trial's segments into ``result.json``: one write of the whole
    file, then the segments are deleted (in that order, so a crash in between
    leaves folded segments that readers skip). Call only while holding the
    trial (its lease): a concurrent writer's new segment would be deleted.

    Returns:
        The number of segments folded (0: nothing to do, nothing written).
    """
    fs, retry = storage.filesystem, storage.retry
    data, segments = assembled_result_bytes(fs, storage.trial_path, retry=retry)
    if not segments:
        return 0
    assert data is not None
    _fsutil.write_bytes(fs, posixpath.join(storage.trial_path, RESULT_FILE), data,
                        storage.backend.capabilities, fsync=storage.fsync, retry=retry)
    for seg in segments:
        try:
            _fsutil.delete_file(fs, seg.path, retry=retry)
        except Exception as exc:
            # Folded already: readers skip it, and the next session end retries.
            logger.warning("could not delete folded result.json segment %s: %s",
                           storage.uri(seg.path), exc)
    return len(segments)


# -- the tail: what session.start needs -----------------------------------------------


def _tail_rows_of(raw: bytes) -> list[dict[str, Any]]:
    """The rows of ``raw``'s last lines, back to the last row with a valid
    iteration (all rows when none has one)."""
    end = len(raw)
    while end > 0:
        start = raw.rfind(b"\n", 0, max(end - _TAIL_CHUNK, 0)) + 1
        rows = parse_result_rows(raw[start:])
        if start == 0 or any(row_iteration(r) is not None for r in rows):
            return rows
        end = start - 1
    return []


def _tail_of_file(fs: pafs.FileSystem, path: str,
                  retry: RetryPolicy | None) -> list[dict[str, Any]]:
    """The last rows of ``path`` (see :func:`_tail_rows_of`) by ranged reads
    from its end: 8 KiB first, doubled while they hold no row with a valid
    iteration. ``[]`` when absent."""

    def _read() -> list[dict[str, Any]]:
        with fs.open_input_file(path) as f:
            size = f.size()
            chunk, start = _TAIL_CHUNK, size
            while True:
                start = max(size - chunk, 0)
                data = f.read_at(size - start, start)
                if start > 0:
                    cut = data.find(b"\n")  # the first line may be cut: drop it
                    data = data[cut + 1:] if cut >= 0 else b""
                rows = parse_result_rows(data)
                if start == 0 or any(row_iteration(r) is not None for r in rows):
                    return rows
                chunk *= 2

    try:
        return _retry.call(_read, policy=retry, store=fs, what=f"read the end of {path}")
    except FileNotFoundError:
        return []


def last_result_rows(storage: TrialStorage) -> list[dict[str, Any]]:
    """The trial's last rows, enough to hold its last valid ``training_iteration``
    (what ``session.start`` continues from): a ranged read of ``result.json``'s
    end, plus the last segment's rows when segments are there (one listing,
    object stores). Cost independent of the number of rows."""
    fs, retry = storage.filesystem, storage.retry
    rows = _tail_of_file(fs, posixpath.join(storage.trial_path, RESULT_FILE), retry)
    segments = list_segments(fs, storage.trial_path, retry=retry)
    if segments:
        last = max(segments, key=lambda s: (s.last, s.first))
        rows.extend(parse_result_rows(_read_or_empty(fs, last.path, retry)))
    return rows
