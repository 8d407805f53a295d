"""How a copied local tree is made durable, and what kind of disk holds it.

Owns :func:`flush_files` (one ``syncfs(2)`` or parallel ``fsync``, as
:data:`DURABILITY` says) and :func:`fs_type`/:func:`creates_locally` (a
local-device or in-memory filesystem, where creating a file costs no network
round trip). The copy routes themselves are in :mod:`.localcopy`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

__all__ = [
    "DURABILITY",
    "SYNCFS_MAX_OTHER_DIRTY",
    "SYNCFS_MIN_FILES",
    "creates_locally",
    "flush_files",
    "fs_type",
]

_O_BINARY = getattr(os, "O_BINARY", 0)


def _syncfs(fd: int) -> bool:
    """``syncfs(2)`` on the filesystem of ``fd``; False where unavailable."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syncfs
    except (OSError, AttributeError):
        return False
    if fn(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return True


#: How :func:`flush_files` makes a copy durable: ``"fsync"`` (every file, in
#: parallel threads), ``"syncfs"`` (one ``syncfs(2)`` of the target
#: filesystem, which also writes back other processes' dirty pages) or
#: ``"auto"``: ``syncfs`` for many files when the machine holds little other
#: dirty data (:func:`_syncfs_pays`), else ``fsync``.
DURABILITY = "auto"
#: ``"auto"`` takes ``syncfs`` from this many files on: one journal commit
#: instead of one per file (2000 x 64 KiB on ext4, 2 cores: 0.13 s against
#: 0.38 s for 8 threads of fsync). For a few large files the two cost the
#: same bytes, and ``fsync`` leaves other processes' writes alone.
SYNCFS_MIN_FILES = 64
#: ... and while the machine's dirty and writeback pages, beyond the bytes
#: just copied, are at most this many bytes: ``syncfs`` waits for them too
#: (at ~1 GiB/s of disk, 128 MiB is ~0.1 s, less than 64 fsyncs).
SYNCFS_MAX_OTHER_DIRTY = 128 * 1024 * 1024
#: ``syncfs`` reports writeback errors only from Linux 5.8 on; before, a
#: failed write would go unnoticed and the commit would claim durability.
_SYNCFS_KERNEL = (5, 8)


#: Filesystems on a local device or in memory, where creating a file costs
#: no network round trip: small files go fastest through one thread there
#: (see :func:`checkpoint_store._transfer.plan.plan`). On others (NFS, Lustre, FUSE
#: ...) and where the type is unknown, small files keep the thread pool.
_LOCAL_FS_TYPES = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "bcachefs", "f2fs", "tmpfs", "ramfs"}
)
#: ``st_dev`` -> filesystem type (None: unknown), read once per device.
_FS_TYPES: dict[int, str | None] = {}


def fs_type(path: str) -> str | None:
    """Type of the filesystem holding ``path`` (``ext4``, ``nfs4`` ...) from
    ``/proc/self/mountinfo``, or None where unknown (not Linux, a device
    the mount table does not name, such as a btrfs subvolume)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    if dev not in _FS_TYPES:
        _FS_TYPES[dev] = _mounted_type(dev)
    return _FS_TYPES[dev]


def _mounted_type(dev: int) -> str | None:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        try:
            major, minor = left.split()[2].split(":")
            if os.makedev(int(major), int(minor)) == dev:
                return right.split()[0]
        except (IndexError, ValueError):
            continue
    return None


def creates_locally(path: str) -> bool:
    """Whether ``path`` lies on a local-device or in-memory filesystem
    (:data:`_LOCAL_FS_TYPES`)."""
    return fs_type(path) in _LOCAL_FS_TYPES


def _kernel_at_least(version: tuple[int, int]) -> bool:
    try:
        got = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    except (AttributeError, ValueError):
        return False
    return got >= version


def _machine_dirty_bytes() -> int | None:
    """Dirty plus writeback bytes of the whole machine (``/proc/meminfo``), or
    None where unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    total = 0
    found = 0
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("Dirty", "Writeback"):
            total += int(rest.split()[0]) * 1024
            found += 1
    return total if found == 2 else None


def _syncfs_pays(n_files: int, nbytes: int) -> bool:
    """Whether one ``syncfs`` beats ``n_files`` fsyncs: many files, a kernel
    that reports writeback errors through it, and little dirty data of others."""
    if n_files < SYNCFS_MIN_FILES or not _kernel_at_least(_SYNCFS_KERNEL):
        return False
    dirty = _machine_dirty_bytes()
    return dirty is not None and dirty - nbytes <= SYNCFS_MAX_OTHER_DIRTY


def flush_files(root: str, rels: Sequence[str], workers: int, nbytes: int = 0) -> None:
    """Make the files ``rels`` (``nbytes`` in all) under the local directory
    ``root`` durable (data and size; their directory entries are the
    caller's), all at once rather than one ``fsync`` after each file: one
    ``syncfs`` or parallel fsyncs, as :data:`DURABILITY` says.

    Raises:
        OSError: a file could not be written back (the caller must not commit).
    """
    mode = DURABILITY
    if mode == "auto":
        mode = "syncfs" if _syncfs_pays(len(rels), nbytes) else "fsync"
    if mode == "syncfs":
        fd = os.open(root, os.O_RDONLY)
        try:
            if _syncfs(fd):
                return
        finally:
            os.close(fd)

    def one(rel: str) -> None:
        fd = os.open(os.path.join(root, *rel.split("/")), os.O_RDONLY | _O_BINARY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    if workers <= 1 or len(rels) <= 1:
        for rel in rels:
            one(rel)
        return
    with ThreadPoolExecutor(min(workers * 2, len(rels)), thread_name_prefix="cs-fsync") as pool:
        list(pool.map(one, rels))
