"""One history of a trial across its tiers: which local copy is the trial's.

A local tier's ``checkpoint_<i>`` and the storage_path's ``checkpoint_<i>``
claim the same index, but need not be the same report: machine A's tier may
hold a copy of ``checkpoint_000002`` that never reached the storage_path
while machine B (no tier) resumed from ``checkpoint_000001`` and committed
its own ``checkpoint_000002``. The trial's history is what the storage_path
says: the durable copy of ``i`` when it is committed, else the last
``result.json`` row naming ``checkpoint_dir_name`` ``i``. A local copy is
the trial's only if that history agrees with the row it was reported with
(its internal metadata's ``metrics``: the same ``timestamp`` and
``training_iteration``), or if the history says nothing of ``i`` and no row
of it is newer than the copy (a copy reported and killed before its row or
its durable copy was written), and no row reported after the copy names a
checkpoint at or below ``i`` (no run resumed from before it). Any other
local copy is *stale*: never returned, never persisted, dropped from
its tier with a warning naming both copies.

This module is the one place the rule lives: :meth:`FastTier._open
<checkpoint_store.tiers.local.FastTier>` (every session with a local tier,
hence ``get_checkpoint()`` and every integration's session) and
:func:`joint_history` (readers that open no session: the Hugging Face
``restore_latest``, the CLI) apply it.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import socket
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow.fs as pafs

from checkpoint_store._format.layout import (
    TIER_STATE_FILE,
    checkpoint_dir_name,
    is_local_tier_pointer_name,
    parse_checkpoint_dir_name,
)
from checkpoint_store._results.reader import read_results
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import inspect_checkpoint, read_internal_metadata
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.storage import StorageContext
from checkpoint_store.tiers.config import LocalTier
from checkpoint_store.tiers.statefile import local_trial_dir, read_tier_state

__all__ = ["LOCAL_DURABLE_URI", "HistoryCopy", "TrialHistory", "durable_trial_uri",
           "joint_history", "same_report", "tier_dirs_of", "trial_copies"]

logger = logging.getLogger("checkpoint_store.tiers.local")

Where = Literal["local", "durable"]

#: The key of a local copy's internal metadata naming the persistent tier's
#: trial it belongs to (its canonical URI; docs/format.md, "Local tier").
LOCAL_DURABLE_URI = "durable_uri"


def _report_key(row: Mapping[str, Any]) -> tuple[Any, Any]:
    return row.get("timestamp"), row.get("training_iteration")


def same_report(local: Mapping[str, Any], history: Mapping[str, Any]) -> bool:
    """Whether two result rows are the same report: equal ``timestamp`` and
    ``training_iteration`` (the auto-filled keys every row has)."""
    return _report_key(local) == _report_key(history)


class TrialHistory:
    """What the storage_path says of each index, read lazily and at most once:
    the committed copy's metadata per index asked, ``result.json`` once.

    Args:
        storage: the trial on its storage_path (only read).
    """

    def __init__(self, storage: StorageContext):
        self.storage = storage
        self._durable: dict[int, dict[str, Any] | None] = {}
        self._rows: dict[str, dict[str, Any]] | None = None
        # (timestamp, checkpoint index) of every row naming a checkpoint, and
        # the newest row's timestamp.
        self._named: list[tuple[float, int]] = []
        self._last_ts: float | None = None
        self._rows_failed = False

    def know(self, index: int, meta: dict[str, Any]) -> None:
        """Record the durable ``checkpoint_<index>``'s metadata, read by the caller."""
        self._durable[index] = meta

    def durable_meta(self, index: int) -> dict[str, Any] | None:
        """The internal metadata of the committed durable ``checkpoint_<index>``,
        or None (absent, not committed, or unreadable)."""
        if index not in self._durable:
            s = self.storage
            try:
                meta = read_internal_metadata(
                    s.filesystem, posixpath.join(s.trial_path, checkpoint_dir_name(index)),
                    retry=s.retry)
            except Exception:  # unreadable: the history says nothing of it
                meta = None
            self._durable[index] = meta
        return self._durable[index]

    def row_naming(self, index: int) -> dict[str, Any] | None:
        """The last ``result.json`` row whose ``checkpoint_dir_name`` is
        ``checkpoint_<index>``, or None."""
        if self._rows is None:
            self._rows = {}
            s = self.storage
            try:
                rows = read_results(s.filesystem, s.trial_path, retry=s.retry)
            except Exception as exc:  # no rows: the durable copies alone decide
                logger.warning("could not read the rows of %s: %s", s.uri(s.trial_path), exc)
                rows = []
                self._rows_failed = True
            for row in rows:
                if not isinstance(row, dict):
                    continue
                ts = _number(row.get("timestamp"))
                if ts is not None:
                    self._last_ts = ts if self._last_ts is None else max(self._last_ts, ts)
                name = row.get("checkpoint_dir_name")
                if isinstance(name, str):
                    self._rows[name] = row
                    named = parse_checkpoint_dir_name(name)
                    if ts is not None and named is not None:
                        self._named.append((ts, named))
        return self._rows.get(checkpoint_dir_name(index))

    def _went_back(self, index: int, ts: float) -> tuple[float, int] | None:
        """A row reported after ``ts`` naming a checkpoint at or below
        ``index``: the history restarted below a copy of ``index`` reported at
        ``ts`` (another run resumed from an older one), or None."""
        self.row_naming(index)  # reads the rows once
        return next(((t, i) for t, i in self._named if t > ts and i <= index), None)

    def stale_reason(self, index: int, local_meta: Mapping[str, Any]) -> str | None:
        """None when the local copy of ``index`` (internal metadata
        ``local_meta``) is the trial's; else why it is not, naming both copies."""
        local_row = local_meta.get("metrics") or {}
        name = checkpoint_dir_name(index)
        ts = _number(local_row.get("timestamp"))
        durable = self.durable_meta(index)
        if durable is not None:
            theirs: Mapping[str, Any] = durable.get("metrics") or {}
            s = self.storage
            where = f"the committed {s.uri(posixpath.join(s.trial_path, name))}"
        else:
            row = self.row_naming(index)
            if row is None:
                if ts is not None and self._last_ts is not None and self._last_ts >= ts:
                    return (f"the trial's history went on without it: result.json does not "
                            f"name it and its last row (timestamp {self._last_ts}) is newer "
                            f"than the local copy ({_who(local_meta, local_row)})")
                return None
            theirs, where = row, f"the result.json row naming {name}"
        if same_report(local_row, theirs):
            back = self._went_back(index, ts) if ts is not None else None
            if back is None:
                return None
            return (f"a later result.json row (timestamp {back[0]}) names "
                    f"{checkpoint_dir_name(back[1])}: another run resumed from before the "
                    f"local copy ({_who(local_meta, local_row)})")
        return (f"{where} is another report ({_who(durable, theirs)}) than the local copy "
                f"({_who(local_meta, local_row)})")

    def knows(self, index: int, local_meta: Mapping[str, Any]) -> bool | None:
        """Whether the storage_path records the local copy of ``index`` as the
        same report: its committed copy, or the last row naming it. None when
        neither says so and ``result.json`` could not be read."""
        if self.durable_agrees(index, local_meta):
            return True
        row = self.row_naming(index)
        if row is not None and same_report(local_meta.get("metrics") or {}, row):
            return True
        return None if self._rows_failed else False

    def reset_reason(self, copies: Iterable[tuple[int, Mapping[str, Any], str | None]]
                     ) -> str | None:
        """Why the storage_path's history is no longer the one a local tier's
        ``copies`` (index, internal metadata, the state file's durable status
        or None) were made in, or None. A copy recorded ``"durable"`` reached
        the storage_path, and its row went there before it, and rows are never
        deleted: when neither is there any more (or another report holds its
        index), the trial there was deleted or started over since, and none of
        the tier's copies the new history does not name is the trial's. The
        newest such copy is asked (one read of its durable copy's metadata)."""
        durable = [(index, meta) for index, meta, status in copies if status == "durable"]
        if not durable:
            return None
        index, meta = max(durable, key=lambda c: c[0])
        if self.knows(index, meta) is not False:
            return None
        s = self.storage
        return (f"{checkpoint_dir_name(index)} was copied to {s.uri(s.trial_path)}, which "
                "holds neither it nor its result.json row any more: the trial there was "
                "deleted or started over since")

    def durable_agrees(self, index: int, local_meta: Mapping[str, Any]) -> bool:
        """Whether the durable ``checkpoint_<index>`` is committed and is the
        same report as the local copy (a pending copy it makes durable)."""
        durable = self.durable_meta(index)
        return durable is not None and same_report(local_meta.get("metrics") or {},
                                                   durable.get("metrics") or {})


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _who(meta: Mapping[str, Any] | None, row: Mapping[str, Any]) -> str:
    """Which run wrote a copy and when, for a warning."""
    run = created = None
    if meta is not None:
        run, created = meta.get("run_id"), meta.get("created_at")
    return (f"run {run}, created_at {created}, training_iteration "
            f"{row.get('training_iteration')}, timestamp {row.get('timestamp')}")


