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

from checkpoint_store import _fsutil, _json
from checkpoint_store._layout import (
    MANAGER_STATE,
    STATE_FORMAT_VERSION,
    parse_state_chunk_name,
    parse_state_log_name,
    state_chunk_name,
    state_log_name,
)
from checkpoint_store.retention.state import (
    LogRecord,
    ManagerState,
    StoredCheckpoint,
    apply,
    check_version,
)
from checkpoint_store.storage import StorageContext

__all__ = ["StateLog"]

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
    """A sealed chunk the current root names."""

    name: str
    level: int
    members: frozenset[str]


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

    # -- reading ---------------------------------------------------------------------------

    def load(self, names: Collection[str] | None = None) -> tuple[ManagerState | None, str]:
        """``(state, problem)``: the stored state, or None with why (``"missing"``,
        ``"unreadable (...)"``, ``"corrupt (...)"``).

        Args:
            names: the file names of the trial directory's listing (listed
                here when None). Records are found there, never probed for.

        Raises:
            InvalidConfigError: a part has a newer format than this release reads.
        """
        for attempt in range(3):
            if names is None or attempt:
                names = self._list()
            try:
                return self._load(names)
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

    def _load(self, names: Collection[str]) -> tuple[ManagerState | None, str]:
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
        entries: dict[str, StoredCheckpoint] = {}
        self._chunks = []
        for name, level in refs:
            chunk = self._read_chunk(name, state.seq)
            entries.update((e.dir_name, e) for e in chunk if e.dir_name not in dropped)
            self._chunks.append(_Chunk(name, level, frozenset(e.dir_name for e in chunk)))
        entries.update(state.checkpoints)  # open entries are newer than any chunk's
        state = dataclasses.replace(state, checkpoints=entries)
        after = [s for s in records if s > state.seq]
        for seq in after:
            state = apply(state, self._read_record(seq, root["seq"]))
        self._seq = max(self._seq, state.seq)
        self._records = after
        self._stale = set()
        self._garbage = ({state_log_name(s) for s in records if s <= root["seq"]}
                         | (chunk_files - {n for n, _ in refs}))
        self._dirty = root.get("format_version") != STATE_FORMAT_VERSION
        return state, ""

    def _read_root(self) -> tuple[dict[str, Any] | None, str]:
        fs = self._storage.filesystem
        try:
            raw = _fsutil.read_bytes(fs, self.root_path, retry=self._storage.retry)
        except FileNotFoundError:
            return None, "missing"
        except OSError as exc:
            if not _fsutil.exists(fs, self.root_path):
                return None, "missing"
            return None, f"unreadable ({exc})"
        obj = self._parse(raw, self.root_path)
        if obj is None:
            return None, "corrupt (not a JSON object)"
        obj.setdefault("seq", 0)
        return obj, ""

    def _parse(self, raw: bytes, path: str) -> dict[str, Any] | None:
        try:
            obj = _json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(obj, dict):
            return None
        check_version(self._storage, path, obj)
        return obj

    def _read_part(self, name: str, root_seq: int) -> dict[str, Any]:
        path = posixpath.join(self._dir, name)
        try:
            raw = _fsutil.read_bytes(self._storage.filesystem, path, retry=self._storage.retry)
        except FileNotFoundError:
            root, _ = self._read_root()
            if root is None or root.get("seq") != root_seq:
                raise _Vanished(name) from None
            raise _Corrupt(f"{name} is missing") from None
        obj = self._parse(raw, path)
        if obj is None:
            raise _Corrupt(f"{name} is not a JSON object")
        return obj

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
        if record.register is not None and any(record.register.dir_name in c.members
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
        kept = state.checkpoints
        live, retired = self._live_chunks(kept)
        sealed = set().union(*(c.members for c in live)) - self._stale
        open_ = sorted((e for n, e in kept.items() if n not in sealed), key=lambda e: e.index)
        new: dict[str, list[StoredCheckpoint]] = {}
        if len(open_) >= self.chunk_entries:
            live, retired = self._seal(open_, live, retired, new, kept, seq)
            open_ = []
        for name, entries in new.items():
            body = {"kind": _CHUNK_KIND, "format_version": STATE_FORMAT_VERSION, "seq": seq,
                    "checkpoints": [e.to_json() for e in entries]}
            if not self._write(name, body):
                self._garbage |= set(new)
                return False
        members = set().union(*(c.members for c in live))
        root = dataclasses.replace(state, seq=seq).to_json()
        root["checkpoints"] = [e.to_json() for e in open_]
        root["chunks"] = [{"name": c.name, "level": c.level, "count": len(c.members)}
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
            alive = len((c.members & kept.keys()) - self._stale)
            (live if 2 * alive >= len(c.members) else retired).append(c)
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
            live.append(_Chunk(name, level, frozenset(e.dir_name for e in entries)))

        add(open_, 0)
        while True:
            level = live[-1].level
            same = [c for c in live if c.level == level]
            if len(same) < self.fanout:
                return live, retired
            names = set().union(*(c.members for c in same)) & kept.keys()
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


def _chunk_refs(root: Mapping[str, Any]) -> list[tuple[str, int]] | None:
    """``(name, level)`` of each chunk the root names, or None when malformed."""
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
        refs.append((c["name"], c["level"]))
    return refs
