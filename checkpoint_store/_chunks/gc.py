"""Garbage collection of chunk objects, and what the chunks of each trial cost.

:func:`collect` follows the four steps of docs/format.md ("Chunks"):

1. list intents (removing expired ones), compute refs, list objects:
   candidates = objects - refs - objects whose chunk an intent names;
2. write a condemned file listing the candidates;
3. list intents and compute refs again; delete candidates - refs - intents;
4. delete the condemned file, and condemned files older than an hour.

A writer whose intent lands before step 3's listing is protected by it (or,
once it finished, by its marker: intents are listed before refs). One whose
intent lands later reads step 2's condemned file (or, if it is gone, sees
step 3's deletions done) and uploads afresh under a new name. An intent
protects every object of its chunks, fresh copies included, so a fresh copy
uploaded after step 1 of a later gc is not deleted before its marker commits.
"""

from __future__ import annotations

import posixpath
import time
import uuid
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field

from checkpoint_store._chunks.refs import MarkerChunks
from checkpoint_store._chunks.store import (
    CONDEMNED_DIR,
    INTENTS_DIR,
    ChunkStore,
    base_name,
)

__all__ = ["CONDEMNED_TTL_S", "INTENT_TTL_S", "GcReport", "Usage", "UsageReport",
           "collect", "collect_steps", "usage"]

INTENT_TTL_S = 6 * 3600.0
"""A crashed writer's intent protects its chunks this long (seconds)."""
CONDEMNED_TTL_S = 3600.0
"""A condemned file this old is a crashed gc's: the next gc removes it. A gc
stops deleting once its own condemned file is half this old, so a slow gc
never deletes after another removed its condemned file."""

_ALL = None  # an intent that does not parse protects every object


@dataclass
class GcReport:
    """What one gc pass did (or, with ``dry_run``, would delete).

    Attributes:
        deleted: object names deleted (dry run: those that would be).
        bytes_freed: their stored bytes.
        kept: candidates kept at step 3 (referenced or announced meanwhile,
            or the pass ran too long to delete safely).
        expired_intents: intent files removed as expired (paths).
        stale_condemned: condemned files of crashed gcs removed (paths).
        dry_run: nothing was written or deleted.
    """

    deleted: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    kept: list[str] = field(default_factory=list)
    expired_intents: list[str] = field(default_factory=list)
    stale_condemned: list[str] = field(default_factory=list)
    dry_run: bool = False


def _live_intents(store: ChunkStore, t: float, ttl: float, report: GcReport | None
                  ) -> set[str] | None:
    """Chunk names the live intents name (None: one did not parse, so every
    object is protected). Expired ones are removed when ``report`` is given."""
    names: set[str] | None = set()
    for c in store.read_controls(INTENTS_DIR):
        if c.created_at < t - ttl:
            if report is not None:
                store.delete_path(c.path)
                report.expired_intents.append(c.path)
            continue
        if c.chunks is None or names is None:
            names = _ALL
        else:
            names |= {base_name(n) for n in c.chunks}
    return names


def _protected(name: str, intents: set[str] | None) -> bool:
    return intents is _ALL or base_name(name) in intents  # type: ignore[operator]


def _kept(name: str, live: set[str] | None, intents: set[str] | None) -> bool:
    """Whether object ``name`` stays: referenced (``live`` None: references
    unknown, every object stays) or announced by a live intent."""
    return live is None or name in live or _protected(name, intents)


def collect_steps(store: ChunkStore, refs: Callable[[], set[str] | None], *,
                  candidates: Iterable[str] | None = None,
                  intent_ttl_s: float = INTENT_TTL_S, dry_run: bool = False,
                  now: Callable[[], float] = time.time,
                  condemned_ttl_s: float = CONDEMNED_TTL_S
                  ) -> Generator[str, None, GcReport]:
    """:func:`collect` one phase at a time: yields ``"listed"`` (step 1),
    ``"condemned"`` (step 2), ``"relisted"`` (step 3's listings),
    ``"deleted"`` (step 3's deletes), ``"finished"`` (step 4) and returns the
    report. Abandoning it midway is a crashed gc: safe, its garbage and
    condemned file go in a later pass. Without candidates, only step 1 and 4."""
    report = GcReport(dry_run=dry_run)
    intents = _live_intents(store, now(), intent_ttl_s, None if dry_run else report)
    live = refs()
    objects = (store.list_objects() if candidates is None
               else store.stat_objects(candidates))
    doomed = {n: s for n, s in objects.items() if not _kept(n, live, intents)}
    yield "listed"
    if dry_run:
        report.deleted = sorted(doomed)
        report.bytes_freed = sum(doomed.values())
        return report
    own: str | None = None
    if doomed:
        created = now()
        own = store.write_control(CONDEMNED_DIR, f"gc-{uuid.uuid4().hex}", doomed, created)
        yield "condemned"
        intents = _live_intents(store, now(), intent_ttl_s, None)
        live = refs()
        order = sorted(n for n in doomed if not _kept(n, live, intents))
        report.kept = sorted(set(doomed) - set(order))
        yield "relisted"
        _delete(store, order, doomed, report, lambda: now() - created < condemned_ttl_s / 2)
        yield "deleted"
        store.delete_path(own)
    for c in store.read_controls(CONDEMNED_DIR):
        if c.path != own and c.created_at < now() - condemned_ttl_s:
            store.delete_path(c.path)
            report.stale_condemned.append(c.path)
    yield "finished"
    return report