@dataclass(frozen=True)
class HistoryCopy:
    """One copy in the joint history of a trial.

    Attributes:
        index: the checkpoint index.
        checkpoint: the copy (local directory or durable).
        meta: its internal metadata.
        where: ``"local"`` (a local tier's) or ``"durable"`` (the storage_path's).
    """

    index: int
    checkpoint: Checkpoint
    meta: dict[str, Any]
    where: Where


def _single_rank_tier(trial_dir: str, storage: StorageContext) -> bool:
    """Whether ``trial_dir`` is a one-rank local tier of ``storage``'s trial
    (its state file names this storage_path, or names none)."""
    try:
        with open(os.path.join(trial_dir, TIER_STATE_FILE), "rb") as f:
            body = json.loads(f.read())
    except (OSError, ValueError):
        return False
    if not isinstance(body, dict) or body.get("world_size", 1) != 1:
        return False
    theirs = body.get("durable_uri")
    return not isinstance(theirs, str) or theirs == durable_trial_uri(storage)


def durable_trial_uri(storage: StorageContext) -> str:
    """The persistent trial's URI as a local tier records it (the canonical one)."""
    try:
        return storage.canonical_uri(storage.trial_path)
    except Exception:  # a backend that cannot say: its plain URI
        return storage.uri(storage.trial_path)


