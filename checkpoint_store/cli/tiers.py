"""The tier columns of ``ls`` and the tier lines of ``show`` (checkpoint_store/tiers/view.py).

A trial with a local tier (``session.start(local_tier=...)``) lists, per
checkpoint, the tiers it is committed on (``durable``: the storage_path;
``local``: a local tier readable on this host) and what its durable copy is
(``committed``, ``pending``, ``local only``, ``evicted``); checkpoints still
only on a local tier are listed too. Pointed at the local tier's own trial
directory, ``ls`` reads its state file. A trial without a local tier lists
as before, without these columns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from checkpoint_store._browse.locations import Location
from checkpoint_store._format.layout import checkpoint_dir_name
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.tiers.view import (
    TierView,
    describe,
    is_tier_trial,
    local_only_indexes,
    local_tier_views,
    tier_state_view,
)

__all__ = ["annotate_rows", "checkpoint_tiers", "local_history", "trial_tiers"]


def trial_tiers(trial: Location, names: Iterable[str] | None = None
                ) -> tuple[list[TierView], bool]:
    """The local tiers of ``trial`` and whether ``trial`` is itself a local tier's
    trial directory (then the one view is its own state)."""
    local = _fsutil.local_path(trial.fs, trial.path)
    if local is not None and is_tier_trial(local):
        view = tier_state_view(local)
        return ([view] if view is not None else []), True
    try:
        return local_tier_views(trial.fs, trial.path, names), False
    except OSError:
        return [], False


def local_history(trial: Location, durable: Iterable[tuple[Location, Mapping[str, Any]]],
                  names: Iterable[str] | None = None) -> list[tuple[Location, dict[str, Any]]]:
    """The copies of ``trial``'s history that only its one-rank local tiers on
    this host hold (indexes not in ``durable``, the storage_path's committed
    copies), oldest first; stale local copies (another run's report owns
    their index, checkpoint_store/tiers/history.py) are left out. ``[]`` for
    a trial without a local tier, or not laid out as ``<storage>/<exp>/<trial>``;
    ``names``: the trial directory's entry names, when the caller listed it."""
    from checkpoint_store._browse.locations import resolve_location, storage_context
    from checkpoint_store.tiers.history import joint_history, tier_dirs_of

    ctx = storage_context(trial, strict=False)
    if ctx is None:
        return []
    dirs = tier_dirs_of(ctx, names=names)
    if not dirs:
        return []
    have = {meta.get("index") for _, meta in durable}
    copies = joint_history(ctx, dirs, durable=[])
    return [(resolve_location(c.checkpoint.path, {}), c.meta)
            for c in reversed(copies) if c.index not in have]


def annotate_rows(trial: Location, rows: list[dict[str, Any]], tiers: list[TierView],
                  own: bool, metric: str | None) -> None:
    """Add ``tiers`` and ``durable`` to each ``ls`` row of ``trial``, and rows for
    the checkpoints only a local tier holds (read from that tier's copy)."""
    from checkpoint_store.retention.recorded import metric_value

    if not tiers:
        return
    for row in rows:
        index = row["index"]
        if own:
            status = tiers[0].status.get(index)
            row.update(describe(index, status == "durable", tiers))
        else:
            row.update(describe(index, True, tiers))
    if own:
        return
    for index in local_only_indexes(tiers, (r["index"] for r in rows)):
        view = next(t for t in tiers if index in t.status)
        meta = _local_meta(view, index)
        if meta is None:
            continue
        name = checkpoint_dir_name(index)
        row = {"index": index, "name": name, "uri": f"{view.path}/{name}",
               "created_at": meta.get("created_at"),
               "score": metric_value(meta.get("metrics") or {}, metric) if metric else None}
        row.update(describe(index, False, tiers))
        rows.append(row)
    rows.sort(key=lambda r: r["index"])


def _local_meta(view: TierView, index: int) -> Mapping[str, Any] | None:
    import pyarrow.fs as pafs

    from checkpoint_store._util.inspect import read_internal_metadata

    try:
        return read_internal_metadata(pafs.LocalFileSystem(),
                                      f"{view.path}/checkpoint_{index:06d}")
    except Exception:
        return None


def checkpoint_tiers(loc: Location, index: Any) -> dict[str, Any] | None:
    """``show``'s tier fields of the checkpoint at ``loc`` (``tiers``, ``durable``,
    ``local_tiers``), or None when its trial has no local tier."""
    if not isinstance(index, int):
        return None
    tiers, own = trial_tiers(loc.parent)
    if not tiers:
        return None
    if own:
        out = describe(index, tiers[0].status.get(index) == "durable", tiers)
    else:
        out = describe(index, True, tiers)
    out["local_tiers"] = [t.to_json() for t in tiers]
    return out
