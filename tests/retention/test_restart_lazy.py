"""A keep-all restart reads none of the state's chunks (issue 19): what it answers
without them, and that reading them later gives what an eager read gives."""

from __future__ import annotations

import posixpath
import warnings

import pytest
from _retention_helpers import save

from checkpoint_store import Checkpoint, CheckpointConfig, CheckpointManager
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.retention import statelog
from checkpoint_store.retention.state import LazyEntries
from checkpoint_store.retention.statelog import load_state
from checkpoint_store.testing.faults import faulty_backend

FAST = pytest.mark.parametrize("backend_name", ["local", "memory"])
KEEP_ALL = CheckpointConfig(checkpoint_score_attribute="score")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 entries, a snapshot every 3 records: a trial of tens has chunks."""
    monkeypatch.setattr(statelog, "CHUNK_ENTRIES", 4)
    monkeypatch.setattr(statelog, "COMPACT_EVERY", 3)
    monkeypatch.setattr(statelog, "FANOUT", 2)


def _chunk_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    real = statelog.StateLog._read_chunk

    def spy(self, name, root_seq):
        reads.append(name)
        return real(self, name, root_seq)

    monkeypatch.setattr(statelog.StateLog, "_read_chunk", spy)
    return reads


def _fill(storage, source_dir, n: int, start: int = 0) -> str:
    with CheckpointManager(KEEP_ALL, storage) as m:
        for i in range(start, start + n):
            save(m, storage, source_dir, {"score": float((i * 7) % 13)})
        return m.run_id


def _eager(storage) -> tuple[list[str], list[tuple[str, float]], dict]:
    """What a read-only manager (which reads every chunk) answers."""
    with CheckpointManager(KEEP_ALL, storage, read_only=True) as m:
        return (m.kept_dir_names,
                [(c.path.rsplit("/", 1)[-1], meta["score"]) for c, meta in m.best_checkpoints],
                m.kept_scores)


@FAST
def test_a_keep_all_restart_reads_no_chunk_and_answers_as_an_eager_read(
        make_storage, source_dir, small_chunks, monkeypatch):
    storage = make_storage()
    _fill(storage, source_dir, 30)
    want = _eager(storage)
    reads = _chunk_reads(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = CheckpointManager(KEEP_ALL, make_storage())
    assert isinstance(m._sel.kept, LazyEntries) and reads == []
    assert m.latest_checkpoint is not None
    assert m.latest_checkpoint.path.endswith("checkpoint_000029") and reads == []
    assert m.next_index == 30 and m.latest_index == 29
    candidates = m.resume_candidates()
    assert candidates[-1][0].path.endswith("checkpoint_000029") and reads == []
    # Asked for the whole kept set: the chunks are read once, the answer is the eager one.
    assert (m.kept_dir_names, [(c.path.rsplit("/", 1)[-1], meta["score"])
                               for c, meta in m.best_checkpoints], m.kept_scores) == want
    assert reads and len(reads) == len(set(reads))
    m.close()


@FAST
def test_reports_after_a_lazy_restart_keep_the_state_whole(make_storage, source_dir,
                                                           small_chunks, monkeypatch):
    storage = make_storage()
    _fill(storage, source_dir, 21)
    _fill(make_storage(), source_dir, 10, start=21)  # lazy restart, then 10 more reports
    state, problem = load_state(storage)
    assert state is not None, problem
    assert sorted(state.checkpoints) == [f"checkpoint_{i:06d}" for i in range(31)]
    assert _eager(storage)[0] == sorted(state.checkpoints)


@FAST
def test_a_lazy_restart_finds_what_changed_since_the_last_record(make_storage, source_dir,
                                                                 small_chunks, monkeypatch):
    storage = make_storage()
    run_id = _fill(storage, source_dir, 25)
    # The process died between a commit and its record: two checkpoints past it ...
    for i in (25, 26):
        storage.persist_checkpoint(Checkpoint(source_dir), i,
                                   {"metrics": {"score": 50.0 + i}, "run_id": run_id})
    # ... an uncommitted leftover past those, and a sealed (chunked) one deleted by hand.
    stray = posixpath.join(storage.trial_path, "checkpoint_000027")
    _fsutil.ensure_dir(storage.filesystem, stray, storage.backend.capabilities)
    _fsutil.delete_dir(storage.filesystem, posixpath.join(storage.trial_path,
                                                          "checkpoint_000003"))
    reads = _chunk_reads(monkeypatch)
    m = CheckpointManager(KEEP_ALL, make_storage())
    assert m.next_index == 28
    assert m.best_checkpoint is not None
    assert m.best_checkpoint.path.endswith("checkpoint_000026")
    assert m.kept_dir_names == [f"checkpoint_{i:06d}" for i in range(27) if i != 3]
    assert m.uncommitted_dir_names == ["checkpoint_000027"]
    m.close()
    assert reads
    state, _ = load_state(storage)
    assert state is not None and sorted(state.checkpoints) == _eager(storage)[0]


@pytest.mark.parametrize("backend_name", [
    "local", "memory", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_lazy_restart_costs_the_same_at_any_number_of_checkpoints(
        make_storage, source_dir, small_chunks, monkeypatch):
    """Storage calls of a restart (lease, state, newest checkpoint): equal at 12 and 60
    checkpoints; only the listing grows with N, by pages of 1,000 on object stores."""
    calls = []
    for n in (12, 60):
        storage = make_storage(trial=f"n{n}")
        _fill(storage, source_dir, n)
        backend = faulty_backend(storage.backend)
        counted = type(storage).from_backend(backend, storage.storage_path,
                                             storage.experiment_name, storage.trial_name)
        handler = counted.filesystem.handler
        before = dict(handler.calls)
        reads = _chunk_reads(monkeypatch)
        with CheckpointManager(KEEP_ALL, counted) as m:
            assert m.resume_candidates()[-1][0].path.endswith(f"checkpoint_{n - 1:06d}")
        assert reads == []
        calls.append({k: v - before.get(k, 0) for k, v in handler.calls.items()
                      if v != before.get(k, 0)})
    assert calls[0] == calls[1], calls


@FAST
def test_a_lazy_reader_whose_chunks_a_writer_compacted_away_reads_the_newer_state(
        make_storage, source_dir, small_chunks, monkeypatch):
    storage = make_storage()
    _fill(storage, source_dir, 20)
    reader = CheckpointManager(KEEP_ALL, make_storage(), read_only=True)
    assert isinstance(reader._sel.kept, LazyEntries)
    _fill(make_storage(), source_dir, 20, start=20)  # merges and deletes the old chunks
    names = reader.kept_dir_names
    assert names[:20] == [f"checkpoint_{i:06d}" for i in range(20)]
    assert set(names) <= {f"checkpoint_{i:06d}" for i in range(40)}
    reader.close()
