"""Restore: what a new manager makes of a trial it takes over.

Owns the one listing of the trial a restart makes (:class:`Listing`, by name
only on a local disk), the inspection of the checkpoint directories the
retention state does not vouch for (:func:`scan`: newer ones, leftovers,
another run's) and the lazily built resume candidates (:class:`Candidates`).
The manager (:mod:`~checkpoint_store.retention.manager`) decides with them.
"""

from __future__ import annotations

import logging
import os
import posixpath
import uuid
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import pyarrow.fs as pafs

from checkpoint_store._format.layout import CHECKPOINT_PREFIX, parse_checkpoint_dir_name
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import inspect_checkpoint
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.storage import StorageContext

__all__ = ["Candidates", "Committed", "Listing", "Scan", "created_at", "run_id_of", "scan",
           "warn_corrupt"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint directory found at restore."""

    index: int
    dir_name: str
    meta: Mapping[str, Any]


@dataclass
class Listing:
    """One listing of the trial directory: all a restart lists."""

    files: set[str] = field(default_factory=set)
    dirs: dict[str, int] = field(default_factory=dict)  # checkpoint_NNNNNN -> index
    other_dirs: set[str] = field(default_factory=set)  # staging, deleting, user's ...
    #: ``checkpoint_NNNNNN`` entries that cannot be a checkpoint whatever they
    #: hold: a file, or a symbolic link (local disks), name -> (index, why).
    #: Never inspected, ranked, resumed from, cleaned or deleted; numbering
    #: continues past them (a commit there would fail).
    bad: dict[str, tuple[int, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, storage: StorageContext) -> Listing:
        """List the trial once; on a local disk by name and entry type only (no
        ``stat`` per checkpoint: a trial of 100,000 lists in milliseconds; the
        entry type tells a link without a ``stat`` too)."""
        listing = cls()
        local = _fsutil.local_path(storage.filesystem, storage.trial_path)
        links: set[str] = set()
        if local is not None:
            try:
                with os.scandir(local) as it:
                    found = []
                    for e in it:
                        found.append((e.name, e.is_dir()))
                        if e.is_symlink():
                            links.add(e.name)
            except FileNotFoundError:
                found = []
        else:
            found = [(posixpath.basename(fi.path.rstrip("/")), fi.type == pafs.FileType.Directory)
                     for fi in _fsutil.list_dir(storage.filesystem, storage.trial_path,
                                                retry=storage.retry)
                     if fi.type in (pafs.FileType.File, pafs.FileType.Directory)]
        for name, is_dir in found:
            index = _checkpoint_index(name)
            if index is not None and name in links:
                target = _fsutil.link_target(storage.filesystem,
                                             posixpath.join(storage.trial_path, name))
                listing.bad[name] = (index, f"is a symbolic link (to {target!r}), not a "
                                            "checkpoint directory of its own")
            elif index is not None and not is_dir:
                listing.bad[name] = (index, "is a file, not a checkpoint directory")
            elif index is not None:
                listing.dirs[name] = index
            elif is_dir:
                listing.other_dirs.add(name)
            else:
                listing.files.add(name)
        return listing

    @property
    def highest_index(self) -> int:
        """The highest index a ``checkpoint_NNNNNN`` entry of any kind takes (-1: none)."""
        return max([*self.dirs.values(), *(i for i, _ in self.bad.values())], default=-1)

    def entries_except(self, storage: StorageContext, only: Collection[str]
                       ) -> list[pafs.FileInfo]:
        """The listing as ``FileInfo``, of its checkpoint directories only those
        in ``only`` (the others are committed ones the state vouches for: a
        cleanup has nothing to do there)."""
        join, trial = posixpath.join, storage.trial_path
        out = [pafs.FileInfo(join(trial, n), pafs.FileType.File) for n in sorted(self.files)]
        out += [pafs.FileInfo(join(trial, n), pafs.FileType.Directory)
                for n in sorted({*self.other_dirs, *(n for n in only if n in self.dirs)})]
        return out


def _checkpoint_index(name: str) -> int | None:
    """:func:`parse_checkpoint_dir_name`, fast (a restart parses every name of a trial)."""
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    digits = name[len(CHECKPOINT_PREFIX):]
    return int(digits) if len(digits) >= 6 and digits.isdecimal() else None


@dataclass
class Scan:
    """What a trial directory holds, as restore sees it."""

    committed: list[Committed] = field(default_factory=list)  # oldest first
    present: set[str] = field(default_factory=set)
    highest_dir_index: int = -1
    uncommitted: list[str] = field(default_factory=list)
    corrupt: dict[str, str] = field(default_factory=dict)  # name -> what is wrong


def scan(storage: StorageContext, listing: Listing, names: list[str]) -> Scan:
    """Inspect the ``checkpoint_NNNNNN`` directories ``names`` of ``listing``:
    committed, corrupt, or not committed."""
    scan = Scan(present=set(listing.dirs), highest_dir_index=listing.highest_index)
    for name in sorted(names, key=listing.dirs.__getitem__):
        insp = inspect_checkpoint(storage.filesystem, posixpath.join(storage.trial_path, name),
                                  retry=storage.retry)
        if insp.state == "committed" and insp.meta is not None:
            scan.committed.append(Committed(insp.meta["index"], name, insp.meta))
        elif insp.state == "invalid":
            # A commit marker whose files no longer match it (a file added,
            # removed or resized): corrupt, not an unfinished write.
            scan.corrupt[name] = insp.reason or "does not match its manifest"
        else:
            scan.uncommitted.append(name)
    scan.committed.sort(key=lambda c: c.index)
    return scan


def created_at(meta: Mapping[str, Any]) -> float | None:
    """``created_at`` of internal metadata, when it is a number."""
    value = meta.get("created_at")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def run_id_of(committed: list[Committed], trial_name: str) -> str:
    """Without a state file: the run id of the newest committed checkpoint of this
    trial, else a new one."""
    mine = [c.meta["run_id"] for c in committed
            if c.meta.get("trial_name") in (None, trial_name)
            and isinstance(c.meta.get("run_id"), str)]
    return mine[-1] if mine else uuid.uuid4().hex


class Candidates(Sequence[tuple[Checkpoint, dict[str, Any]]]):
    """``(Checkpoint, meta)`` pairs, oldest first, built on first read (the same
    object after) by ``build`` (a directory name to its Checkpoint). ``items``
    is called only when more than ``newest`` is asked for: a resume reads the
    newest one and, only if it fails to verify, more."""

    def __init__(self, build: Callable[[str], Checkpoint],
                 items: Callable[[], list[tuple[str, dict[str, Any]]]],
                 newest: tuple[str, dict[str, Any]] | None = None):
        self._build_checkpoint = build
        self._items_of = items
        self._items: list[tuple[str, dict[str, Any]]] | None = None
        self._newest = newest
        self._built: dict[str, tuple[Checkpoint, dict[str, Any]]] = {}

    def _all(self) -> list[tuple[str, dict[str, Any]]]:
        if self._items is None:
            self._items = self._items_of()
        return self._items

    def _build(self, name: str, meta: dict[str, Any]) -> tuple[Checkpoint, dict[str, Any]]:
        if name not in self._built:
            self._built[name] = (self._build_checkpoint(name), dict(meta))
        return self._built[name]

    def named(self) -> list[tuple[str, dict[str, Any]]]:
        """``(dir_name, meta)`` of every candidate, oldest first, building no
        :class:`Checkpoint` (a CLI ranking a trial of 100,000 needs one of them)."""
        return list(self._all())

    def __bool__(self) -> bool:
        return self._newest is not None or bool(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __reversed__(self) -> Iterator[tuple[Checkpoint, dict[str, Any]]]:
        if self._newest is not None:
            yield self._build(*self._newest)
        rest = self._all()
        if self._newest is not None and rest and rest[-1][0] == self._newest[0]:
            rest = rest[:-1]
        for name, meta in reversed(rest):
            yield self._build(name, meta)

    @overload
    def __getitem__(self, i: int) -> tuple[Checkpoint, dict[str, Any]]: ...

    @overload
    def __getitem__(self, i: slice) -> list[tuple[Checkpoint, dict[str, Any]]]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i == -1 and self._newest is not None:
            return self._build(*self._newest)
        items = self._all()
        j = i + len(items) if i < 0 else i
        if not 0 <= j < len(items):
            raise IndexError(i)
        return self._build(*items[j])


def warn_corrupt(storage: StorageContext, corrupt: Mapping[str, str], highest_dir_index: int,
                 newest_kept: str | None, *, stacklevel: int = 5) -> None:
    """Name each corrupt checkpoint (``corrupt``: name -> what is wrong) and
    why; say so louder (a ``RuntimeWarning``, ``stacklevel`` as for
    :func:`warnings.warn`) when it is the newest directory
    (``highest_dir_index``), since resume then falls back to ``newest_kept``."""
    if not corrupt:
        return
    trial = storage.uri(storage.trial_path)
    def index(name: str) -> int:
        parsed = parse_checkpoint_dir_name(name)
        return -1 if parsed is None else parsed  # not ``or -1``: index 0 is a checkpoint

    newest = max(corrupt, key=index)
    if index(newest) == highest_dir_index:
        fallback = (f"resume falls back to {newest_kept}" if newest_kept is not None
                    else "no committed checkpoint is left to resume from")
        warnings.warn(
            f"the newest checkpoint of trial {trial}, {newest}, is corrupt "
            f"({corrupt[newest]}): {fallback}; `checkpoint-store verify {trial}` "
            "names every fault", RuntimeWarning, stacklevel=stacklevel,
        )
    logger.warning(
        "trial %s holds invalid checkpoints (files not matching their manifest, a marker "
        "naming another index, a file or a link in a checkpoint's place), left out "
        "of ranking and resume and never deleted by retention: %s", trial,
        "; ".join(f"{n} ({why})" for n, why in sorted(corrupt.items())),
    )
