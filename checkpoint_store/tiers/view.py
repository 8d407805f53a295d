"""Which tiers hold a checkpoint, for ``ls``, ``show`` and the web page.

A session with a local tier records where it is in the durable trial
directory, one small file per host and rank,
``.cs_local_tier-<host>-<rank>.json`` = ``{"version": 1, "host", "rank",
"path": <the local tier's trial directory>, "updated_at"}`` (docs/format.md,
"Local tier"). A reader of the durable trial on the same host finds the
local tier's state file (``.cs_tier_state.json``: which indexes are
committed there, and whether each one's durable copy is ``pending``,
``durable`` or ``local_only``) through it; a reader pointed at the local
tier's trial directory reads that state file directly. Nothing here writes
but :func:`record_local_tier`.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._format.layout import (
    TIER_STATE_FILE,
    is_local_tier_pointer_name,
    local_tier_pointer_name,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.tiers.statefile import read_tier_state

__all__ = ["TierView", "describe", "local_tier_views", "record_local_tier", "tier_state_view"]

logger = logging.getLogger(__name__)

#: What a checkpoint's durable copy is, as ``ls``, ``show`` and the page say it:
#: ``committed`` (on the storage_path), ``pending`` (selected, its copy not
#: committed yet), ``local only`` (the persist policy did not select it),
#: ``evicted`` (it was durable; the storage_path's retention deleted it since).
_WORDS = {"pending": "pending", "local_only": "local only", "durable": "evicted"}


@dataclass
class TierView:
    """One local tier of a trial, as a reader sees it.

    Attributes:
        path: the local tier's trial directory.
        host, rank: where it lives (the rank's part, with several ranks).
        visible: its state file was read on this host.
        status: index -> ``"pending"``, ``"durable"`` or ``"local_only"``.
    """

    path: str
    host: str
    rank: int
    visible: bool
    status: dict[int, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "host": self.host, "rank": self.rank,
                "visible": self.visible}


def record_local_tier(fs: pafs.FileSystem, trial_path: str, tier_trial_dir: str, rank: int,
                      caps: Any) -> None:
    """Write (or refresh) the pointer from the durable trial ``trial_path`` on
    ``fs`` to the local tier's trial directory ``tier_trial_dir``. Never raises:
    a reader without it only misses the local tier's column."""
    host = socket.gethostname()
    body = {"version": 1, "host": host, "rank": rank, "path": os.path.abspath(tier_trial_dir),
            "updated_at": time.time()}
    path = posixpath.join(trial_path, local_tier_pointer_name(host, rank))
    try:
        _fsutil.write_bytes(fs, path, json.dumps(body).encode(), caps, fsync=False)
    except Exception as exc:  # the tier works without it
        logger.warning("could not record the local tier in %s: %s", path, exc)


def tier_state_view(trial_dir: str, host: str | None = None, rank: int = 0) -> TierView | None:
    """The local tier whose trial directory is ``trial_dir`` (a local path), from
    its state file; None when there is none."""
    entries = read_tier_state(trial_dir)
    if entries is None:
        return None
    return TierView(trial_dir, host or socket.gethostname(), rank, True,
                    {i: e.durable for i, e in entries.items()})


def local_tier_views(fs: pafs.FileSystem, trial_path: str,
                     names: Iterable[str] | None = None) -> list[TierView]:
    """The local tiers the durable trial ``trial_path`` records (see the module
    docstring), rank by rank; those of another host, or whose state this host
    cannot read, have ``visible=False``.

    Args:
        names: the trial directory's entry names, when the caller listed it
            (no second listing then).
    """
    if names is None:
        names = [posixpath.basename(fi.path.rstrip("/")) for fi in _fsutil.list_dir(fs, trial_path)]
    here = socket.gethostname()
    out = []
    for name in sorted(n for n in names if is_local_tier_pointer_name(n)):
        try:
            body = json.loads(_fsutil.read_bytes(fs, posixpath.join(trial_path, name)))
            path, host, rank = str(body["path"]), str(body["host"]), int(body["rank"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        view = tier_state_view(path, host, rank) if host == here else None
        out.append(view if view is not None else TierView(path, host, rank, False))
    return out


def describe(index: int, committed: bool, tiers: Iterable[TierView]) -> dict[str, Any]:
    """Where checkpoint ``index`` is: ``{"tiers": ["durable", "local"], "durable":
    "committed" | "pending" | "local only" | "evicted" | None}`` (None: no local
    tier knows it and it is not committed on the storage_path)."""
    on = ["durable"] if committed else []
    status = None
    for t in tiers:
        s = t.status.get(index)
        if s is not None:
            if "local" not in on:
                on.append("local")
            status = status or s
    word = "committed" if committed else (_WORDS.get(status) if status else None)
    return {"tiers": on, "durable": word}


def local_only_indexes(tiers: Iterable[TierView], committed: Iterable[int]) -> list[int]:
    """Indexes the local tiers hold that are not committed on the storage_path."""
    done = set(committed)
    return sorted({i for t in tiers for i in t.status} - done)


def is_tier_trial(trial_dir: str | None) -> bool:
    """Whether the local directory ``trial_dir`` is a local tier's trial directory."""
    return trial_dir is not None and os.path.exists(os.path.join(trial_dir, TIER_STATE_FILE))


def tier_rows(tiers: list[TierView], committed: Mapping[int, Any]) -> dict[int, dict[str, Any]]:
    """:func:`describe` for every index known to the storage_path (``committed``)
    or to a local tier."""
    indexes = set(committed) | {i for t in tiers for i in t.status}
    return {i: describe(i, i in committed, tiers) for i in sorted(indexes)}
