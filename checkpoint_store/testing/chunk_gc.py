"""A hypothesis state machine for chunk gc on any filesystem (docs/format.md, "Chunks").

:class:`ChunkGcMachine` runs writers, evictions, forks and gc passes of one
experiment's chunk store side by side, each advancing one protocol step per
rule, and abandons any of them at any step (a crash). Writers: intent,
condemned read, existence check, one upload per step, commit (a marker with
chunk entries in a checkpoint dir of a trial), finish. Gc passes: the phases
of :func:`~checkpoint_store._chunks.gc.collect_steps`. A clock (the ``now``
of writers and gc) moves on in small ticks.

Invariants: after every step, every committed checkpoint's objects exist
and decode to their chunk's bytes. At teardown, once every writer finished
or its intent expired (the clock moved past the TTL) and a final gc ran,
the store holds exactly the objects the committed checkpoints reference,
and no intent or condemned file.

Run it in pytest (local disk by default)::

    from hypothesis import settings
    from checkpoint_store.testing.chunk_gc import ChunkGcMachine

    TestChunkGc = ChunkGcMachine.TestCase
    TestChunkGc.settings = settings(max_examples=50, deadline=None)

On your storage, subclass and override :meth:`ChunkGcMachine.make_filesystem`
(return the filesystem and an empty base path on it) and
:meth:`ChunkGcMachine.cleanup_filesystem`.
"""

from __future__ import annotations

import json
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from checkpoint_store._chunks.codec import chunk_name, decode_chunk, encode_chunk
from checkpoint_store._chunks.gc import (
    CONDEMNED_TTL_S,
    INTENT_TTL_S,
    GcReport,
    collect,
    collect_steps,
)
from checkpoint_store._chunks.refs import experiment_refs
from checkpoint_store._chunks.store import (
    CONDEMNED_DIR,
    INTENTS_DIR,
    ChunkStore,
    ChunkWrite,
    base_name,
)
from checkpoint_store._format.layout import (
    CHUNK_DIR,
    CHUNK_ROOT,
    INTERNAL_METADATA,
    checkpoint_dir_name,
)
from checkpoint_store._util import fs as _fsutil

__all__ = ["ChunkGcMachine", "MemoryChunkGcMachine"]

POOL = 5
"""Distinct chunk contents the writers draw from (small: they share often)."""
TICK_S = 300.0
MAX_WRITERS = 3
"""Writers in flight at once (more would rarely reach their commit)."""
MAX_GCS = 2


def _data(i: int) -> bytes:
    return f"chunk {i} ".encode() * (1 + i)


@dataclass
class _Writer:
    write: ChunkWrite
    steps: Generator[str, None, None]
    trial: str
    stage: str = "new"
    todo: list[str] = field(default_factory=list)


