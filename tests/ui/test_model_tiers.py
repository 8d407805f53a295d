"""The web page's JSON model says on which tiers each checkpoint is committed and
whether its durable copy is pending (a session with ``local_tier=LocalTier(...)``)."""

from __future__ import annotations

import os
import threading
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store import Checkpoint, LocalTier, StorageContext, session
from checkpoint_store.backends.base import LOCAL_CAPABILITIES, Backend
from checkpoint_store.backends.forwarding import ForwardingHandler
from checkpoint_store.session import Session
from checkpoint_store.ui._model import StoreView


def _src(tmp_path: Any) -> Checkpoint:
    d = tmp_path / "src"
    d.mkdir(exist_ok=True)
    (d / "model.bin").write_bytes(os.urandom(1000))
    return Checkpoint.from_directory(str(d))


class GatedCheckpointWrites(ForwardingHandler):
    """The local disk; writes into checkpoint directories wait for ``gate``."""

    def __init__(self) -> None:
        super().__init__(pafs.LocalFileSystem())
        self.gate = threading.Event()

    def open_output_stream(self, path: str, metadata):  # noqa: ANN001, ANN201
        if "checkpoint_" in path:
            assert self.gate.wait(60)
        return self.inner.open_output_stream(path, metadata=metadata)


def test_rows_name_the_tiers_and_the_durable_copy(tmp_path: Any) -> None:
    root = str(tmp_path / "durable")
    with session.start(storage_path=root, experiment_name="exp", trial_name="t1",
                       local_tier=LocalTier(str(tmp_path / "fast"), num_to_keep=1)) as s:
        for step in range(3):
            s.report({"loss": 1.0 / (step + 1)}, checkpoint=_src(tmp_path))
        s.wait()
    rows = {r["name"]: r for r in StoreView(root).trial("exp", "t1")["checkpoints"]}
    assert rows["checkpoint_000000"]["tiers"] == ["durable"]
    assert rows["checkpoint_000002"]["tiers"] == ["durable", "local"]
    assert {r["durable"] for r in rows.values()} == {"committed"}
    assert rows["checkpoint_000002"]["kind"] == "latest"


def test_a_pending_copy_is_local_not_evicted(tmp_path: Any) -> None:
    handler = GatedCheckpointWrites()
    backend = Backend(pafs.PyFileSystem(handler), scheme="file",
                      capabilities=LOCAL_CAPABILITIES, name="local")
    root = str(tmp_path / "durable")
    s = Session(StorageContext.from_backend(backend, root, "exp", "t1"),
                local_tier=LocalTier(str(tmp_path / "fast"), num_to_keep=2))
    try:
        s.report({"loss": 0.5}, checkpoint=_src(tmp_path))
        view = StoreView(root)
        row = next(r for r in view.trial("exp", "t1")["checkpoints"]
                   if r["name"] == "checkpoint_000000")
        assert row["kind"] == "local"
        assert row["tiers"] == ["local"] and row["durable"] == "pending"
        handler.gate.set()
        s.wait()
        row = next(r for r in view.trial("exp", "t1")["checkpoints"]
                   if r["name"] == "checkpoint_000000")
        assert row["kind"] == "latest" and row["durable"] == "committed"
        assert row["tiers"] == ["durable", "local"]
    finally:
        handler.gate.set()
        s.close()


def test_a_trial_without_a_local_tier_has_no_tier_fields(tmp_path: Any) -> None:
    root = str(tmp_path / "plain")
    with session.start(storage_path=root, experiment_name="exp", trial_name="t1") as s:
        s.report({"loss": 0.5}, checkpoint=_src(tmp_path))
    rows = StoreView(root).trial("exp", "t1")["checkpoints"]
    assert rows and all("tiers" not in r and "durable" not in r for r in rows)
