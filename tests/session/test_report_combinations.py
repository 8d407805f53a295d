"""One rule per invariant of report(), over every combination of what it saves
(a directory or a state), where (no tier or a local tier), when (sync or in
the background), on how many ranks, and how it ends (success, a refusal, a
failed commit, an earlier background error).

The rules (checkpoint_store/session/_ledger.py):
- the index is consumed once the report writes under it; reused after a refusal;
- training_iteration moves, and the row is stored, iff the report returned;
- commit order is report order;
- an earlier background error is raised by the next report of any kind.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np
import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint, LocalTier, StorageContext, UploadConfig, session
from checkpoint_store.backends.forwarding import ForwardingHandler
from checkpoint_store.errors import (
    CheckpointNotFoundError,
    CheckpointStoreError,
    InvalidConfigError,
    MetadataError,
)
from checkpoint_store.session import Session
from checkpoint_store.testing import session_internals

SOURCES = ["directory", "state"]
TIERS = ["none", "tier"]
MODES = ["sync", "async"]


class _FailWrites(ForwardingHandler):
    """Fails every write under ``checkpoint_<index>`` while ``armed``."""

    def __init__(self, inner: pafs.FileSystem):
        super().__init__(inner)
        self.armed: str | None = None

    def open_output_stream(self, path: str, metadata: object):
        if self.armed is not None and f"/{self.armed}/" in path:
            raise PermissionError(f"injected: access denied ({path})")
        return super().open_output_stream(path, metadata)


def _source(tmp_path, name: str, payload: bytes, file: str = "w.bin") -> Checkpoint:
    d = tmp_path / "src" / name
    d.mkdir(parents=True)
    (d / file).write_bytes(payload)
    return Checkpoint.from_directory(str(d))


def _report(s: Session, what: str, i: int, tmp_path, mode: str, **metrics):
    if what == "directory":
        src = _source(tmp_path, f"c{i}-{mode}", b"x%d" % i)
        return s.report({"i": i, **metrics}, checkpoint=src, upload_mode=mode)
    return s.report({"i": i, **metrics}, state={"w": np.full(4, i, dtype=np.float32)},
                    upload_mode=mode)


def _start(tmp_path, tier: str, fs: pafs.FileSystem | None = None, **kw) -> Session:
    store = str(tmp_path / "durable")
    os.makedirs(store, exist_ok=True)
    extra = {} if fs is None else {"storage_filesystem": fs}
    if fs is not None:
        store = f"/{tmp_path.name}"
    return session.start(storage_path=store, experiment_name="e", trial_name="t",
                         local_tier=LocalTier(tmp_path / "fast") if tier == "tier" else None,
                         **extra, **kw)


def _durable(tmp_path, fs: pafs.FileSystem | None = None) -> StorageContext:
    if fs is not None:
        return StorageContext(f"/{tmp_path.name}", "e", "t", storage_filesystem=fs)
    return StorageContext(str(tmp_path / "durable"), "e", "t")


@pytest.mark.parametrize("what", SOURCES)
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("mode", MODES)
def test_success_numbers_rows_and_commits_in_report_order(tmp_path, what, tier, mode):
    with _start(tmp_path, tier) as s:
        rows = [_report(s, what, i, tmp_path, mode) for i in range(3)]
        s.report({"i": 3})  # metrics only: no index taken
        rows.append(_report(s, what, 4, tmp_path, mode))
        s.wait()
    assert [r["checkpoint_dir_name"] for r in rows] == [f"checkpoint_00000{i}" for i in range(4)]
    assert [r["training_iteration"] for r in rows] == [1, 2, 3, 5]
    ctx = _durable(tmp_path)
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0, 1, 2, 3]
    stored = ctx.read_results()
    assert [r["i"] for r in stored] == [0, 1, 2, 3, 4]
    assert [r["checkpoint_dir_name"] for r in stored] == [
        "checkpoint_000000", "checkpoint_000001", "checkpoint_000002", None, "checkpoint_000003"]


@pytest.mark.parametrize("what", SOURCES)
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("mode", MODES)
def test_a_refused_report_moves_nothing_and_its_index_is_reused(tmp_path, what, tier, mode):
    with _start(tmp_path, tier) as s:
        _report(s, what, 0, tmp_path, mode)
        with pytest.raises(MetadataError):
            _report(s, what, 1, tmp_path, mode, bad={1, 2})
        row = _report(s, what, 2, tmp_path, mode)
        s.wait()
    assert row["checkpoint_dir_name"] == "checkpoint_000001"
    assert row["training_iteration"] == 2
    assert [r["i"] for r in _durable(tmp_path).read_results()] == [0, 2]


@pytest.mark.parametrize("what", SOURCES)
@pytest.mark.parametrize("mode", MODES)
def test_a_commit_that_failed_after_writing_consumes_its_index(tmp_path, what, mode):
    # No tier: the storage_path refuses every write under checkpoint_000001.
    import fsspec

    memory = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))
    handler = _FailWrites(memory)
    fs = pafs.PyFileSystem(handler)
    with _start(tmp_path, "none", fs=fs) as s:
        _report(s, what, 0, tmp_path, mode)
        s.wait()
        handler.armed = "checkpoint_000001"
        if mode == "sync":
            with pytest.raises(OSError):
                _report(s, what, 1, tmp_path, mode)
        else:  # queued: the error comes with the next report, of any kind
            _report(s, what, 1, tmp_path, mode)
            session_internals(s).uploader.wait()
            with pytest.raises(OSError):
                s.report({"i": "next"})
        handler.armed = None
        row = _report(s, what, 2, tmp_path, mode)
        s.wait()
    # Something may have been written under checkpoint_000001: never reused.
    assert row["checkpoint_dir_name"] == "checkpoint_000002"
    ctx = _durable(tmp_path, fs)
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0, 2]
    stored = [r["i"] for r in ctx.read_results()]
    # A sync report that raised is not recorded; a queued one was (its row names a
    # checkpoint that is not committed), and the report that raised its error was not.
    assert stored == ([0, 2] if mode == "sync" else [0, 1, 2])


class _FailingStaged:
    """A staged state whose write fails in the background (the persist process died)."""

    nbytes = 8

    def write_to(self, directory: str, record: bool = True) -> dict:
        raise OSError("staged write failed (probe)")

    def release(self) -> None:
        pass


@pytest.mark.parametrize("next_report", ["checkpoint", "state", "metrics"])
def test_a_tier_background_error_is_raised_by_the_next_report_of_any_kind(tmp_path, next_report):
    # Divergence: the next report(state=...) used to return without raising it.
    with _start(tmp_path, "tier") as s:
        internals = session_internals(s)
        internals.pipeline.report_source({"i": 0}, _FailingStaged())
        internals.pipeline.work.lane("local").wait()
        with pytest.raises(OSError, match="probe"):
            if next_report == "checkpoint":
                s.report({"i": 1}, checkpoint=_source(tmp_path, "n", b"n"))
            elif next_report == "state":
                s.report({"i": 1}, state={"w": np.zeros(2)})
            else:
                s.report({"i": 1})
        s.report({"i": 2})  # raised once


def test_staging_where_no_copy_is_staged_is_refused_saying_where_it_applies(tmp_path):
    with _start(tmp_path, "none") as s:
        for kwargs in ({}, {"state": {"w": np.zeros(1)}},
                       {"checkpoint": _source(tmp_path, "a", b"a"), "upload_mode": "sync"}):
            with pytest.raises(InvalidConfigError, match="upload_mode='async'"):
                s.report({"i": 0}, staging="move", **kwargs)
        row = s.report({"i": 0}, checkpoint=_source(tmp_path, "b", b"b"), upload_mode="async",
                       staging="move")
        s.wait()
    assert row["training_iteration"] == 1  # the refusals moved nothing
    with _start(tmp_path, "tier") as s, pytest.raises(InvalidConfigError, match="local tier"):
        s.report({"i": 1}, checkpoint=_source(tmp_path, "c", b"c"), staging="copy")


def test_async_uploads_with_several_ranks_and_no_tier_are_refused_at_start(tmp_path):
    # Divergence: the session used to start, then refuse every report, metrics too.
    with pytest.raises(InvalidConfigError, match="local_tier"):
        session.start(storage_path=str(tmp_path / "d"), experiment_name="e", trial_name="t",
                      world_rank=0, world_size=2, attempt_id="a1",
                      upload_config=UploadConfig(upload_mode="async"))
    assert not (tmp_path / "d" / "e" / "t").exists()  # refused before anything was written


def _ranks(tmp_path, body: Callable[[Session, int], object], tier: bool) -> list[object]:
    """Run ``body(session, rank)`` on two ranks (threads meeting through storage)."""
    out: list[object] = [None, None]

    def run(rank: int) -> None:
        try:
            s = Session(StorageContext(str(tmp_path / "durable"), "e", "t"),
                        world_rank=rank, world_size=2, attempt_id="att",
                        local_tier=LocalTier(tmp_path / f"fast{rank}") if tier else None,
                        sync_timeout_s=60)
            try:
                out[rank] = body(s, rank)
            finally:
                s.close()
        except BaseException as exc:  # noqa: BLE001 -- reported by the test
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_upload_mode_is_checked_on_the_tier_path_with_several_ranks(tmp_path):
    # Divergence: a bogus upload_mode went through there unchecked.
    def body(s: Session, rank: int) -> object:
        with pytest.raises(InvalidConfigError, match="upload_mode"):
            s.report({"i": 0}, checkpoint=_source(tmp_path, f"r{rank}", b"r", f"w{rank}.bin"),
                     upload_mode="bogus")
        src = _source(tmp_path, f"q{rank}", b"q%d" % rank, f"w{rank}.bin")
        return s.report({"i": 1}, checkpoint=src)

    rows = _ranks(tmp_path, body, tier=True)
    assert [r["checkpoint_dir_name"] for r in rows] == ["checkpoint_000000"] * 2  # type: ignore[index]


def test_ranks_saving_in_place_on_their_local_tiers_commit_the_files_there(tmp_path):
    # Divergence: with a tier and several ranks there was no in-place branch.
    def body(s: Session, rank: int) -> object:
        where = s.next_checkpoint_dir()
        with open(os.path.join(where, f"shard{rank}.bin"), "wb") as f:
            f.write(b"s%d" % rank)
        ckpt = Checkpoint.from_directory(where) if rank == 0 else None
        row = s.report({"i": 0}, checkpoint=ckpt)
        s.wait()
        return row

    rows = _ranks(tmp_path, body, tier=True)
    assert [r["checkpoint_dir_name"] for r in rows] == ["checkpoint_000000"] * 2  # type: ignore[index]
    [(ckpt, meta)] = _durable(tmp_path).committed_checkpoints()
    assert sorted(e["path"] for e in meta["manifest"]) == ["shard0.bin", "shard1.bin"]
    ckpt.verify()


@pytest.mark.parametrize("tier", [False, True])
def test_several_ranks_consume_the_index_of_a_failed_commit_together(tmp_path, tier):
    # Rank 1's source vanishes before its upload: the index is aborted on every
    # rank, and every rank moves past it together.
    def body(s: Session, rank: int) -> object:
        src = _source(tmp_path, f"a{rank}", b"a", f"w{rank}.bin")
        if rank == 1:
            for name in os.listdir(src.path):
                os.remove(os.path.join(src.path, name))
            os.rmdir(src.path)
        with pytest.raises(Exception):  # noqa: B017 -- rank 1's own error, rank 0's abort
            s.report({"i": 0}, checkpoint=src)
            s.wait()
        row = s.report({"i": 1}, checkpoint=_source(tmp_path, f"b{rank}", b"b", f"w{rank}.bin"))
        s.wait()
        return row

    rows = _ranks(tmp_path, body, tier=tier)
    assert all(isinstance(r, dict) for r in rows), rows
    assert [r["checkpoint_dir_name"] for r in rows] == ["checkpoint_000001"] * 2  # type: ignore[index]
    assert [m["index"] for _, m in _durable(tmp_path).committed_checkpoints()] == [1]


@pytest.mark.parametrize("tier", [False, True])
def test_ranks_stay_in_step_after_one_rank_fails_and_commit_only_same_step_shards(
        tmp_path, tier):
    # Rank 1's directory of step 1 is gone. Every rank goes on reporting: the
    # ranks must meet at the same reports afterwards (a background error of
    # one rank aborts the next checkpoint on every rank, never skips a
    # rendezvous), so a committed checkpoint holds shards of one step only.
    outcomes: dict[int, list[str]] = {0: [], 1: []}

    def body(s: Session, rank: int) -> object:
        for step in range(4):
            src = _source(tmp_path, f"s{step}-r{rank}", b"rank%d-step%d" % (rank, step),
                          f"shard{rank}.bin")
            if rank == 1 and step == 1:
                os.remove(os.path.join(src.path, "shard1.bin"))
                os.rmdir(src.path)
            try:
                s.report({"step": step}, checkpoint=src)
                outcomes[rank].append("ok")
            except Exception as exc:  # noqa: BLE001 -- recorded, compared below
                outcomes[rank].append(type(exc).__name__)
        s.wait() if not tier else None
        return None

    rows = _ranks(tmp_path, body, tier=tier)
    assert not any(isinstance(r, BaseException) and not isinstance(r, Exception)
                   for r in rows)
    for rank, r in enumerate(rows):  # close() raised nothing but a named failure, or nothing
        assert r is None or "RankTimeout" not in type(r).__name__, (rank, r, outcomes)
    committed = _durable(tmp_path).committed_checkpoints()
    assert committed, outcomes
    for ckpt, meta in committed:
        with ckpt.as_directory() as d:
            steps = {open(os.path.join(d, f"shard{r}.bin"), "rb").read().split(b"-")[1]
                     for r in (0, 1)}
        assert len(steps) == 1, (meta["index"], steps, outcomes)
        assert steps == {b"step%d" % meta["metrics"]["step"]}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("mode", MODES)
def test_a_directory_gone_before_report_is_refused_and_its_index_reused(tmp_path, tier, mode):
    with _start(tmp_path, tier) as s:
        _report(s, "directory", 0, tmp_path, mode)
        gone = _source(tmp_path, "gone", b"g")
        os.remove(os.path.join(gone.path, "w.bin"))
        os.rmdir(gone.path)
        with pytest.raises(CheckpointNotFoundError):
            s.report({"i": 1}, checkpoint=gone, upload_mode=mode)
        row = _report(s, "directory", 2, tmp_path, mode)
        s.wait()
    assert row["checkpoint_dir_name"] == "checkpoint_000001"
    assert row["training_iteration"] == 2


def test_a_state_after_next_checkpoint_dir_is_refused_before_anything_is_written(tmp_path):
    with _start(tmp_path, "none") as s:
        where = s.next_checkpoint_dir()
        with open(os.path.join(where, "junk"), "w") as f:
            f.write("j")
        with pytest.raises(InvalidConfigError, match="next_checkpoint_dir"):
            s.report({"i": 0}, state={"w": np.ones(3)})
        row = s.report({"i": 0}, checkpoint=Checkpoint.from_directory(where))
    assert row["checkpoint_dir_name"] == "checkpoint_000000"
    [(_, meta)] = _durable(tmp_path).committed_checkpoints()
    assert [e["path"] for e in meta["manifest"]] == ["junk"]


def test_a_report_after_the_end_says_the_session_ended_whatever_it_passes(tmp_path):
    with _start(tmp_path, "none") as s:
        pass
    for kwargs in ({"metrics": {"bad": {1}}}, {"metrics": {}, "staging": "move"},
                   {"metrics": {}, "state": {"w": np.ones(1)}}):
        metrics = kwargs.pop("metrics")
        with pytest.raises(CheckpointStoreError, match="ended"):
            s.report(metrics, **kwargs)


class _LoseMarker(ForwardingHandler):
    """Fails the marker write of ``checkpoint_<armed>`` and every read of it back
    with a retryable error: the commit's outcome is unknown."""

    def __init__(self, inner: pafs.FileSystem):
        super().__init__(inner)
        self.armed: str | None = None

    def _hit(self, path: str) -> bool:
        return self.armed is not None and path.endswith(f"/{self.armed}/.internal_metadata.json")

    def open_output_stream(self, path: str, metadata: object):
        if self._hit(path):
            raise ConnectionResetError(f"injected: connection reset ({path})")
        return super().open_output_stream(path, metadata)

    def open_input_stream(self, path: str):
        if self._hit(path):
            raise ConnectionResetError(f"injected: connection reset ({path})")
        return super().open_input_stream(path)

    def open_input_file(self, path: str):
        if self._hit(path):
            raise ConnectionResetError(f"injected: connection reset ({path})")
        return super().open_input_file(path)


