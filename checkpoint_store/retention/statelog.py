"""Where a trial's retention state lives: a snapshot root, immutable chunks, a log.

Owns the layout (docs/format.md, "Retention state") and when each part is
written. All in the trial directory, beside the checkpoints, so the one
listing a restart makes of the trial finds every part:

* ``.checkpoint_manager.json``, the root: run id, config, numbering, deletes
  due, the kept entries not yet sealed in a chunk ("open"), the chunk list,
  the names chunks hold that are no longer kept ("dropped"), and ``seq``,
  the last log record folded in.
* ``.cs_state-chunk-<seq>-<part>.json``: kept entries sealed by the snapshot
  ``seq``, never rewritten. Chunks of ``chunk_entries`` entries are merged
  ``fanout`` at a time into one of the next level, so a trial of N kept
  checkpoints has O(fanout * log(N)) chunks and each entry is rewritten
  O(log N) times.
* ``.cs_state-log-<seq>.json``: one record per change after the root
  (:class:`~checkpoint_store.retention.state.LogRecord`).

A report writes one record (a few hundred bytes); every ``compact_every``
records a snapshot instead (the open entries, at most ``chunk_entries``, and
the chunks sealed or merged), after which the records it folded in and the
chunks it replaced are deleted. A reader loads the root, its chunks and the
records after ``seq`` named in the listing: O(log N + compact_every)
requests, whatever the trial's history.

Single writer: only the holder of the trial's lease writes, so records are
numbered without conditional writes. Crash-safe at every step: a snapshot is
written (chunks, then the root, each atomically) before anything it replaces
is deleted; a record already folded in (``seq`` <= the root's) is ignored,
and a part left by a cut-short write is deleted by the next writer.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    MANAGER_STATE,
    STATE_FORMAT_VERSION,
    checkpoint_dir_name,
    parse_state_chunk_name,
    parse_state_log_name,
    state_chunk_name,
    state_log_name,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.errors import CheckpointStoreError
from checkpoint_store.retention.state import (
    LazyEntries,
    LogRecord,
    ManagerState,
    StoredCheckpoint,
    apply,
    check_version,
)
from checkpoint_store.storage import StorageContext

__all__ = ["StateLog", "load_state", "recorded_invalid", "recorded_state", "save_state",
           "state_problem"]

logger = logging.getLogger(__name__)

_CHUNK_KIND = "checkpoint_manager_chunk"

#: Defaults of :class:`StateLog` (records between snapshots, open entries per
#: sealed chunk, chunks merged at a time). Crash sweeps and state machines
#: lower them to reach every step of a compaction in a few reports.
COMPACT_EVERY = 16
CHUNK_ENTRIES = 256
FANOUT = 8


@dataclass(frozen=True)
class _Chunk:
    """A sealed chunk the current root names (``members``: None until read)."""

    name: str
    level: int
    members: frozenset[str] | None
    runs: tuple[tuple[int, int], ...] | None = None  # see _index_runs

    @property
    def names(self) -> frozenset[str]:
        assert self.members is not None, "chunk not read (StateLog._members first)"
        return self.members

    @property
    def last(self) -> int | None:
        """The highest index it holds, when the root says so."""
        if self.runs is None:
            return None
        return self.runs[-1][1] if self.runs else -1


class _Vanished(Exception):
    """A part the listing named is gone: a writer compacted meanwhile (read again)."""


class _Corrupt(Exception):
    """A part the root or the listing names cannot be trusted."""


class StateLog:
    """Reads and writes one trial's retention state (see the module docstring).

    Args:
        storage: the trial's storage; every I/O goes through it.
        root_path: the root's path (default ``<trial>/.checkpoint_manager.json``).
        compact_every: records between two snapshots (a reader reads at most
            this many records after a snapshot that did not fail); default
            :data:`COMPACT_EVERY`.
        chunk_entries: open entries that are sealed into a chunk; default
            :data:`CHUNK_ENTRIES`.
        fanout: chunks of one level merged into one of the next (>= 2);
            default :data:`FANOUT`.

    Not thread-safe: its manager calls it under the session's lock.
    """

    def __init__(self, storage: StorageContext, root_path: str | None = None, *,
                 compact_every: int | None = None, chunk_entries: int | None = None,
                 fanout: int | None = None):
        self._storage = storage
        self.root_path = root_path or posixpath.join(storage.trial_path, MANAGER_STATE)
        self._dir = posixpath.dirname(self.root_path)
        self.compact_every = compact_every or COMPACT_EVERY
        self.chunk_entries = chunk_entries or CHUNK_ENTRIES
        self.fanout = max(2, fanout or FANOUT)
        self._seq = 0  # the last number used (a record, a snapshot, or a failed write)
        self._records: list[int] = []  # records after the root, as far as known
        self._chunks: list[_Chunk] = []
        self._stale: set[str] = set()  # re-registered while a chunk holds an older entry
        self._garbage: set[str] = set()  # names to delete after the next snapshot
        self._dirty = True  # no version-2 root yet, or a write failed: snapshot next
        self._unread: Callable[[], dict[str, StoredCheckpoint]] | None = None  # lazy chunks

    # -- reading ---------------------------------------------------------------------------

    def load(self, names: Collection[str] | None = None, *, lazy: bool = False
             ) -> tuple[ManagerState | None, str]:
        """``(state, problem)``: the stored state, or None with why (``"missing"``,
        ``"unreadable (...)"``, ``"corrupt (...)"``).

        Args:
            names: the file names of the trial directory's listing (listed
                here when None). Records are found there, never probed for.
            lazy: leave the chunks unread when the root says which index each
                of their entries has: the state's ``checkpoints`` is then a
                :class:`~checkpoint_store.retention.state.LazyEntries` that
                reads them on first need (for a reader without the lease, from
                the newer state if a writer compacted them away meanwhile).

        Raises:
            InvalidConfigError: a part has a newer format than this release reads.
        """
        for attempt in range(3):
            if names is None or attempt:
                names = self._list()
            try:
                return self._load(names, lazy)
            except _Vanished:
                continue
            except _Corrupt as exc:
                # The rebuilt state's snapshot replaces every part there is.
                self._chunks, self._records = [], []
                self._garbage = {n for n in names if parse_state_chunk_name(n) is not None
                                 or parse_state_log_name(n) is not None}
                return None, f"corrupt ({exc})"
        return None, "unreadable (rewritten while read three times)"

    def _list(self) -> list[str]:
        return [posixpath.basename(fi.path) for fi in _fsutil.list_dir(
            self._storage.filesystem, self._dir, retry=self._storage.retry)
            if fi.type == pafs.FileType.File]

    def _load(self, names: Collection[str], lazy: bool = False
              ) -> tuple[ManagerState | None, str]:
        records = sorted(s for s in map(parse_state_log_name, names) if s is not None)
        chunk_seqs = {n: parsed[0] for n in names
                      if (parsed := parse_state_chunk_name(n)) is not None}
        chunk_files = set(chunk_seqs)
        self._seq = max([0, *records, *chunk_seqs.values()])
        root, problem = self._read_root()
        if root is None:
            self._garbage = chunk_files | {state_log_name(s) for s in records}
            return None, problem
        state = ManagerState.from_json(root)
        refs = _chunk_refs(root)
        if state is None or refs is None:
            raise _Corrupt("unexpected fields")
        dropped = set(root.get("dropped") or ())
        self._chunks = [_Chunk(name, level, None, runs) for name, level, runs in refs]
        # Lazy only when the listing shows every chunk the root names: a missing
        # one is found now, and the state rebuilt, as with an eager read.
        if lazy and all(c.runs is not None and c.name in chunk_files for c in self._chunks):
            covered = sorted(r for c in self._chunks for r in c.runs or ())
            lazy_entries = LazyEntries(self._lazy_sealed(state.seq, dropped),
                                       state.checkpoints, covered, dropped)
            state = dataclasses.replace(state, checkpoints=lazy_entries)
        else:
            entries = self._read_chunks(state.seq, dropped)
            entries.update(state.checkpoints)  # open entries are newer than any chunk's
            state = dataclasses.replace(state, checkpoints=entries)
        after = [s for s in records if s > state.seq]
        for seq in after:
            state = apply(state, self._read_record(seq, root["seq"]))
        self._seq = max(self._seq, state.seq)
        self._records = after
        self._stale = set()
        self._garbage = ({state_log_name(s) for s in records if s <= root["seq"]}
                         | (chunk_files - {n for n, _, _ in refs}))
        self._dirty = root.get("format_version") != STATE_FORMAT_VERSION
        return state, ""

    def _read_root(self) -> tuple[dict[str, Any] | None, str]:
        fs = self._storage.filesystem
        try:
            obj = self._read_json(self.root_path)
        except FileNotFoundError:
            return None, "missing"
        except OSError as exc:
            if not _fsutil.exists(fs, self.root_path):
                return None, "missing"
            return None, f"unreadable ({exc})"
        if obj is None:
            return None, "corrupt (not a JSON object)"
        obj.setdefault("seq", 0)
        return obj, ""

    def _read_json(self, path: str) -> dict[str, Any] | None:
        """The JSON object in ``path``; None when it is none. Read again while
        it does not parse (:func:`_fsutil.read_control`): the root is
        rewritten in place, and a store may show it torn meanwhile; taken
        for corrupt, the state was rebuilt and its parts deleted.

        Raises:
            FileNotFoundError, OSError: as :func:`_fsutil.read_bytes`.
            InvalidConfigError: a newer format than this release reads.
        """
        try:
            obj = _fsutil.read_control(self._storage.filesystem, path,
                                       retry=self._storage.retry)
        except _fsutil.UnparsableFileError:
            return None
        if not isinstance(obj, dict):
            return None
        check_version(self._storage, path, obj)
        return obj

    def _read_part(self, name: str, root_seq: int) -> dict[str, Any]:
        path = posixpath.join(self._dir, name)
        try:
            obj = self._read_json(path)
        except FileNotFoundError:
            root, _ = self._read_root()
            if root is None or root.get("seq") != root_seq:
                raise _Vanished(name) from None
            raise _Corrupt(f"{name} is missing") from None
        if obj is None:
            raise _Corrupt(f"{name} is not a JSON object")
        return obj

    def _read_chunks(self, root_seq: int, dropped: Collection[str]
                     ) -> dict[str, StoredCheckpoint]:
        """The entries of every chunk the root names but ``dropped``; fills in
        the chunks' members."""
        entries: dict[str, StoredCheckpoint] = {}
        chunks = []
        for c in self._chunks:
            if c.members is None:
                body = self._read_chunk(c.name, root_seq)
                entries.update((e.dir_name, e) for e in body if e.dir_name not in dropped)
                c = dataclasses.replace(c, members=frozenset(e.dir_name for e in body))
            chunks.append(c)
        self._chunks = chunks
        return entries

    def _lazy_sealed(self, root_seq: int, dropped: Collection[str]
                     ) -> Callable[[], dict[str, StoredCheckpoint]]:
        """The loader of a lazy state's sealed entries: reads the chunks once."""
        cache: list[dict[str, StoredCheckpoint]] = []

        def load() -> dict[str, StoredCheckpoint]:
            if not cache:
                try:
                    cache.append(self._read_chunks(root_seq, dropped))
                except _Vanished:
                    # A reader without the lease: the writer compacted since (it
                    # only adds under keep-all), so the newer state holds ours.
                    fresh, problem = StateLog(self._storage, self.root_path).load()
                    if fresh is None:
                        raise CheckpointStoreError(
                            f"retention state of {self._storage.uri(self._dir)} changed "
                            f"while read and is now {problem}") from None
                    cache.append(dict(fresh.checkpoints))
                except _Corrupt as exc:
                    raise CheckpointStoreError(
                        f"retention state of {self._storage.uri(self._dir)} cannot be read "
                        f"({exc}); delete {posixpath.basename(self.root_path)} there to rebuild "
                        "it from the checkpoints") from None
            return dict(cache[0])

        self._unread = load
        return load

    def _members(self) -> None:
        """Read the chunks a lazy load left unread (a snapshot needs their members)."""
        if self._unread is not None and any(c.members is None for c in self._chunks):
            self._unread()

    def _read_chunk(self, name: str, root_seq: int) -> list[StoredCheckpoint]:
        obj = self._read_part(name, root_seq)
        raw = obj.get("checkpoints")
        entries = ([StoredCheckpoint.from_json(c) for c in raw]
                   if obj.get("kind") == _CHUNK_KIND and isinstance(raw, list) else [None])
        if any(e is None for e in entries):
            raise _Corrupt(f"{name} has unexpected fields")
        return [e for e in entries if e is not None]

    def _read_record(self, seq: int, root_seq: int) -> LogRecord:
        name = state_log_name(seq)
        record = LogRecord.from_json(self._read_part(name, root_seq))
        if record is None or record.seq != seq:
            raise _Corrupt(f"{name} has unexpected fields")
        return record

    # -- writing ---------------------------------------------------------------------------

    def append(self, record: LogRecord, state: Callable[[], ManagerState]) -> bool:
        """Store one change: a record, or every ``compact_every`` records (and
        after a failed write) a snapshot of ``state()``, the state after it.

        Returns:
            False (logged) when storage refused the write: the change is not
            durable, nothing it evicted may be deleted yet, and the next write
            is a snapshot.
        """
        self._seq += 1
        if record.register is not None and any(
                c.last is None or record.register.index <= c.last for c in self._chunks):
            self._members()
        if record.register is not None and any(record.register.dir_name in (c.members or ())
                                               for c in self._chunks):
            self._stale.add(record.register.dir_name)
        if self._dirty or len(self._records) + 1 >= self.compact_every:
            return self._snapshot(state(), self._seq)
        record = dataclasses.replace(record, seq=self._seq)
        name = state_log_name(self._seq)
        if not self._write(name, record.to_json()):
            return False
        self._records.append(self._seq)
        return True

    @property
    def records(self) -> int:
        """Log records written after the current root (0 right after a snapshot)."""
        return len(self._records)

    def compact(self, state: ManagerState) -> bool:
        """Write ``state`` as a new snapshot now; False (logged) when storage refused it."""
        self._seq += 1
        return self._snapshot(state, self._seq)

    def collect_garbage(self) -> None:
        """Delete parts that no root needs any more: records a snapshot folded in,
        chunks it replaced, parts of a snapshot cut short. Failures are retried
        after the next snapshot."""
        fs = self._storage.filesystem
        for name in sorted(self._garbage):
            try:
                _fsutil.delete_file(fs, posixpath.join(self._dir, name), retry=self._storage.retry)
                self._garbage.discard(name)
            except Exception as exc:  # retried after the next snapshot
                logger.debug("could not delete %s: %s", name, exc)

    def _snapshot(self, state: ManagerState, seq: int) -> bool:
        self._members()
        kept = state.checkpoints
        live, retired = self._live_chunks(kept)
        sealed = set().union(*(c.names for c in live)) - self._stale
        open_ = sorted((e for n, e in kept.items() if n not in sealed), key=lambda e: e.index)
        new: dict[str, list[StoredCheckpoint]] = {}
        if len(open_) > self.chunk_entries:
            # The newest entry stays open: a restart finds the checkpoint it
            # resumes from in the root, without reading a chunk.
            live, retired = self._seal(open_[:-1], live, retired, new, kept, seq)
            open_ = open_[-1:]
        for name, entries in new.items():
            body = {"kind": _CHUNK_KIND, "format_version": STATE_FORMAT_VERSION, "seq": seq,
                    "checkpoints": [e.to_json() for e in entries]}
            if not self._write(name, body):
                self._garbage |= set(new)
                return False
        members = set().union(*(c.names for c in live))
        root = dataclasses.replace(state, seq=seq).to_json()
        root["checkpoints"] = [e.to_json() for e in open_]
        root["chunks"] = [{"name": c.name, "level": c.level, "count": len(c.names),
                           **({"runs": [list(r) for r in c.runs]} if c.runs is not None else {})}
                          for c in live]
        root["dropped"] = sorted(members - kept.keys())
        if not self._write(posixpath.basename(self.root_path), root, root=True):
            self._garbage |= set(new)
            return False
        self._garbage |= {c.name for c in retired} | {state_log_name(s) for s in self._records}
        self._records = []
        self._chunks = live
        self._stale &= members
        self._dirty = False
        self.collect_garbage()
        return True

    def _live_chunks(self, kept: Mapping[str, StoredCheckpoint]
                     ) -> tuple[list[_Chunk], list[_Chunk]]:
        """The chunks to keep naming, and those to retire: a chunk of which less
        than half is still kept gives its entries back to the open set (paid for
        by the dropped half: each entry is rewritten O(1) times by this)."""
        live: list[_Chunk] = []
        retired: list[_Chunk] = []
        for c in self._chunks:
            alive = len((c.names & kept.keys()) - self._stale)
            (live if 2 * alive >= len(c.names) else retired).append(c)
        return live, retired

    def _seal(self, open_: list[StoredCheckpoint], live: list[_Chunk], retired: list[_Chunk],
              new: dict[str, list[StoredCheckpoint]], kept: Mapping[str, StoredCheckpoint],
              seq: int) -> tuple[list[_Chunk], list[_Chunk]]:
        """Seal ``open_`` into a level-0 chunk, then merge ``fanout`` chunks of one
        level into one of the next while there are that many."""
        live, retired = list(live), list(retired)

        def add(entries: list[StoredCheckpoint], level: int) -> None:
            name = state_chunk_name(seq, len(new))
            new[name] = entries
            live.append(_Chunk(name, level, frozenset(e.dir_name for e in entries),
                               _index_runs(entries)))

        add(open_, 0)
        while True:
            level = live[-1].level
            same = [c for c in live if c.level == level]
            if len(same) < self.fanout:
                return live, retired
            names = set().union(*(c.names for c in same)) & kept.keys()
            for c in same:
                live.remove(c)
                if new.pop(c.name, None) is None:
                    retired.append(c)
            add(sorted((kept[n] for n in names), key=lambda e: e.index), level + 1)

    def _write(self, name: str, body: dict[str, Any], *, root: bool = False) -> bool:
        storage = self._storage
        try:
            if root:
                storage.ensure_trial_dir()
            _fsutil.write_bytes(storage.filesystem, posixpath.join(self._dir, name),
                                _json.dumps(body), storage.backend.capabilities,
                                fsync=storage.fsync)
            return True
        except Exception as exc:
            self._dirty = True
            logger.warning(
                "could not write retention state %s (deletes postponed, retried at the next "
                "report): %s", storage.uri(posixpath.join(self._dir, name)), exc,
            )
            return False


