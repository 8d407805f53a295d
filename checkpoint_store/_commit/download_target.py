"""The local download target of :meth:`Checkpoint.to_directory`: its helper
directories, completion marker, ownership check and crash recovery.

:mod:`checkpoint_store.checkpoint` keeps the download flow itself
(``_to_directory``, ``_download_and_swap``, ``_swap_in``) and imports these
under private names of its own. Nothing here touches the
checkpoint's storage: only the local disk around the target.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    DownloadHelperKind,
    download_helper_name,
    parse_download_helper_name,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import liveness as _proc
from checkpoint_store.backends.base import LOCAL_CAPABILITIES
from checkpoint_store.errors import CheckpointConflictError, InvalidConfigError

# The download's log records keep the logger they always had.
logger = logging.getLogger("checkpoint_store.checkpoint")


def inside(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip(os.sep) + os.sep)


# Helper directories of a download into ``<parent>/<name>``
# (:func:`~checkpoint_store._format.layout.download_helper_name`). The writer tag (pid
# and start time, :func:`_proc.writer_tag`) lets the next download tell a
# crashed writer's leftovers from a live one's, also once the pid was reused.
def new_sibling_dir(parent: str, kind: DownloadHelperKind, base: str) -> str:
    """A new ``.cs_<kind>-<base>-<writer>-<random>`` directory in ``parent``
    (a name within NAME_MAX whatever the length of ``base``)."""
    name = download_helper_name(kind, base, _proc.writer_tag(), uuid.uuid4().hex[:8])
    path = os.path.join(parent, name)
    os.mkdir(path)
    return path


def dead_helpers(parent: str, base: str) -> list[tuple[DownloadHelperKind, str]]:
    """``(kind, path)`` of the helper directories of downloads into
    ``parent/base`` whose writer process is gone. A name is taken only if it
    is exactly the one :func:`new_sibling_dir` builds for ``base``, so the
    helpers of another target (``run`` vs ``run-5``) are never taken."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    out = []
    for name in names:
        parsed = parse_download_helper_name(name, base)
        if parsed is None:
            continue
        kind, tag = parsed
        # Only a writer known to be gone: a tag we cannot judge stays.
        if _proc.writer_tag_alive(tag) is False:
            out.append((kind, os.path.join(parent, name)))
    return out


def recover_interrupted(parent: str, base: str, target: str) -> None:
    """Undo what a download into ``target`` that died part-way left behind.

    Called under the target's download lock, so no live download of this
    target is running; each helper must also belong to a dead process.
    A writer that died between moving the old ``target`` aside and moving
    its staged one in leaves no ``target``: the old one is moved back (the
    marker of that moment lists its files, so the caller's download replaces
    it as usual). Then every dead helper is removed: a staging directory is
    only a copy of what is on storage.
    """
    dead = dead_helpers(parent, base)
    if not dead:
        return
    if not os.path.lexists(target):
        aside = [os.path.join(p, "d") for kind, p in dead if kind == "download_old"]
        aside = [d for d in aside if os.path.isdir(d) and not os.path.islink(d)]
        if aside:
            back = max(aside, key=lambda d: os.stat(os.path.dirname(d)).st_mtime_ns)
            os.rename(back, target)
            logger.warning("restored %s from %s, left by a download that did not finish",
                           target, os.path.dirname(back))
    for _, path in dead:
        remove_tree(path)


def tree_entries(root: str) -> list[str]:
    """Relative posix paths of everything under ``root`` but directories
    (symlinks, also to directories, are entries, never followed). Its own
    stack: ``os.walk`` recurses per level and fails 1,000 levels down."""
    out = []
    stack = [(root, "")]
    while stack:
        path, rel_dir = stack.pop()
        with os.scandir(path) as it:
            for entry in it:
                rel = f"{rel_dir}{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, f"{rel}/"))
                else:
                    out.append(rel)
    return sorted(out)


def remove_tree(path: str) -> None:
    """``shutil.rmtree(path, ignore_errors=True)``, also for a tree deeper
    than its recursion allows (Python before 3.12 recurses per level):
    then bottom up with a stack of our own, links removed, never followed."""
    try:
        shutil.rmtree(path, ignore_errors=True)
        return
    except RecursionError:
        pass
    dirs, stack = [], [path]
    while stack:
        d = stack.pop()
        dirs.append(d)
        with contextlib.suppress(OSError), os.scandir(d) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
    for d in reversed(dirs):
        with contextlib.suppress(OSError):
            os.rmdir(d)


def owned_files(target: str, previous: Mapping[str, Any]) -> list[str]:
    """What ``target`` holds, when all of it came from earlier downloads of
    ours (the marker lists their files); else refuse, touching nothing."""
    if not os.path.lexists(target):
        return []
    present = tree_entries(target)
    ours = previous.get("files")
    foreign = sorted(set(present) - set(ours if isinstance(ours, list) else []))
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise CheckpointConflictError(
            f"cannot download into {target!r}: it holds {foreign[0]!r}{more}, which no earlier "
            "download put there. A download replaces the whole directory, so it never "
            "touches files it did not write; choose a new or empty directory, or move "
            "those files away"
        )
    return present


def sizes_match(target: str, manifest: list[dict[str, Any]]) -> bool:
    """Every manifest file present in ``target`` with its size (stat only)."""
    for e in manifest:
        try:
            if os.stat(os.path.join(target, e["path"])).st_size != e["size"]:
                return False
        except OSError:
            return False
    return True


def read_download_marker(path: str) -> dict[str, Any]:
    """The marker's body (``identity``: what was downloaded, None while
    incomplete; ``files``: the relative paths the download wrote), or ``{}``."""
    try:
        with open(path, "rb") as f:
            body = _json.loads(f.read())
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def write_download_marker(path: str, identity: dict[str, Any] | None,
                           files: list[str]) -> None:
    body = {"identity": identity, "files": files, "pid": os.getpid(),
            "completed_at": time.time()}
    _fsutil.write_bytes(pafs.LocalFileSystem(), path, _json.dumps(body), LOCAL_CAPABILITIES,
                        fsync=False)


def check_lock_creatable(lock_path: str, target: str) -> None:
    """Fail at once where the download lock cannot exist: filelock would take
    an error creating it for a lock held by someone else and wait forever."""
    try:
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        raise InvalidConfigError(
            f"cannot download into {target!r}: {exc.strerror or exc} creating "
            f"{lock_path!r}; choose a directory you can write to"
        ) from None
    os.close(fd)
