"""Which directory holds the checkpoint at a Lightning path, and how a re-save replaces it.

Lightning saves to one path again and again (``last.ckpt``). A replacement
must never leave a moment without a complete checkpoint at that path, on any
backend (object stores cannot rename a directory; local disks cannot rename
one over another). So the new checkpoint is committed beside the path, under
``.cs_replace-<name>-<writer>`` (hidden from listings), and a pointer file
``<path>/.cs_current`` holding that sibling's name makes it current (one PUT
on object stores, a rename on local disks: readers see the old name or the
new one). Only then does the old checkpoint go::

    <dirpath>/last.ckpt/.cs_current                 ".cs_replace-last.ckpt-<writer>"
    <dirpath>/.cs_replace-last.ckpt-<writer>/       the committed checkpoint

Readers (:func:`current_dir`) trust, in order: the pointer; the path itself
when it is a committed checkpoint (or a legacy ``.ckpt`` file); else the
newest committed replacement sibling (a replacement cut short after the old
checkpoint went and before the pointer was written, or a local two-rename swap
of an earlier version cut between its renames).
"""

from __future__ import annotations

import posixpath

import pyarrow.fs as pafs

from checkpoint_store._commit.pointer import POINTER_FILE, is_replacement_of, pointed_name, stem
from checkpoint_store._format.layout import (
    deleting_dir_name,
    replace_dir_name,
    staging_dir_name,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import inspect_checkpoint
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend

__all__ = [
    "POINTER_FILE",
    "current_dir",
    "has_pointer",
    "orphaned_names",
    "replacement_dir",
    "replacements",
    "traces",
]

_PREFIX = replace_dir_name("", "")[:-1]  # ".cs_replace-"
# What a rename commit or delete cut short leaves beside a directory.
_TRACES = (staging_dir_name("", "")[:-1], deleting_dir_name("", "")[:-1])


def replacement_dir(fs_path: str, writer: str) -> str:
    """Where a re-save of ``fs_path`` commits its checkpoint."""
    parent, name = posixpath.split(fs_path)
    return posixpath.join(parent, replace_dir_name(name, writer))


def _pointed(backend: Backend, fs_path: str, retry: RetryPolicy | None) -> str | None:
    return pointed_name(backend.filesystem, fs_path, retry)


def has_pointer(backend: Backend, fs_path: str, retry: RetryPolicy | None = None) -> bool:
    return _pointed(backend, fs_path, retry) is not None


def replacements(backend: Backend, fs_path: str, retry: RetryPolicy | None = None
                 ) -> list[str]:
    """Paths of every replacement sibling of ``fs_path``, committed or not."""
    parent, name = posixpath.split(fs_path)
    return [fi.path.rstrip("/") for fi in _fsutil.list_dir(backend.filesystem, parent,
                                                           retry=retry)
            if fi.type == pafs.FileType.Directory
            and is_replacement_of(posixpath.basename(fi.path.rstrip("/")), name)]


def traces(backend: Backend, fs_path: str, retry: RetryPolicy | None = None) -> list[str]:
    """Paths of the staging and deleting directories (local disks) that saves
    and removes of ``fs_path`` or of its replacements left when cut short."""
    parent, name = posixpath.split(fs_path)
    out = []
    for fi in _fsutil.list_dir(backend.filesystem, parent, retry=retry):
        base = posixpath.basename(fi.path.rstrip("/"))
        for prefix in _TRACES:
            if base.startswith(prefix) and "-" in base[len(prefix):]:
                of = base[len(prefix):].rsplit("-", 1)[0]
                if of == name or is_replacement_of(of, name):
                    out.append(fi.path.rstrip("/"))
    return out


def _newest_committed(backend: Backend, paths: list[str], retry: RetryPolicy | None
                      ) -> str | None:
    best: tuple[float, str] | None = None
    for path in paths:
        insp = inspect_checkpoint(backend.filesystem, path, retry=retry)
        if insp.state == "committed" and insp.meta is not None:
            key = (float(insp.meta.get("created_at", 0.0)), path)
            best = key if best is None or key > best else best
    return best[1] if best is not None else None


def current_dir(backend: Backend, fs_path: str, retry: RetryPolicy | None = None) -> str:
    """The path that holds the checkpoint at Lightning path ``fs_path`` (see
    the module docstring for the order readers trust); ``fs_path`` itself
    when nothing better is there (the caller then reports what it is).

    Raises:
        CheckpointCorruptError: a pointer file that names no replacement of
            this path.
    """
    target = _pointed(backend, fs_path, retry)
    if target is not None:
        return posixpath.join(posixpath.dirname(fs_path), target)
    kind = _fsutil.info(backend.filesystem, fs_path, retry=retry).type
    if kind == pafs.FileType.File:
        return fs_path
    if kind == pafs.FileType.Directory:
        state = inspect_checkpoint(backend.filesystem, fs_path, retry=retry).state
        if state in ("committed", "invalid"):
            return fs_path
    newest = _newest_committed(backend, replacements(backend, fs_path, retry), retry)
    return newest if newest is not None else fs_path


def orphaned_names(names: set[str], siblings: list[str]) -> set[str]:
    """Lightning names, not in ``names``, whose only trace in a listing of
    their directory is a replacement sibling among ``siblings`` (base names):
    a replacement cut short between removing the old checkpoint and writing
    the pointer."""
    out = set()
    for s in siblings:
        if s.startswith(_PREFIX):
            name = stem(s)[len(_PREFIX):]
            if name and name not in names:
                out.add(name)
    return out