@pytest.mark.parametrize("mode", MODES)
def test_an_ambiguous_commit_keeps_its_row_and_its_index_is_never_reused(tmp_path, mode):
    import fsspec

    from checkpoint_store.errors import AmbiguousCommitError

    memory = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))
    handler = _LoseMarker(memory)
    fs = pafs.PyFileSystem(handler)
    with _start(tmp_path, "none", fs=fs) as s:
        _report(s, "directory", 0, tmp_path, mode)
        s.wait()
        handler.armed = "checkpoint_000001"
        if mode == "sync":
            with pytest.raises(AmbiguousCommitError):
                _report(s, "directory", 1, tmp_path, mode)
        else:
            _report(s, "directory", 1, tmp_path, mode)
            with pytest.raises(AmbiguousCommitError):
                s.wait()
        handler.armed = None
        row = _report(s, "directory", 2, tmp_path, mode)
        s.wait()
    assert row["checkpoint_dir_name"] == "checkpoint_000002"
    assert row["training_iteration"] == 3  # the ambiguous report's row was kept
    ctx = _durable(tmp_path, fs)
    assert [r["i"] for r in ctx.read_results()] == [0, 1, 2]
    # The next report settled it: its marker never landed, so it is not
    # committed, and its index was not reused.
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0, 2]
