"""checkpoint_store.integrations.optuna with a real Optuna study (threads, a pruner)."""

from __future__ import annotations

import os
import threading

import pytest

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext, session

optuna = pytest.importorskip("optuna")
from checkpoint_store.integrations.optuna import (  # noqa: E402
    ATTR_BEST_CHECKPOINT,
    ATTR_TRIAL_DIR,
    objective,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_study_reports_prunes_through_stop_and_keeps_top_k_per_trial(tmp_path):
    store = str(tmp_path / "store")
    finished: dict[float, str] = {}
    lock = threading.Lock()

    def train(config):
        x = config["x"]
        outcome = "stopped"
        try:
            for step in range(1, 6):
                d = tmp_path / "src" / f"{x}-{step}"
                d.mkdir(parents=True)
                (d / "w.txt").write_text(f"{x * step}")
                # Peaks at step 3, so the best checkpoint is not the last one.
                session.report({"score": x * (3 - abs(3 - step))},
                               checkpoint=Checkpoint.from_directory(d))
            outcome = "completed"
        finally:
            with lock:
                finished[x] = outcome

    study = optuna.create_study(direction="maximize",
                                pruner=optuna.pruners.ThresholdPruner(lower=0.0))
    for x in (1.0, -1.0, 2.0, -2.0):
        study.enqueue_trial({"x": x})
    study.optimize(
        objective(train, lambda t: {"x": t.suggest_float("x", -2, 2)},
                  storage_path=store, experiment_name="sweep", metric="score", mode="max",
                  checkpoint_config=CheckpointConfig(num_to_keep=2)),
        n_trials=4, n_jobs=2,
    )
    by_x = {t.params["x"]: t for t in study.trials}
    assert by_x[1.0].state == optuna.trial.TrialState.COMPLETE
    assert by_x[-1.0].state == optuna.trial.TrialState.PRUNED
    # Every report became trial.report(value, step=training_iteration).
    assert by_x[2.0].intermediate_values == {1: 2.0, 2: 4.0, 3: 6.0, 4: 4.0, 5: 2.0}
    assert by_x[-2.0].intermediate_values == {1: -2.0}
    # Pruned trials unwound through the stop path (their finally blocks ran).
    assert finished == {1.0: "completed", -1.0: "stopped", 2.0: "completed",
                        -2.0: "stopped"}
    assert study.best_value == 6.0 and study.best_trial.params["x"] == 2.0
    # Each trial keeps its own top 2 (plus the latest) in its own directory.
    for t in study.trials:
        trial_dir = t.user_attrs[ATTR_TRIAL_DIR]
        assert trial_dir.endswith(f"/sweep/trial_{t.number:05d}")
        ctx = StorageContext(store, "sweep", f"trial_{t.number:05d}")
        kept = [c.internal_metadata["metrics"]["score"] for c, _ in ctx.committed_checkpoints()]
        if t.state == optuna.trial.TrialState.COMPLETE:
            x = t.params["x"]
            assert sorted(kept) == sorted([3 * x, 2 * x, x])  # best 2 + latest
        else:
            assert len(kept) == 1
    best = Checkpoint(study.best_trial.user_attrs[ATTR_BEST_CHECKPOINT])
    with best.as_directory() as d:
        assert open(os.path.join(d, "w.txt")).read() == "6.0"


def test_objective_errors(tmp_path):
    from checkpoint_store import InvalidConfigError

    with pytest.raises(InvalidConfigError):
        objective(lambda c: None, storage_path=str(tmp_path), experiment_name="e",
                  metric="m", mode="up")

    def silent(config):
        session.report({"other": 1})

    study = optuna.create_study()
    f = objective(silent, storage_path=str(tmp_path), experiment_name="e", metric="m")
    with pytest.raises(InvalidConfigError, match="never reported"):
        f(study.ask())

    def boom(config):
        session.report({"m": 1.0})
        raise ZeroDivisionError("train_fn failed")

    with pytest.raises(ZeroDivisionError, match="train_fn failed"):
        objective(boom, storage_path=str(tmp_path), experiment_name="e2", metric="m")(
            study.ask())


def test_objective_finds_flattened_metrics_and_refuses_ambiguous_ones(tmp_path):
    """Ray's lookup (issue 14): ``"nested/sub/attr"`` finds the value whichever way the
    keys split; two different values under one name are an error naming both."""
    from checkpoint_store import AmbiguousMetricError

    def train(config):
        session.report({"nested": {"sub/attr": 1.0}})
        session.report({"nested/sub": {"attr": 5.0}})

    study = optuna.create_study(direction="maximize")
    study.optimize(objective(train, lambda t: {}, storage_path=str(tmp_path / "a"),
                             experiment_name="e", metric="nested/sub/attr", mode="max"),
                   n_trials=1)
    assert study.best_value == 5.0

    def ambiguous(config):
        session.report({"nested": {"sub/attr": 1.0}, "nested/sub": {"attr": 2.0}})

    study = optuna.create_study(direction="maximize")
    with pytest.raises(AmbiguousMetricError, match=r"\['nested'\]\['sub/attr'\].*\['nested/sub'\]"):
        study.optimize(objective(ambiguous, lambda t: {}, storage_path=str(tmp_path / "b"),
                                 experiment_name="e", metric="nested/sub/attr", mode="max"),
                       n_trials=1)
