"""Hypothesis state machines that check :class:`CheckpointManager` and its stored
state (:class:`StateLogMachine`: log records, snapshots, chunks) against models.

:class:`RetentionMachine` registers checkpoints with random scores (NaN,
``±inf``, missing, ties), under random ``num_to_keep`` / ``keep_latest`` /
order / attribute, and at random restarts the manager from storage (state
kept, deleted or corrupted; a crash between a commit and its registration),
while deletes randomly fail. After every step it compares the manager and the
storage with :class:`RetentionModel`, a sorted list of every ``(index,
score)`` ever reported. Each step is printed with ``note()`` so a failure
replays as a readable story.

Run it in pytest::

    from hypothesis import settings
    from checkpoint_store.testing.stateful import RetentionMachine

    TestRetention = RetentionMachine.TestCase
    TestRetention.settings = settings(max_examples=1000, deadline=None)

To run it on another storage, subclass and override :meth:`RetentionMachine.make_storage`
and :meth:`RetentionMachine.cleanup_storage` (fault injection then stays off
unless your storage supports it through :attr:`RetentionMachine.fail_deletes`).
"""

from __future__ import annotations

import math
import os
import posixpath
import tempfile
import uuid
import warnings
from typing import Any

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from checkpoint_store._format.layout import (
    MANAGER_STATE,
    checkpoint_dir_name,
    parse_state_log_name,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.retention import CheckpointConfig, CheckpointManager
from checkpoint_store.retention.state import LogRecord, ManagerState, StoredCheckpoint
from checkpoint_store.retention.statelog import StateLog
from checkpoint_store.storage import StorageContext
from checkpoint_store.testing import strategies as cst

__all__ = [
    "MemoryRetentionMachine",
    "RetentionMachine",
    "RetentionModel",
    "StateLogMachine",
    "StateLogModel",
]


class RetentionModel:
    """The reference: every reported ``(index, score)`` in a plain list, the kept
    set recomputed from scratch by sorting. Written from docs/retention.md, not
    from the manager's code.

    Scores are floats or None (NaN or missing). Without a score attribute
    the score is the index.
    """

    def __init__(self, config: CheckpointConfig):
        self.config = config
        self.reported: list[tuple[int, float | None]] = []

    def add(self, index: int, score: float | None) -> None:
        if self.config.checkpoint_score_attribute is None:
            score = float(index)
        self.reported = [r for r in self.reported if r[0] != index] + [(index, score)]

    def _goodness(self, item: tuple[int, float | None]) -> tuple[int, float, int]:
        index, score = item
        if self.config.checkpoint_score_attribute is None:  # recency: order is ignored
            return (1, float(index), index)
        if score is None:
            return (0, 0.0, index)
        return (1, score if self.config.checkpoint_score_order == "max" else -score, index)

    def kept(self) -> list[int]:
        """Indices that must be kept, ascending."""
        cfg = self.config
        if not self.reported:
            return []
        if cfg.num_to_keep is None:
            return sorted(i for i, _ in self.reported)
        keep_missing = cfg.missing_score == "keep" and cfg.checkpoint_score_attribute
        ranked = sorted(
            (r for r in self.reported if not (keep_missing and r[1] is None)),
            key=self._goodness, reverse=True,
        )
        keep = {i for i, _ in ranked[: cfg.num_to_keep]}
        if keep_missing:
            keep |= {i for i, s in self.reported if s is None}
        if cfg.keep_latest:
            keep.add(max(i for i, _ in self.reported))
        return sorted(keep)

    def best(self) -> int | None:
        kept = set(self.kept())
        items = [r for r in self.reported if r[0] in kept]
        return max(items, key=self._goodness)[0] if items else None


_SOURCE: str | None = None


def _source_dir() -> str:
    """One tiny local checkpoint directory, shared (read-only) by every run."""
    global _SOURCE
    if _SOURCE is None or not os.path.isdir(_SOURCE):
        _SOURCE = tempfile.mkdtemp(prefix="cs-retention-src-")
        with open(os.path.join(_SOURCE, "weights.bin"), "wb") as f:
            f.write(b"\x00" * 16)
    return _SOURCE


def _metrics_for(attribute: str | None, score: Any, index: int) -> dict[str, Any]:
    m: dict[str, Any] = {"step": index}
    if attribute is None or score is None:
        return m
    if "/" in attribute:
        head, tail = attribute.split("/", 1)
        m[head] = {tail: score}
    else:
        m[attribute] = score
    return m


def _model_score(score: Any) -> float | None:
    if score is None:
        return None
    value = float(score)
    return None if math.isnan(value) else value


class RetentionMachine(RuleBasedStateMachine):
    """Drives a CheckpointManager and a :class:`RetentionModel` side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_deletes = False
        self.storage: StorageContext | None = None
        self.manager: CheckpointManager | None = None
        self.model: RetentionModel | None = None
        self.next_index = 0

    # -- storage hooks (override to run on other storage) -------------------------------

    def make_storage(self) -> StorageContext:
        """A fresh, empty trial. Default: a local temporary directory (in
        ``/dev/shm`` where it exists, without fsync: the machine checks logic,
        not durability)."""
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        root = tempfile.mkdtemp(prefix="cs-retention-", dir=base)
        return StorageContext(root, "exp", "trial", fsync=False)

    def cleanup_storage(self, storage: StorageContext) -> None:
        _fsutil.delete_dir(storage.filesystem, storage.storage_path)

    def _inject_faults(self, storage: StorageContext) -> None:
        """Make ``storage.delete_checkpoint`` raise while :attr:`fail_deletes`."""
        real = storage.delete_checkpoint

        def delete_checkpoint(dir_name: str) -> None:
            if self.fail_deletes:
                raise OSError(f"injected delete failure for {dir_name}")
            real(dir_name)

        storage.delete_checkpoint = delete_checkpoint  # type: ignore[method-assign]

    # -- rules -----------------------------------------------------------------------------

    @initialize(config=cst.checkpoint_configs())
    def setup(self, config: CheckpointConfig) -> None:
        note(f"config: {config}")
        self.storage = self.make_storage()
        self._inject_faults(self.storage)
        self.model = RetentionModel(config)
        self.manager = self._open(config)

    def _open(self, config: CheckpointConfig) -> CheckpointManager:
        assert self.storage is not None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return CheckpointManager(config, self.storage)

    def _persist(self, score: Any) -> tuple[Checkpoint, dict[str, Any], int]:
        assert self.storage is not None and self.manager is not None and self.model is not None
        index = max(self.next_index, self.manager.next_index)
        metrics = _metrics_for(self.model.config.checkpoint_score_attribute, score, index)
        ckpt = self.storage.persist_checkpoint(
            Checkpoint(_source_dir()), index, {"metrics": metrics, "run_id": self.manager.run_id}
        )
        self.next_index = index + 1
        return ckpt, metrics, index

    @rule(score=cst.scores())
    def report(self, score: Any) -> None:
        assert self.manager is not None and self.model is not None
        ckpt, metrics, index = self._persist(score)
        note(f"report index={index} score={score!r} (deletes failing: {self.fail_deletes})")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            self.manager.register(ckpt, metrics)  # must not raise, even if deletes fail
        self.model.add(index, _model_score(score))

    @rule(drop_state=st.sampled_from(["keep", "delete", "corrupt"]))
    def restart(self, drop_state: str) -> None:
        """A new manager (a new process) on the same storage."""
        assert self.manager is not None and self.storage is not None and self.model is not None
        note(f"restart (state file: {drop_state})")
        self.manager.close()
        state = posixpath.join(self.storage.trial_path, MANAGER_STATE)
        if drop_state == "delete":
            _fsutil.delete_file(self.storage.filesystem, state)
        elif drop_state == "corrupt" and _fsutil.exists(self.storage.filesystem, state):
            with self.storage.filesystem.open_output_stream(state) as f:
                f.write(b'{"format_version": 1, "checkpoints": [')
        self.manager = self._open(self.model.config)

    @rule(score=cst.scores())
    def crash_after_commit(self, score: Any) -> None:
        """The process dies after a checkpoint is committed, before it is registered."""
        assert self.manager is not None and self.model is not None
        _, _, index = self._persist(score)
        note(f"crash after committing index={index} score={score!r}; restart")
        self.manager.close()
        self.model.add(index, _model_score(score))
        self.manager = self._open(self.model.config)

    @rule(fail=st.booleans())
    def set_delete_failures(self, fail: bool) -> None:
        note(f"deletes {'fail' if fail else 'work'} from now on")
        self.fail_deletes = fail

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def kept_matches_model(self) -> None:
        if self.manager is None or self.model is None:
            return
        want = [checkpoint_dir_name(i) for i in self.model.kept()]
        assert self.manager.kept_dir_names == want, (self.manager.kept_dir_names, want)
        best = self.model.best()
        got_best = self.manager.best_checkpoint
        if best is None:
            assert got_best is None
        else:
            assert got_best is not None
            assert posixpath.basename(got_best.path) == checkpoint_dir_name(best)
        latest = self.manager.latest_checkpoint
        if want:
            assert latest is not None and posixpath.basename(latest.path) == want[-1]

    @invariant()
    def storage_matches(self) -> None:
        """Every kept checkpoint is committed on storage; anything else committed
        is an evicted one whose delete failed and is still pending."""
        if self.manager is None or self.storage is None:
            return
        # Injected failures refuse the whole delete, so listing names is enough.
        committed = {name for _, name in self.storage.checkpoint_dirs()}
        kept = set(self.manager.kept_dir_names)
        pending = set(self.manager.pending_deletes)
        assert kept <= committed, ("kept but deleted", kept - committed)
        assert committed <= kept | pending, ("leaked", committed - kept - pending)

    def teardown(self) -> None:
        if self.manager is not None:
            self.manager.close()
        if self.storage is not None:
            self.fail_deletes = False
            self.cleanup_storage(self.storage)


class MemoryRetentionMachine(RetentionMachine):
    """The same machine on ``memory://`` storage (fsspec memory behind pyarrow)."""

    def make_storage(self) -> StorageContext:
        return StorageContext(f"memory://cs-retention-{uuid.uuid4().hex}", "exp", "trial")


class StateLogModel:
    """The reference for :class:`StateLogMachine`: the kept entries, the deletes
    due and the numbering in plain containers, changed as docs/format.md
    ("Retention state") says a record changes them."""

    def __init__(self) -> None:
        self.kept: dict[str, StoredCheckpoint] = {}
        self.pending: list[str] = []
        self.latest: int | None = None
        self.next_index = 0

    def register(self, entry: StoredCheckpoint, evict: list[str]) -> None:
        self.kept.pop(entry.dir_name, None)
        self.kept[entry.dir_name] = entry
        if entry.dir_name in self.pending:
            self.pending.remove(entry.dir_name)
        self.latest = entry.index if self.latest is None else max(self.latest, entry.index)
        self.next_index = max(self.next_index, entry.index + 1)
        for name in evict:
            del self.kept[name]
            self.pending.append(name)

    def deleted(self, names: list[str]) -> None:
        self.pending = [n for n in self.pending if n not in names]

    def state(self) -> ManagerState:
        return ManagerState("run", {}, self.latest, self.next_index, dict(self.kept),
                            tuple(self.pending))

    def copy(self) -> StateLogModel:
        other = StateLogModel()
        other.kept, other.pending = dict(self.kept), list(self.pending)
        other.latest, other.next_index = self.latest, self.next_index
        return other


class StateLogMachine(RuleBasedStateMachine):
    """Drives a :class:`~checkpoint_store.retention.statelog.StateLog` (records,
    snapshots, chunks sealed, merged and retired, with small thresholds) and a
    :class:`StateLogModel` side by side. Writes randomly fail (the change stays
    in memory, as in a manager, and is durable only after the next write that
    succeeds); restarts read the state back; records a snapshot folded in
    reappear (a delete cut short). After every step, what a new reader loads
    must equal the model as of the last write that succeeded.

    Run it in pytest::

        TestStateLog = StateLogMachine.TestCase
        TestStateLog.settings = settings(max_examples=1000, deadline=None)
    """

    def __init__(self) -> None:
        super().__init__()
        self.storage = StorageContext(f"memory://cs-statelog-{uuid.uuid4().hex}", "exp", "trial")
        self.model = StateLogModel()
        self.durable = StateLogModel()
        self.folded: dict[str, bytes] = {}  # record name -> its bytes, once written
        self.params: dict[str, Any] = {}
        self.log: StateLog | None = None
        self.fail_writes = False

    @initialize(compact_every=st.integers(1, 5), chunk_entries=st.integers(1, 4),
                fanout=st.integers(2, 3))
    def setup(self, compact_every: int, chunk_entries: int, fanout: int) -> None:
        self.params = {"compact_every": compact_every, "chunk_entries": chunk_entries,
                       "fanout": fanout}
        note(f"StateLog({self.params})")
        self.log = StateLog(self.storage, **self.params)

    def _wrote(self, ok: bool) -> None:
        if ok:
            self.durable = self.model.copy()
        fs, trial = self.storage.filesystem, self.storage.trial_path
        for fi in _fsutil.list_dir(fs, trial):
            name = posixpath.basename(fi.path)
            if parse_state_log_name(name) is not None and name not in self.folded:
                self.folded[name] = _fsutil.read_bytes(fs, fi.path)

    def _write(self, fn: Any) -> bool:
        if not self.fail_writes:
            return bool(fn())
        real = _fsutil.write_bytes

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise OSError("injected: write refused")

        _fsutil.write_bytes = refuse  # type: ignore[assignment]
        try:
            return bool(fn())
        finally:
            _fsutil.write_bytes = real  # type: ignore[assignment]

    @rule(score=st.one_of(st.none(), st.floats(-10, 10)), evict=st.lists(st.integers(0, 30),
                                                                          max_size=3),
          again=st.booleans())
    def register(self, score: float | None, evict: list[int], again: bool) -> None:
        assert self.log is not None
        names = sorted(self.model.kept)
        if again and names:  # the same directory registered a second time
            index = self.model.kept[names[-1]].index
        else:
            index = self.model.next_index
        entry = StoredCheckpoint(index, checkpoint_dir_name(index), score, {"s": score})
        chosen = sorted({names[i % len(names)] for i in evict} - {entry.dir_name}) if names else []
        note(f"register {entry.dir_name} score={score} evict={chosen} "
             f"(writes {'fail' if self.fail_writes else 'work'})")
        self.model.register(entry, chosen)
        record = LogRecord(0, entry, tuple(chosen), next_index=self.model.next_index)
        self._wrote(self._write(lambda: self.log.append(record, self.model.state)))

    @rule(picks=st.lists(st.integers(0, 30), min_size=1, max_size=3))
    def deleted(self, picks: list[int]) -> None:
        assert self.log is not None
        if not self.model.pending:
            return
        names = sorted({self.model.pending[i % len(self.model.pending)] for i in picks})
        note(f"deleted {names}")
        self.model.deleted(names)
        self._wrote(self._write(lambda: self.log.append(LogRecord(0, deleted=tuple(names)),
                                                         self.model.state)))

    @rule()
    def compact(self) -> None:
        assert self.log is not None
        note("compact")
        self._wrote(self._write(lambda: self.log.compact(self.model.state())))

    @rule(fail=st.booleans())
    def set_write_failures(self, fail: bool) -> None:
        note(f"writes {'fail' if fail else 'work'} from now on")
        self.fail_writes = fail

    @rule()
    def restart(self) -> None:
        """A new writer: it reads the durable state and carries on from there."""
        note("restart")
        self.log = StateLog(self.storage, **self.params)
        state, problem = self.log.load()
        assert state is not None or problem == "missing", problem
        self.model = self.durable.copy()
        self.log.collect_garbage()

    @rule(pick=st.integers(0, 1000))
    def folded_record_reappears(self, pick: int) -> None:
        """A record a snapshot folded in is back (its delete was cut short)."""
        root, _ = StateLog(self.storage)._read_root()
        seq = root["seq"] if root else 0
        old = sorted(n for n in self.folded if (parse_state_log_name(n) or 0) <= seq)
        if not old:
            return
        name = old[pick % len(old)]
        note(f"{name} reappears")
        with self.storage.filesystem.open_output_stream(
                posixpath.join(self.storage.trial_path, name)) as f:
            f.write(self.folded[name])

    @invariant()
    def reader_sees_the_durable_state(self) -> None:
        if self.log is None:
            return
        state, problem = StateLog(self.storage).load()
        want = self.durable
        if state is None:
            assert problem == "missing" and not want.kept and not want.pending, problem
            return
        assert dict(state.checkpoints) == want.kept, (sorted(state.checkpoints), sorted(want.kept))
        assert list(state.pending_deletes) == want.pending
        assert state.latest_index == want.latest
        assert state.next_index == want.next_index

    @invariant()
    def chunks_stay_few(self) -> None:
        """O(fanout * log N) chunks: never more than fanout per level."""
        if self.log is None:
            return
        levels: dict[int, int] = {}
        for c in self.log._chunks:
            levels[c.level] = levels.get(c.level, 0) + 1
        assert all(n <= self.log.fanout for n in levels.values()), levels

    def teardown(self) -> None:
        _fsutil.delete_dir(self.storage.filesystem, self.storage.storage_path)