def _delete(store: ChunkStore, order: list[str], sizes: dict[str, int], report: GcReport,
            in_time: Callable[[], bool]) -> None:
    batch = 16 * store.workers
    for i in range(0, len(order), batch):
        part = order[i:i + batch]
        if not in_time():
            report.kept = sorted(set(report.kept) | set(order[i:]))
            return
        store._parallel(store.delete_object, part)
        report.deleted.extend(part)
        report.bytes_freed += sum(sizes[n] for n in part)


def collect(store: ChunkStore, refs: Callable[[], set[str] | None], *,
            candidates: Iterable[str] | None = None, intent_ttl_s: float = INTENT_TTL_S,
            dry_run: bool = False, now: Callable[[], float] = time.time) -> GcReport:
    """Delete the chunk objects of ``store`` that no checkpoint references
    and no live writer announced.

    Args:
        store: the experiment's chunk store.
        refs: returns every object name referenced now (e.g.
            ``lambda: experiment_refs(fs, experiment_dir)``), or None when
            that is unknown (a marker not understood: nothing is deleted);
            called twice.
        candidates: only these object names (an evicted checkpoint's
            chunks); None: every object listed.
        intent_ttl_s: an intent older than this (seconds) is a crashed
            writer's: removed, and protects nothing.
        dry_run: report what would be deleted; write and delete nothing.
        now: the clock (seconds since the epoch), for intent ages.

    Raises:
        TransientBackendError, PermanentBackendError: a listing, read or
            delete failed. What was deleted is unreferenced; the rest goes
            in a later pass.
    """
    steps = collect_steps(store, refs, candidates=candidates, intent_ttl_s=intent_ttl_s,
                          dry_run=dry_run, now=now)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


@dataclass(frozen=True)
class Usage:
    """Bytes of a set of checkpoints.

    Attributes:
        checkpoints: markers counted.
        logical_bytes: bytes of every file of every checkpoint, as loaded.
        chunked_bytes: of those, bytes of files kept as chunks.
        unique_bytes: logical bytes of the distinct chunks they use.
        stored_bytes: stored bytes of those chunks (after the codec).
    """

    checkpoints: int = 0
    logical_bytes: int = 0
    chunked_bytes: int = 0
    unique_bytes: int = 0
    stored_bytes: int = 0

    @property
    def dedup_ratio(self) -> float:
        """``chunked_bytes / unique_bytes`` (1.0 when nothing is chunked)."""
        return self.chunked_bytes / self.unique_bytes if self.unique_bytes else 1.0

    @property
    def compression_ratio(self) -> float:
        """``unique_bytes / stored_bytes`` (1.0 when nothing is chunked)."""
        return self.unique_bytes / self.stored_bytes if self.stored_bytes else 1.0


@dataclass(frozen=True)
class UsageReport:
    """``trials``: name -> :class:`Usage` of its checkpoints; ``total``: the
    experiment (a chunk two trials share counts once here, in each trial there)."""

    trials: dict[str, Usage]
    total: Usage


def _sum(markers: list[MarkerChunks]) -> Usage:
    distinct: dict[str, tuple[int, int]] = {}
    for m in markers:
        distinct.update(m.chunks)
    return Usage(len(markers), sum(m.logical_bytes for m in markers),
                 sum(m.chunked_bytes for m in markers),
                 sum(v[0] for v in distinct.values()), sum(v[1] for v in distinct.values()))


def usage(experiment_dir: str, markers: Iterable[MarkerChunks]) -> UsageReport:
    """Logical against stored bytes per trial, from the markers alone (no
    object is read): ``usage(exp, experiment_markers(fs, exp))``."""
    exp = experiment_dir.rstrip("/") + "/"
    by_trial: dict[str, list[MarkerChunks]] = {}
    every = list(markers)
    for m in every:
        rel = m.path[len(exp):] if m.path.startswith(exp) else posixpath.basename(m.path)
        by_trial.setdefault(rel.split("/", 1)[0], []).append(m)
    return UsageReport({t: _sum(ms) for t, ms in sorted(by_trial.items())}, _sum(every))
