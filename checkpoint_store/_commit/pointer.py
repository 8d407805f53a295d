"""The pointer rule of a re-saved checkpoint path (Lightning's ``last.ckpt``).

A path saved again and again gets each new checkpoint committed beside it as
``.cs_replace-<name>-<writer>``; ``<path>/.cs_current`` names the current one
(docs/format.md, "Re-saved paths"). Every reader follows the pointer through
:func:`pointed_name`: the Lightning plugin, ``resume_path``, the CLI's
locations and walks, and the trial scan behind ``gc`` (which therefore never
takes the pointed sibling, or the pointer's directory, for a leftover).
"""

from __future__ import annotations

import posixpath

import pyarrow.fs as pafs

from checkpoint_store._format.layout import POINTER_FILE, replace_dir_name
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.errors import CheckpointCorruptError

__all__ = ["POINTER_FILE", "is_replacement_of", "pointed_name", "pointed_path", "stem"]


def stem(sibling: str) -> str:
    """A replacement sibling's name without its writer id (writer ids hold no ``-``)."""
    return sibling.rsplit("-", 1)[0]


def is_replacement_of(sibling: str, name: str) -> bool:
    """True when ``sibling`` is a :func:`replace_dir_name` of ``name``."""
    return stem(sibling) == stem(replace_dir_name(name, "w"))


def pointed_name(fs: pafs.FileSystem, fs_path: str, retry: RetryPolicy | None = None
                 ) -> str | None:
    """The sibling name in ``fs_path``'s pointer file, or None without one
    (also when ``fs_path`` is a file or absent). Costs one info and, for a
    directory, one read.

    Raises:
        CheckpointCorruptError: a pointer naming no replacement of ``fs_path``.
    """
    if _fsutil.kind(fs, fs_path, retry=retry) != pafs.FileType.Directory:
        return None  # also a legacy plain file: never a pointer inside
    try:
        raw = _fsutil.read_bytes(fs, posixpath.join(fs_path, POINTER_FILE), retry=retry)
    except FileNotFoundError:
        return None
    name = posixpath.basename(fs_path.rstrip("/"))
    target = raw.decode("utf-8", "replace").strip()
    if "/" in target or not is_replacement_of(target, name):
        raise CheckpointCorruptError(
            f"{posixpath.join(fs_path, POINTER_FILE)} names {target!r}, not a replacement "
            f"of {name}: it was not written by checkpoint-store",
            path=fs_path, file=POINTER_FILE)
    return target


def pointed_path(fs: pafs.FileSystem, fs_path: str, retry: RetryPolicy | None = None
                 ) -> str | None:
    """The path of the sibling ``fs_path``'s pointer names, or None without a pointer."""
    target = pointed_name(fs, fs_path, retry)
    return None if target is None else posixpath.join(posixpath.dirname(fs_path.rstrip("/")),
                                                      target)
