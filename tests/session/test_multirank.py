"""Multi-rank report(): every rank uploads, rank 0 commits (ranks run as threads here;
test_torchrun.py runs real processes)."""

from __future__ import annotations

import io
import os
import tempfile
import threading
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointConflictError,
    CheckpointNotFoundError,
    InvalidConfigError,
    StorageContext,
    session,
)
from checkpoint_store.session import CheckpointAbortedError, RankTimeoutError

# s3: 6 to 12 s a test (ranks as threads against moto); in the full run only.
STORES = ["local", "memory", pytest.param("s3", marks=pytest.mark.slow)]


_OPTIONS: dict[str, dict] = {}


@pytest.fixture(params=STORES)
def store(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "s3":
        loc = request.getfixturevalue("s3_location")
        _OPTIONS[loc.uri] = loc.storage_options
        return loc.uri
    return f"memory://mr-{uuid.uuid4().hex}"



def _dir(tmp_path, name: str, files: dict[str, bytes]) -> Checkpoint:
    d = tmp_path / "src" / name
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    d.mkdir(parents=True, exist_ok=True)
    return Checkpoint.from_directory(d)


def _start(store, rank, n, attempt="a1", **kw):
    kw.setdefault("sync_timeout_s", 20)
    return session.start(storage_path=store, experiment_name="e", trial_name="t",
                         world_rank=rank, world_size=n, attempt_id=attempt,
                         storage_options=_OPTIONS.get(store), **kw)


def _ctx(store) -> StorageContext:
    return StorageContext(store, "e", "t", storage_options=_OPTIONS.get(store))


def _names(ctx: StorageContext, path: str) -> list[str]:
    sel = pafs.FileSelector(path, recursive=True, allow_not_found=True)
    prefix = path.rstrip("/") + "/"
    return sorted(fi.path[len(prefix):] for fi in ctx.filesystem.get_file_info(sel)
                  if fi.type == pafs.FileType.File)


def test_all_ranks_files_in_one_checkpoint_rank0_metrics_recorded(ranks, store, tmp_path):
    n = 3
    cfg = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="acc")

    def rank_fn(rank):
        with _start(store, rank, n, checkpoint_config=cfg) as s:
            rows = []
            for step in range(2):
                files = {f"shard_{rank}.bin": bytes([rank]) * (rank + 1 + step)}
                if rank == 0:
                    files["common/config.json"] = b"{}"
                ck = _dir(tmp_path, f"r{rank}-s{step}", files)
                ck.set_metadata({"written_by": rank})
                rows.append(session.report({"acc": 0.5 + step / 10 + rank, "rank": rank},
                                           checkpoint=ck))
            assert s.get_context().world_size == n
            return rows, s.get_checkpoint()

    out = ranks(n, rank_fn)
    for r in out:
        assert not isinstance(r, BaseException), r
    latest = {o[1].path for o in out}
    assert len(latest) == 1  # every rank sees the same committed checkpoint
    ctx = _ctx(store)
    committed = ctx.committed_checkpoints()
    assert [c.path.rsplit("/", 1)[-1] for c, _ in committed] == ["checkpoint_000001"]
    ckpt, meta = committed[0]
    assert sorted(e["path"] for e in meta["manifest"]) == [
        "common/config.json", "shard_0.bin", "shard_1.bin", "shard_2.bin"]
    assert {e["path"]: e["size"] for e in meta["manifest"]}["shard_2.bin"] == 4
    assert meta["world_size"] == n
    assert meta["metrics"]["rank"] == 0 and meta["metrics"]["acc"] == pytest.approx(0.6)
    assert ckpt.get_metadata() == {"written_by": 0}
    # Our per-rank markers never reach the user, nor stay in the committed directory.
    got = sorted(os.listdir(ckpt.to_directory(tmp_path / "down")))
    assert got == [".user_metadata.json", "common", "shard_0.bin", "shard_1.bin", "shard_2.bin"]
    assert not [p for p in _names(ctx, ckpt.path) if ".cs_rank" in p]
    # Only rank 0 writes result rows.
    rows = ctx.read_results()
    assert [r["rank"] for r in rows] == [0, 0]
    assert [r["checkpoint_dir_name"] for r in rows] == ["checkpoint_000000", "checkpoint_000001"]


