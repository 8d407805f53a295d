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
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import google_crc32c
import pyarrow as pa
import pyarrow.fs as pafs

T = TypeVar("T")

#: Bytes of file data held in memory at once by one transfer (all its threads).
#: Keeps peak RSS of a 1 GiB transfer within 100 MiB of the baseline.
DEFAULT_MEMORY_LIMIT = 80 * 1024 * 1024
#: Local-to-local copies read into per-thread buffers this large (the page
#: cache is the source; 1-4 MiB buffers were fastest, larger ones fell out of
#: the CPU caches).
LOCAL_BUFFER = 4 * 1024 * 1024
#: A local copy splits files larger than this into parallel parts.
LOCAL_PART = 64 * 1024 * 1024
#: Remote transfers count each byte twice against the memory limit: the HTTP
#: client holds its own copy while ours is in flight (measured with VmHWM).
_REMOTE_COPIES = 2
#: A batch of small files holds at most this many files ...
BATCH_FILES = 64
#: ... and this many bytes.
BATCH_BYTES = 16 * 1024 * 1024

_O_BINARY = getattr(os, "O_BINARY", 0)


# -- CRC32C ---------------------------------------------------------------------

_POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    p = 1 << 30  # x^1
    table = [p]
    for _ in range(1, 32):
        p = _multmodp(p, p)
        table.append(p)
    return table


