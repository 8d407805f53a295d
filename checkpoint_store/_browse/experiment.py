"""An experiment as one object: its trials with status, parameters and best
checkpoint, and the best trial of all (:class:`Experiment`).

What Ray users know from ``ResultGrid.get_best_result()`` and Optuna users
from ``study.best_trial``, read from storage alone (any backend), by the
readers ``ls``, ``best`` and the page use: the trial listing and status of
:mod:`.locations` and :mod:`.status`, the checkpoints and metrics the
trial's retention state records (:func:`~.locations.recorded_checkpoints`,
else every checkpoint's metadata), the metric and order the trial recorded
(:mod:`checkpoint_store.retention.recorded`) and the retention manager's
ranking (:func:`checkpoint_store.retention.rank_key`: NaN or missing scores
rank last, ties go to the newer checkpoint).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from checkpoint_store._browse.locations import (
    Location,
    classify,
    committed_checkpoints,
    describe_kind,
    follow,
    foreign_of,
    list_entries,
    not_walked_message,
    read_internal,
    recorded_checkpoints,
    storage_context,
    trials_under,
)
from checkpoint_store._browse.status import trial_status
from checkpoint_store._format.layout import ERROR_FILE, PARAMS_FILE, validate_component
from checkpoint_store._results.trialfiles import read_error, read_params
from checkpoint_store.errors import (
    CheckpointNotFoundError,
    InvalidConfigError,
    MetricMismatchError,
)

if TYPE_CHECKING:
    from checkpoint_store.checkpoint import Checkpoint

__all__ = ["Experiment", "TrialSummary", "experiment_of", "flatten", "rank_checkpoints",
           "summarize_trial", "trial_checkpoints"]

#: ``(checkpoint location, internal metadata)``, oldest first.
_Listed = list[tuple[Location, dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class TrialSummary:
    """One trial of an :class:`Experiment`, as storage records it.

    ``status`` is one of :data:`checkpoint_store._browse.status.STATUSES`
    (``running``, ``finished``, ``pruned``, ``stopped``, ``preempted``,
    ``errored``, ``interrupted``; docs/cli.md); ``reason`` says why it ended
    early (``stopped.json``) or the last line of its error, else None.
    ``params`` is the trial's ``params.json`` (``session.start(config=...)``),
    ``{}`` when none was recorded. ``metric`` and ``mode`` are the score
    attribute and order the trial recorded (its retention state; without one,
    the metric its framework monitored), None when it recorded none;
    ``best_checkpoint`` and ``best_score`` are the best by them (a checkpoint
    with a numeric score first; without a metric, the newest checkpoint and
    None), ``best_metrics`` the metrics reported with it. ``checkpoints``
    counts its committed checkpoints (those a read found damaged left out).
    """

    name: str
    uri: str
    status: str
    reason: str | None
    params: dict[str, Any]
    metric: str | None
    mode: str | None
    best_checkpoint: Checkpoint | None
    best_score: float | None
    best_metrics: dict[str, Any]
    checkpoints: int
    latest_index: int | None = None
    latest_created_at: float | None = None
    _listed: tuple[tuple[Location, dict[str, Any]], ...] = dataclasses.field(
        default=(), repr=False, compare=False)

    def best(self, metric: str, mode: str) -> tuple[Checkpoint, float | None] | None:
        """``(checkpoint, score)`` of this trial's best by ``metric`` in ``mode``
        (``"min"`` or ``"max"``), or None without a committed checkpoint."""
        ranked = rank_checkpoints(list(self._listed), metric, mode)
        if not ranked:
            return None
        loc, _meta, score = ranked[0]
        return _checkpoint(loc), score

    def to_dict(self) -> dict[str, Any]:
        """This trial as JSON-ready values (``best_checkpoint`` as its URI)."""
        return {"name": self.name, "uri": self.uri, "status": self.status,
                "reason": self.reason, "metric": self.metric, "mode": self.mode,
                "best_score": self.best_score,
                "best_checkpoint": None if self.best_checkpoint is None
                else self.best_checkpoint.uri,
                "checkpoints": self.checkpoints, "latest_index": self.latest_index,
                "latest_created_at": self.latest_created_at, "params": dict(self.params)}


def _checkpoint(loc: Location) -> Checkpoint:
    from checkpoint_store.checkpoint import Checkpoint

    return Checkpoint._from_backend(loc.backend, loc.path)


def _metrics(meta: Mapping[str, Any]) -> dict[str, Any]:
    metrics = meta.get("metrics")
    return dict(metrics) if isinstance(metrics, Mapping) else {}


def _score(meta: Mapping[str, Any], metric: str) -> float | None:
    """The numeric score of ``metric``; None when missing, NaN or not a number
    (data another tool wrote: ranked as missing, never raised for one trial)."""
    from checkpoint_store.retention import score_of

    try:
        return score_of(_metrics(meta), metric)
    except InvalidConfigError:
        return None


def rank_checkpoints(listed: _Listed, metric: str | None, mode: str | None
                     ) -> list[tuple[Location, dict[str, Any], float | None]]:
    """``(checkpoint, meta, score)`` best first by the retention manager's
    ranking (:func:`~checkpoint_store.retention.rank_key`); without ``metric``,
    newest first with no scores."""
    from checkpoint_store.retention import rank_key

    scored = [(loc, meta, _score(meta, metric) if metric else None) for loc, meta in listed]
    scored.sort(key=lambda t: rank_key(t[2], t[1]["index"], mode or "max"), reverse=True)
    return scored


def trial_checkpoints(trial: Location, problems: list[str] | None = None
                      ) -> tuple[_Listed, list[tuple[str, bool]] | None]:
    """The trial's committed checkpoints with their metadata, oldest first,
    and the listing made when one was: from its retention state and one
    listing (:func:`recorded_checkpoints`), else every checkpoint's metadata
    (those the state records as damaged, and another run's or trial's copied
    in, left out either way: the manager never ranks them). Why a state that
    is there cannot be used is appended to ``problems``."""
    recorded = recorded_checkpoints(trial, problems)
    if recorded is not None:
        return [(c, m) for c, m in recorded.checkpoints if c.name not in recorded.foreign], \
            recorded.entries
    from checkpoint_store.retention.statelog import recorded_state

    ctx = storage_context(trial, strict=False)
    invalid = recorded_state(ctx)[0] if ctx is not None else {}
    listed = [(c, m) for c, m in committed_checkpoints(trial) if c.name not in invalid]
    foreign = foreign_of(trial, listed)
    return [(c, m) for c, m in listed if c.name not in foreign], None


def _recorded_metric(trial: Location, listed: _Listed) -> tuple[str | None, str | None]:
    """The ``(metric, mode)`` the trial records: its retention state's, else its
    framework's monitored one (:func:`monitored_attribute`)."""
    from checkpoint_store.retention.recorded import (
        UnreadableStateError,
        monitored_attribute,
        score_attribute,
    )

    try:
        metric, mode = score_attribute(trial)
    except UnreadableStateError:
        metric, mode = None, None
    if metric is None:
        metric, mode = monitored_attribute(listed)
    # Recorded without an order (a monitored metric, say): the CLI's default.
    return metric, ((mode or "max") if metric else None)


