"""Rebuild: the retention state a new manager takes over a trial with.

Owns what :meth:`CheckpointManager._restore
<checkpoint_store.retention.manager.CheckpointManager>` decides at a restart:
which of the stored state's kept entries still stand (their directories are
listed), which listed directories must be inspected (:func:`~checkpoint_store.
retention.restore.scan`), the selection rebuilt from both, the numbering that
continues past every index seen, the warnings about a rebuilt state, another
run's checkpoints, damaged and uncommitted ones, and whether the state must be
written again. The manager applies the :class:`Rebuilt` result: it writes the
state and resumes the deletes that were due.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store.retention.config import CheckpointConfig
from checkpoint_store.retention.recorded import warn_disagreeing
from checkpoint_store.retention.restore import (
    Listing,
    Scan,
    created_at,
    run_id_of,
    scan,
    warn_corrupt,
)
from checkpoint_store.retention.scoring import config_score
from checkpoint_store.retention.selection import Entry, Selection
from checkpoint_store.retention.state import LazyEntries, ManagerState, StoredCheckpoint
from checkpoint_store.retention.statelog import StateLog
from checkpoint_store.storage import StorageContext

__all__: list[str] = []

# The manager's logger: the restore's warnings keep the name they always had.
logger = logging.getLogger("checkpoint_store.retention.manager")


@dataclass
class Rebuilt:
    """What a restore found, for :class:`CheckpointManager` to take over."""

    restored_from_state: bool
    run_id: str
    restore_listing: list[pafs.FileInfo] | None
    restore_known: dict[str, int]
    invalid: dict[str, str]
    pending: list[str]
    uncommitted: list[str]
    foreign: list[str]
    foreign_meta: dict[str, Mapping[str, Any]]
    next_index: int
    #: The state must be written (and the pending deletes resumed); always
    #: False for a read-only manager.
    needs_write: bool
    #: Why the stored state could not be used; None when read or not there.
    state_problem: str | None = None


def is_ours(meta: Mapping[str, Any], run_id: str, trial_name: str) -> bool:
    """Whether a checkpoint's internal metadata ``meta`` names run ``run_id``
    (or, written before run ids existed or by hand, trial ``trial_name``)."""
    owner = meta.get("run_id")
    if owner is not None:
        return bool(owner == run_id)
    # Written before run ids existed (or by hand): judge by the trial name.
    trial = meta.get("trial_name")
    return trial is None or trial == trial_name


def _holds(kept: Mapping[str, StoredCheckpoint], name: str, index: int) -> bool:
    """``name in kept``, without reading a lazy state's chunks for it."""
    return bool(kept.knows(name, index)) if isinstance(kept, LazyEntries) else name in kept


def rebuild(config: CheckpointConfig, storage: StorageContext, log: StateLog, sel: Selection,
            warned: set[str], next_index: int, state_path: str, *, read_only: bool) -> Rebuilt:
    """The body of :meth:`CheckpointManager._restore` up to writing the state:
    fills ``sel`` (and ``warned``) and returns the rest. Warnings point at the
    caller of ``CheckpointManager(...)``."""
    listing = Listing.of(storage)
    keep_all = config.num_to_keep is None and config.policy is None
    state, problem = log.load(listing.files, lazy=keep_all)
    # A writer given the default keeps everything (a new run's choice, nothing
    # deleted by it); any other config ranking otherwise than recorded is named.
    if state is not None and state.config is not None \
            and (read_only or config != CheckpointConfig()):
        # rebuild <- _restore <- __init__ <- the caller of CheckpointManager(...)
        warn_disagreeing(config, state.config, storage.uri(storage.trial_path), stacklevel=4)
    pending_before = set(state.pending_deletes) if state is not None else set()
    # Found damaged before: not inspected, ranked or re-registered again.
    recorded = {n: why for n, why in (state.invalid if state is not None else {}).items()
                if n in listing.dirs}
    trusted, unknown = _trusted(config, state, listing, pending_before | recorded.keys())
    if isinstance(trusted, LazyEntries) or trusted:  # a lazy one's len() reads it
        top = (trusted.newest() if isinstance(trusted, LazyEntries)
               else max(trusted.values(), key=lambda e: e.index))
        if top is not None:
            unknown.append(top.dir_name)
    found = scan(storage, listing, unknown)
    lost = found.corrupt.keys() | set(found.uncommitted)
    for name in lost | recorded.keys():
        trusted.pop(name, None)
    # A file or a link in a checkpoint's place: named, never read or deleted.
    invalid = {**recorded, **found.corrupt, **{n: why for n, (_, why) in listing.bad.items()}}
    run_id = (state.run_id if state is not None
              else run_id_of(found.committed, storage.trial_name))
    out = Rebuilt(
        restored_from_state=state is not None,
        run_id=run_id,
        restore_listing=listing.entries_except(storage, {*unknown, *pending_before, *lost}),
        restore_known={c.dir_name: c.index for c in found.committed},
        invalid=invalid, pending=[], uncommitted=[], foreign=[], foreign_meta={},
        next_index=next_index, needs_write=False,
        state_problem=None if state is not None or problem == "missing" else problem,
    )
    evicted = _rebuild_selection(config, sel, warned, out, storage.trial_name, found, state,
                                 trusted)
    out.next_index = _continue_numbering(sel, next_index, found, state)
    _log_restore(storage, state_path, sel, out, found, state, problem)
    if read_only:
        return out
    learned = any(not _holds(trusted, c.dir_name, c.index)
                  and is_ours(c.meta, run_id, storage.trial_name)
                  and c.dir_name not in pending_before for c in found.committed)
    if isinstance(trusted, LazyEntries):
        changed = bool(lost) or any(n not in listing.dirs for n in trusted.recent())
    else:
        changed = state is not None and trusted.keys() != state.checkpoints.keys()
    out.needs_write = (state is None and bool(found.committed) or bool(evicted)
                       or bool(out.pending) or learned or changed
                       or invalid != dict(state.invalid if state is not None else {})
                       or (state is not None and state.config != config.to_json()))
    return out