def _index_runs(entries: list[StoredCheckpoint]) -> tuple[tuple[int, int], ...] | None:
    """Inclusive ``(first, last)`` runs of the indexes of ``entries`` (sorted by
    index), or None when an entry is not named ``checkpoint_<index>``: what
    lets a lazy load place a name in a chunk without reading it."""
    runs: list[list[int]] = []
    for e in entries:
        if e.dir_name != checkpoint_dir_name(e.index):
            return None
        if runs and e.index == runs[-1][1] + 1:
            runs[-1][1] = e.index
        elif not runs or e.index > runs[-1][1]:
            runs.append([e.index, e.index])
        else:
            return None
    return tuple((a, b) for a, b in runs)


def _parse_runs(value: Any) -> tuple[tuple[int, int], ...] | None:
    if not isinstance(value, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(type(i) is int for i in r)
            and r[0] <= r[1] for r in value):
        return None
    runs = tuple((r[0], r[1]) for r in value)
    return runs if all(a[1] < b[0] for a, b in zip(runs, runs[1:], strict=False)) else None


_Runs = tuple[tuple[int, int], ...]


def _chunk_refs(root: Mapping[str, Any]) -> list[tuple[str, int, _Runs | None]] | None:
    """``(name, level, runs)`` of each chunk the root names (runs: None when
    the root does not say), or None when malformed."""
    chunks = root.get("chunks", [])
    dropped = root.get("dropped", [])
    if not isinstance(chunks, list) or not isinstance(dropped, list):
        return None
    refs = []
    for c in chunks:
        if not (isinstance(c, dict) and isinstance(c.get("name"), str)
                and parse_state_chunk_name(c["name"]) is not None
                and isinstance(c.get("level"), int)):
            return None
        refs.append((c["name"], c["level"], _parse_runs(c.get("runs"))))
    return refs


