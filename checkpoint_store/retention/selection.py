"""Which checkpoints are kept: the decision, without storage.

Owns :func:`select_kept` (a pure function; the CLI's ``prune`` and the UI use
it) and :class:`Selection`, the same decision kept up to date one
registration at a time in O(num_to_keep) memory (the manager uses it). The
kept set is the union of what each rule of the config preserves: the best
``num_to_keep`` by :func:`~checkpoint_store.retention.scoring.rank_key`, the
checkpoints without a score under ``missing_score="keep"``, and the latest
under ``keep_latest``. Each rule is a small function of the registered
entries (:func:`_preserved`), so retention policies (best N, latest N, every
N steps) can slot in beside this module as objects answering the same
question, the way Orbax's ``PreservationPolicy`` objects do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.retention.config import CheckpointConfig, ScoreOrder
from checkpoint_store.retention.scoring import RankKey, config_score, rank_key

__all__ = ["CheckpointRecord", "Entry", "Selection", "select_kept"]


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint as :func:`select_kept` sees it.

    Attributes:
        index: the checkpoint index from its internal metadata (defines order).
        dir_name: the directory name relative to the trial (``checkpoint_000042``).
        metrics: the metrics reported with it (the score is looked up here).
    """

    index: int
    dir_name: str
    metrics: Mapping[str, Any]


@dataclass(slots=True)
class Entry:
    """A registered checkpoint with its score (None: NaN or missing; the index
    when ranking by recency)."""

    index: int
    dir_name: str
    score: float | None
    metrics: Mapping[str, Any]


def _order(config: CheckpointConfig) -> ScoreOrder:
    # Without a score attribute the score is the index: newer is better.
    return config.checkpoint_score_order if config.checkpoint_score_attribute else "max"


def _preserved(config: CheckpointConfig, kept: Mapping[str, Entry],
               rank: Mapping[str, RankKey[int]], latest: int | None) -> set[str]:
    """The names some rule of ``config`` preserves: the union of the rules."""
    keep_missing = config.missing_score == "keep" and config.checkpoint_score_attribute is not None
    ranked = [n for n, e in kept.items() if not keep_missing or e.score is not None]
    ranked.sort(key=rank.__getitem__, reverse=True)
    preserve = set(ranked[: config.num_to_keep])
    if keep_missing:
        preserve.update(n for n, e in kept.items() if e.score is None)
    if config.keep_latest:
        preserve.update(n for n, e in kept.items() if e.index == latest)
    return preserve


class Selection:
    """The kept set, updated one registration at a time in O(K) memory.

    Incremental is exact: an entry evicted once had K entries ranked above it
    (a strict total order, the index breaks ties) that stay registered, and a
    newer latest; so it is outside the kept set of every later superset.
    """

    def __init__(self, config: CheckpointConfig):
        self.config = config
        self._order = _order(config)
        self.kept: dict[str, Entry] = {}
        self.latest_index: int | None = None
        # Rank keys are computed once per entry: _trim runs on every registration.
        self._rank: dict[str, RankKey[int]] = {}

    def key(self, entry: Entry) -> RankKey[int]:
        """``entry``'s :func:`rank_key` under this config."""
        return rank_key(entry.score, entry.index, self._order)

    def add(self, entry: Entry) -> list[Entry]:
        """Add (or replace, by directory name) one entry; returns the evicted ones,
        oldest first."""
        name = entry.dir_name
        self.kept.pop(name, None)
        self.kept[name] = entry
        self._rank[name] = self.key(entry)
        if self.latest_index is None or entry.index > self.latest_index:
            self.latest_index = entry.index
        return self._trim()

    def _trim(self) -> list[Entry]:
        k = self.config.num_to_keep
        kept = self.kept
        if k is None or len(kept) <= k:
            return []
        keep = _preserved(self.config, kept, self._rank, self.latest_index)
        evicted = [kept.pop(n) for n in list(kept) if n not in keep]
        for e in evicted:
            del self._rank[e.dir_name]
        evicted.sort(key=lambda e: e.index)
        return evicted

    def ordered(self) -> list[Entry]:
        """The kept entries, oldest first."""
        return sorted(self.kept.values(), key=lambda e: e.index)

    def ranked(self) -> list[Entry]:
        """The kept entries, best first."""
        return sorted(self.kept.values(), key=self.key, reverse=True)


def _as_record(rec: CheckpointRecord | tuple[int, str, Mapping[str, Any]]) -> CheckpointRecord:
    if not isinstance(rec, CheckpointRecord):
        try:
            index, dir_name, metrics = rec
        except (TypeError, ValueError):
            raise InvalidConfigError(
                f"records must be CheckpointRecord or (index, dir_name, metrics); got {rec!r}"
            ) from None
        rec = CheckpointRecord(index, dir_name, metrics)
    if isinstance(rec.index, bool) or not isinstance(rec.index, int):
        raise InvalidConfigError(f"record index must be an int, got {rec.index!r}")
    if not isinstance(rec.metrics, Mapping):
        raise InvalidConfigError(
            f"record metrics must be a mapping, got {type(rec.metrics).__name__}"
        )
    return rec


def select_kept(
    records: Iterable[CheckpointRecord | tuple[int, str, Mapping[str, Any]]],
    config: CheckpointConfig,
) -> tuple[list[CheckpointRecord], list[CheckpointRecord]]:
    """Split checkpoints into kept and evicted, with exactly the manager's semantics.

    A pure function: no storage is touched. The result depends only on the
    ``(index, score)`` pairs, not on the order of ``records``. A record whose
    ``dir_name`` repeats replaces the earlier one. Memory besides the output
    is O(num_to_keep) (plus the NaN/missing ones under ``missing_score="keep"``).

    Args:
        records: :class:`CheckpointRecord` or ``(index, dir_name, metrics)``
            tuples, in any order.
        config: the retention rules.

    Returns:
        ``(kept, evicted)``, each sorted by index (oldest first).

    Raises:
        InvalidConfigError: a score is not numeric, or is missing under
            ``missing_score="raise"``, or a record is malformed.
    """
    if not isinstance(config, CheckpointConfig):
        raise InvalidConfigError(f"config must be a CheckpointConfig, got {type(config).__name__}")
    sel = Selection(config)
    warned: set[str] = set()
    evicted: dict[str, CheckpointRecord] = {}
    originals: dict[str, CheckpointRecord] = {}
    for rec in map(_as_record, records):
        score = config_score(config, rec.metrics, rec.index, warned, stacklevel=3)
        evicted.pop(rec.dir_name, None)
        originals[rec.dir_name] = rec
        for e in sel.add(Entry(rec.index, rec.dir_name, score, rec.metrics)):
            evicted[e.dir_name] = originals.pop(e.dir_name)
    kept = [originals[e.dir_name] for e in sel.ordered()]
    return kept, sorted(evicted.values(), key=lambda r: r.index)