def test_ranks_from_environment_and_torchelastic_attempt(ranks, tmp_path, monkeypatch):
    store = str(tmp_path / "store")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job/7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")

    def rank_fn(rank):
        with session.start(storage_path=store, experiment_name="e", trial_name="t",
                           world_rank=rank, sync_timeout_s=20) as s:
            ctx = session.get_context()
            session.report({"x": rank}, checkpoint=_dir(tmp_path, f"r{rank}",
                                                         {f"s{rank}": b"1"}))
            return ctx.world_rank, ctx.world_size, ctx.local_rank, s.attempt_id

    out = ranks(2, rank_fn)
    assert out == [(0, 2, 1, "job_7-3"), (1, 2, 1, "job_7-3")]


def test_no_attempt_id_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(InvalidConfigError, match="attempt_id"):
        session.start(storage_path=str(tmp_path), world_rank=0, world_size=2)
    # torchrun's default rendezvous id is the same for every launch.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(InvalidConfigError, match="attempt_id"):
        session.start(storage_path=str(tmp_path), world_rank=0, world_size=2)
    with pytest.raises(InvalidConfigError, match="world_rank"):
        session.start(storage_path=str(tmp_path), world_rank=2, world_size=2, attempt_id="x")


def test_same_file_from_two_ranks_names_both_and_commits_nothing(ranks, store, tmp_path):
    def rank_fn(rank):
        with _start(store, rank, 3):
            files = {"model.pt": bytes([rank])} if rank in (1, 2) else {"opt.pt": b"o"}
            session.report({"i": 0}, checkpoint=_dir(tmp_path, f"r{rank}", files))

    out = ranks(3, rank_fn)
    assert all(isinstance(e, CheckpointConflictError) for e in out), out
    for e in out:
        assert "ranks 1 and 2" in str(e) and "model.pt" in str(e)
    ctx = _ctx(store)
    assert ctx.committed_checkpoints() == []


class _VanishingLocalFS:
    """An fsspec local filesystem whose source directory disappears after the
    first file was opened: the middle of an upload, deterministically."""

    def __new__(cls, root: str):
        import shutil

        from fsspec.implementations.local import LocalFileSystem

        class Vanishing(LocalFileSystem):
            opened = 0

            def _open(self, path, mode="rb", **kw):
                if "r" in mode:
                    Vanishing.opened += 1
                    if Vanishing.opened == 2:
                        shutil.rmtree(root)
                return super()._open(path, mode=mode, **kw)

        return Vanishing(skip_instance_cache=True)


def test_source_vanishing_mid_upload_names_path_and_commits_nothing(ranks, store, tmp_path):
    def rank_fn(rank):
        with _start(store, rank, 2) as s:
            files = {f"part_{i}_{rank}.bin": b"x" * 10 for i in range(4)}
            ck = _dir(tmp_path, f"r{rank}", files)
            if rank == 1:
                ck = Checkpoint(ck.path, filesystem=_VanishingLocalFS(ck.path))
            try:
                session.report({"i": 0}, checkpoint=ck)
            except Exception as exc:
                return exc, s.get_checkpoint()
            return None, s.get_checkpoint()

    (e0, latest0), (e1, latest1) = ranks(2, rank_fn)
    assert isinstance(e1, CheckpointNotFoundError)
    src1 = str(tmp_path / "src" / "r1")
    assert src1 in str(e1) and "rank 1" in str(e1)
    assert isinstance(e0, CheckpointAbortedError)
    assert e0.failed_ranks == [1] and e0.index == 0 and "rank 1" in str(e0)
    assert latest0 is None and latest1 is None
    ctx = _ctx(store)
    assert ctx.committed_checkpoints() == []
    assert not _names(ctx, ctx.checkpoint_path(0))  # the partial upload was removed


def test_failed_index_is_never_reused_and_never_mixes_attempts(ranks, store, tmp_path):
    barrier = threading.Barrier(2)

    def rank_fn(rank):
        with _start(store, rank, 2):
            # Report 1: rank 0 uploads old_0.bin, rank 1 fails (bad metrics).
            try:
                metrics = {"bad": object()} if rank == 1 else {"i": 1}
                session.report(metrics, checkpoint=_dir(tmp_path, f"a{rank}",
                                                        {f"old_{rank}.bin": b"old"}))
            except Exception as exc:
                first = exc
            barrier.wait()
            # Report 2: both succeed; the old files must not show up.
            session.report({"i": 2}, checkpoint=_dir(tmp_path, f"b{rank}",
                                                     {f"new_{rank}.bin": b"new"}))
            return type(first).__name__

    out = ranks(2, rank_fn)
    assert out == ["CheckpointAbortedError", "MetadataError"]
    ctx = _ctx(store)
    [(ck, meta)] = ctx.committed_checkpoints()
    assert meta["index"] == 1
    assert sorted(e["path"] for e in meta["manifest"]) == ["new_0.bin", "new_1.bin"]
    assert _names(ctx, ck.path) == [".internal_metadata.json", "new_0.bin", "new_1.bin"]


