"""Refuse a write destination that lies inside a committed checkpoint.

A committed checkpoint is immutable (docs/format.md): its manifest lists every
file it holds. A trial directory, a Lightning ``.ckpt`` or an upload target
placed inside one would add files the manifest does not list, so ``verify``
reports the checkpoint corrupt and a resume no longer trusts it. Every write
entry point asks :func:`refuse_inside_checkpoint` once, before its first write.
"""

from __future__ import annotations

import os
import posixpath

import pyarrow.fs as pafs

from checkpoint_store._commit.pointer import POINTER_FILE
from checkpoint_store._format.layout import (
    INTERNAL_METADATA,
    MANAGER_STATE,
    RESULT_FILE,
    parse_checkpoint_dir_name,
)
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend
from checkpoint_store.errors import InvalidConfigError, NestedCheckpointError

__all__ = ["ancestors", "refuse_inside_checkpoint", "refuse_local_store_target"]

# What makes a directory a committed checkpoint: its marker, or the pointer
# naming the current replacement of a checkpoint saved again under one name.
_MARKERS = (INTERNAL_METADATA, POINTER_FILE)


def ancestors(path: str) -> list[str]:
    """``path`` and each directory above it, nearest first, up to (not
    including) the filesystem root; for object stores the bucket is the last."""
    out: list[str] = []
    current = path.rstrip("/")
    while current and current not in ("/", "."):
        out.append(current)
        parent = posixpath.dirname(current)
        if parent == current:
            break
        current = parent
    return out


def refuse_inside_checkpoint(
    backend: Backend,
    path: str,
    what: str,
    *,
    retry: RetryPolicy | None = None,
) -> None:
    """Raise if ``path`` or a directory above it is a committed checkpoint.

    Two stats per level, nearest level first: the commit marker
    ``<ancestor>/.internal_metadata.json`` and the pointer ``.cs_current`` of
    a checkpoint saved again under one name (Lightning's ``last.ckpt``,
    :mod:`._pointer`). Paths are shallow, so this is a handful of requests,
    made once per destination.

    Args:
        backend: the storage ``path`` is on.
        path: the destination directory (or the parent of a destination file),
            in ``backend.filesystem``'s spelling.
        what: names the destination in the message (``"storage_path"``).
        retry: retry policy for the stats.

    Raises:
        NestedCheckpointError: a committed checkpoint holds ``path``; ``.path`` is
            that checkpoint, ``.file`` the destination relative to it.
            Nothing was written.
    """
    for level in ancestors(path):
        if any(_is_file(backend, posixpath.join(level, name), retry) for name in _MARKERS):
            rel = posixpath.relpath(path.rstrip("/"), level)
            raise NestedCheckpointError(
                f"{what} {backend.uri_for(path)} lies inside the committed checkpoint "
                f"{backend.uri_for(level)}; writing there would corrupt it. Choose a "
                "destination outside every committed checkpoint",
                path=level,
                file=None if rel == "." else rel,
            )


def _is_file(backend: Backend, path: str, retry: RetryPolicy | None) -> bool:
    # One stat per call: each is retried on its own (a stat of many paths
    # fails whole when any one request does), and through the backend, so
    # expired credentials rebuild its filesystem as every storage call does.
    info = _retry.call_fs(backend, lambda fs: fs.get_file_info(path), policy=retry,
                          what=f"stat {backend.uri_for(path)}")
    return info.type == pafs.FileType.File


def _is_trial_dir(level: str) -> bool:
    """Whether the local directory ``level`` is a trial of a store: its retention
    state, or its result log beside a checkpoint directory. A ``result.json``
    alone is anybody's (a test's output, another tool's log): not a trial."""
    if os.path.isfile(os.path.join(level, MANAGER_STATE)):
        return True
    if not os.path.isfile(os.path.join(level, RESULT_FILE)):
        return False
    try:
        names = os.listdir(level)
    except OSError:
        return False
    return any(parse_checkpoint_dir_name(n) is not None
               and os.path.isdir(os.path.join(level, n)) for n in names)


def refuse_local_store_target(path: str, what: str, *, trials: bool = True) -> None:
    """Refuse a local write target (a download directory, a plot's folder)
    that is, or lies inside, a committed checkpoint or a store's trial
    directory: files written there would corrupt the checkpoint, or land
    among the files a trial's readers and retention own. One or two stats
    per directory level; writes nothing.

    Args:
        path: the local directory that would be written (it may not exist yet).
        what: names it in the message (``"download directory"``).
        trials: also refuse a trial directory (a download replaces its
            target whole; a single file beside a trial's own is harmless).

    Raises:
        NestedCheckpointError: a committed checkpoint holds ``path``.
        InvalidConfigError: a trial directory holds ``path`` (or is it).
    """
    from checkpoint_store.backends.local import local_backend

    real = os.path.realpath(path)
    # A local path is the local disk's, whatever store the checkpoint came from:
    # no location is resolved (a store passed in as a filesystem stays the only
    # one a download touches).
    backend = local_backend("file://", {})
    refuse_inside_checkpoint(backend, backend.normalize_path(real), what)
    for level in ancestors(real) if trials else ():
        if _is_trial_dir(level):
            raise InvalidConfigError(
                f"{what} {path!r} {'is' if level == real else 'lies inside'} the trial "
                f"directory {level!r} of a checkpoint store; writing there would mix files "
                "into the trial. Choose a directory outside every trial (nothing was written)"
            )
