"""The retention state of one trial as values: what a manager decided, and the
log records that change it.

Owns :class:`ManagerState` (the kept checkpoints, the deletes still due, the
numbering; what a new process needs to take over), :class:`LogRecord` (one
report's change to it) and :func:`apply`, the pure fold of a record into a
state, plus the JSON forms and the checks a stored object must pass to be
trusted (anything else is rebuilt from the checkpoints' internal metadata by
the manager). Where these live on storage, and when a snapshot is written,
is :mod:`~checkpoint_store.retention.statelog`.

Version-1 files (one ``.checkpoint_manager.json`` rewritten at every report)
read back; an object of a newer format is refused.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from checkpoint_store._format.layout import (
    STATE_FORMAT_VERSION,
    STATE_KIND,
    checkpoint_dir_name,
    name_disagreement,
    newer_format_version,
    validate_component,
)
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.storage import StorageContext

__all__ = [
    "LazyEntries",
    "LogRecord",
    "ManagerState",
    "StoredCheckpoint",
    "apply",
    "check_version",
]

logger = logging.getLogger(__name__)

LOG_KIND = "checkpoint_manager_log"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _names_its_checkpoint(index: Any, dir_name: Any) -> bool:
    """Whether an entry's ``dir_name`` can be the checkpoint of ``index``: one
    path component and, for a ``checkpoint_NNNNNN`` name, that very index
    (the directory name is a checkpoint's identity)."""
    if not (_is_int(index) and index >= 0 and isinstance(dir_name, str)):
        return False
    try:
        validate_component(dir_name, "dir_name")
    except InvalidConfigError:
        return False
    return name_disagreement(dir_name, index) is None


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a JSON number, else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


@dataclass(frozen=True)
class StoredCheckpoint:
    """One kept checkpoint as the state records it.

    Attributes:
        index: its checkpoint index.
        dir_name: its directory name inside the trial.
        score: its score under the config (None: NaN or missing).
        metrics: the metrics reported with it (what policies read).
        created_at: its ``created_at`` (seconds since the epoch), if known.
    """

    index: int
    dir_name: str
    score: float | None
    metrics: Mapping[str, Any]
    created_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"index": self.index, "dir_name": self.dir_name, "score": self.score,
               "metrics": dict(self.metrics)}
        if self.created_at is not None:
            out["created_at"] = self.created_at
        return out

    @classmethod
    def from_json(cls, obj: Any) -> StoredCheckpoint | None:
        """The entry of a parsed object, or None when it is not what a manager writes."""
        if not (isinstance(obj, dict) and _names_its_checkpoint(obj.get("index"),
                                                                obj.get("dir_name"))):
            return None
        score, metrics, created = obj.get("score"), obj.get("metrics"), obj.get("created_at")
        return cls(
            obj["index"], obj["dir_name"],
            _number(score),
            metrics if isinstance(metrics, Mapping) else {},
            _number(created),
        )


