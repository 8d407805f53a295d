"""Moving checkpoint directories between filesystems, and the commit protocol.

Owns three things:

* copying a tree file by file through a bounded thread pool, computing each
  file's CRC32C on the bytes as they pass (no second read);
* the commit: which protocol is used is chosen from the destination's
  :class:`~checkpoint_store.backends.Capabilities` (docs/format.md):

  - ``atomic_rename`` (local disks): write everything, the internal metadata
    included, into a staging sibling ``.cs_staging-<name>-<writer>``, fsync
    files and directories, then rename it to ``checkpoint_NNNNNN``.
  - otherwise (object stores, memory): write the data files into
    ``checkpoint_NNNNNN/``, then ``.internal_metadata.json`` last.

* downloads that verify sizes and checksums against the manifest.
"""

from __future__ import annotations

import os
import posixpath
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import google_crc32c
import pyarrow.fs as pafs

from checkpoint_store import _fsutil, _json
from checkpoint_store._layout import (
    FORMAT_VERSION,
    INTERNAL_METADATA,
    INTERNAL_PREFIX,
    USER_METADATA,
    is_internal_file,
)
from checkpoint_store.backends.base import Backend, Capabilities
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
)


@dataclass(frozen=True)
class ManifestEntry:
    """One file of a checkpoint: relative posix path, size in bytes, CRC32C (8 hex digits)."""

    path: str
    size: int
    crc32c: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "crc32c": self.crc32c}


def _crc_hex(value: int) -> str:
    return f"{value:08x}"


def _copy_one(
    src_fs: pafs.FileSystem,
    src: str,
    dst_fs: pafs.FileSystem,
    dst: str,
    *,
    chunk_size: int,
    fsync: bool,
) -> tuple[int, str]:
    """Copy one file, returning ``(size, crc32c hex)`` of the bytes that went through."""
    crc = 0
    size = 0
    src_os = _fsutil.local_path(src_fs, src)
    dst_os = _fsutil.local_path(dst_fs, dst)
    reader = open(src_os, "rb", buffering=0) if src_os is not None else src_fs.open_input_stream(src)
    try:
        if dst_os is not None:
            with open(dst_os, "wb", buffering=0) as out:
                while True:
                    buf = reader.read(chunk_size)
                    if not buf:
                        break
                    crc = google_crc32c.extend(crc, buf)
                    size += len(buf)
                    out.write(buf)
                if fsync:
                    os.fsync(out.fileno())
        else:
            with dst_fs.open_output_stream(dst) as out:
                while True:
                    buf = reader.read(chunk_size)
                    if not buf:
                        break
                    crc = google_crc32c.extend(crc, buf)
                    size += len(buf)
                    out.write(buf)
    finally:
        reader.close()
    return size, _crc_hex(crc)


def copy_tree(
    src_fs: pafs.FileSystem,
    src_root: str,
    dst_fs: pafs.FileSystem,
    dst_root: str,
    dst_caps: Capabilities,
    *,
    include: Callable[[str], bool] = lambda rel: True,
    fsync: bool = True,
    chunk_size: int | None = None,
    concurrency: int | None = None,
) -> list[ManifestEntry]:
    """Copy every file under ``src_root`` for which ``include(relpath)`` holds.

    Returns:
        One :class:`ManifestEntry` per file copied, sorted by path.

    Raises:
        CheckpointNotFoundError: ``src_root`` is not a directory.
        OSError: any I/O error of either filesystem (the partial copy is left
            for the caller's commit protocol to discard).
    """
    if not _fsutil.is_dir(src_fs, src_root):
        raise CheckpointNotFoundError(f"source directory {src_root!r} does not exist")
    files = sorted((rel, size) for rel, size in _fsutil.walk_files(src_fs, src_root) if include(rel))
    do_fsync = fsync and dst_caps.needs_fsync
    chunk = chunk_size or dst_caps.chunk_size
    _fsutil.ensure_dir(dst_fs, dst_root, dst_caps)
    if dst_caps.directories:
        for d in sorted({posixpath.dirname(rel) for rel, _ in files} - {""}):
            dst_fs.create_dir(posixpath.join(dst_root, d), recursive=True)

    def one(item: tuple[str, int]) -> ManifestEntry:
        rel, _ = item
        size, crc = _copy_one(
            src_fs,
            posixpath.join(src_root, rel),
            dst_fs,
            posixpath.join(dst_root, rel),
            chunk_size=chunk,
            fsync=do_fsync,
        )
        return ManifestEntry(rel, size, crc)

    workers = max(1, min(concurrency or dst_caps.concurrency, len(files)))
    if workers == 1:
        entries = [one(f) for f in files]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="cs-transfer") as pool:
            entries = list(pool.map(one, files))
    if do_fsync:
        root_os = _fsutil.local_path(dst_fs, dst_root)
        if root_os is not None:
            for d in sorted({posixpath.dirname(e.path) for e in entries} | {""}):
                _fsutil.fsync_dir(os.path.join(root_os, d))
    return entries


def _is_checkpoint_data(rel: str) -> bool:
    return not is_internal_file(rel)


