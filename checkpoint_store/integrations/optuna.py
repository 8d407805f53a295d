"""Run a function trainable as an Optuna objective, with checkpoints kept per trial.

Usage::

    import optuna
    from checkpoint_store import CheckpointConfig
    from checkpoint_store.integrations.optuna import objective

    study = optuna.create_study(direction="maximize",
                                pruner=optuna.pruners.MedianPruner())
    study.optimize(
        objective(train_fn, lambda t: {"lr": t.suggest_float("lr", 1e-3, 1, log=True)},
                  storage_path="s3://bucket/runs", experiment_name="lr-sweep",
                  metric="val_accuracy", mode="max",
                  checkpoint_config=CheckpointConfig(num_to_keep=2)),
        n_trials=8, n_jobs=2,
    )
    best = study.best_trial.user_attrs["checkpoint_store.best_checkpoint"]

``train_fn`` is the same function a training run uses: it calls
``checkpoint_store.session.report(metrics, checkpoint=...)``. Each trial runs
in a :class:`~checkpoint_store.TrialRunner` under
``<storage_path>/<experiment_name>/trial_<number>/`` with its own top K.
Each report becomes ``trial.report(metrics[metric], step=training_iteration)``;
when the pruner says so, the trial is stopped through
:meth:`TrialRunner.stop` (the function unwinds at its blocked ``report()``)
and :class:`optuna.TrialPruned` is raised. Requires ``pip install
checkpoint-store[tune]``.

With ``preemption=`` (docs/preemption.md), a preemption signal ends the
running trials after their preemption checkpoint: each is told to the study
as ``FAIL`` with the user attribute :data:`ATTR_PREEMPTED` (the signal and
when), a retry with the same parameters is enqueued under the same trial
directory (:data:`ATTR_TRIAL_NAME`), and
:class:`~checkpoint_store.errors.Preempted` ends ``study.optimize`` (the
process exits with the scheduler's status). The next ``study.optimize``
on the same Optuna storage takes the retry first, and it resumes from the
preemption checkpoint. A retry that Optuna's ``RetryFailedTrialCallback``
enqueued (a trial whose process died without a signal, marked failed by its
heartbeat) runs under the directory of the trial it retries too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

from checkpoint_store.backends.handlers import check_filesystem
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.retention import CheckpointConfig, rank_key, score_of

__all__ = ["ATTR_BEST_CHECKPOINT", "ATTR_PREEMPTED", "ATTR_TRIAL_DIR", "ATTR_TRIAL_NAME",
           "objective"]

#: ``trial.user_attrs`` key: URI of the trial's best kept checkpoint (or None).
ATTR_BEST_CHECKPOINT = "checkpoint_store.best_checkpoint"
#: ``trial.user_attrs`` key: URI of the trial's directory.
ATTR_TRIAL_DIR = "checkpoint_store.trial_dir"
#: ``trial.user_attrs`` key of a trial a preemption signal ended (its state is
#: ``FAIL``): ``{"signal": "SIGTERM", "reason": "SIGTERM received at ..."}``.
ATTR_PREEMPTED = "checkpoint_store:preempted"
#: ``trial.user_attrs`` key: the trial's name (its directory). Set when a trial
#: starts; a trial that starts with it (the enqueued retry of a preempted
#: trial, a retry of Optuna's ``RetryFailedTrialCallback``, which copies the
#: user attributes) runs under that directory and resumes from its newest
#: checkpoint.
ATTR_TRIAL_NAME = "checkpoint_store:trial_name"


def _import_optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ImportError(
            "checkpoint_store.integrations.optuna needs Optuna: pip install "
            "'checkpoint-store[tune]'"
        ) from None
    return optuna


def objective(
    train_fn: Callable[..., Any],
    config: Mapping[str, Any] | Callable[[Any], Mapping[str, Any]] | None = None,
    *,
    storage_path: str | os.PathLike[str],
    experiment_name: str,
    metric: str,
    mode: Literal["max", "min"] = "max",
    checkpoint_config: CheckpointConfig | None = None,
    storage_filesystem: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    trial_name: Callable[[Any], str] | None = None,
    value: Literal["best", "last"] = "best",
    preemption: Any = None,
) -> Callable[[Any], float]:
    """An Optuna objective ``f(trial) -> float`` that runs ``train_fn`` for one trial.

    Args:
        train_fn: function trainable (see :class:`~checkpoint_store.TrialRunner`).
        config: the trial config: a callable ``trial -> dict`` that calls
            ``trial.suggest_*``, or a fixed dict; the suggested values are
            merged over a fixed dict's.
        storage_path, experiment_name, storage_filesystem, storage_options:
            where trials live.
        metric: the reported metric Optuna optimises and prunes on (a literal
            key or a ``/``-separated nested path).
        mode: ``"max"`` or ``"min"``; match the study's direction.
        checkpoint_config: retention per trial. Default: keep the best 2 by
            ``metric`` in ``mode``. Without a score attribute, ``metric`` and
            ``mode`` are filled in.
        trial_name: ``trial -> name``; default ``trial_<number:05d>``.
        value: what the objective returns: the best reported value of
            ``metric`` in ``mode`` (default; it matches the best kept
            checkpoint) or the last one (as Ray Tune's Optuna searcher does),
            over every report of the trial: a trial resumed under the same
            ``trial_name`` (a restart, a new machine) counts the reports of
            its earlier attempts (its ``result.json``) too.
        preemption: a :class:`~checkpoint_store.PreemptionConfig` (or True)
            for every trial's session (see above). Its signal handlers are
            installed here when ``objective()`` is called in the main thread
            (call it there, or call
            :func:`checkpoint_store.session.install_preemption_handlers`
            first).

    Returns:
        The objective. Each trial's ``user_attrs`` get
        :data:`ATTR_TRIAL_DIR` and :data:`ATTR_BEST_CHECKPOINT` (URIs).

    Raises:
        InvalidConfigError: at once, for a bad ``mode`` or ``value``, or a
            ``storage_filesystem`` that is no filesystem instance. From the
            objective: whatever ``train_fn`` raised; a metric that was never
            reported or is not a number (naming it); a trial directory whose
            ``params.json`` records another config (another study's trial of
            that number), before anything runs; ``optuna.TrialPruned``.
    """
    optuna = _import_optuna()
    if mode not in ("max", "min"):
        raise InvalidConfigError(f"mode must be 'max' or 'min', got {mode!r}")
    if value not in ("best", "last"):
        raise InvalidConfigError(f"value must be 'best' or 'last', got {value!r}")
    if not isinstance(metric, str) or not metric:
        raise InvalidConfigError(f"metric must be a non-empty string, got {metric!r}")
    if storage_filesystem is not None:  # each trial resolves it: refused now, not in trial 0
        check_filesystem(storage_filesystem, "storage_filesystem")
    from checkpoint_store.session._preemption import check_preemption, install_handlers

    preemption_config = check_preemption(preemption)
    if preemption_config is not None:
        import threading

        if threading.current_thread() is threading.main_thread():
            install_handlers(preemption_config.signals)
    if checkpoint_config is None:
        checkpoint_config = CheckpointConfig(
            num_to_keep=2, checkpoint_score_attribute=metric, checkpoint_score_order=mode
        )
    elif checkpoint_config.checkpoint_score_attribute is None:
        checkpoint_config = CheckpointConfig(
            num_to_keep=checkpoint_config.num_to_keep,
            checkpoint_score_attribute=metric,
            checkpoint_score_order=mode,
            keep_latest=checkpoint_config.keep_latest,
            missing_score=checkpoint_config.missing_score,
        )

    def run_trial(trial: Any) -> float:
        from checkpoint_store.errors import Preempted
        from checkpoint_store.session import TrialRunner

        if callable(config):
            cfg = dict(config(trial))
        else:
            cfg = dict(config or {})
        name = trial.user_attrs.get(ATTR_TRIAL_NAME)
        if not isinstance(name, str):  # not a retry: a trial directory of its own
            name = trial_name(trial) if trial_name is not None else f"trial_{trial.number:05d}"
            trial.set_user_attr(ATTR_TRIAL_NAME, name)
        _refuse_another_config(storage_path, experiment_name, name, cfg,
                               storage_filesystem, storage_options)
        runner = TrialRunner(
            train_fn, cfg, storage_path=storage_path, experiment_name=experiment_name,
            trial_name=name, checkpoint_config=checkpoint_config,
            storage_filesystem=storage_filesystem, storage_options=storage_options,
            preemption=preemption_config,
        )
        values: list[float] = []
        preempted: Preempted | None = None
        try:
            while (result := runner.step()) is not None:
                v = _metric_value(result, metric)
                if v is None:
                    continue
                values.append(v)
                trial.report(v, step=int(result["training_iteration"]))
                if trial.should_prune():
                    why = (f"pruned at training_iteration {result['training_iteration']} "
                           f"({metric}={v})")
                    runner.stop(reason=why, status="pruned")  # the trial shows as pruned
                    raise optuna.TrialPruned(why)
        except Preempted as exc:  # a SystemExit: it ends study.optimize, and the process
            preempted = exc
            raise
        finally:
            runner.stop()
            _record(trial, runner)
            if preempted is not None:
                _requeue(optuna, trial, name, preempted)
        # A trial resumed under its name (a restart, a new machine) continues
        # its history: its earlier attempts' reports count as much as this
        # one's, as its best kept checkpoint may be one of theirs.
        history = _history(runner, metric)
        if not history:
            raise InvalidConfigError(
                f"trial {name!r} never reported a number for metric {metric!r}; report it "
                "with checkpoint_store.session.report({...})"
            )
        if value == "last":
            return history[-1]
        return max(history, key=lambda v: rank_key(v, 0, mode))

    return run_trial


def _refuse_another_config(
    storage_path: str | os.PathLike[str], experiment_name: str, name: str,
    cfg: Mapping[str, Any], storage_filesystem: Any, storage_options: Mapping[str, Any] | None,
) -> None:
    """Refuse to run a trial under ``name`` when that trial directory's
    ``params.json`` records another config: its checkpoints and rows are
    another trial's (trial numbers start at 0 again in every new study, so a
    second study in the same ``experiment_name`` meets the first one's
    ``trial_00000``). Resuming there would load the other trial's weights and
    count its scores as this trial's. A directory without recorded params
    says nothing against it and is resumed as before.

    Raises:
        InvalidConfigError: the recorded config differs from ``cfg``.
    """
    from checkpoint_store._format import jsonrules as _json
    from checkpoint_store._results.trialfiles import read_params
    from checkpoint_store.storage import StorageContext

    storage = StorageContext(storage_path, experiment_name, name,
                             storage_filesystem=storage_filesystem,
                             storage_options=storage_options)
    recorded = read_params(storage.filesystem, storage.trial_path)
    if not recorded:
        return
    mine = {k: v for k, v in _json.loads(_json.dumps(_json.to_json_object(cfg, "config")))
            .items() if not k.startswith("_")}
    if recorded != mine:
        raise InvalidConfigError(
            f"trial directory {storage.uri(storage.trial_path)} holds a trial run with "
            f"another config ({recorded!r}; this trial's is {mine!r}), so this trial would "
            "resume from its checkpoints and count its scores; trial numbers start at 0 in "
            "every new study: give each study its own experiment_name (or trial_name=), "
            "or remove that directory"
        )


def _requeue(optuna: Any, trial: Any, name: str, exc: Any) -> None:
    """Tell the study ``trial`` failed because it was preempted and enqueue a
    retry with its parameters that resumes ``name`` (its trial directory)."""
    trial.set_user_attr(ATTR_PREEMPTED, {"signal": exc.signal, "reason": exc.reason})
    study = trial.study
    study.enqueue_trial(dict(trial.params), user_attrs={ATTR_TRIAL_NAME: name})
    study.tell(trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)


def _metric_value(result: Mapping[str, Any], metric: str) -> float | None:
    """The report's score for ``metric``, as retention reads it; None when this
    report did not carry it (or it is NaN)."""
    try:
        return score_of(result, metric)
    except InvalidConfigError as exc:
        # The same type (AmbiguousMetricError stays one), with what Optuna needs added.
        raise type(exc)(f"{exc}; Optuna needs a number") from None


def _history(runner: Any, metric: str) -> list[float]:
    """``metric`` of every report of the trial, oldest first: its ``result.json``
    rows, those of earlier attempts under the same name included."""
    sess = runner.session
    if sess is None:
        return []
    found = (_metric_value(row, metric) for row in sess.storage.read_results())
    return [v for v in found if v is not None]


def _record(trial: Any, runner: Any) -> None:
    sess = runner.session
    if sess is None:
        return
    try:
        trial.set_user_attr(ATTR_TRIAL_DIR, sess.get_context().trial_dir)
        best = runner.best_checkpoints
        trial.set_user_attr(ATTR_BEST_CHECKPOINT, best[0][0].uri if best else None)
    except Exception:  # noqa: BLE001 - never hide the trial's own outcome
        pass
