"""Transfer planning: the fastest path for each (source, destination, file shape).

:func:`checkpoint_store._transfer.trees.copy_tree` lists the files and creates the
directories; this module chooses the route (:data:`Route`), cuts the files
into tasks (:func:`plan`) and runs them (:func:`run`); the tasks that move
the bytes are :mod:`checkpoint_store._transfer.tasks`. Every path computes each file's
CRC32C on the bytes as they pass through this process, so a checksum never
costs a second read of the data.

How files are cut into tasks (numbers measured on a 2-core machine, see
docs/benchmarks.md):

* **small files** (at most one chunk) go in batches through a bounded thread
  pool, so the per-task cost of the pool is paid per batch. Where the remote
  side is an fsspec *async* filesystem (s3fs, adlfs, gcsfs) a batch is one
  ``pipe``/``cat`` call that fsspec runs concurrently on its event loop
  (also beside a C++ client: the S3 and Azure plugins' pyarrow engines, and
  the s3fs twin of a pyarrow S3 filesystem passed in, see
  :func:`~checkpoint_store.backends.clients._client_of`).
  Disk to disk between local-device or in-memory filesystems, all small
  files are one batch copied in turn by one thread (beside the large files'
  tasks): more threads measured slower.
* **large files** are split in parts of one chunk. A download reads each part
  with one ranged request (``read_at`` / ``cat_file(start, end)``) and writes
  it at its offset (``pwrite``); a local copy does the same with ``pread``.
  Parts run in parallel; their CRC32Cs are combined (:func:`crc32c_combine`).
* **uploads of large files** go up in parts that run in parallel like a
  download's, each read with ``pread`` and checksummed as it is sent, where
  the store's fsspec client is at hand: S3 multipart uploads through s3fs
  (both engines of the S3 backend, an s3fs or pyarrow S3 filesystem passed
  in), Azure blocks staged and committed through adlfs (both engines of the
  Azure backend, an adlfs filesystem passed in). The upload completes once every
  part is in. Elsewhere each file streams through one output stream
  (pyarrow's S3 stream uploads its parts in the background; other fsspec
  streams upload a block per chunk). Files go in parallel.

Memory: at most ``memory_limit`` bytes of file data are buffered at once
(default :data:`DEFAULT_MEMORY_LIMIT`), whatever the chunk size and
concurrency; a single chunk larger than the limit is still allowed, alone.
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyarrow.fs as pafs

from checkpoint_store._transfer.budget import DEFAULT_MEMORY_LIMIT
from checkpoint_store._transfer.crc32c import crc32c_combine
from checkpoint_store._transfer.durability import creates_locally, flush_files
from checkpoint_store._transfer.localcopy import _O_BINARY
from checkpoint_store._transfer.remote import (
    _client_of,
    _is_async,
    can_stream_ranges,
    part_upload_client,
    server_copy,
)
from checkpoint_store._transfer.tasks import (
    _PART_UPLOAD_COPIES,
    _REMOTE_COPIES,
    MIN_PART,
    PARTS_IN_FLIGHT,
    FileResult,
    TransferTasks,
)
from checkpoint_store._transfer.tasks import Plan as Plan
from checkpoint_store._transfer.tasks import Route as Route
from checkpoint_store._util.fs import local_path, walk_files
from checkpoint_store.errors import SourceDeletedError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MEMORY_LIMIT",
    "FileResult",
    "Plan",
    "Previous",
    "Route",
    "crc32c_combine",
    "plan",
    "run",
]

T = TypeVar("T")

#: The routes whose destination is the local disk: large files go in parts
#: written at their offsets (``pwrite``), so the file is made first.
_TO_DISK: tuple[Route, ...] = ("local", "download")

#: A large file copied on the local disk is checksummed in parts of this
#: many bytes, one task each, beside its kernel copy: in effect one part per
#: file. One thread reads the page cache and checksums at about 12 GB/s, three
#: times the kernel copy's 4 GB/s, so more checksum threads only take CPU and
#: memory bandwidth from the copy (1 GiB on ext4, 2 cores, 7 alternating runs:
#: 285 ms with one checksum task, 308 ms with 64 MiB parts, ``cp`` 276 ms).
LOCAL_PART = 1 << 40
#: A streamed download part (one ranged GET read piece by piece) is read this
#: many bytes at a time (less where the memory limit needs it).
STREAM_PIECE = 8 * 1024 * 1024
#: ... and covers at most this many bytes (a failed part is fetched again whole).
MAX_STREAM_PART = 512 * 1024 * 1024
#: A download part read whole into memory (a ranged read where the client
#: cannot stream one, e.g. pyarrow's Azure and S3 clients) is at most this
#: large: pyarrow's memory pool (mimalloc) reuses freed blocks up to 16 MiB,
#: but maps a larger one afresh each time, so the kernel zeroes and faults in
#: every page of it (Azurite, 256 MiB read in 32 MiB parts: 256 page faults
#: per MiB against none in 16 MiB parts; 4 x 256 MiB with 4 workers, client
#: CPU 1.0-1.4 s against 0.6-1.0 s).
MAX_READ_PART = 16 * 1024 * 1024
#: A batch of small files holds at most this many files ...
BATCH_FILES = 64
#: ... and this many bytes.
BATCH_BYTES = 16 * 1024 * 1024




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
    src_os, dst_os = local_path(src_fs, src_root), local_path(dst_fs, dst_root)
    route = _route(src_os is not None, dst_os is not None)
    limit = memory_limit if memory_limit is not None else DEFAULT_MEMORY_LIMIT
    part = LOCAL_PART if route == "local" else chunk_size
    small_max = min(part, BATCH_BYTES)
    # With an async fsspec client on the remote side, a whole file up to one
    # chunk is one PUT / GET (s3fs puts below 100 MiB in one request; a
    # multipart upload costs several), run concurrently by fsspec.
    remote = dst_fs if route == "upload" else src_fs if route == "download" else None
    remote_fsspec = _client_of(remote) if remote is not None else None
    if remote_fsspec is not None and _is_async(remote_fsspec):
        small_max = min(part, limit // _REMOTE_COPIES)
    batches: list[list[tuple[str, int]]] = []
    large: list[tuple[str, int]] = []
    cur: list[tuple[str, int]] = []
    cur_bytes = 0
    # Disk to disk, the small files are one batch, copied in turn by one
    # thread, as cp does: each costs a few system calls, and more threads
    # only queue on the directory's lock and hand the GIL back and forth
    # (2000 x 64 KiB, 2 cores, alternating: 1 thread 1.04x cp on ext4 and
    # 0.75x on tmpfs; 4 threads 0.88x and 0.52x). Not from or onto a
    # network filesystem (a storage_path on NFS, say), where each open and
    # close waits for the server: there several files stay in flight.
    local_disks = (route == "local" and src_os is not None and dst_os is not None
                   and creates_locally(src_os) and creates_locally(dst_os))
    for rel, size in files:
        if size > small_max:
            large.append((rel, size))
            continue
        if cur and not local_disks and (len(cur) >= BATCH_FILES
                                      or cur_bytes + size > BATCH_BYTES):
            batches.append(cur)
            cur, cur_bytes = [], 0
        cur.append((rel, size))
        cur_bytes += size
    if cur:
        batches.append(cur)
    # Small files spread over every worker: with few files a batch each.
    workers = max(1, concurrency)
    n_small = sum(len(b) for b in batches)
    if not local_disks and batches and len(batches) < workers and n_small > len(batches):
        flat = [f for b in batches for f in b]
        per = max(1, -(-len(flat) // workers))
        batches = [flat[i : i + per] for i in range(0, len(flat), per)]
    piece = 0
    if route == "download" and can_stream_ranges(remote_fsspec):
        piece = max(1024 * 1024, min(STREAM_PIECE, limit // (_REMOTE_COPIES * workers)))
        part = _stream_part_size(large, workers, part)
    elif route == "upload" and (uploader := part_upload_client(dst_fs)) is not None:
        # A part in flight on every worker (each held _PART_UPLOAD_COPIES
        # times), at least S3's smallest part, few enough for the store's
        # limit on parts (S3 10,000, Azure 50,000 blocks) and none larger
        # than it allows (S3 5 GiB, Azure 4000 MiB).
        biggest = max((size for _, size in large), default=0)
        part = min(uploader.max_part, max(
            MIN_PART, -(-biggest // uploader.max_parts),
            min(part, limit // (_PART_UPLOAD_COPIES * min(workers, PARTS_IN_FLIGHT)))))
    elif route == "download":
        # A ranged GET's bytes exist twice for a moment (the HTTP client's
        # buffer and ours): parts of at most half the memory limit.
        part = max(1024 * 1024, min(part, MAX_READ_PART,
                                    limit // (_REMOTE_COPIES * min(workers, PARTS_IN_FLIGHT))))
    return Plan(route, part, workers, limit, batches, large, piece, local_disks)


def _stream_part_size(large: Sequence[tuple[str, int]], workers: int, chunk: int) -> int:
    """Bytes per streamed ranged GET of a download: the large files' bytes
    shared evenly by the workers (at least a chunk, at most
    :data:`MAX_STREAM_PART`), so there are about as many requests as workers
    and never more than the data needs. With as many large files as
    workers, each file is one GET, as the raw clients do; fewer files are
    cut so every worker still has a request in flight. Servers that re-read
    the object for every ranged GET (moto) pay per request, so no part is
    cut smaller than needed; memory does not grow with the part (each is
    read :data:`STREAM_PIECE` at a time)."""
    total = sum(size for _, size in large)
    if not total:
        return chunk
    mib = 1024 * 1024
    even = -(-total // (workers * mib)) * mib
    return max(chunk, min(MAX_STREAM_PART, even))


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


def _call_plain(fn: Callable[[], T], what: str) -> T:
    return fn()


def _unchanged(r: TransferTasks, previous: Previous,
               files: Sequence[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """``(relpath, size, CRC32C)`` of the files equal in size and CRC32C to
    the same path of the previous checkpoint (checksummed in parallel, from
    the page cache where the user just wrote them)."""
    candidates = [(rel, size) for rel, size in files
                  if previous.files.get(rel, (-1, 0))[0] == size]

    def one(item: tuple[str, int]) -> tuple[str, int, int] | None:
        rel, size = item
        fd = os.open(r._src_os(rel), os.O_RDONLY | _O_BINARY)
        try:
            crc = r._crc_range(rel, fd, 0, size)
            if os.fstat(fd).st_size != size:
                return None
        finally:
            os.close(fd)
        return (rel, size, crc) if crc == previous.files[rel][1] else None

    if not candidates:
        return []
    workers = max(1, min(r.p.concurrency, len(candidates)))
    with ThreadPoolExecutor(workers, thread_name_prefix="cs-reuse") as pool:
        return [u for u in pool.map(one, candidates) if u is not None]


def _sharing(call: Callable[[Callable[[], Any], str], Any],
             slots: threading.BoundedSemaphore) -> Callable[[Callable[[], Any], str], Any]:
    """``call`` holding one of ``slots`` for each storage task (with its retries)."""

    def bounded(fn: Callable[[], Any], what: str) -> Any:
        with slots:
            return call(fn, what)

    return bounded


def _copy_from_previous(r: TransferTasks, previous: Previous, rel: str, size: int,
                        crc: int) -> FileResult | OSError:
    """Copy one unchanged file inside the store; the error where that failed
    (the previous checkpoint was deleted meanwhile, by retention say): the
    caller uploads it."""
    try:
        r.call(lambda: server_copy(r.dst_fs_outer, posixpath.join(previous.root, rel),
                                   r._dst(rel), size),
               f"copy {rel} from the previous checkpoint")
    except OSError as exc:
        return exc
    return FileResult(rel, size, crc, reused=True)


def _move(r: TransferTasks, p: Plan) -> tuple[dict[str, FileResult], _PartCrcs]:
    """Run the tasks of ``p``; its uploads in parts are completed by then."""
    r.p = p
    # Multipart uploads start here: the caller aborts them if anything fails.
    work = _work_items(p, r)
    sequential = p.concurrency == 1 or work.count == 1
    moved, part_crcs = (_run_in_turn if sequential else _run_on_pool)(r, work)
    r.finish_uploads()
    return moved, part_crcs


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
    on_bytes: Callable[[int], None] | None = None,
) -> list[FileResult]:
    """Copy ``files`` (``(relpath, size)``) from ``src_root`` to ``dst_root``.

    The destination's directories must exist already. ``call(fn, what)`` runs
    each storage task (a retry policy, say); the default runs it once.
    ``on_bytes(n)`` is called, from any worker thread, with the bytes of each
    task once it is done (a batch of small files, a part of a large file, a
    whole file): progress at the granularity of the plan's tasks.

    ``previous`` (an upload from the local disk only): a committed checkpoint
    on the destination store. A file whose size and CRC32C equal those of the
    same path there is copied by the store itself
    (:func:`~checkpoint_store._transfer.remote.server_copy`) instead
    of uploaded, while the other files go up; the copies and the uploads
    share ``concurrency`` (the copies take at most half of it). If that copy
    fails (the previous checkpoint was deleted meanwhile, say), the file is
    uploaded after them.

    Returns:
        One :class:`FileResult` per file, in the order of ``files``.

    Raises:
        OSError: the first error of any task; the others are cancelled (a
            partial copy is left for the caller's commit protocol to discard).
    """
    if not files:
        return []
    p = plan(src_fs, src_root, dst_fs, dst_root, files, chunk_size=chunk_size,
             concurrency=concurrency, memory_limit=memory_limit)
    r = TransferTasks(p, src_fs, src_root, dst_fs, dst_root, fsync=fsync,
                call=call or _call_plain, read_chunk=chunk_size)
    r.on_bytes = on_bytes
    results: dict[str, FileResult] = {}
    sizes = dict(files)
    rest = list(files)
    copies: dict[str, Future[FileResult | OSError]] = {}
    copier: ThreadPoolExecutor | None = None
    try:
        if previous is not None and p.route == "upload":
            same = _unchanged(r, previous, files)
            if same:
                # The store copies the unchanged files while the changed ones
                # go up: the report costs the longer of the two, not the sum.
                # Both draw on the same max_concurrency slots; the copies get
                # at most half of them, the uploads the rest and any a copy frees.
                r.call = _sharing(r.call, threading.BoundedSemaphore(p.concurrency))
                copier = ThreadPoolExecutor(max(1, min(p.concurrency // 2, len(same))),
                                            thread_name_prefix="cs-reuse")
                copies = {rel: copier.submit(_copy_from_previous, r, previous, rel, size, crc)
                          for rel, size, crc in same}
                rest = [f for f in files if f[0] not in copies]
                p = plan(src_fs, src_root, dst_fs, dst_root, rest, chunk_size=chunk_size,
                         concurrency=concurrency, memory_limit=memory_limit)
        moved, part_crcs = _move(r, p) if rest else ({}, {})
        copied = {rel: f.result() for rel, f in copies.items()}
        if on_bytes is not None:
            on_bytes(sum(fr.size for fr in copied.values() if isinstance(fr, FileResult)))
        errors = {rel: fr for rel, fr in copied.items() if isinstance(fr, OSError)}
        failed = [(rel, sizes[rel]) for rel in errors]
        results.update((rel, fr) for rel, fr in copied.items() if isinstance(fr, FileResult))
        if failed:
            assert previous is not None  # copies exist only with a previous checkpoint
            rel, exc = next(iter(errors.items()))
            logger.info("%d of %d unchanged files could not be copied from the previous "
                        "checkpoint %s inside the store (%s: %s: %s); uploading them",
                        len(failed), len(copied), previous.root, rel,
                        type(exc).__name__, exc)
            more, more_crcs = _move(r, plan(src_fs, src_root, dst_fs, dst_root, failed,
                                            chunk_size=chunk_size, concurrency=concurrency,
                                            memory_limit=memory_limit))
            moved.update(more)
            part_crcs.update(more_crcs)
    except BaseException as exc:
        r.abort_uploads()
        gone = _deleted_source(r, files, exc)
        if gone is not None:
            raise gone from exc
        raise
    finally:
        if copier is not None:
            # After a failure (or Ctrl-C): start no other copy, wait for the
            # running ones, whose objects the commit protocol then discards.
            copier.shutdown(wait=True, cancel_futures=True)
        r.close_inputs()
    results.update(moved)
    if fsync and r.dst_os is not None:
        flush_files(r.dst_os, [rel for rel, _ in files], concurrency,
                    sum(size for _, size in files))
    results.update(_combine_parts(part_crcs))
    return [results[rel] for rel, _ in files]


def _deleted_source(r: TransferTasks, files: Sequence[tuple[str, int]],
                    exc: BaseException) -> SourceDeletedError | None:
    """The error for a copy that failed because a listed source file was
    deleted meanwhile (``exc``: a ``FileNotFoundError``), naming the file;
    None for any other failure. A local source is checked file by file (a
    ``stat`` each, only after such a failure); a remote one by one listing."""
    if not isinstance(exc, FileNotFoundError):
        return None
    try:
        if r.src_os is not None:
            missing = [rel for rel, _ in files if not os.path.lexists(r._src_os(rel))]
        else:
            there = {rel for rel, _ in walk_files(r.src_fs_outer, r.src_root)}
            missing = [rel for rel, _ in files if rel not in there]
    except OSError:  # the source cannot be looked at now: the first error stands
        return None
    if not missing:
        return None  # the destination's, or a path the listing never had
    rel = missing[0]
    where = r._src_os(rel) if r.src_os is not None else posixpath.join(r.src_root, rel)
    return SourceDeletedError(
        f"{where} was deleted while it was being copied"
        + (f" ({len(missing) - 1} more file(s) of the source too)" if len(missing) > 1 else "")
        + "; nothing of it is kept. A checkpoint being deleted (retention or a delete in "
        "another process) cannot be copied: copy another one; a directory you report or "
        "upload: report it once nothing deletes or rewrites its files",
        path=r.src_root, file=rel)


@dataclass
class _Work:
    """The tasks of one plan: batches (lists of ``(relpath, size)``), parts of
    large files (``(relpath, offset, length)``), files streamed whole, and
    large local files copied whole by the kernel while their parts are
    checksummed (``copies``, ``(relpath, size)``; route ``"local"``)."""

    batches: list[list[tuple[str, int]]]
    parts: list[tuple[str, int, int]]
    streamed: list[tuple[str, int]]
    copies: list[tuple[str, int]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.batches) + len(self.parts) + len(self.streamed) + len(self.copies)


#: ``{relpath: [(offset, length, CRC32C of the part)]}`` of the files moved in parts.
_PartCrcs = dict[str, list[tuple[int, int, int]]]


def _work_items(p: Plan, r: TransferTasks) -> _Work:
    """Cut ``p`` into tasks: batches, then parts of large files (largest
    first), or whole large files where parts would not pay. The files that
    downloaded parts are written into are made here, before any part runs.

    A large file copied between local disks is one task: a reader that
    checksums and a writer thread (:meth:`_LocalDisk._pipe_copy`). To or
    from a network filesystem it is one kernel copy of the whole
    file (one writer, as ``cp``: parallel writers of one file queue on its
    inode lock) and a CRC32C task per part (:data:`LOCAL_PART`) read from
    the page cache on another thread, all checked against the source's stamp
    taken here. The copy is then the critical path: the checksum ends before
    it (1 GiB on 2 idle cores, timed per task: copy 0.28 s, checksum 0.09 s).
    """
    batches = list(p.batches)
    large = sorted(p.large, key=lambda f: -f[1])
    if p.route == "local" and large and r.reflinks(large[0][0]):
        # Clones cost no data blocks and no time per byte: whole files.
        batches, large = [[f] for f in large] + batches, []
    if p.route == "local" and (len(large) >= p.concurrency or p.local_disks):
        # Enough large files to keep every thread busy: whole files, one per
        # task. Parts of one file would only queue on its inode's write lock.
        # Between local disks each large file is one copy through user space
        # that checksums what it reads, with a writer thread of its own
        # (_LocalDisk._pipe_copy): no second read.
        batches, large = [[f] for f in large] + batches, []
    work = _Work(batches, [], [])
    for rel, size in large:
        if p.route == "local":
            stamp = r.stamps[rel] = r.source_stamp(rel)
            if stamp[1] != size:
                raise r._changed(rel, "changed while it was being copied")
            work.copies.append((rel, size))
            for off in range(0, size, p.chunk_size):
                work.parts.append((rel, off, min(p.chunk_size, size - off)))
        elif p.route in _TO_DISK or (p.route == "upload" and r.part_client is not None):
            if p.route == "upload":
                r.start_upload(rel, size)
            else:
                r.prepare_local(rel, size)
            for off in range(0, size, p.chunk_size):
                work.parts.append((rel, off, min(p.chunk_size, size - off)))
        else:
            work.streamed.append((rel, size))
    return work


def _counted(r: TransferTasks, task: Callable[..., T], size: int) -> Callable[..., T]:
    """``task``, reporting ``size`` bytes to ``r.on_bytes`` once it returns.
    A whole-file copy between local disks (``copy_whole``) reports here, and
    its checksum parts report nothing: their bytes are the same file's."""
    on_bytes = r.on_bytes
    if on_bytes is None:
        return task

    def run(*args: Any) -> T:
        out = task(*args)
        on_bytes(size)
        return out

    return run


def _part_size(whole: set[str], rel: str, length: int) -> int:
    """What a part reports: nothing when its file is a whole-file copy (in ``whole``)."""
    return 0 if rel in whole else length


def _run_in_turn(r: TransferTasks, work: _Work) -> tuple[dict[str, FileResult], _PartCrcs]:
    """Run every task on this thread (one worker, or one task)."""
    results = {fr.path: fr for b in work.batches
               for fr in _counted(r, r.batch, sum(n for _, n in b))(b)}
    for rel, size in work.copies:
        _counted(r, r.copy_whole, size)(rel)
    part_crcs: _PartCrcs = {}
    whole = {c for c, _ in work.copies}
    for rel, off, length in work.parts:
        crc = _counted(r, r.part, _part_size(whole, rel, length))(rel, off, length)
        part_crcs.setdefault(rel, []).append((off, length, crc))
    for rel, size in work.streamed:
        results[rel] = _counted(r, r.stream, size)(rel, size)
    return results, part_crcs


def _run_on_pool(r: TransferTasks, work: _Work) -> tuple[dict[str, FileResult], _PartCrcs]:
    """Run the tasks on ``r.p.concurrency`` threads; the first error cancels
    the tasks not started yet and is raised once the running ones end."""
    with ThreadPoolExecutor(r.p.concurrency, thread_name_prefix="cs-transfer") as pool:
        # The whole-file copies first: they are the longest tasks.
        whole = {c for c, _ in work.copies}
        copy_futs = [pool.submit(_counted(r, r.copy_whole, size), rel)
                     for rel, size in work.copies]
        stream_futs = [pool.submit(_counted(r, r.stream, size), rel, size)
                       for rel, size in work.streamed]
        part_futs = [
            (rel, off, length, pool.submit(
                _counted(r, r.part, _part_size(whole, rel, length)), rel, off, length))
            for rel, off, length in work.parts
        ]
        batch_futs = [pool.submit(_counted(r, r.batch, sum(n for _, n in b)), b)
                      for b in work.batches]
        futs: list[Future[Any]] = (
            copy_futs + stream_futs + [f for *_, f in part_futs] + batch_futs
        )
        try:
            _, pending = wait(futs, return_when=FIRST_EXCEPTION)
        except BaseException:
            # Ctrl-C (or another signal's exception) while waiting: start no
            # other task; leaving the pool waits for the running ones, so the
            # caller's clean-up (aborting multipart uploads, closing the
            # roots' descriptors) runs after the last of them.
            for f in futs:
                f.cancel()
            raise
        for f in pending:
            f.cancel()
        for f in futs:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        results = {fr.path: fr for fr in (f.result() for f in stream_futs)}
        results.update((fr.path, fr) for f in batch_futs for fr in f.result())
        part_crcs: _PartCrcs = {}
        for rel, off, length, f in part_futs:
            part_crcs.setdefault(rel, []).append((off, length, f.result()))
    return results, part_crcs


def _combine_parts(part_crcs: _PartCrcs) -> dict[str, FileResult]:
    """One :class:`FileResult` per file moved in parts: its parts' CRC32Cs
    combined in offset order (:func:`crc32c_combine`), no byte read again."""
    out = {}
    for rel, pieces in part_crcs.items():
        pieces.sort()
        crc = 0
        total = 0
        for _, length, c in pieces:
            crc = crc32c_combine(crc, c, length) if total else c
            total += length
        out[rel] = FileResult(rel, total, crc)
    return out