def tier_dirs_of(storage: StorageContext, tier_trial_dir: str | None = None, *,
                 names: Iterable[str] | None = None) -> list[str]:
    """The local tier trial directories of ``storage``'s trial readable on this
    host with one rank: ``tier_trial_dir`` when given (a local path), else
    those the trial's ``.cs_local_tier-<host>-0.json`` pointers of this host
    record (tiers/view.py). Never raises: a trial without any gives ``[]``.

    Args:
        names: the trial directory's entry names, when the caller listed it
            (no second listing then).
    """
    if tier_trial_dir is not None:
        return [tier_trial_dir] if _single_rank_tier(tier_trial_dir, storage) else []
    here = socket.gethostname()
    out: list[str] = []
    if names is None:
        try:
            names = [posixpath.basename(fi.path.rstrip("/"))
                     for fi in _fsutil.list_dir(storage.filesystem, storage.trial_path)]
        except Exception:
            return []
    for name in sorted(n for n in names if is_local_tier_pointer_name(n)):
        try:
            body = _fsutil.read_control(storage.filesystem,
                                        posixpath.join(storage.trial_path, name), json.loads)
            path, host, rank = str(body["path"]), str(body["host"]), int(body["rank"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if host == here and rank == 0 and path not in out and _single_rank_tier(path, storage):
            out.append(path)
    return out


def _local_copies(trial_dir: str, warn_above: int = -1
                  ) -> list[tuple[int, Checkpoint, dict[str, Any]]]:
    """The committed copies of a local tier trial directory; a damaged one
    above ``warn_above`` (the newest durable index: nothing restores that
    index then) is named in a warning, as :func:`_warn_damaged_newer` does."""
    fs = pafs.LocalFileSystem()
    out = []
    try:
        names = os.listdir(trial_dir)
    except OSError:
        return []
    for name in names:
        index = parse_checkpoint_dir_name(name)
        path = os.path.join(trial_dir, name)
        if index is None or not os.path.isdir(path):
            continue
        insp = inspect_checkpoint(fs, path)
        meta = insp.meta if insp.state == "committed" else None
        if meta is not None and meta.get("index") == index:
            out.append((index, Checkpoint.from_directory(path), meta))
        elif index > warn_above and insp.state == "invalid":
            warnings.warn(f"skipping the local tier's {path}: it is damaged ({insp.reason}); "
                          "the restore goes back to an older checkpoint", RuntimeWarning,
                          stacklevel=5)
    return out


def joint_history(storage: StorageContext, tier_trial_dirs: Iterable[str] = (),
                  durable: list[tuple[Checkpoint, dict[str, Any]]] | None = None
                  ) -> list[HistoryCopy]:
    """Every copy of the trial's history on the storage_path and the local
    tiers ``tier_trial_dirs`` (local paths; :func:`tier_dirs_of`), newest index
    first; for one index the local copy before the durable one. Stale local
    copies (see the module docstring) are left out, with a warning. Nothing
    is verified here: a reader takes the first that verifies.

    Args:
        durable: ``storage.committed_checkpoints()`` when the caller has it.
    """
    if durable is None:
        durable = storage.committed_checkpoints()
    history = TrialHistory(storage)
    copies = [HistoryCopy(int(meta["index"]), ckpt, meta, "durable") for ckpt, meta in durable
              if isinstance(meta.get("index"), int)]
    for copy in copies:
        history.know(copy.index, copy.meta)
    ours = durable_trial_uri(storage)
    newest = max((c.index for c in copies), default=-1)
    for trial_dir in tier_trial_dirs:
        found = _local_copies(trial_dir, newest)
        recorded = read_tier_state(trial_dir) or {}
        reset = history.reset_reason(
            (index, meta, recorded[index].durable if index in recorded else None)
            for index, _, meta in found)
        for index, ckpt, meta in found:
            theirs = meta.get(LOCAL_DURABLE_URI)
            if isinstance(theirs, str) and theirs != ours:
                why: str | None = f"it is a copy of {theirs}"
            elif reset is not None:
                why = None if history.knows(index, meta) else reset
            else:
                why = history.stale_reason(index, meta)
            if why is not None:
                logger.warning("the local tier's %s is not the trial's copy of that index: %s; "
                               "it is not restored", ckpt.uri, why)
                continue
            copies.append(HistoryCopy(index, ckpt, meta, "local"))
    copies.sort(key=lambda c: (c.index, c.where == "local"), reverse=True)
    return copies


def trial_copies(storage: StorageContext, local_tier: LocalTier | None = None
                 ) -> list[HistoryCopy]:
    """:func:`joint_history` of ``storage``'s trial with its one-rank local tier
    ``local_tier`` (the one given to the session), or, when None, the tiers
    the trial's pointer files record for this host: what every restore path
    without a session reads (HF ``restore_latest``, Lightning's
    ``resume_path``, the CLI)."""
    tier_dir = (None if local_tier is None else
                local_trial_dir(local_tier.path, storage.experiment_name, storage.trial_name))
    durable = storage.committed_checkpoints()
    _warn_damaged_newer(storage, durable)
    return joint_history(storage, tier_dirs_of(storage, tier_dir), durable)


def _warn_damaged_newer(storage: StorageContext,
                        durable: list[tuple[Checkpoint, dict[str, Any]]]) -> None:
    """Name each damaged ``checkpoint_<i>`` above the newest committed one (a
    truncated or deleted file, an unreadable marker): the restore goes back
    past it, which must not happen unsaid. The committed listing leaves such
    a directory out without a word; one never committed (no marker) is a
    save cut short and says nothing."""
    newest = max((m["index"] for _, m in durable if isinstance(m.get("index"), int)),
                 default=-1)
    for index, name in storage.checkpoint_dirs():
        if index <= newest:
            continue
        path = posixpath.join(storage.trial_path, name)
        insp = inspect_checkpoint(storage.filesystem, path, retry=storage.retry)
        if insp.state == "invalid":
            warnings.warn(f"skipping {storage.uri(path)}: it is damaged ({insp.reason}); the "
                          "restore goes back to an older checkpoint", RuntimeWarning,
                          stacklevel=4)
