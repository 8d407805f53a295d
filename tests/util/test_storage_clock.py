"""Cross-machine decisions are judged on the storage's clock, never the local one
(issue 11, kind 7). A machine whose clock is off is simulated through the one
seam for the local clock, ``checkpoint_store._util.clock.local_time``."""

from __future__ import annotations

import json
import posixpath
import threading
import time
from typing import Any

import pytest
from click.testing import CliRunner
from fsspec.implementations.local import LocalFileSystem

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointConflictError,
    CheckpointManager,
)
from checkpoint_store._commit.commit import commit_checkpoint
from checkpoint_store._util import clock as _clock
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.ids import new_writer_id
from checkpoint_store.cli import main

TWO_HOURS = 7200.0
# memory:// lives in this process and records no modification times: there is
# no other machine's clock to disagree with, so it is left out where the
# decision needs the store's time.
STORES_WITH_A_CLOCK = ["local", "s3", "s3fs", "azure", "gcs"]


def _skew(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    monkeypatch.setattr(_clock, "local_time", lambda: time.time() + seconds)


class _PausingLocalFS(LocalFileSystem):
    """A local source that holds the read of ``slow.bin`` until released: an
    upload caught in the middle, as another process would be."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.reading = threading.Event()
        self.release = threading.Event()

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        if path.endswith("slow.bin"):
            self.reading.set()
            assert self.release.wait(120)
        return super()._open(path, mode=mode, **kw)


@pytest.fixture
def source(tmp_path) -> str:
    d = tmp_path / "src"
    d.mkdir()
    (d / "fast.bin").write_bytes(b"f" * 1000)
    (d / "slow.bin").write_bytes(b"s" * 1000)
    return str(d)


@pytest.mark.parametrize("store", ["local", "memory", "s3", "s3fs", "azure", "gcs"],
                         indirect=True)
def test_gc_with_a_clock_two_hours_ahead_leaves_a_live_upload_alone(
        store, source, monkeypatch):
    ctx = store.ctx()
    ctx.persist_checkpoint(Checkpoint(source), 0, {"metrics": {}})
    # Another process (another run id) is uploading checkpoint 1 right now.
    writer = store.ctx(run_id="other_machine")
    fs = _PausingLocalFS(skip_instance_cache=True)
    errors: list[BaseException] = []

    def upload() -> None:
        try:
            writer.persist_checkpoint(Checkpoint(source, filesystem=fs), 1, {"metrics": {}})
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    t = threading.Thread(target=upload)
    t.start()
    try:
        assert fs.reading.wait(60)
        assert ctx.scan().uncommitted, "the upload in progress left no trace to test on"
        _skew(monkeypatch, TWO_HOURS)
        result = CliRunner().invoke(main, ["gc", store.join("exp", "t"), *store.opt_args(),
                                           "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        assert report["removed"] == []
        assert report["skipped_recent"] == ctx.scan().uncommitted
    finally:
        fs.release.set()
        t.join(120)
    assert errors == []
    assert [c.path.rsplit("/", 1)[1] for c, _ in ctx.committed_checkpoints()] == [
        "checkpoint_000000", "checkpoint_000001"]
    ctx.checkpoint("checkpoint_000001").verify()


@pytest.mark.parametrize("store", STORES_WITH_A_CLOCK, indirect=True)
def test_a_live_lease_is_not_taken_over_by_a_machine_whose_clock_is_ahead(
        store, monkeypatch):
    with CheckpointManager(CheckpointConfig(1), store.ctx(), lease_ttl_s=60.0):
        _skew(monkeypatch, TWO_HOURS)
        with pytest.raises(CheckpointConflictError, match="another live checkpoint manager"):
            CheckpointManager(CheckpointConfig(1), store.ctx())


@pytest.mark.slow
@pytest.mark.parametrize("store", STORES_WITH_A_CLOCK, indirect=True)
def test_an_expired_lease_is_taken_over_by_a_machine_whose_clock_is_behind(
        store, monkeypatch):
    # The holder stopped renewing (hung, or its machine lost power); a new
    # manager on a machine two hours behind still sees it expire on time.
    # The ttl leaves the second manager time to start and still find the
    # lease live on a loaded machine: at 3 s an s3fs start-up under load
    # took longer, and found it expired.
    ttl = 10.0
    held = CheckpointManager(CheckpointConfig(1), store.ctx(), lease_ttl_s=ttl)
    written = time.monotonic()  # the lease was written before this
    held._lease.stop_renewing()
    with pytest.raises(CheckpointConflictError):
        CheckpointManager(CheckpointConfig(1), store.ctx())
    _skew(monkeypatch, -TWO_HOURS)
    # ttl + the one-second slack for whole-second stamps (S3) + a margin
    time.sleep(max(0.0, written + ttl + 2.5 - time.monotonic()))
    with CheckpointManager(CheckpointConfig(1), store.ctx()) as m:
        assert not m.read_only


@pytest.mark.parametrize("store", ["s3", "s3fs", "azure", "gcs"], indirect=True)
def test_a_live_writers_claim_is_not_stale_to_a_clock_two_hours_ahead(
        store, source, monkeypatch):
    # Found beside the inputs: the marker-last commit's claims. Two
    # writers of one checkpoint must never both write, whatever their clocks.
    ctx = store.ctx()
    dest = ctx.checkpoint_path(0)
    claim = posixpath.join(dest, f".cs_claim-{time.time_ns():020d}-{new_writer_id('a')}")
    _fsutil.write_bytes(ctx.filesystem, claim, b"a", ctx.backend.capabilities)
    _skew(monkeypatch, TWO_HOURS)
    with pytest.raises(CheckpointConflictError, match="another writer"):
        commit_checkpoint(_fsutil.pafs.LocalFileSystem(), source, ctx.backend, dest,
                          {"index": 0}, writer_id=new_writer_id("b"), claim_timeout=0.5)
    names = [fi.path.rsplit("/", 1)[1] for fi in _fsutil.list_dir(ctx.filesystem, dest)]
    assert names == [posixpath.basename(claim)]  # nothing written beside the live claim


def test_storage_now_reads_the_stores_clock_not_ours(tmp_path, monkeypatch):
    _skew(monkeypatch, TWO_HOURS)
    fs = _fsutil.pafs.LocalFileSystem()
    from checkpoint_store.backends.base import LOCAL_CAPABILITIES

    now = _clock.storage_now(fs, str(tmp_path), LOCAL_CAPABILITIES)
    assert now is not None and abs(now - time.time()) < 5
    assert list(tmp_path.iterdir()) == []  # the probe is gone
