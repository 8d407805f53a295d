"""Removing a directory of ours so that a removal cut short stays recognisably ours.

Two ways, one per commit protocol (:mod:`checkpoint_store._commit.protocols`):

* :func:`rename_away` (atomic directory rename): the directory is renamed to
  ``.cs_deleting-<name>-<writer>`` in one step, then removed. Whatever a
  crash leaves carries that name.
* :func:`remove_in_order` (object stores, memory): the data files go first,
  our ``.cs_*`` files (claims, rank markers, the ``.cs_deleting`` tombstone)
  last, so that until the very end the directory holds a trace that tells
  cleanup (:mod:`checkpoint_store._commit.leftovers`) it is ours and never foreign.

Either is called from any thread; neither checks what the directory is
(callers did: it is not a checkpoint, or its marker is already gone).
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._format.layout import deleting_dir_name, is_internal_name
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.ids import new_writer_id
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend
from checkpoint_store.backends.clients import _fsspec_of, _is_async

__all__ = ["move_away", "remove_in_order", "rename_away"]


def move_away(dest: Backend, path: str, writer: str | None = None,
              retry: RetryPolicy | None = None) -> str | None:
    """Rename ``path`` to ``.cs_deleting-<name>-<writer>`` beside it (one
    atomic step); the caller deletes what it returns, now or later (a crash
    before that leaves a ``.cs_deleting`` directory that cleanup removes).

    Returns:
        The new path, or None when ``path`` was absent.

    Raises:
        OSError: the rename failed while ``path`` still exists.
    """
    parent, name = posixpath.split(path.rstrip("/"))
    trash = posixpath.join(parent, deleting_dir_name(name, writer or new_writer_id()))
    try:
        _fsutil.move(dest.filesystem, path, trash, retry=retry)
    except FileNotFoundError:
        return None
    except OSError:
        if not _fsutil.exists(dest.filesystem, path, retry=retry):
            return None
        raise
    return trash


def rename_away(dest: Backend, path: str, writer: str | None = None,
                retry: RetryPolicy | None = None) -> None:
    """Rename ``path`` to ``.cs_deleting-<name>-<writer>`` beside it, then
    delete that. Absent is fine.

    Raises:
        OSError: the rename failed while ``path`` still exists.
    """
    trash = move_away(dest, path, writer, retry)
    if trash is not None:
        _fsutil.delete_dir(dest.filesystem, trash, retry=retry)


def remove_in_order(dest: Backend, path: str, files: Iterable[str] | None = None,
                    retry: RetryPolicy | None = None) -> None:
    """Remove ``path``: data files first, our ``.cs_*`` files last, then the
    directory.

    One batched delete per data subdirectory and, on fsspec's async clients
    (s3fs, adlfs, gcsfs), one batched call for the top-level data files (S3
    DeleteObjects, 1000 keys each); elsewhere one DELETE per file, up to
    ``capabilities.concurrency`` at a time. Every data delete is done (or
    has raised) before the first trace goes.

    Args:
        files: the files of ``path`` (relative), if the caller listed them
            already; else ``path`` is listed once.
    """
    if files is None:
        files = [_fsutil.relative(path, fi.path)
                 for fi in _fsutil.list_tree(dest.filesystem, path, retry=retry)
                 if fi.type == pafs.FileType.File]
    data = sorted(rel for rel in files if not is_internal_name(rel.split("/")[-1]))
    subdirs = sorted({rel.split("/", 1)[0] for rel in data if "/" in rel})
    tasks: list[Callable[..., None]] = [
        lambda sub=sub: _fsutil.delete_dir(dest.filesystem, posixpath.join(path, sub),
                                           retry=retry)
        for sub in subdirs]
    top = [posixpath.join(path, rel) for rel in data if "/" not in rel]
    fss = _fsspec_of(dest.filesystem)
    if fss is not None and _is_async(fss):
        # fsspec reads *, ? and [ as a glob: such names go one by one.
        globs = [p for p in top if any(c in p for c in "*?[")]
        plain = [p for p in top if p not in globs] if globs else top
        top = globs
        if plain:
            tasks.append(lambda: _delete_batch(dest, fss, plain, retry))
    tasks += [lambda p=p: _fsutil.delete_file(dest.filesystem, p, retry=retry) for p in top]
    if len(tasks) > 1 and dest.capabilities.concurrency > 1:
        with ThreadPoolExecutor(min(dest.capabilities.concurrency, len(tasks)),
                                thread_name_prefix="cs-delete") as pool:
            for f in [pool.submit(t) for t in tasks]:
                f.result()
    else:
        for t in tasks:
            t()
    _fsutil.delete_dir(dest.filesystem, path, retry=retry)


def _delete_batch(dest: Backend, fss: Any, paths: list[str],
                  retry: RetryPolicy | None) -> None:
    try:
        _retry.call(lambda: fss.rm(paths), policy=retry, store=dest.filesystem,
                    what=f"delete {len(paths)} files")
    except FileNotFoundError:  # some already gone (adlfs): the rest one by one
        for p in paths:
            _fsutil.delete_file(dest.filesystem, p, retry=retry)
