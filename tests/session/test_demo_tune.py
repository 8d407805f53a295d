"""``checkpoint-store demo --tune``: an Optuna study over the digits MLP's learning rate."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from checkpoint_store import Checkpoint

pytest.importorskip("optuna")
pytest.importorskip("sklearn")


@pytest.mark.slow
def test_demo_tune_prints_best_trial_checkpoint_and_test_accuracy(tmp_path):
    from checkpoint_store.cli import main

    store = tmp_path / "store"
    result = CliRunner().invoke(
        main, ["demo", "--tune", "--trials", "4", "--parallel", "2", "--epochs", "5",
               "--storage", str(store)],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    out = result.output
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+(complete|pruned)\s+(\d+)\s+([\d.]+)$", out, re.M)
    assert sorted(int(r[0]) for r in rows) == [0, 1, 2, 3]
    best = re.search(r"Best trial: (\d+) \(lr ([\d.]+), val_accuracy ([\d.]+)\)", out)
    assert best, out
    uri = re.search(r"Its best checkpoint: (\S+) \(epoch (\d+)\)", out).group(1)
    acc = float(re.search(r"Test accuracy of the model loaded from it: ([\d.]+)", out).group(1))
    assert f"/digits-tune/trial_{int(best.group(1)):05d}/checkpoint_" in uri
    ckpt = Checkpoint(uri)
    assert ckpt.is_committed
    # The printed checkpoint is the one with the trial's best validation accuracy.
    assert ckpt.internal_metadata["metrics"]["val_accuracy"] == pytest.approx(
        float(best.group(3)), abs=1e-4)
    best_row = max(rows, key=lambda r: float(r[4]))
    assert float(best_row[4]) == pytest.approx(float(best.group(3)), abs=1e-4)
    assert 0.8 < acc <= 1.0
    # Each trial has its own directory with its own kept checkpoints.
    trials = sorted(p.name for p in (store / "digits-tune").iterdir())
    assert trials == [f"trial_{i:05d}" for i in range(4)]


def test_demo_tune_with_resume_is_refused_and_deletes_nothing(tmp_path):
    from checkpoint_store.cli import main

    previous = tmp_path / "store" / "digits-tune" / "trial_00000"
    previous.mkdir(parents=True)
    (previous / "result.json").write_text("{}\n")
    result = CliRunner().invoke(main, ["demo", "--tune", "--resume", "--storage",
                                       str(tmp_path / "store")])
    assert result.exit_code == 2
    assert "always starts fresh" in result.output
    assert (previous / "result.json").read_text() == "{}\n"