def test_new_attempt_starts_past_leftovers_of_a_crashed_one(ranks, store, tmp_path):
    # A crashed attempt left rank 0's part of checkpoint_000000 uncommitted.
    ctx = _ctx(store)
    ctx.ensure_trial_dir()
    fs = ctx.filesystem
    leftover = ctx.checkpoint_path(0)
    if ctx.backend.capabilities.directories:
        fs.create_dir(leftover, recursive=True)
    with fs.open_output_stream(f"{leftover}/stale_0.bin") as f:
        f.write(b"stale")

    def rank_fn(rank):
        with _start(store, rank, 2, attempt="second"):
            return session.report({"i": 0}, checkpoint=_dir(tmp_path, f"n{rank}",
                                                            {f"fresh_{rank}.bin": b"f"}))

    out = ranks(2, rank_fn)
    assert [r["checkpoint_dir_name"] for r in out] == ["checkpoint_000001"] * 2
    [(ck, meta)] = ctx.committed_checkpoints()
    assert _names(ctx, ck.path) == [".internal_metadata.json", "fresh_0.bin", "fresh_1.bin"]


def test_rank_that_never_reports_times_out_listing_it(ranks, store, tmp_path):
    def rank_fn(rank):
        with _start(store, rank, 3, sync_timeout_s=0.5):
            if rank == 2:
                return "skipped"
            try:
                session.report({"i": 0}, checkpoint=_dir(tmp_path, f"r{rank}",
                                                         {f"s{rank}": b"1"}))
            except RankTimeoutError as exc:
                return exc

    e0, e1, skipped = ranks(3, rank_fn)
    assert skipped == "skipped"
    assert isinstance(e0, RankTimeoutError) and e0.missing_ranks == [2]
    assert "[2]" in str(e0)
    assert isinstance(e1, RankTimeoutError) and e1.missing_ranks == [2]
    assert _ctx(store).committed_checkpoints() == []


def test_rank_waiting_for_missing_rank0_times_out(store, tmp_path):
    with pytest.raises(RankTimeoutError, match=r"missing ranks: \[0\]") as info:
        _start(store, 1, 2, sync_timeout_s=0.3)
    assert info.value.missing_ranks == [0]


def test_reports_without_checkpoint_only_rank0_rows(ranks, store, tmp_path):
    def rank_fn(rank):
        with _start(store, rank, 2, config={"lr": 0.1}):
            for i in range(3):
                session.report({"i": i, "rank": rank})

    assert ranks(2, rank_fn) == [None, None]
    rows = _ctx(store).read_results()
    assert [(r["i"], r["rank"]) for r in rows] == [(0, 0), (1, 0), (2, 0)]


class _WholeOnClose(io.BytesIO):
    """A write to fsspec's memory store that appears whole when closed, as an
    object store's PUT does (memory:// itself shows a file from its open on,
    so a listing can catch it empty and the reader must read it again)."""

    def __init__(self, fs, path):
        super().__init__()
        self.fs, self.path = fs, fs._strip_protocol(path)

    def close(self):
        if not self.closed:
            from fsspec.implementations.memory import MemoryFile

            self.fs.store[self.path] = MemoryFile(self.fs, self.path, self.getvalue())
        super().close()


