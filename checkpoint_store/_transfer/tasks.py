"""The tasks of a transfer: each moves one batch of small files, one part of
a large file, or one file through an output stream, and returns CRC32Cs of
the bytes as they passed.

:func:`checkpoint_store._transfer.plan.run` cuts a tree into these tasks and runs them
on a thread pool; :class:`TransferTasks` holds what they share (both sides, the
memory budget, the retry wrapper ``call``). Bytes go through the C++
filesystem behind a Python handler where there is one, and through the fsspec
client's concurrent calls for batches where it is async
(:mod:`checkpoint_store._transfer.remote`). The local-disk half (kernel copies,
``pwrite`` of parts) is :class:`~checkpoint_store._transfer.localcopy._LocalDisk`.

Memory: every buffer is taken from the transfer's
:class:`~checkpoint_store._transfer.budget._Budget`
before it is filled, counted as often as it exists at once (ours, the HTTP
client's, the part an output stream uploads in the background).
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import pyarrow as pa
import pyarrow.fs as pafs

from checkpoint_store._transfer.budget import _Budget
from checkpoint_store._transfer.crc32c import _crc
from checkpoint_store._transfer.localcopy import _O_BINARY, _LocalDisk, _pwrite_all
from checkpoint_store._transfer.remote import (
    PartUpload,
    _client_of,
    _is_async,
    _native_of,
    keeps_names,
    open_range,
    part_upload_client,
    writer_of,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.errors import SourceChangedError

logger = logging.getLogger(__name__)

__all__ = ["PARTS_IN_FLIGHT", "FileResult", "Plan", "Route", "TransferTasks", "_PART_UPLOAD_COPIES",
           "_REMOTE_COPIES"]

#: Parts of large files a transfer aims to keep in flight at once (ranged GETs
#: for downloads, multipart parts for uploads); the budget sets the part size.
PARTS_IN_FLIGHT = 8
#: Remote transfers count each byte twice against the memory limit: the HTTP
#: client holds its own copy while ours is in flight (measured with VmHWM).
_REMOTE_COPIES = 2
#: A part of a parallel multipart upload through s3fs is held three times at
#: its peak: our bytes, botocore's request body and aiohttp's send buffer
#: (4 x 256 MiB with two copies counted: VmHWM grew 369 MiB on a 256 MiB budget).
#: Azure's staged blocks are counted alike (ours, the SDK's request, aiohttp's).
_PART_UPLOAD_COPIES = 3
#: Smallest part of a multipart upload S3 accepts (and the smallest part we cut).
MIN_PART = 5 * 1024 * 1024
#: pyarrow's S3 output stream buffers smaller writes into parts this large.
_PYARROW_PART = 10 * 1024 * 1024
#: S3 allows 10000 parts per upload; parts grow so a file never needs more.
MAX_PARTS = 9000
#: A local source that read more bytes than its listed size.
_GREW_BY = ("changed while it was being copied: it read {got} bytes where its size says "
            "{size} (it grew, or is a pseudo file whose size is not what it reads)")


#: How :func:`plan` moves a tree, from where its two sides live: ``"local"``
#: disk to disk, ``"download"`` remote to disk, ``"upload"`` disk to remote,
#: ``"stream"`` remote to remote (through this process).
Route = Literal["local", "download", "upload", "stream"]


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
        piece: for a download whose client streams ranges
            (:func:`~checkpoint_store._transfer.remote.can_stream_ranges`), bytes read
            at a time from each part's one request (parts are then large:
            see :func:`_stream_part_size`); 0 when each part is one buffer.
        local_disks: route ``"local"`` with both roots on a local-device or
            in-memory filesystem (:func:`creates_locally`): small files are
            one batch, and a large file is one copy through user space
            (:meth:`~checkpoint_store._transfer.localcopy._LocalDisk._pipe_copy`).
    """

    route: Route
    chunk_size: int
    concurrency: int
    memory_limit: int
    batches: list[list[tuple[str, int]]]
    large: list[tuple[str, int]]
    piece: int = 0
    local_disks: bool = False


@dataclass(frozen=True)
class FileResult:
    """What one copied file was: relative path, size in bytes, CRC32C (int)."""

    path: str
    size: int
    crc32c: int
    #: True when the store copied it from the previous checkpoint (no upload).
    reused: bool = False


