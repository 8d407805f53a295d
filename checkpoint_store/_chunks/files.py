"""Reading one chunked file of a committed checkpoint (format version 3).

A manifest entry ``{"path", "size", "crc32c", "chunks": [[name, logical_len,
stored_len], ...]}`` names a file that is not in the checkpoint directory:
its bytes are the concatenation of the chunks' logical bytes, each chunk an
object ``<chunk root>/<name[:2]>/<name>`` (the root is the marker's
``"chunk_root"``, relative to the checkpoint directory; docs/format.md,
"Chunks"). :class:`ChunkedFile` reads a range of it, writes it whole to a
local file, or verifies it; every chunk read is decoded and checked against
its own header (:func:`~checkpoint_store._chunks.codec.decode_chunk`) and its
manifest length.

Thread use: one :class:`ChunkedFile` may serve many threads at once (its
cache is locked); each method fans out over a bounded pool of its own.
"""

from __future__ import annotations

import bisect
import os
import posixpath
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._chunks.codec import chunk_header, decode_chunk
from checkpoint_store._chunks.store import check_object_name, resolve_root
from checkpoint_store._format.manifest import crc_hex, is_chunked
from checkpoint_store._transfer.crc32c import crc32c_combine
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.errors import CheckpointCorruptError

__all__ = ["ChunkedFile", "chunk_object_path", "chunk_root_path", "chunked_entries"]

#: Decoded chunks a :class:`ChunkedFile` keeps for :meth:`ChunkedFile.read_range`
#: (16 MiB chunks: at most 64 MiB).
CACHE_CHUNKS = 4


def chunk_root_path(checkpoint_path: str, meta: Mapping[str, Any]) -> str:
    """The chunk store directory of a checkpoint, from its marker's ``"chunk_root"``.

    Raises:
        CheckpointCorruptError: the marker has no ``"chunk_root"``;
            :class:`~checkpoint_store.errors.UnsafePathError` (one) when it
            names anything but its experiment's chunk store.
    """
    root = meta.get("chunk_root")
    if not isinstance(root, str) or not root:
        raise CheckpointCorruptError(
            f"checkpoint {checkpoint_path!r} lists chunked files but its marker has no "
            "'chunk_root'", path=checkpoint_path)
    return resolve_root(checkpoint_path, root)


def chunk_object_path(root: str, name: str) -> str:
    """Where chunk ``name`` lives under the chunk store ``root``.

    Raises:
        ValueError: ``name`` is not a chunk object name.
    """
    return posixpath.join(root, name[:2], check_object_name(name))


