"""Whole-checkpoint reads that know chunked files: download and verify.

Plain files go the way they always went (:func:`~checkpoint_store._transfer.
trees.download_tree`, :func:`~checkpoint_store._util.inspect.verify_files`);
chunked ones (format version 3) through :class:`~checkpoint_store._chunks.
files.ChunkedFile`. A downloaded directory holds every file for real, so
whatever reads a directory (the integrations, a user's code) needs no change.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._chunks.files import ChunkedFile
from checkpoint_store._format.manifest import check_relpath, is_chunked
from checkpoint_store._transfer.trees import download_tree
from checkpoint_store._util.inspect import verify_files
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Capabilities
from checkpoint_store.errors import UnsafePathError

__all__ = ["download_checkpoint", "materialized", "verify_checkpoint"]


def _split(manifest: list[dict[str, Any]] | None
           ) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    if manifest is None:
        return None, []
    return ([e for e in manifest if not is_chunked(e)], [e for e in manifest if is_chunked(e)])


def download_checkpoint(
    fs: pafs.FileSystem,
    checkpoint_path: str,
    caps: Capabilities,
    local_dir: str,
    *,
    meta: Mapping[str, Any] | None,
    verify: bool = True,
    retry: RetryPolicy | None = None,
    listed: Mapping[str, int] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """:func:`~checkpoint_store._transfer.trees.download_tree` of a checkpoint
    whose marker is ``meta`` (None: not committed), chunked files written
    whole into ``local_dir`` from their chunks (``caps.concurrency`` chunks
    at a time; their CRC32C always checked, ``verify`` or not).

    Returns:
        The relative paths written, sorted.

    Raises:
        UnsafePathError: an unsafe manifest path; nothing was written.
        CheckpointCorruptError: a plain file fails its check (``verify``), or
            a chunk is missing or damaged, or a chunked file's CRC32C differs;
            names the file. Files already written are left for the caller.
    """
    plain, chunked = _split(list(meta["manifest"]) if meta is not None else None)
    for e in chunked:
        why = check_relpath(e.get("path"))
        if why is not None:
            raise UnsafePathError(
                f"checkpoint {checkpoint_path!r} lists {e.get('path')!r}, which {why}; refusing "
                "to download it", path=checkpoint_path, file=str(e.get("path")))
    first = sum(int(e["size"]) for e in plain or ())
    total = first + sum(int(e["size"]) for e in chunked)
    inner = progress
    if progress is not None and chunked:
        def inner(done: int, _total: int) -> None:
            progress(done, total)
    written = download_tree(fs, checkpoint_path, caps, local_dir, manifest=plain,
                            verify=verify, retry=retry, listed=listed, progress=inner)
    done = first
    for e in chunked:
        target = os.path.join(os.path.abspath(local_dir), *e["path"].split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        assert meta is not None
        ChunkedFile(fs, checkpoint_path, meta, e, retry=retry,
                    workers=max(caps.concurrency, 1)).write_to(target)
        done += int(e["size"])
        if progress is not None:
            progress(done, total)
    return sorted([*written, *(e["path"] for e in chunked)])


def verify_checkpoint(
    fs: pafs.FileSystem,
    checkpoint_path: str,
    meta: Mapping[str, Any],
    *,
    chunk_size: int = 8 * 1024 * 1024,
    concurrency: int = 4,
    retry: RetryPolicy | None = None,
) -> None:
    """Read every file of a committed checkpoint and compare it with its
    manifest: plain files by :func:`~checkpoint_store._util.inspect.verify_files`,
    chunked ones chunk by chunk (:meth:`ChunkedFile.verify`).

    Raises:
        CheckpointCorruptError: the first plain file that is missing or
            differs, else the first chunked one; ``.file`` names it.
    """
    plain, chunked = _split(list(meta["manifest"]))
    verify_files(fs, checkpoint_path, plain or [], chunk_size=chunk_size,
                 concurrency=concurrency, retry=retry)
    for e in chunked:
        ChunkedFile(fs, checkpoint_path, meta, e, retry=retry,
                    workers=max(concurrency, 1)).verify()


@contextlib.contextmanager
def materialized(fs: pafs.FileSystem, checkpoint_path: str, caps: Capabilities,
                 meta: Mapping[str, Any]) -> Iterator[str]:
    """A local temporary directory holding every file of a committed checkpoint
    for real (chunked ones written from their chunks, everything verified),
    removed when the block exits: a copy to another store commits from it.

    Raises:
        CheckpointCorruptError: as :func:`download_checkpoint`; nothing is left.
    """
    tmp = tempfile.mkdtemp()
    try:
        download_checkpoint(fs, checkpoint_path, caps, os.path.join(tmp, "d"), meta=meta)
        yield os.path.join(tmp, "d")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
