"""A preemption signal in a trial of a TrialRunner and of an Optuna study: the
trial commits a preemption checkpoint, is recorded as preempted (not failed)
and the next run resumes it from that checkpoint. Real signals: the trial's
thread sends SIGTERM to this process; the driver's thread runs the handler."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from checkpoint_store import Checkpoint, StorageContext, TrialRunner, session
from checkpoint_store.errors import InvalidConfigError, Preempted

# Each test starts from a fresh process's handlers (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_signal_handlers")


def _preempt_self() -> None:
    """What a scheduler does: SIGTERM to this process; return once the session
    has seen it (the handler runs in the main thread, the driver's)."""
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not session.reached_preemption():
        assert time.monotonic() < deadline, "the signal never reached the session"
        time.sleep(0.005)


def _train(tmp_path, last: int, preempt_at: set[int]):
    """Resumes from its newest checkpoint; one checkpoint per step; the
    scheduler's signal arrives during a step in ``preempt_at`` (once each)."""

    def train(config):
        ckpt = session.get_checkpoint()
        start = ckpt.internal_metadata["metrics"]["step"] if ckpt else 0
        for step in range(start + 1, last + 1):
            d = tmp_path / "src" / uuid.uuid4().hex
            d.mkdir(parents=True)
            (d / "w.txt").write_text(str(step))
            if step in preempt_at:
                preempt_at.discard(step)
                _preempt_self()
            session.report({"loss": 1.0 / step, "step": step},
                           checkpoint=Checkpoint.from_directory(d))

    return train


def _checkpoints(storage: StorageContext) -> dict[int, dict]:
    return {meta["metrics"]["step"]: meta for _, meta in storage.committed_checkpoints()}


def test_trial_runner_preempted_trial_is_recorded_and_resumes(tmp_path):
    store = str(tmp_path / "store")
    kw = {"storage_path": store, "experiment_name": "sweep", "trial_name": "t0"}
    runner = TrialRunner(_train(tmp_path, 5, {3}), {"lr": 0.1}, preemption=True, **kw)
    results = []
    with pytest.raises(Preempted) as info:
        while (r := runner.step()) is not None:
            results.append(r)
    assert info.value.code == 143 and info.value.signal == "SIGTERM"
    assert isinstance(info.value, SystemExit)
    assert runner.status == "preempted"
    # The step the signal arrived in was committed, marked as a preemption checkpoint.
    assert [r["step"] for r in results] == [1, 2, 3]
    assert results[-1]["checkpoint"].internal_metadata["preemption"]["signal"] == "SIGTERM"
    storage = StorageContext(store, "sweep", "t0")
    metas = _checkpoints(storage)
    assert sorted(metas) == [1, 2, 3]
    assert metas[3]["preemption"]["grace_period_s"] == 30.0
    assert "preemption" not in metas[2]
    assert storage.read_stop()["status"] == "preempted"
    assert storage.read_error() is None  # preempted is not failed
    runner.stop()
    assert runner.status == "preempted"  # stop() after the end keeps the outcome

    # A restart: a new runner of the same trial resumes from the preemption checkpoint.
    again = TrialRunner(_train(tmp_path, 5, set()), {"lr": 0.1}, preemption=True, **kw)
    steps = [r["step"] for r in iter(again.step, None)]
    assert steps == [4, 5]
    assert again.status == "finished"
    assert sorted(_checkpoints(storage)) == [1, 2, 3, 4, 5]
    assert [r["step"] for r in storage.read_results()] == [1, 2, 3, 4, 5]


def test_trial_runner_resumes_in_the_same_runner_after_preemption(tmp_path):
    store = str(tmp_path / "store")
    runner = TrialRunner(_train(tmp_path, 4, {2}), storage_path=store, experiment_name="e",
                         trial_name="t", preemption=True)
    with pytest.raises(Preempted):
        while runner.step() is not None:
            pass
    # The next step() starts the function again; it resumes from step 2.
    assert [r["step"] for r in iter(runner.step, None)] == [3, 4]
    assert runner.status == "finished"


def test_trial_runner_preemption_outside_main_thread_needs_installed_handlers(tmp_path):
    import threading

    out: dict[str, BaseException] = {}

    def build() -> None:
        try:
            TrialRunner(lambda: None, storage_path=str(tmp_path), experiment_name="e",
                        trial_name="t", preemption=True)
        except BaseException as exc:  # collected for the test
            out["error"] = exc

    t = threading.Thread(target=build)
    t.start()
    t.join()
    assert isinstance(out.get("error"), InvalidConfigError)
    assert "install_preemption_handlers" in str(out["error"])
    assert not (tmp_path / "e").exists()  # refused before anything was written
    session.install_preemption_handlers(["SIGTERM"])
    t = threading.Thread(target=build)
    out.clear()
    t.start()
    t.join()
    assert out == {}


optuna = pytest.importorskip("optuna")


def test_optuna_preempted_trial_is_marked_requeued_and_resumed(tmp_path):
    from checkpoint_store.integrations.optuna import (
        ATTR_PREEMPTED,
        ATTR_TRIAL_NAME,
        objective,
    )

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    store = str(tmp_path / "store")
    preempt_at = {2}
    f = objective(_train(tmp_path, 4, preempt_at), lambda t: {"x": t.suggest_float("x", 0, 1)},
                  storage_path=store, experiment_name="sweep", metric="loss", mode="min",
                  preemption=True)
    study = optuna.create_study(direction="minimize",
                                storage=f"sqlite:///{tmp_path / 'study.db'}",
                                study_name="s")
    with pytest.raises(Preempted) as info:
        study.optimize(f, n_trials=3)
    assert info.value.code == 143
    first, retry = study.get_trials(deepcopy=False)
    # Failed, with a mark saying why, and a retry of the same parameters waiting.
    assert first.state == optuna.trial.TrialState.FAIL
    assert first.user_attrs[ATTR_PREEMPTED]["signal"] == "SIGTERM"
    assert first.intermediate_values == {1: 1.0, 2: 0.5}
    assert retry.state == optuna.trial.TrialState.WAITING
    assert retry.user_attrs[ATTR_TRIAL_NAME] == "trial_00000"
    storage = StorageContext(store, "sweep", "trial_00000")
    assert storage.read_stop()["status"] == "preempted"
    metas = _checkpoints(storage)
    assert sorted(metas) == [1, 2] and metas[2]["preemption"]["signal"] == "SIGTERM"

    # A restart of the process: the same study (its storage) runs the retry first,
    # which resumes the trial's directory from the preemption checkpoint.
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}")
    study.optimize(f, n_trials=1)
    resumed = study.trials[1]
    assert resumed.state == optuna.trial.TrialState.COMPLETE
    assert resumed.params == first.params
    assert resumed.intermediate_values == {3: 1 / 3, 4: 0.25}
    assert resumed.value == 0.25
    # Retention keeps the best two by loss (the objective's default).
    assert sorted(_checkpoints(storage)) == [3, 4]
    assert [r["step"] for r in storage.read_results()] == [1, 2, 3, 4]
    assert not (tmp_path / "store" / "sweep" / "trial_00001").exists()
