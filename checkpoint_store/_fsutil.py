"""Small helpers over ``pyarrow.fs.FileSystem`` used by every layer above backends."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterator

import pyarrow.fs as pafs

from checkpoint_store.backends.base import Capabilities


def info(fs: pafs.FileSystem, path: str) -> pafs.FileInfo:
    return fs.get_file_info(path)


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return info(fs, path).type != pafs.FileType.NotFound


def is_dir(fs: pafs.FileSystem, path: str) -> bool:
    return info(fs, path).type == pafs.FileType.Directory


def is_file(fs: pafs.FileSystem, path: str) -> bool:
    return info(fs, path).type == pafs.FileType.File


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def list_dir(fs: pafs.FileSystem, path: str) -> list[pafs.FileInfo]:
    """Direct children of ``path``; an empty list when it does not exist."""
    return fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=False))


def walk_files(fs: pafs.FileSystem, root: str) -> Iterator[tuple[str, int]]:
    """``(relative posix path, size in bytes)`` of every file under ``root``."""
    prefix = root.rstrip("/") + "/"
    for fi in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True, recursive=True)):
        if fi.type == pafs.FileType.File:
            rel = fi.path[len(prefix) :] if fi.path.startswith(prefix) else fi.path
            yield rel, fi.size


def ensure_dir(fs: pafs.FileSystem, path: str, caps: Capabilities) -> None:
    """Create ``path`` where the store has real directories; a no-op on object
    stores, where a directory marker would cost a request and a zero-byte object."""
    if caps.directories:
        fs.create_dir(path, recursive=True)


def delete_dir(fs: pafs.FileSystem, path: str) -> None:
    """Delete ``path`` and everything under it; nothing happens if it is absent."""
    try:
        fi = info(fs, path)
        if fi.type == pafs.FileType.NotFound:
            return
        if fi.type == pafs.FileType.File:
            fs.delete_file(path)
            return
        fs.delete_dir(path)
    except FileNotFoundError:
        return


def delete_file(fs: pafs.FileSystem, path: str) -> None:
    """Delete one file; nothing happens if it is absent."""
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        return
    except OSError:
        if exists(fs, path):
            raise


def local_path(fs: pafs.FileSystem, path: str) -> str | None:
    """The OS path when ``fs`` is the local disk (so os-level calls like fsync apply)."""
    if isinstance(fs, pafs.LocalFileSystem):
        return path
    if isinstance(fs, pafs.SubTreeFileSystem) and isinstance(fs.base_fs, pafs.LocalFileSystem):
        return posixpath.join(fs.base_path, path.lstrip("/"))
    return None


def fsync_dir(path: str) -> None:
    """fsync a directory so the entries created in it survive a machine crash."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(
    fs: pafs.FileSystem, path: str, data: bytes, caps: Capabilities, *, fsync: bool = True
) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new bytes, never a mix.

    On a local disk: a temporary sibling, fsynced, renamed over ``path``, then
    the directory fsynced. On object stores a single PUT already is atomic.
    """
    parent = posixpath.dirname(path)
    ensure_dir(fs, parent, caps)
    osp = local_path(fs, path)
    if osp is not None:
        tmp = f"{osp}.{os.getpid()}.{id(data):x}.cs_tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if fsync and caps.needs_fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, osp)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if fsync and caps.needs_fsync:
            fsync_dir(os.path.dirname(osp))
        return
    with fs.open_output_stream(path) as out:
        out.write(data)