class _CountingHandler(pafs.FSSpecHandler):
    """Counts the calls a commit makes; writes are whole on close, so every
    read counted is one a store with atomic PUTs would see too."""

    def __init__(self, fs, counts, lock, torn=()):
        super().__init__(fs)
        self.counts, self.lock = counts, lock
        self.torn = set(torn)  # paths whose first read returns half their bytes

    def _count(self, what, path):
        with self.lock:
            self.counts.append((what, path))

    def open_output_stream(self, path, metadata):
        self._count("write", path)
        return pa.PythonFile(_WholeOnClose(self.fs, path), mode="w")

    def open_input_stream(self, path):
        self._count("read", path)
        with self.lock:
            torn = path in self.torn
            self.torn.discard(path)
        if torn:
            data = self.fs.cat_file(path)
            return pa.BufferReader(data[: len(data) // 2])
        return super().open_input_stream(path)

    def delete_file(self, path):
        self._count("delete", path)
        return super().delete_file(path)


@pytest.mark.parametrize("n", [2, 8])
def test_storage_calls_per_commit_grow_linearly(ranks, tmp_path, n):
    from fsspec.implementations.memory import MemoryFileSystem

    counts: list[tuple[str, str]] = []
    fs = pafs.PyFileSystem(_CountingHandler(MemoryFileSystem(), counts, threading.Lock()))
    root = f"/count-{n}-{id(tmp_path)}"
    sources = [_dir(tmp_path, f"r{r}", {f"s{r}.bin": b"x"}) for r in range(n)]

    def rank_fn(rank):
        with session.start(storage_path=root, storage_filesystem=fs, experiment_name="e",
                           trial_name="t", world_rank=rank, world_size=n, attempt_id="c",
                           sync_timeout_s=30):
            if rank == 0:
                counts.clear()
            barrier.wait()
            session.report({"i": 0}, checkpoint=sources[rank])

    barrier = threading.Barrier(n)
    assert ranks(n, rank_fn) == [None] * n
    ck = [c for c in counts if "checkpoint_000000" in c[1]]
    markers = [c for c in ck if ".cs_rank" in c[1]]
    # Each marker written once, read once (by rank 0) and deleted once.
    assert sorted(w for w, _ in markers) == ["delete"] * n + ["read"] * n + ["write"] * n
    # Data, rank markers and the claims each rank puts before its data: n
    # each; the commit marker: one. No call grows with n squared.
    writes = [p for w, p in ck if w == "write"]
    assert len([p for p in writes if ".cs_claim-" in p]) == n
    assert len(writes) == 3 * n + 1


def test_a_marker_read_half_written_is_read_again_and_the_commit_completes(ranks, tmp_path):
    """memory:// shows a file while it is written: rank 0 can list a marker
    and read half of it. That read is not an error; the marker is read again."""
    from fsspec.implementations.memory import MemoryFileSystem

    counts: list[tuple[str, str]] = []
    root = f"/torn-{id(tmp_path)}"
    marker = f"{root}/e/t/checkpoint_000000/.cs_rank-000001.json"
    handler = _CountingHandler(MemoryFileSystem(), counts, threading.Lock(), torn=[marker])
    fs = pafs.PyFileSystem(handler)
    sources = [_dir(tmp_path, f"r{r}", {f"s{r}.bin": bytes([r]) * 8}) for r in range(2)]

    def rank_fn(rank):
        with session.start(storage_path=root, storage_filesystem=fs, experiment_name="e",
                           trial_name="t", world_rank=rank, world_size=2, attempt_id="c",
                           sync_timeout_s=30):
            session.report({"i": 0}, checkpoint=sources[rank])

    assert ranks(2, rank_fn) == [None, None]
    assert [w for w, p in counts if p == marker] == ["write", "read", "read", "delete"]
    ck = Checkpoint(f"{root}/e/t/checkpoint_000000", filesystem=fs)
    with ck.as_directory() as d:
        assert sorted(os.listdir(d)) == ["s0.bin", "s1.bin"]


def test_rank_markers_mark_an_interrupted_commit_as_ours_not_foreign():
    """A crash between the ranks' uploads and rank 0's marker-last commit on an
    object-like store leaves data plus rank markers: cleanup must recognise it
    as ours. A marker left after the commit changes nothing."""
    from checkpoint_store._format.layout import rank_marker_name
    from checkpoint_store._util import fs as _fsutil

    root = f"memory://mr-gap-{uuid.uuid4().hex[:8]}"
    ctx = StorageContext(root, "e", "t")
    fs, caps = ctx.filesystem, ctx.backend.capabilities
    part = ctx.checkpoint_path(0)
    _fsutil.write_bytes(fs, f"{part}/shard_0.bin", b"abc", caps)
    _fsutil.write_bytes(fs, f"{part}/{rank_marker_name(0)}", b'{"ok": true}', caps)
    scan = ctx.scan()
    assert scan.uncommitted == ["checkpoint_000000"] and scan.foreign == []
    assert not ctx.checkpoint("checkpoint_000000").is_committed
    # Commit another index, then leave a stray marker inside it.
    assert ctx.remove_uncommitted() == ["checkpoint_000000"]
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "shard_0.bin"), "wb") as f:
            f.write(b"abc")
        done = ctx.persist_checkpoint(Checkpoint.from_directory(d), 1, {"metrics": {}})
    _fsutil.write_bytes(fs, f"{done.path}/{rank_marker_name(1)}", b'{"ok": true}', caps)
    assert done.is_committed
    done.verify()
    assert ctx.scan().committed == ["checkpoint_000001"]
