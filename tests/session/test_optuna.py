"""checkpoint_store.integrations.optuna with a real Optuna study (threads, a pruner)."""

from __future__ import annotations

import os
import threading
import uuid

import pytest

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext, session
from checkpoint_store.errors import InvalidConfigError

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


class _Preempted(Exception):
    """The machine went away mid-trial."""


def _resumable_train(tmp_path, scores: dict[int, float], stop_after: set[int]):
    """A trial function that continues from its newest checkpoint, reports
    ``scores[step]`` with a checkpoint per step, and is cut off after a step
    in ``stop_after`` (once)."""

    def train(config):
        ckpt = session.get_checkpoint()
        start = ckpt.internal_metadata["metrics"]["step"] if ckpt else 0
        for step in range(start + 1, max(scores) + 1):
            d = tmp_path / "src" / uuid.uuid4().hex
            d.mkdir(parents=True)
            (d / "w.txt").write_text(str(scores[step]))
            session.report({"loss": scores[step], "step": step},
                           checkpoint=Checkpoint.from_directory(d))
            if step in stop_after:
                stop_after.discard(step)
                raise _Preempted(f"preempted after step {step}")

    return train


@pytest.mark.parametrize("where", ["local", "s3"])
def test_resumed_trial_returns_the_best_of_its_whole_history(tmp_path, request, where):
    if where == "s3":
        loc = request.getfixturevalue("s3_location")
        kw = {"storage_path": loc.uri, "storage_options": loc.storage_options}
    else:
        kw = {"storage_path": str(tmp_path / "store")}
    scores = {1: 0.5, 2: 0.2, 3: 0.4, 4: 0.6, 5: 0.7}
    train = _resumable_train(tmp_path, scores, stop_after={3})
    f = objective(train, storage_path=kw["storage_path"], experiment_name="sweep",
                  storage_options=kw.get("storage_options"), metric="loss", mode="min",
                  trial_name=lambda t: "the-trial")
    study = optuna.create_study(direction="minimize")
    study.optimize(f, n_trials=1, catch=(_Preempted,))   # steps 1-3, then preempted
    assert study.trials[0].state == optuna.trial.TrialState.FAIL
    study.optimize(f, n_trials=1)                        # resumed: steps 4-5
    resumed = study.trials[1]
    assert resumed.intermediate_values == {4: 0.6, 5: 0.7}
    best = Checkpoint(resumed.user_attrs[ATTR_BEST_CHECKPOINT],
                      storage_options=kw.get("storage_options"))
    assert best.internal_metadata["metrics"]["loss"] == 0.2
    # The value is the best of the trial's history (step 2), as the checkpoint named.
    assert resumed.value == 0.2
    assert study.best_value == 0.2


def test_resumed_trial_with_nothing_left_to_run_returns_its_history(tmp_path):
    store = str(tmp_path / "store")
    scores = {1: 0.3, 2: 0.9, 3: 0.5}
    kw = {"storage_path": store, "experiment_name": "sweep", "metric": "loss",
          "trial_name": lambda t: "the-trial"}
    study = optuna.create_study(direction="maximize")
    study.optimize(objective(_resumable_train(tmp_path, scores, set()), **kw), n_trials=1)
    assert study.best_value == 0.9
    # Run again (a restart after the study's own record was lost): the function
    # finds its last checkpoint at the end and reports nothing new.
    study2 = optuna.create_study(direction="maximize")
    study2.optimize(objective(_resumable_train(tmp_path, scores, set()), **kw), n_trials=1)
    assert study2.best_value == 0.9
    study3 = optuna.create_study(direction="maximize")
    study3.optimize(objective(_resumable_train(tmp_path, scores, set()), value="last", **kw),
                    n_trials=1)
    assert study3.best_value == 0.5


def test_new_study_in_the_same_experiment_never_resumes_the_old_trials(tmp_path):
    """Trial numbers start at 0 in every study: the second study's trial 0
    must not load the first one's checkpoint nor count its scores."""
    store = str(tmp_path / "store")
    loaded: list[object] = []

    def train(config):
        ckpt = session.get_checkpoint()
        loaded.append(ckpt)
        d = tmp_path / "src" / uuid.uuid4().hex
        d.mkdir(parents=True)
        (d / "w.txt").write_text(str(config["x"]))
        session.report({"score": config["x"]}, checkpoint=Checkpoint.from_directory(d))

    def study_of(x):
        study = optuna.create_study(direction="maximize")
        study.enqueue_trial({"x": x})
        study.optimize(objective(train, lambda t: {"x": t.suggest_float("x", 0, 10)},
                                 storage_path=store, experiment_name="sweep",
                                 metric="score"),
                       n_trials=1, catch=(InvalidConfigError,))
        return study

    first = study_of(9.0)
    assert first.best_value == 9.0
    second = study_of(1.0)
    assert second.trials[0].state == optuna.trial.TrialState.FAIL
    assert loaded == [None]  # the second trial never ran on the first one's directory
    assert StorageContext(store, "sweep", "trial_00000").read_results()[-1]["score"] == 9.0
    # The same config again (a restart that lost the study's record) resumes.
    third = study_of(9.0)
    assert third.best_value == 9.0
    assert len(loaded) == 2 and loaded[1] is not None