def summarize_trial(trial: Location, listed: _Listed | None = None,
                    entries: list[tuple[str, bool]] | None = None) -> TrialSummary:
    """The :class:`TrialSummary` of ``trial``; ``listed`` and ``entries`` as
    :func:`trial_checkpoints` returns them when already read."""
    if listed is None:
        listed, entries = trial_checkpoints(trial)
    names = [n for n, _ in (entries if entries is not None else list_entries(trial))]
    error = None
    if ERROR_FILE in names:
        lines = [ln.strip() for ln in (read_error(trial.fs, trial.path) or "").splitlines()
                 if ln.strip()]
        error = lines[-1] if lines else None
    status, stop = trial_status(trial, names, error)
    reason = (stop["reason"] if stop is not None and stop["status"] == status
              else error if status == "errored" else None)
    metric, mode = _recorded_metric(trial, listed)
    ranked = rank_checkpoints(listed, metric, mode)
    best = ranked[0] if ranked else None
    return TrialSummary(
        name=trial.name, uri=trial.uri, status=status, reason=reason,
        params=read_params(trial.fs, trial.path) if PARAMS_FILE in names else {},
        metric=metric, mode=mode,
        best_checkpoint=_checkpoint(best[0]) if best is not None else None,
        best_score=best[2] if best is not None else None,
        best_metrics=_metrics(best[1]) if best is not None else {},
        checkpoints=len(listed),
        latest_index=listed[-1][1]["index"] if listed else None,
        latest_created_at=listed[-1][1].get("created_at") if listed else None,
        _listed=tuple(listed))