def load_state(storage: StorageContext, path: str | None = None
               ) -> tuple[ManagerState | None, str]:
    """``(state, problem)``: the trial's retention state (snapshot and log), or
    None with why (``"missing"``, ``"unreadable (...)"``, ``"corrupt (...)"``;
    problem is ``""`` with a state). ``path`` is the root's (default
    ``<trial>/.checkpoint_manager.json``).

    Raises:
        InvalidConfigError: a stored object has a newer format than this release reads.
    """
    return StateLog(storage, path).load()


def recorded_invalid(storage: StorageContext) -> dict[str, str]:
    """``dir_name -> why`` of the checkpoints the trial's retention state
    records as damaged (:attr:`ManagerState.invalid`); {} without a usable
    state. Reads the root and the log records after it, never a chunk."""
    return recorded_state(storage)[0]


def recorded_state(storage: StorageContext) -> tuple[dict[str, str], str | None]:
    """``(recorded invalid, problem)``: :func:`recorded_invalid`, and why a
    state that is there cannot be used (None when it reads, or is not there),
    from one read of the root and the log records after it."""
    from checkpoint_store.errors import CheckpointStoreError
    try:
        state, problem = StateLog(storage).load(lazy=True)
    except (CheckpointStoreError, OSError) as exc:
        return {}, str(exc)
    if state is None:
        return {}, None if problem == "missing" else problem
    return dict(state.invalid), None


def state_problem(storage: StorageContext, *, lazy: bool = False) -> str | None:
    """Why the trial's retention state cannot be used (``"corrupt (...)"``,
    ``"unreadable (...)"``, or a newer format's refusal), or None when it reads
    whole or is not there (a trial written without a manager). Reads the
    root, its chunks and the records after it, as a restart does; ``lazy``
    leaves the chunks the root places unread (a damaged one is not seen)."""
    from checkpoint_store.errors import CheckpointStoreError
    try:
        state, problem = StateLog(storage).load(lazy=lazy)
    except CheckpointStoreError as exc:
        return str(exc)
    return None if state is not None or problem == "missing" else problem


def save_state(storage: StorageContext, path: str, state: ManagerState) -> bool:
    """Write ``state`` as a snapshot root at ``path`` (every entry inline, no log)
    atomically; False (logged) when storage refused it."""
    return StateLog(storage, path).compact(state)
