"""The README's examples give what its text says (tests/docs/test_docs.py runs
every block of it; here their outcomes, and the torchrun line on 2 ranks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint_store import StorageContext
from tests.docs.test_docs import README, blocks_of

torch = pytest.importorskip("torch")


def _block(lang: str, needle: str, *, title: str | None = None):
    return next(b for b in blocks_of(README) if b.lang == lang and needle in b.body
                and (title is None or b.title == title))


def test_the_first_python_example_reports_the_state_and_resumes(tmp_path, monkeypatch):
    first = next(b for b in blocks_of(README) if b.lang == "python")
    # The first way shown is the PyTorch one: report(state=...), not torch.save.
    assert "state={" in first.body and "torch.save" not in first.body
    monkeypatch.chdir(tmp_path)
    exec(compile(first.body, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102
    trial = tmp_path / "results" / "exp" / "run1"
    kept = sorted(p.name for p in trial.iterdir() if p.name.startswith("checkpoint_"))
    # num_to_keep=3 by rising val_accuracy: the last three of ten reports.
    assert kept == ["checkpoint_000007", "checkpoint_000008", "checkpoint_000009"]
    assert len((trial / "result.json").read_text().splitlines()) == 10
    [*_, (latest, meta)] = StorageContext("./results", "exp", "run1").committed_checkpoints()
    saved = latest.load_state()
    assert saved["epoch"] == 9 and meta["metrics"]["val_accuracy"] == pytest.approx(0.95)
    assert set(saved["model"]) == {"weight", "bias"}
    # Run again: it resumes after epoch 9, so there is nothing left to train.
    exec(compile(first.body, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102
    assert len((trial / "result.json").read_text().splitlines()) == 10


def test_the_trial_runner_example_defines_train_fn() -> None:
    tuner = _block("python", "TrialRunner(")
    assert re.search(r"^def train_fn\(", tuner.body, re.M), tuner.body


def _run_torchrun_line(tmp_path: Path, train_py: str) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(train_py, encoding="utf-8")
    line = _block("bash", "torchrun").body
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", line], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_torchrun_line_runs_train_py_on_two_ranks(tmp_path) -> None:
    train_py = _block("python", "world_rank", title="train.py").body
    proc = _run_torchrun_line(tmp_path, train_py)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ctx = StorageContext(str(tmp_path / "results"), "files", "run1")
    committed = ctx.committed_checkpoints()
    # num_to_keep=2 by falling loss: the last two of three, each with both ranks' files.
    assert [m["index"] for _, m in committed] == [1, 2]
    for _, meta in committed:
        assert meta["world_size"] == 2
        assert sorted(e["path"] for e in meta["manifest"]) == ["model-rank0.bin",
                                                               "model-rank1.bin"]
    local = committed[-1][0].to_directory(tmp_path / "down")
    assert (Path(local) / "model-rank1.bin").read_bytes() == b"weights of rank 1"


@pytest.mark.slow
def test_one_file_name_on_every_rank_is_the_conflict_the_readme_avoids(tmp_path) -> None:
    # The README's earlier example wrote "model.bin" on every rank: under torchrun
    # that is refused, which is why train.py names its files per rank.
    train_py = _block("python", "world_rank", title="train.py").body.replace(
        'f"model-rank{rank}.bin"', '"model.bin"')
    assert '"model.bin"' in train_py
    proc = _run_torchrun_line(tmp_path, train_py)
    assert proc.returncode != 0
    assert "CheckpointConflictError" in proc.stderr and "model.bin" in proc.stderr