_X2N = _x2n_table()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc1 = crc(A)``, ``crc2 = crc(B)`` and ``len(B)``.

    Same method as zlib's ``crc32_combine`` (multiply by x^(8*len2) modulo the
    polynomial); costs microseconds, so parts of a file can be checksummed in
    parallel.
    """
    if len2 <= 0:
        return crc1
    # x^(8 * len2): walk the bits of len2, starting at x^(2^3).
    p = 1 << 31
    k = 3
    n = len2
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def _crc(crc: int, data: Any) -> int:
    # google_crc32c takes bytes or pyarrow buffers, not memoryviews.
    return google_crc32c.extend(crc, data)


# -- memory budget -------------------------------------------------------------


class _Budget:
    """A byte semaphore: at most ``limit`` bytes held at once (one oversize
    request is let through when nothing else is held)."""

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self._held = 0
        self._cond = threading.Condition()

    def try_acquire(self, n: int) -> bool:
        with self._cond:
            if self._held == 0 or self._held + n <= self.limit:
                self._held += n
                return True
            return False

    def acquire(self, n: int) -> None:
        with self._cond:
            while not (self._held == 0 or self._held + n <= self.limit):
                self._cond.wait()
            self._held += n

    def release(self, n: int) -> None:
        with self._cond:
            self._held -= n
            self._cond.notify_all()


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


@dataclass(frozen=True)
class Plan:
    """How a tree is moved; see :func:`plan`. All sizes in bytes.

    Attributes:
        route: ``"local"`` (disk to disk), ``"download"`` (remote to disk),
            ``"upload"`` (disk to remote) or ``"stream"`` (anything else).
        chunk_size: bytes per request / read call; large files are cut in
            parts of this size.
        concurrency: threads moving data at once.
        memory_limit: bytes of file data buffered at once, all threads together.
        batches: lists of small files, each moved by one task.
        large: files moved part by part (or streamed, for uploads).
    """

    route: str
    chunk_size: int
    concurrency: int
    memory_limit: int
    batches: list[list[tuple[str, int]]]
    large: list[tuple[str, int]]


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
    src_local = _local_path(src_fs, src_root) is not None
    dst_local = _local_path(dst_fs, dst_root) is not None
    if src_local and dst_local:
        route = "local"
    elif dst_local:
        route = "download"
    elif src_local:
        route = "upload"
    else:
        route = "stream"
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
        part = max(1024 * 1024, min(part, limit // _REMOTE_COPIES))
    return Plan(route, part, workers, limit, batches, large)


# -- the runner ------------------------------------------------------------------


def _call_plain(fn: Callable[[], T], what: str) -> T:
    return fn()


class _Runner:
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

    def _src_os(self, rel: str) -> str:
        assert self.src_os is not None
        return os.path.join(self.src_os, *rel.split("/"))

    def _dst_os(self, rel: str) -> str:
        assert self.dst_os is not None
        return os.path.join(self.dst_os, *rel.split("/"))

    def _buffer(self) -> tuple[pa.Buffer, memoryview]:
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            buf = pa.allocate_buffer(min(self.read_chunk, LOCAL_BUFFER))
            self._tls.buf = buf
            self._tls.mv = memoryview(buf)
        return buf, self._tls.mv

    # -- local disk primitives

    def _copy_local_range(self, rel: str, offset: int, length: int) -> int:
        """Copy ``length`` bytes at ``offset`` of a local file to the same offset
        of the destination, returning the CRC32C of those bytes."""
        buf, mv = self._buffer()
        cap = len(mv)
        crc = 0
        src = os.open(self._src_os(rel), os.O_RDONLY | _O_BINARY)
        try:
            dst = os.open(self._dst_os(rel), os.O_WRONLY | _O_BINARY)
            try:
                pos = offset
                end = offset + length
                while pos < end:
                    want = min(cap, end - pos)
                    n = os.preadv(src, [mv[:want]], pos)
                    if n <= 0:
                        raise OSError(f"{self._src_os(rel)} shrank while it was being copied")
                    crc = _crc(crc, buf if n == cap else buf.slice(0, n))
                    w = 0
                    while w < n:
                        w += os.pwrite(dst, mv[w:n], pos + w)
                    pos += n
            finally:
                os.close(dst)
        finally:
            os.close(src)
        return crc

    def _copy_local_whole(self, rel: str) -> tuple[int, int]:
        buf, mv = self._buffer()
        cap = len(mv)
        crc = 0
        size = 0
        src = os.open(self._src_os(rel), os.O_RDONLY | _O_BINARY)
        try:
            dst = os.open(self._dst_os(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_BINARY,
                          0o644)
            try:
                while True:
                    n = os.readv(src, [mv])
                    if not n:
                        break
                    crc = _crc(crc, buf if n == cap else buf.slice(0, n))
                    size += n
                    w = 0
                    while w < n:
                        w += os.write(dst, mv[w:n])
                if self.fsync:
                    os.fsync(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        return size, crc

    def _write_local(self, rel: str, data: Any) -> None:
        dst = os.open(self._dst_os(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_BINARY, 0o644)
        try:
            mv = memoryview(data)
            w = 0
            while w < len(mv):
                w += os.write(dst, mv[w:])
            if self.fsync:
                os.fsync(dst)
        finally:
            os.close(dst)

    def _read_local(self, rel: str) -> bytes:
        with open(self._src_os(rel), "rb", buffering=0) as f:
            return f.read()

    # -- tasks

    def batch(self, items: list[tuple[str, int]]) -> list[FileResult]:
        route = self.p.route
        if route == "local":
            out = []
            for rel, _ in items:
                size, crc = self.call(lambda rel=rel: self._copy_local_whole(rel), f"copy {rel}")
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
            datas = [(rel, self.call(lambda rel=rel, size=size: get(rel, size),
                                     f"download {rel}"))
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
        return self.call(lambda: self._stream_once(rel, budgeted), f"copy {rel}")

    def _stream_once(self, rel: str, budgeted: bool) -> FileResult:
        # Chunks sized so that one in flight (counted twice: the client's
        # copy and ours) stays within the memory limit.
        # An fsspec file is opened directly with one chunk per block, so each
        # write uploads one block: it holds the chunk in its buffer and again
        # in the block it sends (4 copies in all, measured with VmHWM on adlfs).
        fsspec_out = isinstance(self.dst_fs, pafs.PyFileSystem) and self.dst_fsspec is not None
        # pyarrow's S3 stream: ours, the part it uploads in the background, and
        # the freed part its memory pool still holds (RSS reached 100 MiB with 2).
        copies = 4 if fsspec_out else _REMOTE_COPIES + 1
        chunk = max(1024 * 1024, min(self.p.chunk_size, self.p.memory_limit // copies))
        if fsspec_out:
            chunk = max(chunk, 5 * 1024 * 1024)  # S3's smallest multipart part
        charge = chunk * copies
        crc = 0
        size = 0
        held = 0
        if self.src_os is not None:
            reader: Any = pa.OSFile(self._src_os(rel), "rb")
        else:
            reader = self.src_fs.open_input_stream(self._src(rel))
        try:
            if fsspec_out:
                out = self.dst_fsspec.open(self._dst(rel), "wb", block_size=chunk)
            else:
                out = self.dst_fs.open_output_stream(self._dst(rel))
            try:
                while True:
                    if budgeted and not self.budget.try_acquire(charge):
                        # Before waiting for others, finish what this stream
                        # holds (pyarrow's S3 stream keeps the parts it uploads
                        # in the background until flush), so no one waits on us.
                        if held:
                            out.flush()
                            self.budget.release(held)
                            held = 0
                        self.budget.acquire(charge)
                    if budgeted:
                        held += charge
                    buf = reader.read_buffer(chunk)
                    n = buf.size
                    if not n:
                        break
                    crc = _crc(crc, buf)
                    size += n
                    out.write(buf)
                    del buf
            finally:
                out.close()
        finally:
            reader.close()
            if held:
                self.budget.release(held)
        return FileResult(rel, size, crc)

    def prepare_local(self, rel: str, size: int) -> None:
        """Create the destination of a part-wise download at its final size."""
        fd = os.open(self._dst_os(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_BINARY, 0o644)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def fsync_file(self, rel: str) -> None:
        fd = os.open(self._dst_os(rel), os.O_RDONLY | _O_BINARY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
) -> list[FileResult]:
    """Copy ``files`` (``(relpath, size)``) from ``src_root`` to ``dst_root``.

    The destination's directories must exist already. ``call(fn, what)`` runs
    each storage task (a retry policy, say); the default runs it once.

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

    # Work items: batches, then parts of large files (largest first).
    parts: list[tuple[str, int, int]] = []
    streamed: list[tuple[str, int]] = []
    batches = list(p.batches)
    large = sorted(p.large, key=lambda f: -f[1])
    if p.route == "local" and len(large) >= p.concurrency:
        # Enough large files to keep every thread busy: whole files, one per
        # task. Parts of one file would only queue on its inode's write lock.
        batches = [[f] for f in large] + batches
        large = []
    for rel, size in large:
        if p.route in ("local", "download"):
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
            if fsync and part_crcs and r.dst_os is not None:
                list(pool.map(r.fsync_file, list(part_crcs)))
    if sequential and fsync and r.dst_os is not None:
        for rel in part_crcs:
            r.fsync_file(rel)
    for rel, pieces in part_crcs.items():
        pieces.sort()
        crc = 0
        total = 0
        for _, length, c in pieces:
            crc = crc32c_combine(crc, c, length) if total else c
            total += length
        results[rel] = FileResult(rel, total, crc)
    return [results[rel] for rel, _ in files]