def read_internal_metadata(fs: pafs.FileSystem, checkpoint_path: str) -> dict[str, Any] | None:
    """The parsed ``.internal_metadata.json`` if ``checkpoint_path`` is a committed
    checkpoint of a format we read, else None (absent, unparsable, other version)."""
    try:
        raw = _fsutil.read_bytes(fs, posixpath.join(checkpoint_path, INTERNAL_METADATA))
        meta = _json.loads(raw)
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None
    except OSError:
        if not _fsutil.exists(fs, posixpath.join(checkpoint_path, INTERNAL_METADATA)):
            return None
        raise
    if (
        not isinstance(meta, dict)
        or meta.get("format_version") != FORMAT_VERSION
        or not isinstance(meta.get("manifest"), list)
        or not isinstance(meta.get("index"), int)
    ):
        return None
    return meta


def new_writer_id() -> str:
    """A unique id for one writer (process and attempt), used in staging names."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def commit_checkpoint(
    src_fs: pafs.FileSystem,
    src_dir: str,
    dest: Backend,
    dest_dir: str,
    internal: dict[str, Any],
    *,
    fsync: bool = True,
    writer_id: str | None = None,
) -> dict[str, Any]:
    """Upload ``src_dir`` as the committed checkpoint ``dest_dir``.

    Args:
        src_fs, src_dir: where the user's files are. Our internal files found
            there (say, from a downloaded checkpoint reported again) are skipped.
        dest, dest_dir: the destination backend and the final directory path.
        internal: fields of ``.internal_metadata.json`` (index, metrics, ...);
            ``format_version``, ``created_at`` and ``manifest`` are filled in.
        fsync: on local disks, fsync data and directories before the commit.

    Returns:
        The internal metadata as written.

    Raises:
        CheckpointConflictError: ``dest_dir`` is already a committed checkpoint;
            its contents are left untouched.
        CheckpointNotFoundError: ``src_dir`` does not exist.
    """
    fs = dest.filesystem
    caps = dest.capabilities
    if read_internal_metadata(fs, dest_dir) is not None:
        raise CheckpointConflictError(f"{dest.uri_for(dest_dir)} is already committed")
    writer_id = writer_id or new_writer_id()
    if caps.atomic_rename:
        parent, name = posixpath.split(dest_dir)
        staging = posixpath.join(parent, f"{INTERNAL_PREFIX}staging-{name}-{writer_id}")
        try:
            meta = _write_contents(src_fs, src_dir, dest, staging, internal, fsync)
            try:
                fs.move(staging, dest_dir)
            except OSError:
                if read_internal_metadata(fs, dest_dir) is not None:
                    raise CheckpointConflictError(
                        f"{dest.uri_for(dest_dir)} was committed by another writer"
                    ) from None
                # An uncommitted leftover with the final name: replace it.
                _fsutil.delete_dir(fs, dest_dir)
                fs.move(staging, dest_dir)
            if fsync and caps.needs_fsync:
                parent_os = _fsutil.local_path(fs, parent)
                if parent_os is not None:
                    _fsutil.fsync_dir(parent_os)
            return meta
        finally:
            _fsutil.delete_dir(fs, staging)
    return _write_contents(src_fs, src_dir, dest, dest_dir, internal, fsync)


def _write_contents(
    src_fs: pafs.FileSystem,
    src_dir: str,
    dest: Backend,
    target: str,
    internal: dict[str, Any],
    fsync: bool,
) -> dict[str, Any]:
    entries = copy_tree(
        src_fs, src_dir, dest.filesystem, target, dest.capabilities,
        include=_is_checkpoint_data, fsync=fsync,
    )
    meta = dict(internal)
    meta["format_version"] = FORMAT_VERSION
    meta.setdefault("created_at", time.time())
    meta["manifest"] = [e.to_json() for e in entries if e.path != USER_METADATA]
    _fsutil.write_bytes(
        dest.filesystem,
        posixpath.join(target, INTERNAL_METADATA),
        _json.dumps(meta),
        dest.capabilities,
        fsync=fsync,
    )
    return meta


def download_tree(
    fs: pafs.FileSystem,
    checkpoint_path: str,
    caps: Capabilities,
    local_dir: str,
    *,
    manifest: Iterable[dict[str, Any]] | None,
    verify: bool = True,
) -> None:
    """Copy a checkpoint's user files (and ``.user_metadata.json``) into ``local_dir``.

    Raises:
        CheckpointCorruptError: ``verify`` and a file's size or CRC32C differs
            from ``manifest``, or a manifest file is missing. Names the file.
    """
    local = pafs.LocalFileSystem()
    local_caps = Capabilities(directories=True, chunk_size=caps.chunk_size,
                              concurrency=caps.concurrency)
    os.makedirs(local_dir, exist_ok=True)
    got = copy_tree(fs, checkpoint_path, local, os.path.abspath(local_dir), local_caps,
                    include=_is_checkpoint_data, fsync=False)
    if not verify or manifest is None:
        return
    have = {e.path: e for e in got}
    for want in manifest:
        rel = want["path"]
        e = have.get(rel)
        if e is None:
            raise CheckpointCorruptError(
                f"checkpoint {checkpoint_path!r} is missing file {rel!r} listed in its manifest",
                path=checkpoint_path, file=rel,
            )
        if e.size != want["size"] or e.crc32c != want["crc32c"]:
            raise CheckpointCorruptError(
                f"file {rel!r} of checkpoint {checkpoint_path!r} does not match its manifest "
                f"(size {e.size} vs {want['size']}, crc32c {e.crc32c} vs {want['crc32c']})",
                path=checkpoint_path, file=rel,
            )
