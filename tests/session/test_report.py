"""report() on one rank: auto-filled metrics and JSON rules (issue: one report())."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from checkpoint_store import Checkpoint, MetadataError, session
from checkpoint_store.session import AUTO_FILLED


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_autofilled_metrics_on_every_report(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"w")
    with session.start(storage_path=str(tmp_path / "s"), experiment_name="e", trial_name="t"):
        first = session.report({"loss": 1.0})
        time.sleep(0.05)
        second = session.report({"loss": 0.5}, checkpoint=Checkpoint.from_directory(src))
    assert set(AUTO_FILLED) == {"training_iteration", "timestamp", "time_total_s",
                                "time_this_iter_s", "trial_id", "checkpoint_dir_name"}
    for row in (first, second):
        assert set(AUTO_FILLED) <= set(row)
        assert row["trial_id"] == "e/t"
    assert (first["training_iteration"], second["training_iteration"]) == (1, 2)
    assert (first["checkpoint_dir_name"], second["checkpoint_dir_name"]) == (
        None, "checkpoint_000000")
    assert second["time_this_iter_s"] >= 0.05
    assert second["time_total_s"] == pytest.approx(
        first["time_total_s"] + second["time_this_iter_s"], abs=0.01)
    assert second["timestamp"] - first["timestamp"] == pytest.approx(
        second["time_this_iter_s"], abs=0.01)
    assert _rows(tmp_path / "s" / "e" / "t" / "result.json") == [first, second]


def test_iterations_and_total_time_continue_after_restart(tmp_path):
    kw = dict(storage_path=str(tmp_path), experiment_name="e", trial_name="t")
    with session.start(**kw):
        session.report({"i": 1})
        last = session.report({"i": 2})
    with session.start(**kw):
        row = session.report({"i": 3})
    assert row["training_iteration"] == 3
    assert row["time_total_s"] >= last["time_total_s"]


def test_numpy_scalars_are_converted(tmp_path):
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t"):
        row = session.report({"acc": np.float32(0.25), "n": np.int64(7),
                              "ok": np.bool_(True), "nested": {"l": np.array(1.5)}})
    stored = _rows(tmp_path / "e" / "t" / "result.json")[0]
    assert stored["acc"] == 0.25 and stored["n"] == 7 and stored["ok"] is True
    assert stored["nested"] == {"l": 1.5}
    assert type(row["acc"]) is float and type(row["n"]) is int


def test_tensor_metric_is_refused_naming_the_key(tmp_path):
    torch = pytest.importorskip("torch")
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t"):
        with pytest.raises(MetadataError, match=r"'eval/logits'.*Tensor"):
            session.report({"eval": {"logits": torch.ones(3)}})
        with pytest.raises(MetadataError, match=r"'model'.*object"):
            session.report({"model": object()})
        row = session.report({"ok": 1})
    assert row["training_iteration"] == 1  # refused reports wrote nothing
    assert len(_rows(tmp_path / "e" / "t" / "result.json")) == 1


def test_reserved_keys_are_overwritten_by_autofill(tmp_path):
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t"):
        row = session.report({"training_iteration": 99, "trial_id": "mine"})
    assert (row["training_iteration"], row["trial_id"]) == (1, "e/t")


def test_report_without_session_says_how_to_start_one():
    from checkpoint_store import CheckpointStoreError

    with pytest.raises(CheckpointStoreError, match="session.start"):
        session.report({"x": 1})


def test_context_has_ray_style_accessors(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t"):
        ctx = session.get_context()
    assert (ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank()) == (0, 1, 0)
    assert (ctx.get_experiment_name(), ctx.get_trial_name(), ctx.get_trial_id()) == (
        "e", "t", "e/t")
    assert ctx.get_trial_dir() == f"file://{tmp_path}/e/t"