def flatten(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``obj`` with nested keys joined by ``/`` (how metrics and params are named)."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


class Experiment:
    """The trials of one experiment on any storage, and the best of them.

    ``Experiment(storage_path, experiment_name)`` names the experiment as
    ``session.start`` does (``<storage_path>/<experiment_name>``);
    ``Experiment(path)`` names the experiment directory itself. Trials are
    read once, at construction (:meth:`refresh` reads them again)::

        exp = Experiment("s3://bucket/runs", "sweep")
        best = exp.best_trial()               # by the metric the trials recorded
        print(best.name, best.params, best.best_score)
        exp.best_checkpoint().to_directory("./best")
        exp.to_dataframe()                    # one row per trial (pandas if installed)

    Args:
        storage_path: a local path, a URI (``memory://``, ``s3://`` ...) or,
            with ``storage_filesystem``, a path inside that filesystem.
        experiment_name: one path component under ``storage_path``; None when
            ``storage_path`` is the experiment directory.
        storage_filesystem: a ``pyarrow.fs.FileSystem`` or fsspec filesystem.
        storage_options: backend options for a URI (endpoint, credentials).

    Raises:
        CheckpointNotFoundError: nothing exists there.
        InvalidConfigError: the location is not an experiment (a trial, a
            storage root, a checkpoint, a file: named in the message), or is
            not a valid location.
        CheckpointStoreError: the storage refused a read.
    """

    def __init__(self, storage_path: str | os.PathLike[str],
                 experiment_name: str | None = None, *, storage_filesystem: Any = None,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        from checkpoint_store.registry import resolve

        backend, path = resolve(storage_path, filesystem=storage_filesystem,
                                storage_options=storage_options)
        loc = follow(Location(backend, path))
        if experiment_name is not None:
            validate_component(experiment_name, "experiment_name")
            loc = loc.child(experiment_name)
        kind = classify(loc)
        if kind not in ("experiment", "empty"):
            hint = (" (pass its parent, the experiment)" if kind == "trial"
                    else " (pass experiment_name=)" if kind == "root" else "")
            raise InvalidConfigError(
                f"{loc.uri} is {describe_kind(kind)}, not an experiment (a directory of "
                f"trials){hint}")
        self._loc = loc
        self._trials: list[TrialSummary] = []
        self.refresh()

    @property
    def uri(self) -> str:
        """The experiment directory as a URI."""
        return self._loc.uri

    @property
    def name(self) -> str:
        """The experiment's name (its directory's)."""
        return self._loc.name

    @property
    def trials(self) -> list[TrialSummary]:
        """Every trial, sorted by name."""
        return list(self._trials)

    def refresh(self) -> None:
        """Read the trials again (a running sweep adds and changes them).

        Directories of trials beside the trials (see
        :func:`~checkpoint_store._browse.locations.trials_under`) are not
        read; a :class:`UserWarning` names them."""
        skipped: list[Location] = []
        trials = trials_under(self._loc, "experiment", skipped)
        if skipped:
            warnings.warn(not_walked_message(skipped, self._loc, "experiment"), UserWarning,
                          stacklevel=2)
        self._trials = [summarize_trial(t) for t in trials]

    def trial(self, name: str) -> TrialSummary:
        """The trial called ``name``.

        Raises:
            CheckpointNotFoundError: no such trial.
        """
        for t in self._trials:
            if t.name == name:
                return t
        raise CheckpointNotFoundError(f"no trial {name!r} in {self.uri}")

    def ranking(self, metric: str | None, mode: str | None) -> tuple[str, str]:
        """``(metric, mode)`` :meth:`best_trial` ranks by: the given ones, else the one
        pair every trial that recorded a metric recorded (a ``mode`` alone
        applies to the recorded metric; a ``metric`` alone takes the order the
        trials recorded for it, else ``"max"``).

        Raises:
            MetricMismatchError: trials recorded different metrics or orders.
            InvalidConfigError: no metric given or recorded; a bad ``mode``.
        """
        if mode is not None and mode not in ("min", "max"):
            raise InvalidConfigError(f"mode must be 'min' or 'max', got {mode!r}")
        recorded = sorted({(t.metric, t.mode or "max") for t in self._trials
                           if t.metric is not None and (metric is None or t.metric == metric)})
        if metric is None:
            metrics = sorted({m for m, _ in recorded})
            if not metrics:
                raise InvalidConfigError(
                    f"no trial of {self.uri} records a metric to rank by; pass metric= "
                    "and mode= (--metric and --mode)")
            if len(metrics) > 1 or (mode is None and len(recorded) > 1):
                raise MetricMismatchError(self._mismatch(recorded))
            metric = metrics[0]
        if mode is None:
            modes = sorted({o for m, o in recorded if m == metric})
            if len(modes) > 1:
                raise MetricMismatchError(self._mismatch(recorded))
            mode = modes[0] if modes else "max"
        return metric, mode

    def _mismatch(self, recorded: Sequence[tuple[str | None, str]]) -> str:
        named = ", ".join(f"{t.name}: {t.metric!r} ({t.mode})" for t in self._trials
                          if (t.metric, t.mode or "max") in recorded)
        return (f"the trials of {self.uri} rank by different metrics or orders ({named}), "
                "so the best has no single meaning; pass metric= and mode= "
                "(--metric and --mode) to choose one")

    def best_trial(self, metric: str | None = None, mode: str | None = None) -> TrialSummary:
        """The trial whose best checkpoint scores best by ``metric`` in ``mode``
        (``"min"``: lower is better, ``"max"``). Default: the metric and order
        the trials recorded (their ``CheckpointConfig``). Ties go to the trial
        whose best checkpoint is newer; trials without a numeric score are
        never best. A checkpoint whose commit marker is gone since its trial
        recorded it is skipped with a :class:`UserWarning`.

        Raises:
            MetricMismatchError: no ``metric``/``mode`` given and the trials
                recorded different ones.
            InvalidConfigError: no metric given or recorded; a bad ``mode``.
            CheckpointNotFoundError: no trial has a checkpoint with a numeric
                score.
        """
        return self._best(metric, mode)[0]

    def best_checkpoint(self, metric: str | None = None, mode: str | None = None
                        ) -> Checkpoint:
        """The best checkpoint of :meth:`best_trial` (same arguments and errors),
        on storage: ``.uri``, ``.to_directory()``, ``load_state()``."""
        return self._best(metric, mode)[1]

    def _best(self, metric: str | None, mode: str | None
              ) -> tuple[TrialSummary, Checkpoint, float]:
        metric, mode = self.ranking(metric, mode)
        found: list[tuple[float, float, TrialSummary, Location]] = []
        for t in self._trials:
            for loc, meta, score in rank_checkpoints(list(t._listed), metric, mode):
                if score is not None:
                    found.append((score, float(meta.get("created_at") or 0.0), t, loc))
        sign = 1.0 if mode == "max" else -1.0
        found.sort(key=lambda f: (sign * f[0], f[1]), reverse=True)
        for score, _, trial, loc in found:
            # The retention state records what was committed: a marker deleted
            # by hand since must not be the answer (one read, usually).
            if read_internal(loc) is not None:
                return trial, _checkpoint(loc), score
            warnings.warn(f"{loc.uri} is in its trial's retention state but has no valid "
                          "commit marker now (changed by hand?); skipped", UserWarning,
                          stacklevel=3)
        raise CheckpointNotFoundError(
            f"no trial of {self.uri} has a checkpoint with a numeric {metric!r}")

    def to_dataframe(self) -> Any:
        """One row per trial: ``trial``, ``status``, ``metric``, ``mode``,
        ``best_score``, ``best_checkpoint`` (its URI), ``checkpoints``, then the
        parameters as ``param/NAME`` (nested keys joined by ``/``). A
        ``pandas.DataFrame`` when pandas is installed, else a list of dicts."""
        rows = [{"trial": t.name, "status": t.status, "metric": t.metric, "mode": t.mode,
                 "best_score": t.best_score,
                 "best_checkpoint": None if t.best_checkpoint is None
                 else t.best_checkpoint.uri,
                 "checkpoints": t.checkpoints,
                 **{f"param/{k}": v for k, v in flatten(t.params).items()}}
                for t in self._trials]
        try:
            import pandas as pd  # type: ignore[import-untyped,unused-ignore]
        except ImportError:
            return rows
        return pd.DataFrame(rows)

    def __repr__(self) -> str:
        return f"Experiment({self.uri!r}, trials={len(self._trials)})"


def experiment_of(loc: Location) -> Experiment:
    """The :class:`Experiment` at an already resolved location (the CLI's).

    Raises:
        as :class:`Experiment`.
    """
    exp = Experiment.__new__(Experiment)
    exp._loc = loc
    exp._trials = []
    exp.refresh()
    return exp