def _trusted(config: CheckpointConfig, state: ManagerState | None, listing: Listing,
             pending: set[str]
             ) -> tuple[dict[str, StoredCheckpoint] | LazyEntries[StoredCheckpoint], list[str]]:
    """The state's kept entries whose directories are listed, and the listed
    checkpoint directories the state does not know (to inspect), leaving
    out ``pending`` (deletes due, checkpoints recorded invalid). A lazy
    state (keep-all, same config) stays unread when the root places every
    listed name; else it is read here."""
    if state is None:
        return {}, [n for n in listing.dirs if n not in pending]
    kept = state.checkpoints
    if isinstance(kept, LazyEntries) and state.config == config.to_json():
        unknown = kept.not_kept(listing.dirs, pending)
        if unknown is not None:
            return kept.map(lambda e: e, listing.dirs.__contains__), unknown
    trusted = {n: e for n, e in kept.items() if n in listing.dirs}
    return trusted, [n for n in listing.dirs if n not in trusted and n not in pending]


def _rebuild_selection(config: CheckpointConfig, sel: Selection, warned: set[str],
                       out: Rebuilt, trial_name: str, scan: Scan, state: ManagerState | None,
                       trusted: Mapping[str, StoredCheckpoint]) -> list[Entry]:
    """Register the kept checkpoints of the state (``trusted``) and this run's
    committed checkpoints found by ``scan`` again; returns those the config
    evicts now (queued for deletion with the deletes the state had pending)."""
    pending_before = set(state.pending_deletes) if state is not None else set()
    stored = state.checkpoints if state is not None else {}
    # Pending deletes resume, also for half-deleted directories (marker gone).
    out.pending = [n for n in sorted(pending_before) if n in scan.present]
    out.uncommitted = [n for n in scan.uncommitted if n not in pending_before]
    found: dict[str, tuple[int, Mapping[str, Any], float | None]] = {}
    if isinstance(trusted, LazyEntries):
        # Keep-all under the same config: the stored scores stand, and the
        # entries are read from the state's chunks when first asked for.
        sel.kept = trusted.map(lambda e: Entry(e.index, e.dir_name, e.score,
                                               dict(e.metrics), e.created_at),
                               lambda n: True)
        top = sel.newest()
        sel.latest_index = top.index if top is not None else None
    else:
        found.update((n, (e.index, e.metrics, e.created_at)) for n, e in trusted.items())
    for c in scan.committed:
        if not is_ours(c.meta, out.run_id, trial_name):
            out.foreign.append(c.dir_name)
            out.foreign_meta[c.dir_name] = c.meta
            continue
        if c.dir_name in pending_before:
            continue
        metrics = c.meta.get("metrics")
        if not isinstance(metrics, Mapping):
            metrics = stored[c.dir_name].metrics if c.dir_name in stored else {}
        found[c.dir_name] = (c.index, metrics, created_at(c.meta))
    evicted: list[Entry] = []
    for name, (index, metrics, created) in sorted(found.items(), key=lambda kv: kv[1][0]):
        score = config_score(config, metrics, index, warned, lenient=True, stacklevel=7)
        evicted.extend(sel.add(Entry(index, name, score, dict(metrics), created)))
    for e in evicted:
        if e.dir_name not in out.pending:
            out.pending.append(e.dir_name)
    return evicted


def _continue_numbering(sel: Selection, next_index: int, scan: Scan,
                        state: ManagerState | None) -> int:
    """Numbering continues past every index a directory, a registration or the
    state remembers (also a latest that was deleted by hand)."""
    following = [next_index, scan.highest_dir_index + 1]
    if sel.latest_index is not None:
        following.append(sel.latest_index + 1)
    if state is not None and state.latest_index is not None:
        following.append(state.latest_index + 1)
    if state is not None and state.next_index is not None:
        following.append(state.next_index)
    return max(following)


def _log_restore(storage: StorageContext, state_path: str, sel: Selection, out: Rebuilt,
                 scan: Scan, state: ManagerState | None, problem: str) -> None:
    if state is None and (scan.committed or problem != "missing"):
        # Also with nothing to rebuild from: the state it replaces may have
        # recorded damage (checkpoints found invalid by a read) no listing shows.
        replaced = ("" if problem == "missing" else
                    " (it is replaced: checkpoints it recorded as invalid are checked again "
                    "when read)")
        warnings.warn(
            f"retention state {storage.uri(state_path)} is {problem}; rebuilt it from "
            f"{len(scan.committed)} committed checkpoint(s)' internal metadata{replaced}",
            RuntimeWarning,
            stacklevel=5,
        )
    if out.foreign:
        logger.warning(
            "trial %s holds checkpoints of another run, left alone: %s",
            storage.uri(storage.trial_path), ", ".join(out.foreign),
        )
    top = sel.newest()
    warn_corrupt(storage, out.invalid, scan.highest_dir_index,
                 top.dir_name if top is not None else None, stacklevel=6)
    if out.uncommitted:
        logger.warning(
            "trial %s holds uncommitted checkpoint directories, ignored and never deleted "
            "by retention: %s", storage.uri(storage.trial_path), ", ".join(out.uncommitted),
        )