@dataclass(frozen=True)
class ManagerState:
    """What one trial's manager has decided, as stored.

    Attributes:
        run_id: the run whose checkpoints this manager may delete.
        config: the retention config as stored (:meth:`CheckpointConfig.to_json`).
        latest_index: the highest index registered, kept or not (None before any).
        next_index: the next checkpoint index to use (None: not recorded).
        checkpoints: the kept checkpoints, by directory name.
        pending_deletes: evicted directory names whose delete is still due.
        seq: the last log record folded into this state (0: none; version-1 files).
        invalid: ``dir_name -> why`` of the committed checkpoints a read found
            damaged (a file missing, added, or not matching its size or CRC32C):
            never ranked, resumed from or deleted.
    """

    run_id: str
    config: Mapping[str, Any] | None = None
    latest_index: int | None = None
    next_index: int | None = None
    checkpoints: Mapping[str, StoredCheckpoint] = field(default_factory=dict)
    pending_deletes: tuple[str, ...] = ()
    seq: int = 0
    invalid: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The snapshot root's fields, every kept checkpoint inline (a root
        written with chunks replaces ``checkpoints`` by the open ones)."""
        return {
            "kind": STATE_KIND,
            "format_version": STATE_FORMAT_VERSION,
            "run_id": self.run_id,
            "config": dict(self.config or {}),
            "latest_index": self.latest_index,
            "next_index": self.next_index,
            "checkpoints": [c.to_json() for c in self.checkpoints.values()],
            "pending_deletes": list(self.pending_deletes),
            "seq": self.seq,
            "invalid": dict(self.invalid),
        }

    @classmethod
    def from_json(cls, state: Mapping[str, Any]) -> ManagerState | None:
        """The state of a parsed root (its inline checkpoints only), or None when
        its fields are not what a manager writes (the caller rebuilds from the
        checkpoints then). Reads format versions 1 and 2."""
        if not _well_formed(state):
            return None
        entries = [StoredCheckpoint.from_json(c) for c in state["checkpoints"]]
        latest, following, seq = (state.get("latest_index"), state.get("next_index"),
                                  state.get("seq", 0))
        config = state.get("config")
        return cls(
            run_id=state["run_id"],
            config=config if isinstance(config, Mapping) else None,
            latest_index=latest if _is_int(latest) else None,
            next_index=following if _is_int(following) else None,
            checkpoints={e.dir_name: e for e in entries if e is not None},
            pending_deletes=tuple(state.get("pending_deletes", [])),
            seq=seq if _is_int(seq) and seq >= 0 else 0,
            invalid=_invalid_of(state.get("invalid")),
        )


def _invalid_of(value: Any) -> dict[str, str]:
    """The ``invalid`` map of a parsed object; {} when it is absent (files
    written before it existed) or not a map of names to reasons."""
    if not isinstance(value, Mapping):
        return {}
    return {n: r for n, r in value.items() if isinstance(n, str) and isinstance(r, str)}


class _Named(Protocol):
    @property
    def index(self) -> int: ...

    @property
    def dir_name(self) -> str: ...


V = TypeVar("V", bound=_Named)
W = TypeVar("W", bound=_Named)


class LazyEntries(Mapping[str, V]):
    """Kept entries whose sealed part (the snapshot's chunks) is read on first need.

    A restart of a keep-all trial (every checkpoint kept: tens of thousands of
    entries) answers its start from what it holds without the chunks: the open
    entries and the log records after the snapshot (``overlay``), and which
    indexes each chunk covers (``covered``, from the root). Anything that needs
    the whole set (iterating, ``len``, a name the root cannot place) reads the
    chunks once through ``load``, then answers from memory.

    Args:
        load: reads the sealed entries (chunks, minus the root's ``dropped``).
        overlay: entries newer than any chunk's, applied over the sealed ones.
        covered: inclusive, sorted, disjoint ``(first, last)`` runs of the
            indexes of the sealed entries, each named ``checkpoint_<index>``.
        removed: names the chunks hold that are not kept (the root's ``dropped``).
    """

    def __init__(self, load: Callable[[], dict[str, V]],
                 overlay: Mapping[str, V],
                 covered: Sequence[tuple[int, int]], removed: Iterable[str] = ()):
        self._load = load
        self._overlay = dict(overlay)
        self._removed = set(removed)
        self._covered = list(covered)
        self._starts = [lo for lo, _ in self._covered]
        self._full: dict[str, V] | None = None

    @property
    def loaded(self) -> bool:
        """True once the chunks were read."""
        return self._full is not None

    def _all(self) -> dict[str, V]:
        if self._full is None:
            full = {n: e for n, e in self._load().items() if n not in self._removed}
            for n, e in self._overlay.items():
                full.pop(n, None)
                full[n] = e
            self._full = full
        return self._full

    def map(self, fn: Callable[[V], W], keep: Callable[[str], bool]) -> LazyEntries[W]:
        """A lazy mapping of ``fn(entry)`` for the entries whose name ``keep``
        accepts (the chunks still read once, on first need)."""
        return LazyEntries(lambda: {n: fn(e) for n, e in self._all().items() if keep(n)},
                           {n: fn(e) for n, e in self._overlay.items() if keep(n)},
                           self._covered, self._removed)

    def pop(self, name: str, default: Any = None) -> Any:
        """Remove ``name``; its entry, else ``default``."""
        value = self.get(name, default) if self._full is not None or name in self._overlay \
            else default
        self.discard(name)
        return value

    def __setitem__(self, name: str, entry: Any) -> None:
        self.put(entry)

    def copy(self) -> LazyEntries[V]:
        """An independent copy, sharing the (read-once) chunks."""
        out = LazyEntries(self._load, self._overlay, self._covered, self._removed)
        out._full = dict(self._full) if self._full is not None else None
        return out

    def put(self, entry: V) -> None:
        """Add or replace ``entry`` (by directory name), newest last."""
        if self._full is not None:
            self._full.pop(entry.dir_name, None)
            self._full[entry.dir_name] = entry
        self._overlay.pop(entry.dir_name, None)
        self._overlay[entry.dir_name] = entry

    def discard(self, name: str) -> None:
        """Remove ``name`` if kept."""
        if self._full is not None:
            self._full.pop(name, None)
        self._overlay.pop(name, None)
        self._removed.add(name)

    def recent(self) -> list[str]:
        """Names of the entries held besides the chunks (open ones, logged ones)."""
        return list(self._overlay)

    def knows(self, name: str, index: int) -> bool | None:
        """Whether ``name`` (of ``index``) is kept, or None when only the chunks can tell."""
        if self._full is not None:
            return name in self._full
        if name in self._overlay:
            return True
        if name in self._removed:
            return False
        i = bisect.bisect_right(self._starts, index) - 1
        if i >= 0 and index <= self._covered[i][1] and name == checkpoint_dir_name(index):
            return True
        return None

    def not_kept(self, dirs: Mapping[str, int], skip: Collection[str]) -> list[str] | None:
        """The names of ``dirs`` (``name -> index``) but ``skip`` that are not
        kept, or None when only the chunks can tell (one pass, no chunk read)."""
        if self._full is not None:
            return [n for n in dirs if n not in skip and n not in self._full]
        covered: set[int] = set()
        for lo, hi in self._covered:
            covered.update(range(lo, hi + 1))
        out = []
        overlay, removed = self._overlay, self._removed
        for n, i in dirs.items():
            if n in overlay or n in skip:
                continue
            if n in removed or i not in covered:
                out.append(n)
            elif len(n) != 17 and n[11] == "0":  # checkpoint_0000042: not the name of 42
                return None
        return out

    @property
    def sealed_max(self) -> int:
        """The highest index a chunk holds (-1: none)."""
        return self._covered[-1][1] if self._covered else -1

    def newest(self) -> V | None:
        """The kept entry of highest index, read from the chunks only when no
        newer one was logged after them."""
        if self._full is None:
            top = max(self._overlay.values(), key=lambda e: e.index, default=None)
            if top is not None and top.index > self.sealed_max:
                return top
        return max(self._all().values(), key=lambda e: e.index, default=None)

    def __getitem__(self, name: str) -> V:
        if self._full is None and name in self._overlay:
            return self._overlay[name]
        return self._all()[name]

    def __contains__(self, name: object) -> bool:
        if self._full is None and name in self._overlay:
            return True
        return name in self._all()

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


def _well_formed(state: Mapping[str, Any]) -> bool:
    return bool(
        state.get("kind") == STATE_KIND
        and state.get("format_version") in (1, STATE_FORMAT_VERSION)
        and isinstance(state.get("run_id"), str) and state["run_id"]
        and isinstance(state.get("checkpoints"), list)
        and all(StoredCheckpoint.from_json(c) is not None for c in state["checkpoints"])
        and isinstance(state.get("pending_deletes", []), list)
        and all(isinstance(n, str) for n in state.get("pending_deletes", []))
    )


@dataclass(frozen=True)
class LogRecord:
    """One change to the state: a registration with what it evicted, or deletes
    that are done. Applied in ``seq`` order by :func:`apply`.

    Attributes:
        seq: its sequence number (1, 2, ...; the trial's single writer, the
            lease holder, numbers them).
        register: the checkpoint registered, if any.
        evict: directory names evicted (their deletes become due).
        deleted: directory names whose delete is done.
        next_index: the next checkpoint index after this change, if known.
        invalid: ``(dir_name, why)`` of checkpoints found damaged by a read:
            they leave the kept set for :attr:`ManagerState.invalid`.
    """

    seq: int
    register: StoredCheckpoint | None = None
    evict: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    next_index: int | None = None
    invalid: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": LOG_KIND, "format_version":
                               STATE_FORMAT_VERSION, "seq": self.seq}
        if self.register is not None:
            out["register"] = self.register.to_json()
        if self.evict:
            out["evict"] = list(self.evict)
        if self.deleted:
            out["deleted"] = list(self.deleted)
        if self.next_index is not None:
            out["next_index"] = self.next_index
        if self.invalid:
            out["invalid"] = dict(self.invalid)
        return out

    @classmethod
    def from_json(cls, obj: Any) -> LogRecord | None:
        """The record of a parsed object, or None when it is not what a manager writes."""
        if not (isinstance(obj, dict) and obj.get("kind") == LOG_KIND
                and obj.get("format_version") == STATE_FORMAT_VERSION
                and _is_int(obj.get("seq"))):
            return None
        register = None
        if "register" in obj:
            register = StoredCheckpoint.from_json(obj["register"])
            if register is None:
                return None
        evict, deleted = obj.get("evict", []), obj.get("deleted", [])
        following = obj.get("next_index")
        if not (isinstance(evict, list) and isinstance(deleted, list)
                and all(isinstance(n, str) for n in evict + deleted)):
            return None
        return cls(obj["seq"], register, tuple(evict), tuple(deleted),
                   following if _is_int(following) else None,
                   tuple(_invalid_of(obj.get("invalid")).items()))


def apply(state: ManagerState, record: LogRecord) -> ManagerState:
    """``state`` with ``record`` folded in; ``state`` itself when the record is
    already in it (``record.seq <= state.seq``: a record the snapshot folded in
    and whose delete was cut short)."""
    if record.seq <= state.seq:
        return state
    kept: dict[str, StoredCheckpoint] | LazyEntries[StoredCheckpoint] = (
        state.checkpoints.copy() if isinstance(state.checkpoints, LazyEntries)
        else dict(state.checkpoints))
    pending = list(state.pending_deletes)
    latest = state.latest_index
    if record.register is not None:
        entry = record.register
        if isinstance(kept, LazyEntries):
            kept.put(entry)
        else:
            kept.pop(entry.dir_name, None)
            kept[entry.dir_name] = entry
        if entry.dir_name in pending:
            pending.remove(entry.dir_name)
        latest = entry.index if latest is None else max(latest, entry.index)
    for name in record.evict:
        if isinstance(kept, LazyEntries):
            kept.discard(name)
        else:
            kept.pop(name, None)
        if name not in pending:
            pending.append(name)
    done = set(record.deleted)
    pending = [n for n in pending if n not in done]
    invalid = dict(state.invalid)
    for name, why in record.invalid:
        if isinstance(kept, LazyEntries):
            kept.discard(name)
        else:
            kept.pop(name, None)
        invalid[name] = why
    following = state.next_index
    if record.next_index is not None:
        following = (record.next_index if following is None
                     else max(following, record.next_index))
    return dataclasses.replace(state, checkpoints=kept, pending_deletes=tuple(pending),
                               latest_index=latest, next_index=following, seq=record.seq,
                               invalid=invalid)


def check_version(storage: StorageContext, path: str, obj: Mapping[str, Any]) -> None:
    """Refuse an object of a newer format than this release reads.

    Raises:
        InvalidConfigError: its ``format_version`` is newer; upgrade checkpoint-store.
    """
    version = newer_format_version(obj, STATE_FORMAT_VERSION)
    if version is not None:
        raise InvalidConfigError(
            f"{storage.uri(path)} has format version {version}, newer "
            f"than this checkpoint-store reads ({STATE_FORMAT_VERSION}); upgrade checkpoint-store"
        )






