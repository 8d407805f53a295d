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
from checkpoint_store.retention.config import CheckpointConfig
from checkpoint_store.retention.policies import (
    PolicyCheckpoint,
    RetentionPolicy,
    check_metrics,
    evaluate,
)
from checkpoint_store.retention.scoring import RankKey, ScoreOrder, config_score, rank_key
from checkpoint_store.retention.state import LazyEntries

__all__ = ["CheckpointRecord", "Entry", "Selection", "check_report", "explain_kept", "select_kept"]


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint as :func:`select_kept` sees it.

    Attributes:
        index: the checkpoint index from its internal metadata (defines order).
        dir_name: the directory name relative to the trial (``checkpoint_000042``).
        metrics: the metrics reported with it (the score is looked up here).
        created_at: Unix seconds from its internal metadata (``EveryNSeconds``
            reads it; None: not recorded).
    """

    index: int
    dir_name: str
    metrics: Mapping[str, Any]
    created_at: float | None = None


@dataclass(slots=True)
class Entry:
    """A registered checkpoint with its score (None: NaN or missing; the index
    when ranking by recency)."""

    index: int
    dir_name: str
    score: float | None
    metrics: Mapping[str, Any]
    created_at: float | None = None

    def view(self) -> PolicyCheckpoint:
        """This entry as a policy sees it."""
        return PolicyCheckpoint(self.index, self.dir_name, self.metrics, self.created_at)


def _order(config: CheckpointConfig) -> ScoreOrder:
    # Without a score attribute the score is the index: newer is better.
    return config.checkpoint_score_order if config.checkpoint_score_attribute else "max"


def _preserved(policy: RetentionPolicy, kept: Mapping[str, Entry]) -> set[str]:
    """The names some part of ``policy`` preserves (:func:`evaluate`)."""
    by_index = {e.index: n for n, e in kept.items()}
    keep = evaluate(policy, [e.view() for e in kept.values()])
    return {by_index[i] for i in keep}


class Selection:
    """The kept set, updated one registration at a time in O(K) memory.

    Incremental is exact: an entry evicted once had K entries ranked above it
    (a strict total order, the index breaks ties) that stay registered, and a
    newer latest; so it is outside the kept set of every later superset.
    """

    def __init__(self, config: CheckpointConfig):
        self.config = config
        self._policy = config.effective_policy()
        self._order = _order(config)
        # A LazyEntries after a keep-all restart: read from the state on first need.
        self.kept: dict[str, Entry] | LazyEntries[Entry] = {}
        self.latest_index: int | None = None

    def key(self, entry: Entry) -> RankKey[int]:
        """``entry``'s :func:`rank_key` under this config."""
        return rank_key(entry.score, entry.index, self._order)

    def add(self, entry: Entry) -> list[Entry]:
        """Add (or replace, by directory name) one entry; returns the evicted ones,
        oldest first."""
        name = entry.dir_name
        self.kept.pop(name, None)
        self.kept[name] = entry
        if self.latest_index is None or entry.index > self.latest_index:
            self.latest_index = entry.index
        return self._trim()

    def _trim(self) -> list[Entry]:
        k = self.config.num_to_keep
        kept = self.kept
        if self.config.policy is None and (k is None or len(kept) <= k):
            return []
        keep = _preserved(self._policy, kept)
        evicted: list[Entry] = [kept.pop(n) for n in list(kept) if n not in keep]
        evicted.sort(key=lambda e: e.index)
        return evicted

    def newest(self) -> Entry | None:
        """The kept entry of highest index (a lazy kept set stays unread when it can)."""
        if isinstance(self.kept, LazyEntries):
            return self.kept.newest()
        return max(self.kept.values(), key=lambda e: e.index, default=None)

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
    set of records (their indexes, metrics and ``created_at``), not on the
    order of ``records``. A record whose ``dir_name`` repeats replaces the
    earlier one. For the top-K shorthand, memory besides the output is
    O(num_to_keep) (plus the NaN/missing ones under ``missing_score="keep"``).

    Args:
        records: :class:`CheckpointRecord` or ``(index, dir_name, metrics)``
            tuples, in any order.
        config: the retention rules.

    Returns:
        ``(kept, evicted)``, each sorted by index (oldest first).

    Raises:
        InvalidConfigError: a score is not numeric, or is missing under
            ``missing_score="raise"``, or a record is malformed, or a policy
            answers with something other than indexes.
    """
    kept, evicted, _ = explain_kept(records, config)
    return kept, evicted


def explain_kept(
    records: Iterable[CheckpointRecord | tuple[int, str, Mapping[str, Any]]],
    config: CheckpointConfig,
) -> tuple[list[CheckpointRecord], list[CheckpointRecord], dict[str, tuple[str, ...]]]:
    """:func:`select_kept`, plus ``dir_name -> labels of the policies that keep it``
    for each kept record (what ``prune --dry-run`` prints).

    Raises:
        InvalidConfigError: as :func:`select_kept`.
    """
    if not isinstance(config, CheckpointConfig):
        raise InvalidConfigError(f"config must be a CheckpointConfig, got {type(config).__name__}")
    if config.policy is not None:
        kept, evicted = _select_by_policy(map(_as_record, records), config)
    else:
        kept, evicted = _select_incrementally(map(_as_record, records), config)
    entries = {r.index: r for r in kept}
    views = [PolicyCheckpoint(r.index, r.dir_name, r.metrics, r.created_at) for r in kept]
    reasons = evaluate(config.effective_policy(), views)
    return kept, evicted, {entries[i].dir_name: why for i, why in reasons.items()}


def check_report(config: CheckpointConfig, metrics: Mapping[str, Any], index: int | None,
                 warned: set[str], *, stacklevel: int = 3) -> float | None:
    """The score of a new report under ``config`` (see ``config_score``), after the
    checks of every :class:`~checkpoint_store.retention.policies.BestN` of its policy.

    Raises:
        InvalidConfigError: a score is not numeric, or missing under ``"raise"``.
    """
    if config.policy is not None:
        check_metrics(config.policy, metrics, index)
    return config_score(config, metrics, -1 if index is None else index, warned,
                        stacklevel=stacklevel + 1)


def _select_incrementally(
    records: Iterable[CheckpointRecord], config: CheckpointConfig,
) -> tuple[list[CheckpointRecord], list[CheckpointRecord]]:
    sel = Selection(config)
    warned: set[str] = set()
    evicted: dict[str, CheckpointRecord] = {}
    originals: dict[str, CheckpointRecord] = {}
    for rec in records:
        score = config_score(config, rec.metrics, rec.index, warned, stacklevel=5)
        evicted.pop(rec.dir_name, None)
        originals[rec.dir_name] = rec
        for e in sel.add(Entry(rec.index, rec.dir_name, score, rec.metrics, rec.created_at)):
            evicted[e.dir_name] = originals.pop(e.dir_name)
    kept = [originals[e.dir_name] for e in sel.ordered()]
    return kept, sorted(evicted.values(), key=lambda r: r.index)


def _select_by_policy(
    records: Iterable[CheckpointRecord], config: CheckpointConfig,
) -> tuple[list[CheckpointRecord], list[CheckpointRecord]]:
    """The policy evaluated once over every record: a function of the set."""
    warned: set[str] = set()
    latest: dict[str, CheckpointRecord] = {}
    for rec in records:
        check_report(config, rec.metrics, rec.index, warned, stacklevel=5)
        latest.pop(rec.dir_name, None)
        latest[rec.dir_name] = rec
    views = [PolicyCheckpoint(r.index, r.dir_name, r.metrics, r.created_at)
             for r in latest.values()]
    keep = evaluate(config.effective_policy(), views)
    ordered = sorted(latest.values(), key=lambda r: r.index)
    return [r for r in ordered if r.index in keep], [r for r in ordered if r.index not in keep]
