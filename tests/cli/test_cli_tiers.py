"""``ls`` and ``show`` say on which tiers a checkpoint is and whether its durable copy
is pending (a session with ``local_tier=LocalTier(...)``; checkpoint_store/tiers/view.py)."""

from __future__ import annotations

import json
import os
import threading

import pyarrow.fs as pafs
import pytest
from cli_helpers import Store, invoke, write_tree

from checkpoint_store import Checkpoint, LocalTier, StorageContext, session
from checkpoint_store.backends.base import LOCAL_CAPABILITIES, Backend
from checkpoint_store.backends.forwarding import ForwardingHandler
from checkpoint_store.session import Session


def _src(tmp_path) -> Checkpoint:
    return Checkpoint.from_directory(write_tree(str(tmp_path / "src"), {
        "model.bin": os.urandom(2000), "opt/state.bin": os.urandom(500)}))


def _ls(target: str, store: Store | None = None) -> dict:
    res = invoke(["ls", target, "--json", *(store.opt_args() if store else [])])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def _by_index(data: dict) -> dict[int, dict]:
    return {r["index"]: r for r in data["checkpoints"]}


@pytest.fixture(params=["local", "s3"])
def durable(request, tmp_path) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "durable"))
    loc = request.getfixturevalue("s3_location")
    return Store(loc.uri, dict(loc.storage_options))


def test_ls_and_show_say_which_tiers_hold_each_checkpoint(durable, tmp_path):
    tier_root = str(tmp_path / "fast")
    with session.start(storage_path=durable.uri, storage_options=dict(durable.options) or None,
                       experiment_name="exp", trial_name="t1",
                       local_tier=LocalTier(tier_root, num_to_keep=1)) as s:
        for step in range(3):
            s.report({"loss": 1.0 / (step + 1)}, checkpoint=_src(tmp_path))
        s.wait()
    rows = _by_index(_ls(durable.join("exp", "t1"), durable))
    assert sorted(rows) == [0, 1, 2]
    assert rows[0]["tiers"] == ["durable"] and rows[1]["tiers"] == ["durable"]
    assert rows[2]["tiers"] == ["durable", "local"]
    assert {r["durable"] for r in rows.values()} == {"committed"}
    # The local tier's own trial directory, read through its state file.
    tier_trial = os.path.join(tier_root, "exp", "t1")
    local_rows = _by_index(_ls(tier_trial))
    assert sorted(local_rows) == [2]
    assert local_rows[2]["tiers"] == ["durable", "local"]
    assert local_rows[2]["durable"] == "committed"
    table = invoke(["ls", durable.join("exp", "t1"), *durable.opt_args()])
    assert "TIERS" in table.output and "durable,local" in table.output
    res = invoke(["show", durable.join("exp", "t1", "checkpoint_000002"), "--json",
                  *durable.opt_args()])
    shown = json.loads(res.output)
    assert shown["tiers"] == ["durable", "local"] and shown["durable"] == "committed"
    assert shown["local_tiers"][0]["path"] == tier_trial and shown["local_tiers"][0]["visible"]
    text = invoke(["show", durable.join("exp", "t1", "checkpoint_000000"), *durable.opt_args()])
    assert "tiers           durable\n" in text.output
    assert "durable copy    committed" in text.output


class GatedCheckpointWrites(ForwardingHandler):
    """The local disk, where writes into checkpoint directories wait for ``gate``
    (a durable store that is slow to take the copy)."""

    def __init__(self) -> None:
        super().__init__(pafs.LocalFileSystem())
        self.gate = threading.Event()

    def open_output_stream(self, path: str, metadata):  # noqa: ANN001, ANN201
        if "checkpoint_" in path:
            assert self.gate.wait(60)
        return self.inner.open_output_stream(path, metadata=metadata)


def test_a_pending_durable_copy_is_listed_from_the_local_tier(tmp_path):
    handler = GatedCheckpointWrites()
    backend = Backend(pafs.PyFileSystem(handler), scheme="file",
                      capabilities=LOCAL_CAPABILITIES, name="local")
    root = str(tmp_path / "durable")
    tier_root = str(tmp_path / "fast")
    s = Session(StorageContext.from_backend(backend, root, "exp", "t1"),
                local_tier=LocalTier(tier_root, num_to_keep=2))
    try:
        s.report({"loss": 0.5}, checkpoint=_src(tmp_path))  # its durable copy waits
        rows = _by_index(_ls(os.path.join(root, "exp", "t1")))
        assert rows[0]["tiers"] == ["local"] and rows[0]["durable"] == "pending"
        assert rows[0]["uri"].startswith(os.path.join(tier_root, "exp", "t1"))
        shown = json.loads(invoke(["show", os.path.join(tier_root, "exp", "t1",
                                                        "checkpoint_000000"), "--json"]).output)
        assert shown["tiers"] == ["local"] and shown["durable"] == "pending"
        handler.gate.set()
        s.wait()
        rows = _by_index(_ls(os.path.join(root, "exp", "t1")))
        assert rows[0]["tiers"] == ["durable", "local"] and rows[0]["durable"] == "committed"
    finally:
        handler.gate.set()
        s.close()


def test_a_trial_without_a_local_tier_lists_as_before(tmp_path):
    root = str(tmp_path / "plain")
    with session.start(storage_path=root, experiment_name="exp", trial_name="t1") as s:
        s.report({"loss": 0.5}, checkpoint=_src(tmp_path))
    data = _ls(os.path.join(root, "exp", "t1"))
    assert [r["index"] for r in data["checkpoints"]] == [0]
    assert "tiers" not in data["checkpoints"][0] and "durable" not in data["checkpoints"][0]
    assert "TIERS" not in invoke(["ls", os.path.join(root, "exp", "t1")]).output


def test_best_of_a_trial_ranks_its_local_tier_copies_too(durable, tmp_path):
    """``best`` of a trial whose best checkpoint is on its local tier only
    (``persist`` did not send it): the local copy is named, as the session's
    restore would find it (issue 37: the two tiers as one history)."""
    tier = LocalTier(str(tmp_path / "fast"), num_to_keep=3,
                     persist=lambda index, row: index == 0)
    with session.start(storage_path=durable.uri, storage_options=dict(durable.options) or None,
                       experiment_name="exp", trial_name="t1", local_tier=tier) as s:
        for loss in (3.0, 1.0, 2.0):
            s.report({"loss": loss}, checkpoint=_src(tmp_path))
        s.wait()
    res = invoke(["best", durable.join("exp", "t1"), "--metric", "loss", "--mode", "min",
                  "--json", *durable.opt_args()])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got["index"] == 1 and got["score"] == 1.0
    assert got["uri"].endswith(os.path.join("fast", "exp", "t1", "checkpoint_000001"))
    res = invoke(["download", got["uri"], str(tmp_path / "best")])
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(tmp_path / "best")) == ["model.bin", "opt"]
