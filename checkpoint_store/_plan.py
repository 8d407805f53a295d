"""Transfer planning: the fastest path for each (source, destination, file shape).

:func:`checkpoint_store.transfer.copy_tree` lists the files and creates the
directories; this module moves the bytes. Every path computes each file's
CRC32C on the bytes as they pass through this process, so a checksum never
costs a second read of the data.

How files are cut into tasks (numbers measured on a 2-core machine, see
docs/benchmarks.md):

* **small files** (at most one chunk) go in batches through a bounded thread
  pool, so the per-task cost of the pool is paid per batch. Where the remote
  side is an fsspec *async* filesystem (s3fs, adlfs, gcsfs) a batch is one
  ``pipe``/``cat`` call that fsspec runs concurrently on its event loop.
* **large files** are split in parts of one chunk. A download reads each part
  with one ranged request (``read_at`` / ``cat_file(start, end)``) and writes
  it at its offset (``pwrite``); a local copy does the same with ``pread``.
  Parts run in parallel; their CRC32Cs are combined (:func:`crc32c_combine`).
* **uploads of large files** stream each file through one output stream
  (pyarrow's S3 stream uploads multipart parts in the background; fsspec
  streams upload a block per chunk). Files go in parallel.

Memory: at most ``memory_limit`` bytes of file data are buffered at once
(default :data:`DEFAULT_MEMORY_LIMIT`), whatever the chunk size and
concurrency; a single chunk larger than the limit is still allowed, alone.
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

from checkpoint_store._budget import DEFAULT_MEMORY_LIMIT, _Budget
from checkpoint_store._crc32c import _crc, crc32c_combine
from checkpoint_store._localcopy import _O_BINARY, _LocalDisk, flush_files

__all__ = [
    "DEFAULT_MEMORY_LIMIT",
    "FileResult",
    "Plan",
    "Previous",
    "Route",
    "crc32c_combine",
    "plan",
    "run",
    "server_copy",
]

T = TypeVar("T")

#: How :func:`plan` moves a tree, from where its two sides live: ``"local"``
#: disk to disk, ``"download"`` remote to disk, ``"upload"`` disk to remote,
#: ``"stream"`` remote to remote (through this process).
Route = Literal["local", "download", "upload", "stream"]
#: The routes whose destination is the local disk: large files go in parts
#: written at their offsets (``pwrite``), so the file is made first.
_TO_DISK: tuple[Route, ...] = ("local", "download")

#: Parts of large files a transfer aims to keep in flight at once (ranged GETs
#: for downloads, multipart parts for uploads); the budget sets the part size.
PARTS_IN_FLIGHT = 8
#: Smallest part of a multipart upload S3 accepts (and the smallest part we cut).
MIN_PART = 5 * 1024 * 1024
#: pyarrow's S3 output stream buffers smaller writes into parts this large.
_PYARROW_PART = 10 * 1024 * 1024
#: S3 allows 10000 parts per upload; parts grow so a file never needs more.
MAX_PARTS = 9000
#: A local copy splits files larger than this into parallel parts.
LOCAL_PART = 64 * 1024 * 1024
#: Remote transfers count each byte twice against the memory limit: the HTTP
#: client holds its own copy while ours is in flight (measured with VmHWM).
_REMOTE_COPIES = 2
#: A batch of small files holds at most this many files ...
BATCH_FILES = 64
#: ... and this many bytes.
BATCH_BYTES = 16 * 1024 * 1024

# -- filesystem kinds ---------------------------------------------------------


def _local_path(fs: pafs.FileSystem, path: str) -> str | None:
    if isinstance(fs, pafs.LocalFileSystem):
        return path
    if isinstance(fs, pafs.SubTreeFileSystem) and isinstance(fs.base_fs, pafs.LocalFileSystem):
        return posixpath.join(fs.base_path, path.lstrip("/"))
    return None


def _native_of(fs: pafs.FileSystem) -> pafs.FileSystem:
    """The C++ filesystem behind a thin Python handler that keeps it as
    ``handler.native`` (the S3 plugin's marker-free handler), else ``fs``:
    data then moves without a Python call per read or write."""
    if isinstance(fs, pafs.PyFileSystem):
        native = getattr(fs.handler, "native", None)
        if isinstance(native, pafs.FileSystem):
            return native
    return fs


def _fsspec_of(fs: pafs.FileSystem) -> Any | None:
    """The fsspec filesystem behind ``PyFileSystem(FSSpecHandler(...))`` (or the
    s3fs client a plugin's handler keeps as ``deleter``), else None."""
    if isinstance(fs, pafs.PyFileSystem):
        handler = fs.handler
        for attr in ("fs", "deleter"):
            inner = getattr(handler, attr, None)
            if inner is not None and hasattr(inner, "cat_file") and hasattr(inner, "pipe"):
                return inner
    return None


def _is_async(fsspec_fs: Any) -> bool:
    return bool(getattr(fsspec_fs, "async_impl", False))


@dataclass(frozen=True)
class FileResult:
    """What one copied file was: relative path, size in bytes, CRC32C (int)."""

    path: str
    size: int
    crc32c: int
    #: True when the store copied it from the previous checkpoint (no upload).
    reused: bool = False


@dataclass(frozen=True)
class Plan:
    """How a tree is moved; see :func:`plan`. All sizes in bytes.

    Attributes:
        route: how the bytes move (a :data:`Route`).
        chunk_size: bytes per request / read call; large files are cut in
            parts of this size.
        concurrency: threads moving data at once.
        memory_limit: bytes of file data buffered at once, all threads together.
        batches: lists of small files, each moved by one task.
        large: files moved part by part (or streamed, for uploads).
    """

    route: Route
    chunk_size: int
    concurrency: int
    memory_limit: int
    batches: list[list[tuple[str, int]]]
    large: list[tuple[str, int]]


def _route(src_local: bool, dst_local: bool) -> Route:
    if src_local and dst_local:
        return "local"
    if dst_local:
        return "download"
    if src_local:
        return "upload"
    return "stream"


def plan(
    src_fs: pafs.FileSystem,
    src_root: str,
    dst_fs: pafs.FileSystem,
    dst_root: str,
    files: Sequence[tuple[str, int]],
    *,
    chunk_size: int,
    concurrency: int,
    memory_limit: int | None = None,
) -> Plan:
    """Choose the route and cut ``files`` (``(relpath, size)``) into tasks."""
    route = _route(_local_path(src_fs, src_root) is not None,
                   _local_path(dst_fs, dst_root) is not None)
    limit = memory_limit if memory_limit is not None else DEFAULT_MEMORY_LIMIT
    part = LOCAL_PART if route == "local" else chunk_size
    small_max = min(part, BATCH_BYTES)
    # With an async fsspec client on the remote side, a whole file up to one
    # chunk is one PUT / GET (s3fs puts below 100 MiB in one request; a
    # multipart upload costs several), run concurrently by fsspec.
    remote = dst_fs if route == "upload" else src_fs if route == "download" else None
    remote_fsspec = _fsspec_of(remote) if remote is not None else None
    if remote_fsspec is not None and _is_async(remote_fsspec):
        small_max = min(part, limit // _REMOTE_COPIES)
    batches: list[list[tuple[str, int]]] = []
    large: list[tuple[str, int]] = []
    cur: list[tuple[str, int]] = []
    cur_bytes = 0
    for rel, size in files:
        if size > small_max:
            large.append((rel, size))
            continue
        if cur and (len(cur) >= BATCH_FILES or cur_bytes + size > BATCH_BYTES):
            batches.append(cur)
            cur, cur_bytes = [], 0
        cur.append((rel, size))
        cur_bytes += size
    if cur:
        batches.append(cur)
    # Small files spread over every worker: with few files a batch each.
    workers = max(1, concurrency)
    n_small = sum(len(b) for b in batches)
    if batches and len(batches) < workers and n_small > len(batches):
        flat = [f for b in batches for f in b]
        per = max(1, -(-len(flat) // workers))
        batches = [flat[i : i + per] for i in range(0, len(flat), per)]
    if route == "download":
        # A ranged GET's bytes exist twice for a moment (the HTTP client's
        # buffer and ours): parts of at most half the memory limit.
        part = max(1024 * 1024, min(part, limit // (_REMOTE_COPIES * min(workers,
                                                                          PARTS_IN_FLIGHT))))
    return Plan(route, part, workers, limit, batches, large)


# -- the runner ------------------------------------------------------------------


def _call_plain(fn: Callable[[], T], what: str) -> T:
    return fn()


class _Runner(_LocalDisk):
    def __init__(
        self,
        p: Plan,
        src_fs: pafs.FileSystem,
        src_root: str,
        dst_fs: pafs.FileSystem,
        dst_root: str,
        *,
        fsync: bool,
        call: Callable[[Callable[[], Any], str], Any],
        read_chunk: int,
    ):
        self.p = p
        self.src_fs, self.src_root = src_fs, src_root
        self.dst_fs, self.dst_root = dst_fs, dst_root
        self.src_os = _local_path(src_fs, src_root)
        self.dst_os = _local_path(dst_fs, dst_root)
        self.src_fsspec = _fsspec_of(src_fs)
        self.dst_fsspec = _fsspec_of(dst_fs)
        self.dst_fs_outer = dst_fs
        # Bytes go through the C++ filesystem where a Python handler wraps one.
        self.src_fs = _native_of(src_fs)
        self.dst_fs = _native_of(dst_fs)
        self.fsync = fsync
        self.call = call
        self.read_chunk = read_chunk
        self.budget = _Budget(p.memory_limit)
        self._tls = threading.local()

    # paths
    def _src(self, rel: str) -> str:
        return posixpath.join(self.src_root, rel)

    def _dst(self, rel: str) -> str:
        return posixpath.join(self.dst_root, rel)

    # -- tasks

    def batch(self, items: list[tuple[str, int]]) -> list[FileResult]:
        route = self.p.route
        if route == "local":
            out = []
            for rel, _ in items:
                size, crc = self.call(partial(self._copy_local_whole, rel), f"copy {rel}")
                out.append(FileResult(rel, size, crc))
            return out
        nbytes = sum(s for _, s in items)
        nbytes *= _REMOTE_COPIES
        self.budget.acquire(nbytes)
        try:
            if route == "upload":
                return self._upload_batch(items)
            if route == "download":
                return self._download_batch(items)
            return [self.stream(rel, size, budgeted=False) for rel, size in items]
        finally:
            self.budget.release(nbytes)

    def _upload_batch(self, items: list[tuple[str, int]]) -> list[FileResult]:
        datas = {rel: self._read_local(rel) for rel, _ in items}
        out = [FileResult(rel, len(d), _crc(0, d)) for rel, d in datas.items()]
        fss = self.dst_fsspec
        if fss is not None and _is_async(fss):
            payload = {self._dst(rel): d for rel, d in datas.items()}
            self.call(lambda: fss.pipe(payload), f"upload {len(payload)} files")
        else:
            for rel, d in datas.items():
                def put(rel: str = rel, d: bytes = d) -> None:
                    with self.dst_fs.open_output_stream(self._dst(rel)) as f:
                        f.write(d)
                self.call(put, f"upload {rel}")
        return out

    def _download_batch(self, items: list[tuple[str, int]]) -> list[FileResult]:
        fss = self.src_fsspec
        out = []
        if fss is not None and _is_async(fss):
            paths = [self._src(rel) for rel, _ in items]
            # cat_ranges, not cat: cat reads [, * and ? in a name as a glob
            # pattern (and may return another file's bytes under that name).
            got = self.call(lambda: fss.cat_ranges(paths, None, None, on_error="raise"),
                            f"download {len(paths)} files")
            datas = [(rel, data) for (rel, _), data in zip(items, got, strict=True)]
        else:
            def get(rel: str, size: int) -> Any:
                # A random-access file knows its size: one ranged GET. (read()
                # on a *stream* goes 16 KiB at a time: a request each on S3.)
                with self.src_fs.open_input_file(self._src(rel)) as f:
                    return f.read_buffer()
            datas = [(rel, self.call(partial(get, rel, size), f"download {rel}"))
                     for rel, size in items]
        for rel, data in datas:
            self._write_local(rel, data)
            out.append(FileResult(rel, len(data), _crc(0, data)))
        return out

    def part(self, rel: str, offset: int, length: int) -> int:
        """Move bytes ``[offset, offset+length)`` of a large file; returns their CRC32C."""
        if self.p.route == "local":
            return self.call(
                lambda: self._copy_local_range(rel, offset, length),
                f"copy {rel}@{offset}",
            )
        # download
        self.budget.acquire(length * _REMOTE_COPIES)
        try:
            fss = self.src_fsspec
            if fss is not None:
                data = self.call(
                    lambda: fss.cat_file(self._src(rel), start=offset, end=offset + length),
                    f"download {rel}@{offset}",
                )
            else:
                def ranged() -> Any:
                    with self.src_fs.open_input_file(self._src(rel)) as f:
                        return f.read_at(length, offset)
                data = self.call(ranged, f"download {rel}@{offset}")
            if len(data) != length:
                raise OSError(
                    f"{self._src(rel)}: read {len(data)} bytes at offset {offset}, expected "
                    f"{length} (the file changed while it was being downloaded?)"
                )
            crc = _crc(0, data)
            fd = os.open(self._dst_os(rel), os.O_WRONLY | _O_BINARY)
            try:
                mv = memoryview(data)
                w = 0
                while w < length:
                    w += os.pwrite(fd, mv[w:], offset + w)
            finally:
                os.close(fd)
            del data, mv
            return crc
        finally:
            self.budget.release(length * _REMOTE_COPIES)

    def stream(self, rel: str, size: int, *, budgeted: bool = True) -> FileResult:
        """Copy one file through an output stream, chunk by chunk."""
        return self.call(lambda: self._stream_once(rel, size, budgeted), f"copy {rel}")

    def _stream_once(self, rel: str, size: int, budgeted: bool) -> FileResult:
        # Chunks sized so that one in flight (counted twice: the client's
        # copy and ours) stays within the memory limit.
        # An fsspec file is opened directly with one chunk per block, so each
        # write uploads one block: it holds the chunk in its buffer and again
        # in the block it sends (4 copies in all, measured with VmHWM on adlfs).
        dst_fsspec = self.dst_fsspec if isinstance(self.dst_fs, pafs.PyFileSystem) else None
        fsspec_out = dst_fsspec is not None
        # pyarrow's S3 stream: ours, the part it uploads in the background, and
        # the freed part its memory pool still holds (RSS reached 100 MiB with 2).
        copies = 4 if fsspec_out else _REMOTE_COPIES + 1
        # Several parts in flight (pyarrow uploads them in the background),
        # each at least S3's smallest part, and few enough for S3's limit.
        in_flight = 1 if fsspec_out else min(self.p.concurrency, PARTS_IN_FLIGHT) // 2 or 1
        chunk = min(self.p.chunk_size, self.p.memory_limit // (copies * in_flight))
        # pyarrow's S3 stream buffers writes smaller than its part size (10
        # MiB) unseen by the budget: write at least that much at a time.
        chunk = max(chunk, MIN_PART if fsspec_out else _PYARROW_PART, -(-size // MAX_PARTS))
        charge = chunk * copies
        crc = 0
        size = 0
        held = 0
        # The first chunk's share is taken before the stream opens: a stream
        # waiting for the budget holds no buffer.
        if budgeted:
            self.budget.acquire(charge)
            held = charge
        try:
            if self.src_os is not None:
                reader: Any = pa.OSFile(self._src_os(rel), "rb")
            else:
                reader = self.src_fs.open_input_stream(self._src(rel))
            try:
                if dst_fsspec is not None:
                    out = dst_fsspec.open(self._dst(rel), "wb", block_size=chunk)
                else:
                    out = self.dst_fs.open_output_stream(self._dst(rel))
                try:
                    while True:
                        buf = reader.read_buffer(chunk)
                        n = buf.size
                        if not n:
                            break
                        crc = _crc(crc, buf)
                        size += n
                        out.write(buf)
                        del buf
                        if budgeted and not self.budget.try_acquire(charge):
                            # Before waiting for others, finish what this stream
                            # holds (pyarrow's S3 stream keeps the parts it
                            # uploads in the background until flush).
                            out.flush()
                            self.budget.release(held)
                            held = 0
                            self.budget.acquire(charge)
                        if budgeted:
                            held += charge
                finally:
                    out.close()
            finally:
                reader.close()
        finally:
            if held:
                self.budget.release(held)
        return FileResult(rel, size, crc)



@dataclass(frozen=True)
class Previous:
    """A committed checkpoint on the destination store that an upload may copy
    unchanged files from.

    Attributes:
        root: its directory on the destination filesystem.
        files: ``{relative path: (size in bytes, CRC32C as an int)}`` from its manifest.
    """

    root: str
    files: Mapping[str, tuple[int, int]]


#: S3's CopyObject copies at most 5 GiB; larger objects need UploadPartCopy.
_COPY_OBJECT_MAX = 5 * 1024**3


def server_copy(fs: pafs.FileSystem, src: str, dst: str, size: int) -> None:
    """Copy one object of ``size`` bytes inside its store: no byte passes
    through this process.

    A native pyarrow filesystem copies with one request (S3 CopyObject, Azure
    Copy Blob; local and memory copies); objects over 5 GiB, and filesystems
    pyarrow only wraps, go through the fsspec client's ``cp_file`` (s3fs uses
    UploadPartCopy for large objects, adlfs Copy Blob, gcsfs rewrite).
    """
    native = _native_of(fs)
    fss = _fsspec_of(fs)
    if fss is None or (not isinstance(native, pafs.PyFileSystem) and size <= _COPY_OBJECT_MAX):
        native.copy_file(src, dst)
    else:
        fss.cp_file(src, dst)


def _reuse_previous(r: _Runner, previous: Previous,
                    files: Sequence[tuple[str, int]]) -> list[FileResult]:
    """Copy server-side every file equal (size and CRC32C) to the previous
    checkpoint's; what does not match, or cannot be copied, is left out."""
    candidates = [(rel, size) for rel, size in files
                  if previous.files.get(rel, (-1, 0))[0] == size]

    def one(item: tuple[str, int]) -> FileResult | None:
        rel, size = item
        fd = os.open(r._src_os(rel), os.O_RDONLY | _O_BINARY)
        try:
            crc = r._crc_range(fd, 0, size)
            if os.fstat(fd).st_size != size:
                return None
        finally:
            os.close(fd)
        if crc != previous.files[rel][1]:
            return None
        try:
            r.call(lambda: server_copy(r.dst_fs_outer, posixpath.join(previous.root, rel),
                                       r._dst(rel), size),
                   f"copy {rel} from the previous checkpoint")
        except OSError:
            return None  # gone meanwhile (deleted by retention, say): upload it
        return FileResult(rel, size, crc, reused=True)

    if not candidates:
        return []
    workers = max(1, min(r.p.concurrency, len(candidates)))
    with ThreadPoolExecutor(workers, thread_name_prefix="cs-reuse") as pool:
        return [fr for fr in pool.map(one, candidates) if fr is not None]


def run(
    src_fs: pafs.FileSystem,
    src_root: str,
    dst_fs: pafs.FileSystem,
    dst_root: str,
    files: Sequence[tuple[str, int]],
    *,
    chunk_size: int,
    concurrency: int,
    fsync: bool,
    memory_limit: int | None = None,
    call: Callable[[Callable[[], Any], str], Any] | None = None,
    previous: Previous | None = None,
) -> list[FileResult]:
    """Copy ``files`` (``(relpath, size)``) from ``src_root`` to ``dst_root``.

    The destination's directories must exist already. ``call(fn, what)`` runs
    each storage task (a retry policy, say); the default runs it once.

    ``previous`` (an upload from the local disk only): a committed checkpoint
    on the destination store. A file whose size and CRC32C equal those of the
    same path there is copied by the store itself (:func:`server_copy`) instead
    of uploaded; if that copy fails (the previous checkpoint was deleted
    meanwhile, say), the file is uploaded.

    Returns:
        One :class:`FileResult` per file, in the order of ``files``.

    Raises:
        OSError: the first error of any task; the others are cancelled (a
            partial copy is left for the caller's commit protocol to discard).
    """
    p = plan(src_fs, src_root, dst_fs, dst_root, files, chunk_size=chunk_size,
             concurrency=concurrency, memory_limit=memory_limit)
    r = _Runner(p, src_fs, src_root, dst_fs, dst_root, fsync=fsync,
                call=call or _call_plain, read_chunk=chunk_size)
    results: dict[str, FileResult] = {}
    if not files:
        return []
    if previous is not None and p.route == "upload":
        for fr in _reuse_previous(r, previous, files):
            results[fr.path] = fr
        if results:
            rest = [f for f in files if f[0] not in results]
            p = plan(src_fs, src_root, dst_fs, dst_root, rest, chunk_size=chunk_size,
                     concurrency=concurrency, memory_limit=memory_limit)
            r.p = p

    # Work items: batches, then parts of large files (largest first).
    parts: list[tuple[str, int, int]] = []
    streamed: list[tuple[str, int]] = []
    batches = list(p.batches)
    large = sorted(p.large, key=lambda f: -f[1])
    if p.route == "local" and large and r.reflinks(large[0][0]):
        # Clones cost no data blocks and no time per byte: whole files.
        batches = [[f] for f in large] + batches
        large = []
    if p.route == "local" and len(large) >= p.concurrency:
        # Enough large files to keep every thread busy: whole files, one per
        # task. Parts of one file would only queue on its inode's write lock.
        batches = [[f] for f in large] + batches
        large = []
    for rel, size in large:
        if p.route in _TO_DISK:
            r.prepare_local(rel, size)
            for off in range(0, size, p.chunk_size):
                parts.append((rel, off, min(p.chunk_size, size - off)))
        else:
            streamed.append((rel, size))

    workers = p.concurrency
    sequential = workers == 1 or (len(batches) + len(parts) + len(streamed)) == 1
    if sequential:
        for b in batches:
            for fr in r.batch(b):
                results[fr.path] = fr
        part_crcs: dict[str, list[tuple[int, int, int]]] = {}
        for rel, off, length in parts:
            part_crcs.setdefault(rel, []).append((off, length, r.part(rel, off, length)))
        for rel, size in streamed:
            results[rel] = r.stream(rel, size)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="cs-transfer") as pool:
            futs: list[Future[Any]] = []
            stream_futs = [pool.submit(r.stream, rel, size) for rel, size in streamed]
            part_futs = [
                (rel, off, length, pool.submit(r.part, rel, off, length))
                for rel, off, length in parts
            ]
            batch_futs = [pool.submit(r.batch, b) for b in batches]
            futs = stream_futs + [f for *_, f in part_futs] + batch_futs
            done, pending = wait(futs, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in futs:
                if f.done() and not f.cancelled() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            for f in stream_futs:
                fr = f.result()
                results[fr.path] = fr
            for f in batch_futs:
                for fr in f.result():
                    results[fr.path] = fr
            part_crcs = {}
            for rel, off, length, f in part_futs:
                part_crcs.setdefault(rel, []).append((off, length, f.result()))
    if fsync and r.dst_os is not None:
        flush_files(r.dst_os, [rel for rel, _ in files], workers)
    for rel, pieces in part_crcs.items():
        pieces.sort()
        crc = 0
        total = 0
        for _, length, c in pieces:
            crc = crc32c_combine(crc, c, length) if total else c
            total += length
        results[rel] = FileResult(rel, total, crc)
    return [results[rel] for rel, _ in files]
