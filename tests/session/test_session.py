"""session.start/report/get_checkpoint end to end (issue: walking skeleton)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from checkpoint_store import Checkpoint, CheckpointConfig, MetadataError, session


def _ckpt(tmp_path, name: str, payload: bytes) -> Checkpoint:
    d = tmp_path / name
    d.mkdir()
    (d / "weights.bin").write_bytes(payload)
    return Checkpoint.from_directory(d)


def _checkpoint_dirs(trial_dir) -> list[str]:
    return sorted(p.name for p in trial_dir.iterdir() if p.name.startswith("checkpoint_"))


def _rows(trial_dir) -> list[dict]:
    with open(os.path.join(trial_dir, "result.json")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_report_writes_result_rows_and_params(tmp_path):
    store = tmp_path / "store"
    with session.start(storage_path=str(store), experiment_name="e", trial_name="t",
                       config={"lr": 0.1}) as s:
        session.report({"loss": 2.0})
        session.report({"loss": 1.0}, checkpoint=_ckpt(tmp_path, "c", b"w"))
        assert session.get_context().trial_id == "e/t"
        assert s.get_checkpoint().path.endswith("checkpoint_000000")
    trial = store / "e" / "t"
    rows = _rows(trial)
    assert [r["training_iteration"] for r in rows] == [1, 2]
    assert [r["checkpoint_dir_name"] for r in rows] == [None, "checkpoint_000000"]
    assert rows[1]["time_total_s"] >= rows[0]["time_total_s"] >= 0
    assert all(isinstance(r["timestamp"], float) for r in rows)
    assert json.loads((trial / "params.json").read_text()) == {"lr": 0.1}
    internal = json.loads((trial / "checkpoint_000000" / ".internal_metadata.json").read_text())
    assert internal["metrics"]["loss"] == 1.0
    assert internal["metrics"]["training_iteration"] == 2


def test_literal_slash_key_reads_back_and_ranks(tmp_path):
    cfg = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="ptl/val_acc")
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t",
                       checkpoint_config=cfg) as s:
        for i, acc in enumerate([0.9, 0.5, 0.7]):
            session.report({"ptl/val_acc": acc, "ptl": {"val_acc": -acc}},
                           checkpoint=_ckpt(tmp_path, f"c{i}", b"x"))
        best = s.manager.best_checkpoint
    assert best.internal_metadata["metrics"]["ptl/val_acc"] == 0.9
    rows = _rows(tmp_path / "e" / "t")
    assert [r["ptl/val_acc"] for r in rows] == [0.9, 0.5, 0.7]
    assert _checkpoint_dirs(tmp_path / "e" / "t") == ["checkpoint_000000", "checkpoint_000002"]


@pytest.mark.parametrize("bad", [[1, 2], 3.0, "loss", None])
def test_metrics_must_be_a_dict(tmp_path, bad):
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t"):
        with pytest.raises(MetadataError, match="metrics must be a dict"):
            session.report(bad)
    assert not (tmp_path / "e" / "t" / "result.json").exists()


def test_report_outside_a_session_says_how_to_start_one():
    with pytest.raises(Exception, match="session.start"):
        session.report({"x": 1})


def test_new_process_continues_numbering_and_leaves_old_checkpoints_intact(tmp_path):
    store = tmp_path / "store"
    with session.start(storage_path=str(store), experiment_name="e", trial_name="t"):
        session.report({"i": 0}, checkpoint=_ckpt(tmp_path, "a", b"first"))
        session.report({"i": 1}, checkpoint=_ckpt(tmp_path, "b", b"second"))
    trial = store / "e" / "t"

    def snapshot(name):
        d = trial / name
        return {p.name: p.read_bytes() for p in d.iterdir()}

    before = {n: snapshot(n) for n in ("checkpoint_000000", "checkpoint_000001")}
    src = tmp_path / "c"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"third")
    code = textwrap.dedent(f"""
        from checkpoint_store import Checkpoint, session
        with session.start(storage_path={str(store)!r}, experiment_name="e", trial_name="t"):
            assert session.get_checkpoint().path.endswith("checkpoint_000001")
            row = session.report({{"i": 2}}, checkpoint=Checkpoint.from_directory({str(src)!r}))
            print(row["checkpoint_dir_name"], row["training_iteration"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["checkpoint_000002", "3"]
    assert {n: snapshot(n) for n in before} == before
    assert (trial / "checkpoint_000002" / "weights.bin").read_bytes() == b"third"


def test_num_to_keep_none_keeps_everything(tmp_path):
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t",
                       checkpoint_config=CheckpointConfig(num_to_keep=None,
                                                          checkpoint_score_attribute="s")):
        for i in range(5):
            session.report({"s": float(i)}, checkpoint=_ckpt(tmp_path, f"c{i}", b"x"))
    assert _checkpoint_dirs(tmp_path / "e" / "t") == [f"checkpoint_{i:06d}" for i in range(5)]


def test_memory_storage_end_to_end(tmp_path):
    cfg = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="acc")
    with session.start(storage_path="memory://sess-e2e", experiment_name="e", trial_name="t",
                       checkpoint_config=cfg) as s:
        for i, acc in enumerate([0.9, 0.5, 0.7]):
            session.report({"acc": acc}, checkpoint=_ckpt(tmp_path, f"m{i}", bytes([i]) * 10))
        best = s.manager.best_checkpoint
    assert best.uri == "memory://sess-e2e/e/t/checkpoint_000000"
    with best.as_directory() as d:
        assert open(os.path.join(d, "weights.bin"), "rb").read() == b"\x00" * 10
    with session.start(storage_path="memory://sess-e2e", experiment_name="e", trial_name="t"):
        assert session.get_checkpoint().uri.endswith("checkpoint_000002")


def test_a_torn_last_result_row_does_not_swallow_the_next_one(tmp_path):
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t"):
        session.report({"i": 1})
    result = tmp_path / "e" / "t" / "result.json"
    with open(result, "ab") as f:
        f.write(b'{"i": 2, "training_itera')  # a crash mid-append
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t"):
        session.report({"i": 3})
        session.report({"i": 4})
    lines = result.read_bytes().splitlines()
    assert len(lines) == 4
    assert [json.loads(lines[k])["i"] for k in (0, 2, 3)] == [1, 3, 4]
    assert [json.loads(lines[k])["training_iteration"] for k in (2, 3)] == [2, 3]