class TransferTasks(_LocalDisk):
    """The tasks of one transfer (plan ``p``) and what they share.

    Each task method runs on a worker thread of :func:`checkpoint_store._transfer.plan.run`
    and passes every storage call through ``call(fn, what)`` (the retry
    policy). ``p`` may be replaced before the tasks start (after a reuse of
    the previous checkpoint's files leaves fewer to move).
    """

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
        #: Called with the bytes of each task done (:func:`plan.run`'s ``on_bytes``).
        self.on_bytes: Callable[[int], None] | None = None
        self.src_fs, self.src_root = src_fs, src_root
        self.dst_fs, self.dst_root = dst_fs, dst_root
        self.src_os = _fsutil.local_path(src_fs, src_root)
        self.dst_os = _fsutil.local_path(dst_fs, dst_root)
        self.pipe_copies = p.local_disks
        # Beside a C++ client too (see _client_of): batches of small files
        # and streamed ranges go through the fsspec client.
        self.src_fsspec = _client_of(src_fs)
        self.dst_fsspec = _client_of(dst_fs)
        self.dst_fs_outer = dst_fs
        self.src_fs_outer = src_fs
        #: Large files go up in parallel parts through this client, if any
        #: (S3 multipart uploads, Azure staged blocks).
        self.part_client = part_upload_client(dst_fs)
        #: ``{relpath: its upload in parts}``, started before any part runs.
        self.uploads: dict[str, PartUpload] = {}
        #: Parts of each upload not sent yet, and the uploads completed (an
        #: upload completes as soon as its last part is in, see :meth:`part`).
        self._part_counts: dict[str, int] = {}
        self._parts_left: dict[str, int] = {}
        self._completed: set[str] = set()
        self._uploads_lock = threading.Lock()
        # Bytes go through the C++ filesystem where a Python handler wraps one.
        self.src_fs = _native_of(src_fs)
        self.dst_fs = writer_of(_native_of(dst_fs))
        self.fsync = fsync
        self.call = call
        self.read_chunk = read_chunk
        self.budget = _Budget(p.memory_limit)
        self._tls = threading.local()
        self._fds_lock = threading.Lock()
        # Parts of one file share one open handle: opening costs a request
        # (a HEAD on S3, GetProperties on Azure) per part otherwise.
        self._inputs: dict[str, Any] = {}
        self._inputs_lock = threading.Lock()
        #: ``{relpath: (inode, size, mtime_ns)}`` of the local sources copied
        #: whole while their parts are checksummed (see ``_plan._work_items``).
        self.stamps: dict[str, tuple[int, int, int]] = {}

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
        payload = {self._dst(rel): d for rel, d in datas.items()}
        if fss is not None and _is_async(fss) and keeps_names(fss, payload):
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
        # Through the async fsspec client where there is one, also beside a
        # C++ client (the S3 plugin's pyarrow engine): one GET per file, all
        # in flight at once, where pyarrow's Python API sends a HEAD before
        # each GET. 2000 x 64 KiB from moto, alternating: pyarrow 7.8 s,
        # s3fs 5.6 s; through a 10 ms / 1 Gbit/s link 9.6 s against 5.9 s.
        paths = [self._src(rel) for rel, _ in items]
        if fss is not None and _is_async(fss) and keeps_names(fss, paths):
            starts, ends = _whole_file_ranges(fss, items)
            # cat_ranges, not cat: cat reads [, * and ? in a name as a glob
            # pattern (and may return another file's bytes under that name).
            got = self.call(lambda: fss.cat_ranges(paths, starts, ends, on_error="raise"),
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
            # The bytes are copied whole by copy_whole; this checksums them.
            return self.call(
                lambda: self.crc_local_range(rel, offset, length, self.stamps[rel]),
                f"checksum {rel}@{offset}",
            )
        if self.p.route == "upload":
            crc = self.call(lambda: self._upload_part(rel, offset, length),
                            f"upload {rel}@{offset}")
            with self._uploads_lock:
                self._parts_left[rel] -= 1
                last = self._parts_left[rel] == 0
            if last:
                # At once, on this worker, while the others send the next
                # files' parts: the store assembles this object (seconds for
                # a large one, answering nothing meanwhile) beside that
                # traffic, not after it (4 x 256 MiB through a 10 ms / 1 Gbit
                # link to moto: the four assemblies came after the last byte).
                self._complete(rel)
            return crc
        if self.p.piece:
            return self.call(lambda: self._stream_range(rel, offset, length),
                             f"download {rel}@{offset}")
        # download
        self.budget.acquire(length * _REMOTE_COPIES)
        try:
            fss = self.src_fsspec
            # A C++ client behind the handler reads without the fsspec event
            # loop's single thread (Azure's pyarrow client, 1.4x adlfs on Azurite).
            if fss is not None and isinstance(self.src_fs, pafs.PyFileSystem):
                data = self.call(
                    lambda: fss.cat_file(self._src(rel), start=offset, end=offset + length),
                    f"download {rel}@{offset}",
                )
            else:
                data = self.call(lambda: self._read_at(rel, offset, length),
                                 f"download {rel}@{offset}")
            if len(data) != length:
                raise self._remote_changed(rel, len(data), offset, length)
            crc = _crc(0, data)
            fd = os.open(self._dst_os(rel), os.O_WRONLY | _O_BINARY)
            try:
                _pwrite_all(fd, data, offset)
            finally:
                os.close(fd)
            del data
            return crc
        finally:
            self.budget.release(length * _REMOTE_COPIES)

    def start_upload(self, rel: str, size: int) -> None:
        """Start the upload in parts of a large local file (S3 multipart,
        Azure staged blocks; parts then run on any thread, :meth:`part`);
        the source's stamp is taken first."""
        stamp = self.stamps[rel] = self.source_stamp(rel)
        if stamp[1] != size:
            raise self._changed(rel, "changed while it was being uploaded")
        assert self.part_client is not None
        upload = self.part_client.open(self._dst(rel))
        self.call(upload.start, f"start the upload of {rel}")
        self.uploads[rel] = upload
        self._part_counts[rel] = self._parts_left[rel] = -(-size // self.p.chunk_size)

    def _upload_part(self, rel: str, offset: int, length: int) -> int:
        """Upload bytes ``[offset, offset+length)`` of a local file as its
        part ``offset // chunk_size + 1``; returns the CRC32C of exactly the
        bytes sent (a retry reads them again, from the same unchanged file)."""
        self.budget.acquire(length * _PART_UPLOAD_COPIES)
        try:
            fd = os.open(self._src_os(rel), os.O_RDONLY | _O_BINARY)
            try:
                stamp = self.stamps[rel]
                self._same_source(rel, fd, stamp)
                data = _pread_all(fd, offset, length)
                if len(data) != length:
                    raise self._short(rel, offset + len(data), stamp[1])
                if offset + length == stamp[1]:
                    self._at_end(rel, fd, stamp[1])
                self._same_source(rel, fd, stamp)
            finally:
                os.close(fd)
            crc = _crc(0, data)
            self.uploads[rel].put_part(offset // self.p.chunk_size + 1, data)
            del data
            return crc
        finally:
            self.budget.release(length * _PART_UPLOAD_COPIES)

    def _complete(self, rel: str) -> None:
        """Complete the upload of ``rel`` (all its parts are in)."""
        upload = self.uploads[rel]
        self.call(partial(upload.complete, self._part_counts[rel]),
                  f"complete the upload of {rel}")
        with self._uploads_lock:
            self._completed.add(rel)

    def finish_uploads(self) -> None:
        """Complete every upload in parts not completed yet (each completes
        as its last part is in: none, unless a plan sent no part of a file),
        then forget them all: nothing is left to abort."""
        for rel in list(self.uploads):
            if rel not in self._completed:
                self._complete(rel)
        self.uploads.clear()
        self._completed.clear()
        self._part_counts.clear()
        self._parts_left.clear()

    def abort_uploads(self) -> None:
        """Drop the parts of every upload not completed (after a failure),
        each abort retried as any request; one that still fails is logged
        with its upload id (S3 keeps such parts until aborted or expired by a
        lifecycle rule), never raised over the failure that led here."""
        for rel, upload in self.uploads.items():
            if rel in self._completed:
                continue  # an object now, which the commit protocol discards
            try:
                self.call(upload.abort, f"abort the upload of {rel}")
            except Exception as exc:
                logger.warning(
                    "could not abort the multipart upload %s: %s. Its parts stay stored "
                    "(not as an object) until `aws s3api abort-multipart-upload` or a "
                    "bucket lifecycle rule for incomplete multipart uploads removes them",
                    upload.describe(), exc)

    def _stream_range(self, rel: str, offset: int, length: int) -> int:
        """Download bytes ``[offset, offset+length)`` with one streamed ranged
        GET, writing each piece at its offset as it arrives; returns their CRC32C."""
        charge = self.p.piece * _REMOTE_COPIES
        self.budget.acquire(charge)
        try:
            body = open_range(self.src_fsspec, self._src(rel), offset, offset + length)
            fd = os.open(self._dst_os(rel), os.O_WRONLY | _O_BINARY)
            try:
                crc = got = 0
                while got < length:
                    data = body.read(min(self.p.piece, length - got))
                    if not data:
                        raise self._remote_changed(rel, got, offset, length)
                    crc = _crc(crc, data)
                    _pwrite_all(fd, data, offset + got)
                    got += len(data)
                    del data
            finally:
                os.close(fd)
                body.close()
            return crc
        finally:
            self.budget.release(charge)

    def _read_at(self, rel: str, offset: int, length: int) -> Any:
        """``length`` bytes at ``offset`` of a remote file, through a handle
        shared by its parts (Arrow's ``ReadAt`` is safe from many threads);
        a handle that failed is dropped, so a retry opens the file again."""
        with self._inputs_lock:
            f = self._inputs.get(rel)
            if f is None:
                f = self._inputs[rel] = self.src_fs.open_input_file(self._src(rel))
        try:
            return f.read_at(length, offset)
        except BaseException:
            with self._inputs_lock:
                if self._inputs.get(rel) is f:
                    del self._inputs[rel]
            raise

    def _remote_changed(self, rel: str, got: int, offset: int, length: int
                        ) -> SourceChangedError:
        """The error for a ranged read of source file ``rel`` that returned
        ``got`` bytes of the ``length`` asked for at ``offset``."""
        return SourceChangedError(
            f"{self._src(rel)}: read {got} bytes at offset {offset}, expected {length}: the "
            "file changed while it was being downloaded; copy it again once nothing writes it",
            path=self.src_root, file=rel)

    def close_inputs(self) -> None:
        """Close the handles :meth:`_read_at` kept open, and the roots' descriptors."""
        self.close_roots()
        with self._inputs_lock:
            inputs, self._inputs = list(self._inputs.values()), {}
        for f in inputs:
            f.close()

    def copy_whole(self, rel: str) -> None:
        """Copy a large local file whole (route ``"local"``; its CRC32C comes
        from the :meth:`part` tasks of the same file)."""
        self.call(lambda: self.copy_local_file(rel, self.stamps[rel]), f"copy {rel}")

    def stream(self, rel: str, size: int, *, budgeted: bool = True) -> FileResult:
        """Copy one file through an output stream, chunk by chunk."""
        return self.call(lambda: self._stream_once(rel, size, budgeted), f"copy {rel}")

    def _stream_end(self, rel: str, size: int, got: int) -> None:
        """A local source streamed whole (``got`` bytes read to its end) must
        read as many bytes as its size says now, once read: more or fewer, it
        changed meanwhile, or lies about its size (a pseudo file)."""
        if got != size:
            raise (self._short(rel, got, size) if got < size
                   else self._changed(rel, _GREW_BY.format(size=size, got=got)))

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
        opened: int | None = None  # a local source's size as it was opened
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
                opened = reader.size()
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
        if opened is not None:
            self._stream_end(rel, opened, size)
        return FileResult(rel, size, crc)


def _pread_all(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` (fewer only at the end of the file)."""
    pieces = []
    got = 0
    while got < length:
        piece = os.pread(fd, length - got, offset + got)
        if not piece:
            break
        pieces.append(piece)
        got += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _whole_file_ranges(fss: Any, items: list[tuple[str, int]]
                       ) -> tuple[list[int | None], list[int | None]]:
    """``cat_ranges`` bounds that fetch each whole file with one request.

    s3fs asks for an object's size (a HEAD) before an unbounded read: a
    request per small file that the listing already answered. Each file is
    asked one byte past its listed size instead (S3 clamps the range), so a
    file that grew since the listing still comes back longer than listed
    (and fails the manifest check of a download). Empty files (no byte to
    range over) and other clients read unbounded.
    """
    if not hasattr(fss, "_call_s3"):
        return [None] * len(items), [None] * len(items)
    starts: list[int | None] = [0 if size else None for _, size in items]
    ends: list[int | None] = [size + 1 if size else None for _, size in items]
    return starts, ends