class ChunkGcMachine(RuleBasedStateMachine):
    """Writers, evictions, forks, gc passes and crashes over one chunk store."""

    def make_filesystem(self) -> tuple[pafs.FileSystem, str]:
        """The filesystem under test and an empty base path on it (default: a
        temporary local directory)."""
        return pafs.LocalFileSystem(), tempfile.mkdtemp(prefix="cs-chunk-gc-")

    def cleanup_filesystem(self, filesystem: pafs.FileSystem, base: str) -> None:
        """Remove what :meth:`make_filesystem` made."""
        local = _fsutil.local_path(filesystem, base)
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)
        else:
            _fsutil.delete_dir(filesystem, base)

    def __init__(self) -> None:
        super().__init__()
        self.fs, self.base = self.make_filesystem()
        self.exp = f"{self.base.rstrip('/')}/exp"
        self.store = ChunkStore(self.fs, f"{self.exp}/{CHUNK_DIR}", workers=4)
        self.t = 1_000_000.0
        self.data = {chunk_name(_data(i)): _data(i) for i in range(POOL)}
        self.names = sorted(self.data)
        self.writers: dict[int, _Writer] = {}
        self.gcs: dict[int, Generator[str, None, GcReport]] = {}
        self.committed: dict[str, list[str]] = {}  # checkpoint dir -> object names
        self.evicted: list[str] = []  # the objects of the last eviction
        self.next_id = 0
        self.next_index: dict[str, int] = {}

    def now(self) -> float:
        return self.t

    def refs(self) -> set[str] | None:
        return experiment_refs(self.fs, self.exp)

    def _pick(self, d: dict[Any, Any], i: int) -> Any:
        return sorted(d)[i % len(d)]

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    # -- writers -------------------------------------------------------------

    def _start(self, trial: str, names: list[str]) -> None:
        wid = self._new_id()
        w = self.store.prepare(names, writer=f"w{wid}", now=self.now)
        self.writers[wid] = _Writer(w, w.steps(), trial)
        note(f"writer {wid} for {trial}: chunks {[n[:6] for n in sorted(set(names))]}")

    @precondition(lambda self: len(self.writers) < MAX_WRITERS)
    @rule(trial=st.integers(0, 2),
          picks=st.lists(st.integers(0, POOL - 1), min_size=1, max_size=3, unique=True))
    def start_writer(self, trial: int, picks: list[int]) -> None:
        self._start(f"trial_{trial}", [self.names[i] for i in picks])

    @precondition(lambda self: self.committed and len(self.writers) < MAX_WRITERS)
    @rule(i=st.integers(0, 99), extra=st.integers(0, POOL - 1))
    def start_fork(self, i: int, extra: int) -> None:
        """A new trial's checkpoint using the chunks of another trial's one."""
        src = self._pick(self.committed, i)
        names = [base_name(o) for o in self.committed[src]] + [self.names[extra]]
        self._start(f"fork_{self._new_id()}", names)

    @precondition(lambda self: self.writers)
    @rule(i=st.integers(0, 99))
    def advance_writer(self, i: int) -> None:
        self._advance_writer(i)

    def _advance_writer(self, i: int) -> None:
        wid = self._pick(self.writers, i)
        w = self.writers[wid]
        if w.stage in ("new", "intent", "condemned"):
            w.stage = next(w.steps)
            if w.stage == "checked":
                w.todo = sorted(w.write.missing)
        elif w.todo:
            obj = w.todo.pop()
            w.write.upload(obj, encode_chunk(self.data[base_name(obj)]))
            w.stage = "uploads"
        elif w.stage in ("checked", "uploads"):
            self._commit(w)
            w.stage = "committed"
        else:
            w.write.finish()
            del self.writers[wid]
        note(f"writer {wid}: {w.stage}")

    def _commit(self, w: _Writer) -> None:
        index = self.next_index.get(w.trial, 0)
        self.next_index[w.trial] = index + 1
        ckpt = f"{self.exp}/{w.trial}/{checkpoint_dir_name(index)}"
        objects = [w.write.object_names[n] for n in w.write.names]
        entry = {"path": "model.bin", "size": sum(len(self.data[base_name(o)]) for o in objects),
                 "crc32c": "00000000",
                 "chunks": [[o, len(self.data[base_name(o)]), 0] for o in objects]}
        body = {"format_version": 3, "chunk_root": CHUNK_ROOT, "manifest": [entry]}
        _fsutil.write_bytes(self.fs, posixpath.join(ckpt, INTERNAL_METADATA),
                            json.dumps(body).encode(), self.store._caps)
        self.committed[ckpt] = objects

    @precondition(lambda self: self.writers or self.gcs)
    @rule(i=st.integers(0, 99), who=st.sampled_from(["writer", "failed writer", "gc"]))
    def crash(self, i: int, who: str) -> None:
        """A writer or gc pass abandoned mid-way; or a writer that fails before its
        commit and deletes its intent."""
        if who == "gc" and self.gcs:
            gid = self._pick(self.gcs, i)
            del self.gcs[gid]
            note(f"gc {gid}: crashed")
            return
        live = {k: v for k, v in self.writers.items()
                if who == "writer" or v.stage != "committed"}
        if not live:
            return
        wid = self._pick(live, i)
        w = self.writers.pop(wid)
        if who == "writer":
            note(f"writer {wid}: crashed at {w.stage}")
        else:
            w.write.finish()
            note(f"writer {wid}: failed at {w.stage}, finished")

    # -- retention -----------------------------------------------------------

    @precondition(lambda self: self.committed)
    @rule(i=st.integers(0, 99), crash=st.booleans())
    def evict(self, i: int, crash: bool) -> None:
        """Delete a committed checkpoint: its marker, then (unless it crashes) its dir."""
        ckpt = self._pick(self.committed, i)
        self.evicted = self.committed.pop(ckpt)
        _fsutil.delete_file(self.fs, posixpath.join(ckpt, INTERNAL_METADATA))
        if not crash:
            _fsutil.delete_dir(self.fs, ckpt)
        note(f"evicted {ckpt.rsplit('/', 2)[-2:]}{' (crashed)' if crash else ''}")

    # -- gc ------------------------------------------------------------------

    @precondition(lambda self: len(self.gcs) < MAX_GCS)
    @rule(only_evicted=st.booleans())
    def start_gc(self, only_evicted: bool) -> None:
        gid = self._new_id()
        candidates = list(self.evicted) if only_evicted else None
        self.gcs[gid] = collect_steps(self.store, self.refs, candidates=candidates,
                                      now=self.now)
        note(f"gc {gid} started ({'evicted' if only_evicted else 'all'})")

    @precondition(lambda self: self.gcs)
    @rule(i=st.integers(0, 99))
    def advance_gc(self, i: int) -> None:
        self._advance_gc(i)

    def _advance_gc(self, i: int) -> None:
        gid = self._pick(self.gcs, i)
        try:
            note(f"gc {gid}: {next(self.gcs[gid])}")
        except StopIteration as stop:
            del self.gcs[gid]
            note(f"gc {gid}: done, deleted {[n[:6] for n in stop.value.deleted]}")

    @precondition(lambda self: all(self.t + TICK_S - w.write.created_at < INTENT_TTL_S / 2
                                   for w in self.writers.values() if w.stage != "new"))
    @rule()
    def tick(self) -> None:
        """The clock moves on, never so far that a live writer's intent expires
        (the TTL bounds a writer's life)."""
        self.t += TICK_S

    # -- invariants ----------------------------------------------------------

    @invariant()
    def committed_chunks_exist_and_decode(self) -> None:
        wanted = sorted({o for objs in self.committed.values() for o in objs})
        for obj, blob in self.store.read_many(wanted):
            assert decode_chunk(blob, where=obj) == self.data[base_name(obj)], obj

    def teardown(self) -> None:
        try:
            for w in list(self.writers.values()):
                if w.stage == "committed":
                    w.write.finish()
            self.writers.clear()
            self.t += INTENT_TTL_S + CONDEMNED_TTL_S + 1
            report = collect(self.store, self.refs, now=self.now)
            note(f"final gc: {report}")
            left = set(self.store.list_objects())
            referenced = {o for objs in self.committed.values() for o in objs}
            assert left == referenced, (f"leaked {sorted(left - referenced)}, "
                                        f"missing {sorted(referenced - left)}")
            for kind in (INTENTS_DIR, CONDEMNED_DIR):
                assert self.store.read_controls(kind) == [], f"{kind} left after the final gc"
        finally:
            self.cleanup_filesystem(self.fs, self.base)


class MemoryChunkGcMachine(ChunkGcMachine):
    """The same machine on fsspec's memory filesystem behind pyarrow."""

    def make_filesystem(self) -> tuple[pafs.FileSystem, str]:
        import fsspec

        from checkpoint_store.backends.handlers import wrap_fsspec

        return wrap_fsspec(fsspec.filesystem("memory")), f"/cs-chunk-gc-{uuid.uuid4().hex}"


def _weigh(name: str, copies: int, needs: str) -> None:
    """Give ``name`` (a step of a writer or a gc pass, which take several steps
    each) ``copies`` more rules, so they reach their end as often as a crash."""
    impl = f"_{name}"
    for k in range(2, copies + 2):
        def step(self: ChunkGcMachine, i: int) -> None:
            getattr(self, impl)(i)
        step.__name__ = step.__qualname__ = f"{name}_{k}"
        setattr(ChunkGcMachine, step.__name__, precondition(
            lambda self: bool(getattr(self, needs)))(rule(i=st.integers(0, 99))(step)))


_weigh("advance_writer", 5, "writers")
_weigh("advance_gc", 3, "gcs")