def chunked_entries(meta: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The manifest entries of ``meta`` whose bytes live as chunks (``[]``: none)."""
    return [e for e in (meta or {}).get("manifest") or () if is_chunked(e)]


def _read_object(fs: pafs.FileSystem, path: str, *,
                 retry: RetryPolicy | None = None) -> bytes:
    """The whole object at ``path``, read as a file of known size: one ranged
    read of every byte. (pyarrow's S3 input stream reads an object of unknown
    length in pieces, a request each: 2.5x slower for a 12 MiB object through
    a 10 ms link.) Raises FileNotFoundError (not retried) when it is absent."""

    def read() -> bytes:
        with fs.open_input_file(path) as f:
            return f.read()

    return _retry.call(read, policy=retry, store=fs, what=f"read {path}")


class ChunkedFile:
    """One chunked manifest entry of a committed checkpoint, read through its chunks.

    Args:
        filesystem: the checkpoint's filesystem.
        checkpoint_path: the checkpoint directory within it.
        meta: the checkpoint's internal metadata (for ``"chunk_root"``).
        entry: the manifest entry (``{"path", "size", "crc32c", "chunks"}``).
        retry: retry policy of each chunk read.
        workers: chunk reads in flight at once (at least 1).

    Raises (every method):
        CheckpointCorruptError: a chunk is missing, does not decode, or its
            length differs from the manifest's; ``.file`` names the file and
            the message the chunk.
    """

    def __init__(self, filesystem: pafs.FileSystem, checkpoint_path: str,
                 meta: Mapping[str, Any], entry: Mapping[str, Any], *,
                 retry: RetryPolicy | None = None, workers: int = 4) -> None:
        self.fs = filesystem
        self.checkpoint_path = checkpoint_path
        self.entry = entry
        self.rel: str = entry["path"]
        self.size: int = entry["size"]
        self.retry = retry
        self.workers = max(1, int(workers))
        self.root = chunk_root_path(checkpoint_path, meta)
        self.chunks: list[tuple[str, int, int]] = [(c[0], c[1], c[2]) for c in entry["chunks"]]
        self.starts: list[int] = []
        at = 0
        for _, n, _ in self.chunks:
            self.starts.append(at)
            at += n
        self._cache: OrderedDict[int, memoryview] = OrderedDict()
        self._inflight: dict[int, Future[memoryview]] = {}
        self._lock = threading.Lock()

    # -- one chunk ------------------------------------------------------------------

    def _corrupt(self, i: int, why: str) -> CheckpointCorruptError:
        name = self.chunks[i][0]
        return CheckpointCorruptError(
            f"file {self.rel!r} of checkpoint {self.checkpoint_path!r}: chunk #{i} ({name}, "
            f"{chunk_object_path(self.root, name)}) {why}; the checkpoint is corrupt: resume "
            "from an earlier one", path=self.checkpoint_path, file=self.rel)

    def _no_store(self) -> str:
        """What to add to a missing chunk's message when the experiment has
        no chunk store at all: a trial copied by hand out of its experiment
        (its chunks stay in the source experiment's)."""
        try:
            there = _fsutil.is_dir(self.fs, self.root, retry=self.retry)
        except Exception:  # the message stays as it was
            return ""
        if there:
            return ""
        return (f" (its experiment has no chunk store {self.root!r}: a trial copied by hand "
                "from another experiment leaves its chunks there; copy checkpoints between "
                "experiments or stores with `checkpoint-store cp`, which writes whole files)")

    def fetch(self, i: int) -> tuple[memoryview, int]:
        """Chunk ``i``'s logical bytes and their CRC32C (from its checked header)."""
        name, logical, _ = self.chunks[i]
        where = chunk_object_path(self.root, name)
        try:
            blob = _read_object(self.fs, where, retry=self.retry)
        except FileNotFoundError:
            raise self._corrupt(i, "is missing" + self._no_store()) from None
        try:
            data = decode_chunk(blob, where=where)
            crc = int(chunk_header(blob, where=where)["crc32c"], 16)
        except CheckpointCorruptError as exc:
            raise self._corrupt(i, f"is damaged ({exc})") from None
        if len(data) != logical:
            raise self._corrupt(i, f"holds {len(data)} bytes, the manifest says {logical}")
        return data, crc

    def _cached(self, i: int) -> memoryview:
        """Chunk ``i``'s bytes: from the cache, from a fetch another thread has in
        flight, or fetched here (each chunk is read once while it is wanted)."""
        with self._lock:
            data = self._cache.get(i)
            if data is not None:
                self._cache.move_to_end(i)
                return data
            waiting = self._inflight.get(i)
            if waiting is None:
                mine: Future[memoryview] = Future()
                self._inflight[i] = mine
        if waiting is not None:
            return waiting.result()
        try:
            data = self.fetch(i)[0]
        except BaseException as exc:
            with self._lock:
                del self._inflight[i]
            mine.set_exception(exc)
            raise
        with self._lock:
            del self._inflight[i]
            self._cache[i] = data
            while len(self._cache) > CACHE_CHUNKS:
                self._cache.popitem(last=False)
        mine.set_result(data)
        return data

    # -- reads ------------------------------------------------------------------------

    def read_range(self, offset: int, length: int) -> bytes:
        """``length`` bytes of the file from ``offset`` (fewer at its end), reading
        only the chunks that cover them (several at once when more than one)."""
        if offset < 0 or length < 0:
            raise ValueError(f"read_range({offset}, {length}): negative offset or length")
        end = min(offset + length, self.size)
        if end <= offset:
            return b""
        first = bisect.bisect_right(self.starts, offset) - 1
        last = bisect.bisect_left(self.starts, end) - 1
        idx = [i for i in range(first, last + 1) if self.chunks[i][1]]
        if len(idx) > 1 and self.workers > 1:
            with ThreadPoolExecutor(min(self.workers, len(idx)),
                                    thread_name_prefix="cs-chunk-read") as pool:
                parts = list(pool.map(self._cached, idx))
        else:
            parts = [self._cached(i) for i in idx]
        out = bytearray()
        for i, data in zip(idx, parts, strict=True):
            lo = max(offset - self.starts[i], 0)
            hi = min(end - self.starts[i], len(data))
            out += data[lo:hi]
        return bytes(out)

    def _each(self, sink: Callable[[int, memoryview], None]) -> Iterator[tuple[int, int]]:
        """``(crc, length)`` of every chunk in order, each chunk handed to
        ``sink(offset, data)`` first; at most ``workers`` chunks in memory."""
        def one(i: int) -> tuple[int, int]:
            data, crc = self.fetch(i)
            sink(self.starts[i], data)
            return crc, len(data)

        if self.workers == 1 or len(self.chunks) <= 1:
            for i in range(len(self.chunks)):
                yield one(i)
            return
        pool = ThreadPoolExecutor(min(self.workers, len(self.chunks)),
                                  thread_name_prefix="cs-chunk-read")
        try:
            # Submitted lazily, ``workers`` ahead: a failure stops the rest.
            pending: list[Future[tuple[int, int]]] = []
            nxt = 0
            while nxt < len(self.chunks) or pending:
                while nxt < len(self.chunks) and len(pending) < 2 * self.workers:
                    pending.append(pool.submit(one, nxt))
                    nxt += 1
                yield pending.pop(0).result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _check_whole(self, parts: Iterator[tuple[int, int]]) -> None:
        crc = size = 0
        for part_crc, n in parts:
            crc = crc32c_combine(crc, part_crc, n)
            size += n
        if (size, crc_hex(crc)) != (self.size, self.entry["crc32c"]):
            raise CheckpointCorruptError(
                f"file {self.rel!r} of checkpoint {self.checkpoint_path!r} does not match its "
                f"manifest (size {size} vs {self.size}, crc32c {crc_hex(crc)} vs "
                f"{self.entry['crc32c']}); the checkpoint is corrupt: resume from an earlier one",
                path=self.checkpoint_path, file=self.rel)

    def write_to(self, target: int | str | os.PathLike[str], *,
                 workers: int | None = None) -> None:
        """Write the whole file to ``target`` (an open file descriptor, or a local
        path created or truncated), chunks fetched and decoded in parallel and
        written with ``pwrite`` at their offsets; the whole file's CRC32C is
        checked against the manifest from the chunks' own (no second read).

        Raises:
            CheckpointCorruptError: as the class says, or the file's size or
                CRC32C differs; what was written stays for the caller to remove.
        """
        if workers is not None:
            self.workers = max(1, int(workers))
        if isinstance(target, int):
            self._write_fd(target)
            return
        fd = os.open(os.fspath(target), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self._write_fd(fd)
        finally:
            os.close(fd)

    def _write_fd(self, fd: int) -> None:
        os.ftruncate(fd, self.size)

        def sink(offset: int, data: memoryview) -> None:
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n

        self._check_whole(self._each(sink))

    def read_all(self) -> bytes:
        """The whole file in memory, its size and CRC32C checked against the manifest."""
        out = bytearray(self.size)

        def sink(offset: int, data: memoryview) -> None:
            out[offset:offset + len(data)] = data

        self._check_whole(self._each(sink))
        return bytes(out)

    def verify(self) -> None:
        """Read every chunk: present, decodes, lengths and the whole file's
        CRC32C agree with the manifest. Nothing is kept."""
        self._check_whole(self._each(lambda offset, data: None))

