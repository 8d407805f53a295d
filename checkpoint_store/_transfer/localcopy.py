"""Disk-to-disk copies and their durability.

Owns the routes by which a local file is copied (a reflink via ``FICLONE``
where the filesystem shares extents; else, between local disks, through
user space on two threads, checksummed as it is read; to or from a network
filesystem ``copy_file_range``, else a user-space buffer), the check that a source did
not change while it was copied, the per-thread buffers of local reads, and
how a copied tree is made durable lives in :mod:`.durability`.
:class:`_LocalDisk` holds the local-disk primitives of the transfer runner in
:mod:`checkpoint_store._transfer.plan`.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from typing import Any

import pyarrow as pa

from checkpoint_store._transfer.crc32c import _crc
from checkpoint_store.errors import SourceChangedError

__all__ = [
    "LOCAL_BUFFER",
    "_COPY_FILE_RANGE",
    "_NO_REFLINK",
    "_O_BINARY",
    "_LocalDisk",
    "_reflink",
]

#: Local-to-local copies read into per-thread buffers this large (the page
#: cache is the source; 1-4 MiB buffers were fastest, larger ones fell out of
#: the CPU caches).
LOCAL_BUFFER = 4 * 1024 * 1024

#: A large file copied disk to disk through user space (:meth:`_LocalDisk._pipe_copy`)
#: moves in pieces this large, :data:`PIPE_BUFFERS` of them in flight: small
#: enough that the writer's read of a piece finds it still in the CPU caches
#: where the reader (and its checksum) left it. 1 GiB on ext4 (kernel 6.18),
#: 2 cores, 10 alternating runs, CRC32C included: 1 MiB x 4 0.19 s, 256 KiB x 8
#: 0.23 s, 4 MiB x 4 0.65 s; ``cp`` (copy_file_range) 0.30 s. Several large
#: files are copied at once, one per worker (4 x 256 MiB, 9 alternating runs:
#: four at once 0.19 s, one at a time 0.24 s, ``cp -r`` 0.31 s).
PIPE_PIECE = 1024 * 1024
PIPE_BUFFERS = 4
#: ... and writes each piece in calls of at most this many bytes: the page
#: cache gives a write a folio up to its size, and on a VM that hands freed
#: memory back to its host, fresh large folios must be faulted in anew. With
#: 1 MiB writes the first copy after memory was freed took 1.7-2.8 s instead
#: of 0.18 s; with 512 KiB writes 0.20-0.21 s every time (1 GiB, ext4, 3 runs
#: after a sync; 6 steady runs 0.21 s, ``cp`` 0.31 s).
PIPE_WRITE = 512 * 1024

_O_BINARY = getattr(os, "O_BINARY", 0)

#: How a source file that reads on past its size, or ends before it, changed.
_GREW = ("changed while it was being copied: it reads on past the {size} bytes its size "
         "says (it grew, or is a pseudo file whose size is not what it reads)")
_SHRANK = ("changed while it was being copied: it ended after {got} of the {size} bytes its "
           "size says (it shrank, or is a pseudo file whose size is not what it reads)")
#: Whether files can be opened relative to a directory descriptor (POSIX).
_DIR_FD = os.open in os.supports_dir_fd


#: ``FICLONE`` (linux/fs.h): make the destination share the source's extents
#: (btrfs, XFS, bcachefs, OCFS2). Copy-on-write: a later write to either file
#: does not show in the other, so a checkpoint never shares data the user can
#: change (unlike a hard link, which we never make).
_FICLONE = 0x40049409
#: Whether ``os.copy_file_range`` may still be tried (cleared on ENOSYS).
_COPY_FILE_RANGE = [hasattr(os, "copy_file_range")]
#: errnos meaning "no kernel copy between these two files", never a data error.
_NO_KERNEL_COPY = frozenset(
    e for e in (errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP,
                getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.ENOTTY, errno.EBADF)
)
#: ``(source device, destination device)`` pairs where FICLONE was refused.
_NO_REFLINK: set[tuple[int, int]] = set()


def _reflink(src: int, dst: int) -> bool:
    """Clone ``src`` into the empty ``dst`` (True), or False where the
    filesystem cannot (ext4, tmpfs, two filesystems), remembered per device pair."""
    if not hasattr(os, "copy_file_range"):  # not Linux
        return False
    key = (os.fstat(src).st_dev, os.fstat(dst).st_dev)
    if key in _NO_REFLINK:
        return False
    import fcntl

    try:
        fcntl.ioctl(dst, _FICLONE, src)
    except OSError as exc:
        if exc.errno not in _NO_KERNEL_COPY:
            raise
        _NO_REFLINK.add(key)
        return False
    return True


def _stamp(fd: int) -> tuple[int, int]:
    """Size and modification time (ns) of an open file."""
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


class _LocalDisk:
    """Local-disk primitives of a transfer runner: paths under the local
    roots, per-thread buffers, and copies, reads and writes of local files."""

    src_os: str | None
    dst_os: str | None
    #: The source root as its filesystem spells it (named by errors).
    src_root: str
    read_chunk: int
    _tls: threading.local
    #: Set once a clone was refused: later files of this transfer go straight
    #: to ``copy_file_range`` (two ``fstat`` calls fewer per file; a clone
    #: refused for one file of a tree is refused for its siblings).
    _no_clone: bool = False
    #: Whether large files go through :meth:`_pipe_copy` (the plan's
    #: ``local_disks``: both roots on a local-device or in-memory filesystem)
    #: rather than a kernel copy and a second read for the checksum.
    pipe_copies: bool = False
    #: Descriptors of the source and destination roots (:meth:`_root_fds`).
    _fds: tuple[int, int] | None = None
    _fds_lock: threading.Lock

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

    def _root_fds(self) -> tuple[int, int] | None:
        """Open descriptors of the two local roots, opened on first use (None
        where ``open`` takes no ``dir_fd``): a file opened relative to its
        root costs the kernel one path lookup below the root instead of one
        per component of the whole path (2000 x 64 KiB: 6-8 components each)."""
        if self._fds is None and _DIR_FD:
            with self._fds_lock:
                if self._fds is None:
                    assert self.src_os is not None and self.dst_os is not None
                    src = os.open(self.src_os, os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        dst = os.open(self.dst_os, os.O_RDONLY | os.O_DIRECTORY)
                    except BaseException:
                        os.close(src)
                        raise
                    self._fds = (src, dst)
        return self._fds

    def close_roots(self) -> None:
        """Close the descriptors :meth:`_root_fds` opened."""
        fds, self._fds = self._fds, None
        for fd in fds or ():
            os.close(fd)

    def _open_rel(self, dst: bool, rel: str, flags: int) -> int:
        """Open ``rel`` under the destination (``dst``) or source root; an
        error names the whole path."""
        fds = self._root_fds()
        if fds is None:
            return os.open(self._dst_os(rel) if dst else self._src_os(rel), flags, 0o644)
        try:
            return os.open(rel, flags, 0o644, dir_fd=fds[dst])
        except OSError as exc:
            exc.filename = self._dst_os(rel) if dst else self._src_os(rel)
            raise

    # -- local disk primitives

    def source_stamp(self, rel: str) -> tuple[int, int, int]:
        """Inode, size and modification time (ns) of a local source file, taken
        before any task of a large file's copy starts (:meth:`copy_local_file`,
        :meth:`crc_local_range`)."""
        st = os.stat(self._src_os(rel))
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _changed(self, rel: str, how: str) -> SourceChangedError:
        """The error for source file ``rel`` that changed (``how``) while it
        was copied, or reads other bytes than its size says."""
        return SourceChangedError(
            f"{self._src_os(rel)} {how}; its copy would not be the file, so nothing of it is "
            "kept. Write the checkpoint completely before reporting or copying it (wait for "
            "whatever writes it), and copy a pseudo file (/proc, /sys) into a regular file "
            "first", path=self.src_root, file=rel)

    def _same_source(self, rel: str, fd: int, stamp: tuple[int, int, int]) -> None:
        st = os.fstat(fd)
        if (st.st_ino, st.st_size, st.st_mtime_ns) != stamp:
            raise self._changed(rel, "changed while it was being copied")

    def _at_end(self, rel: str, fd: int, size: int) -> None:
        """Raise unless ``fd`` ends at ``size``, the bytes copied: a file that
        reads on past its size grew meanwhile, or is a pseudo file whose size
        says 0 (``/proc/self/status``) while it reads a page."""
        if os.pread(fd, 1, size):
            raise self._changed(rel, _GREW.format(size=size))

    def _short(self, rel: str, got: int, size: int) -> SourceChangedError:
        return self._changed(rel, _SHRANK.format(got=got, size=size))

    def copy_local_file(self, rel: str, stamp: tuple[int, int, int]) -> None:
        """Copy a large file whole inside the kernel, one sequential writer as
        ``cp`` is, while :meth:`crc_local_range` checksums its parts from the
        page cache on the other threads. Every task checks at its end that
        the source still has ``stamp``: a write between the first task's start
        and the last one's end fails the copy, so the bytes copied and the
        bytes checksummed are the same."""
        src = os.open(self._src_os(rel), os.O_RDONLY | _O_BINARY)
        try:
            self._same_source(rel, src, stamp)
            dst = os.open(
                self._dst_os(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_BINARY, 0o644
            )
            try:
                self._kernel_copy(rel, src, dst, 0, stamp[1])
            finally:
                os.close(dst)
            self._at_end(rel, src, stamp[1])
            self._same_source(rel, src, stamp)
        finally:
            os.close(src)

    def crc_local_range(
        self, rel: str, offset: int, length: int, stamp: tuple[int, int, int]
    ) -> int:
        """CRC32C of ``length`` bytes at ``offset`` of a local source whose
        whole copy :meth:`copy_local_file` makes (see there)."""
        src = os.open(self._src_os(rel), os.O_RDONLY | _O_BINARY)
        try:
            self._same_source(rel, src, stamp)
            crc = self._crc_range(rel, src, offset, length)
            if offset + length == stamp[1]:
                self._at_end(rel, src, stamp[1])
            self._same_source(rel, src, stamp)
            return crc
        finally:
            os.close(src)

    def _copy_local_whole(self, rel: str) -> tuple[int, int]:
        src = self._open_rel(False, rel, os.O_RDONLY | _O_BINARY)
        try:
            before = _stamp(src)
            size = before[0]
            dst = self._open_rel(True, rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_BINARY)
            try:
                if size and self._clone(src, dst):
                    crc = self._crc_range(rel, src, 0, size)
                    self._at_end(rel, src, size)
                elif size < len(self._buffer()[1]):
                    crc = self._copy_through_buffer(rel, src, dst, size)  # ends checked
                elif self.pipe_copies:
                    crc = self._pipe_copy(rel, src, dst, size)
                    self._at_end(rel, src, size)
                else:
                    self._kernel_copy(rel, src, dst, 0, size)
                    crc = self._crc_range(rel, src, 0, size)
                    self._at_end(rel, src, size)
            finally:
                os.close(dst)
            self._unchanged(rel, src, before)
        finally:
            os.close(src)
        return size, crc

    def _copy_through_buffer(self, rel: str, src: int, dst: int, size: int) -> int:
        """Copy a file smaller than the thread's buffer with one read and one
        write, checksumming exactly the bytes written: two memory copies, as
        ``copy_file_range`` followed by the checksum's read, but in two system
        calls instead of three (2000 x 64 KiB on tmpfs, 2 loaded cores: about
        14% less CPU per file). The read asks for one byte more than ``size``
        and must stop at ``size``: one that reads on (a file that grew, a
        pseudo file that stats 0 bytes) fails, and a regular file's end costs
        no call more (a read short of what it asked, reaching ``size``)."""
        buf, mv = self._buffer()
        got = 0
        while True:
            want = size + 1 - got
            n = os.preadv(src, [mv[got:size + 1]], got)
            if n <= 0:
                break
            got += n
            if got > size:
                raise self._changed(rel, _GREW.format(size=size))
            if got == size and n < want:
                break  # the end, where its size says
        if got < size:
            raise self._short(rel, got, size)
        w = 0
        while w < size:
            w += os.write(dst, mv[w:size])
        return _crc(0, buf if size == len(mv) else buf.slice(0, size))

    def _pipe_copy(self, rel: str, src: int, dst: int, size: int) -> int:
        """Copy a large file between two local disks through user space, in
        two stages on two threads: this one reads a piece and checksums it,
        a writer thread writes it (:data:`PIPE_WRITE` bytes per call),
        :data:`PIPE_BUFFERS` pieces of :data:`PIPE_PIECE` bytes in flight.
        Returns the CRC32C of exactly the bytes written, read once.

        Where the filesystem cannot clone, this beats ``copy_file_range``
        (which ``cp`` uses, one piece at a time on one thread) and the
        checksum's second read of the page cache: see :data:`PIPE_PIECE`.
        Not between network filesystems, where the kernel copy may happen
        on the server (:attr:`pipe_copies`).

        Raises:
            OSError: a read or write failed, or the source shrank; the first
                error, after the writer stopped.
        """
        free: queue.SimpleQueue[pa.Buffer] = queue.SimpleQueue()
        full: queue.SimpleQueue[tuple[pa.Buffer, int, int] | None] = queue.SimpleQueue()
        for _ in range(PIPE_BUFFERS):
            free.put(pa.allocate_buffer(PIPE_PIECE))
        failed: list[BaseException] = []

        def write_pieces() -> None:
            # Every piece goes back to ``free``, written or not (after an
            # error): the reader never waits for a buffer that cannot come.
            while (item := full.get()) is not None:
                buf, n, pos = item
                if not failed:
                    try:
                        mv = memoryview(buf)
                        for off in range(0, n, PIPE_WRITE):
                            _pwrite_all(dst, mv[off : min(n, off + PIPE_WRITE)], pos + off)
                    except BaseException as exc:
                        failed.append(exc)
                free.put(buf)

        writer = threading.Thread(target=write_pieces, name="cs-copy-writer", daemon=True)
        writer.start()
        crc = pos = 0
        try:
            while pos < size and not failed:
                buf = free.get()
                n = os.preadv(src, [memoryview(buf)[: min(PIPE_PIECE, size - pos)]], pos)
                if n <= 0:
                    free.put(buf)
                    raise self._short(rel, pos, size)
                crc = _crc(crc, buf if n == PIPE_PIECE else buf.slice(0, n))
                full.put((buf, n, pos))
                pos += n
        finally:
            full.put(None)
            writer.join()
        if failed:
            raise failed[0]
        return crc

    def _clone(self, src: int, dst: int) -> bool:
        if self._no_clone:
            return False
        if _reflink(src, dst):
            return True
        self._no_clone = True
        return False

    def _unchanged(self, rel: str, fd: int, before: tuple[int, int]) -> None:
        """The source was copied by the kernel and checksummed by a second
        read: both saw the same bytes only if it did not change in between."""
        if _stamp(fd) != before:
            raise self._changed(rel, "changed while it was being copied")

    def _kernel_copy(self, rel: str, src: int, dst: int, offset: int, length: int) -> None:
        """Copy a byte range inside the kernel (``copy_file_range``: no byte
        passes through this process; a reflink where the filesystem shares
        extents), else through a user-space buffer."""
        pos, end = offset, offset + length
        while pos < end and _COPY_FILE_RANGE[0]:
            try:
                n = os.copy_file_range(src, dst, end - pos, pos, pos)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                # Not between these filesystems (or not in this kernel): the
                # rest goes through the buffer.
                if exc.errno in (errno.ENOSYS,):
                    _COPY_FILE_RANGE[0] = False
                break
            if n == 0:
                raise self._short(rel, pos, end)
            pos += n
        if pos < end:
            self._buffer_copy(rel, src, dst, pos, end - pos)

    def _buffer_copy(self, rel: str, src: int, dst: int, offset: int, length: int) -> None:
        _, mv = self._buffer()
        pos, end = offset, offset + length
        while pos < end:
            n = os.preadv(src, [mv[: min(len(mv), end - pos)]], pos)
            if n <= 0:
                raise self._short(rel, pos, end)
            _pwrite_all(dst, mv[:n], pos)
            pos += n

    def _crc_range(self, rel: str, fd: int, offset: int, length: int) -> int:
        """CRC32C of ``length`` bytes at ``offset`` of ``fd``, the source file
        ``rel`` (which the kernel copy has just read: from the page cache)."""
        buf, mv = self._buffer()
        cap = len(mv)
        crc = 0
        pos, end = offset, offset + length
        while pos < end:
            n = os.preadv(fd, [mv[: min(cap, end - pos)]], pos)
            if n <= 0:
                raise self._short(rel, pos, end)
            crc = _crc(crc, buf if n == cap else buf.slice(0, n))
            pos += n
        return crc

    def _write_local(self, rel: str, data: Any) -> None:
        dst = os.open(self._dst_os(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_BINARY, 0o644)
        try:
            mv = memoryview(data)
            w = 0
            while w < len(mv):
                w += os.write(dst, mv[w:])
        finally:
            os.close(dst)

    def _read_local(self, rel: str) -> bytes:
        """The whole local source file ``rel``, read to its end, which must be
        where its size said when it was opened: one that reads more or fewer
        bytes changed meanwhile (or is a pseudo file whose size is not what
        it reads: ``/proc/self/status`` stats 0 bytes)."""
        with open(self._src_os(rel), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read()
        if len(data) < size:
            raise self._short(rel, len(data), size)
        if len(data) > size:
            raise self._changed(rel, _GREW.format(size=size))
        return data

    def reflinks(self, rel: str) -> bool:
        """Whether the filesystem clones ``rel`` into its destination (tried on
        that file; the answer is kept per pair of devices).

        Where the clone is refused, the empty file the attempt made is removed
        again, so the copy that follows creates it. Reopening an existing file
        with ``O_TRUNC`` would make ext4 (``auto_da_alloc``, on by default)
        start writing it back when it is closed, and wait: 1 GiB copied with
        ``copy_file_range`` took 0.27 s, and its ``close`` 0.29 s more.
        """
        src = os.open(self._src_os(rel), os.O_RDONLY | _O_BINARY)
        try:
            dst = os.open(self._dst_os(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_BINARY,
                          0o644)
            try:
                cloned = _reflink(src, dst)
            finally:
                os.close(dst)
            if not cloned:
                os.unlink(self._dst_os(rel))
            return cloned
        finally:
            os.close(src)

    def prepare_local(self, rel: str, size: int) -> None:
        """Create the destination of a part-wise download at its final size."""
        fd = os.open(self._dst_os(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_BINARY, 0o644)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` (bytes-like) at ``offset`` (``pwrite`` may write less)."""
    mv = memoryview(data)
    done = 0
    while done < len(mv):
        done += os.pwrite(fd, mv[done:], offset + done)
