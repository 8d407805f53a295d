"""What a trial's retention state records, as the command line and the web page read it.

Scoring itself is the library's (:func:`checkpoint_store.retention.score_of`,
:func:`~checkpoint_store.retention.lookup_metric`); this module reads around
it what ``ls``, ``best`` and ``prune`` need: the recorded run id, score
attribute and config, the metric a directory without a state is ranked by,
and stored data that is not what a writer of ours would write (a score that
is not a number) named as a fault of the data rather than of the arguments.
The command line's own side (usage errors, warnings) is
:mod:`checkpoint_store.cli.metrics`.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from checkpoint_store._format.layout import (
    MANAGER_STATE,
    STATE_FORMAT_VERSION,
    STATE_KIND,
    newer_format_version,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.errors import CheckpointStoreError, InvalidConfigError

if TYPE_CHECKING:
    from checkpoint_store.storage import StorageContext


class Location(Protocol):
    """What is read here of a location a command names (the command line's
    ``Location``): its filesystem, its path, its URI and a child's."""

    @property
    def fs(self) -> Any: ...

    @property
    def path(self) -> str: ...

    @property
    def uri(self) -> str: ...

    def child(self, *names: str) -> Location: ...


__all__ = [
    "UnreadableStateError",
    "config_for",
    "foreign_names",
    "warn_disagreeing",
    "recorded_config",
    "recorded_run_id",
    "metric_value",
    "monitored_attribute",
    "score_attribute",
    "stored_score",
]


class UnreadableStateError(CheckpointStoreError):
    """The trial's retention state exists but cannot be read as one: it no
    longer says which metric, order and policy the trial ranks by."""


def recorded_run_id(trial: Location) -> str | None:
    """The run id the trial's retention state records; None without a state.

    Raises:
        UnreadableStateError: the state is there but unreadable.
    """
    root = _recorded_root(trial)
    if root is None:
        return None
    run_id = root.get("run_id")
    return run_id if isinstance(run_id, str) else None


def foreign_names(checkpoints: Sequence[tuple[str, Mapping[str, Any]]], trial_name: str,
                  run_id: str | None) -> set[str]:
    """The names among ``checkpoints`` (``(dir name, internal metadata)``, oldest
    first) written by another run or trial (copied in): the retention manager's
    rule (docs/retention.md, "What may retention delete?"), so they are never
    ranked, named best nor deleted. Ours is ``run_id`` (the one the trial's
    retention state records), else the newest checkpoint's of ``trial_name``;
    without run ids on either side, a checkpoint naming another trial."""
    if run_id is None:
        # No usable state: the run is the newest checkpoint's of this trial, as a
        # manager rebuilding the state decides (retention.restore.run_id_of).
        mine = [m["run_id"] for _, m in checkpoints
                if m.get("trial_name") in (None, trial_name) and isinstance(m.get("run_id"), str)]
        run_id = mine[-1] if mine else None
    out = set()
    for name, meta in checkpoints:
        owner = meta.get("run_id")
        if run_id is not None and owner is not None:
            ours = owner == run_id
        else:
            ours = meta.get("trial_name") in (None, trial_name)
        if not ours:
            out.add(name)
    return out


def _recorded_json(trial: Location) -> dict[str, Any] | None:
    """The ``config`` object of the trial's retention state, or None when the
    trial has no state; raises as :func:`_recorded_root`."""
    root = _recorded_root(trial)
    return None if root is None else root["config"]


def _recorded_root(trial: Location) -> dict[str, Any] | None:
    """The trial's retention state root, read once, holding a ``config``
    object; None when the trial has no state (``.checkpoint_manager.json`` absent).

    Raises:
        UnreadableStateError: the file is there but is not JSON, not an object,
            or holds no ``config`` object (truncated, overwritten by hand), or
            a config no :class:`CheckpointConfig` accepts, or it is of a newer
            format version than this release reads.
        CheckpointStoreError: the store refused the read (access denied ...);
            never taken for "no state", which would change the ranking.
    """
    path = posixpath.join(trial.path, MANAGER_STATE)
    try:
        # Read again while torn: the trial's manager rewrites it in place.
        root = _fsutil.read_control(trial.fs, path)
    except ValueError as exc:  # it stayed unparsable
        raise _unreadable_state(trial, f"{type(exc).__name__}: {exc}") from None
    except OSError:
        # Not found, or not a file: a directory in its place (a sync tool's
        # folder marker, a mkdir; on an object store, objects under its name)
        # reads as missing on some stores and as a store error on others. It
        # is neither "no state" (which ranks by recency) nor a fault of the
        # credentials the error's hint names.
        found = _fsutil.kind(trial.fs, path)
        if found == _fsutil.pafs.FileType.NotFound:
            return None
        if found == _fsutil.pafs.FileType.Directory:
            raise _unreadable_state(trial, "a directory, not a file") from None
        raise
    try:
        config = root["config"]
    except (KeyError, TypeError) as exc:
        config, why = None, f"{type(exc).__name__}: {exc}"
    else:
        why = f"'config' is a {type(config).__name__}, not an object"
        if root.get("kind") != STATE_KIND:
            # Another file under its name (a chunk, a record, a lease copied
            # over it): what it says is not what the trial's manager decided.
            config, why = None, f"its kind is {root.get('kind')!r}, not {STATE_KIND!r}"
    if not isinstance(config, dict):
        raise _unreadable_state(trial, why)
    version = newer_format_version(root, STATE_FORMAT_VERSION)
    if version is not None:
        # A newer release's state: its rules may hold fields this one does not
        # know (a policy that keeps more); ranking or pruning by the fields it
        # does know would delete what that release keeps.
        raise UnreadableStateError(
            f"the retention state {trial.child(MANAGER_STATE).uri} has format version "
            f"{version}, newer than this checkpoint-store reads ({STATE_FORMAT_VERSION}), "
            "so the metric, order and policy this trial ranks by are not known here; "
            "upgrade checkpoint-store, or pass them (--metric and --mode, and --keep "
            "for prune)")
    from checkpoint_store.retention.config import CheckpointConfig

    try:
        CheckpointConfig.from_json(config)
    except InvalidConfigError as exc:
        # Rules no manager could have written (a count as a string, an order
        # 'MIN'): ranking by a guess at them could name, or keep, the wrong one.
        raise _unreadable_state(trial, f"its config is invalid: {exc}") from None
    return root  # type: ignore[no-any-return]


def _unreadable_state(trial: Location, why: str) -> UnreadableStateError:
    return UnreadableStateError(
        f"the retention state {trial.child(MANAGER_STATE).uri} is unreadable ({why}), so "
        "the metric, order and policy this trial ranks by are unknown; pass them "
        "(--metric and --mode, and --keep for prune). The trial's next session.start "
        "rebuilds the state from its checkpoints"
    )


def score_attribute(trial: Location) -> tuple[str | None, str | None]:
    """The ``(checkpoint_score_attribute, checkpoint_score_order)`` recorded in the
    trial's retention state; ``(None, None)`` when it has none.

    Raises:
        UnreadableStateError: a state that is there but unreadable: a guess
            (no attribute: the newest first) would rank, and prune, wrongly.
    """
    config = _recorded_json(trial)
    if config is None:
        return None, None
    return config.get("checkpoint_score_attribute"), config.get("checkpoint_score_order")


def monitored_attribute(checkpoints: Sequence[tuple[Location, Mapping[str, Any]]]
                        ) -> tuple[str | None, str | None]:
    """``(metric, mode)`` a directory without a retention state is ranked by:
    what the newest checkpoint that records one names as its framework's
    monitored metric (the Lightning plugin records ``ModelCheckpoint``'s
    ``monitor`` and ``mode``); ``(None, None)`` when none does.
    ``checkpoints`` are ``(location, internal metadata)``, oldest first."""
    for _ckpt, meta in reversed(checkpoints):
        framework = meta.get("lightning")
        monitor = framework.get("monitor") if isinstance(framework, Mapping) else None
        if isinstance(monitor, str) and monitor:
            mode = framework.get("mode")
            return monitor, mode if mode in ("min", "max") else None
    return None, None


def recorded_config(trial: Location) -> Any:
    """The :class:`~checkpoint_store.retention.CheckpointConfig` recorded in the
    trial's retention state (its policy included), or None when it has none.

    Raises:
        UnreadableStateError: the state is there but unreadable.
        CheckpointStoreError: the recorded config or policy is invalid.
    """
    from checkpoint_store.retention.config import CheckpointConfig

    config = _recorded_json(trial)
    return None if config is None else CheckpointConfig.from_json(config)


class _TrialOf:
    """A :class:`StorageContext`'s trial directory seen as a :class:`Location`."""

    def __init__(self, storage: StorageContext, path: str | None = None) -> None:
        self._storage = storage
        self.path = storage.trial_path if path is None else path

    @property
    def fs(self) -> Any:
        return self._storage.filesystem

    @property
    def uri(self) -> str:
        return self._storage.uri(self.path)

    def child(self, *names: str) -> Location:
        return _TrialOf(self._storage, posixpath.join(self.path, *names))


def config_for(config: Any, storage: StorageContext, *, read_only: bool) -> Any:
    """The :class:`~checkpoint_store.retention.CheckpointConfig` a manager of
    the trial ``storage`` applies when given ``config``: "best" means the
    metric and order the trial recorded, never silently another one. A
    read-only manager given the default ``CheckpointConfig()`` takes the
    recorded config whole (metric, order and policy: what the trial's writer
    ranked and kept by), as ``checkpoint-store best`` and the page do; one
    read of the state root. Any other ``config`` is returned unchanged (a
    disagreeing one is warned by :func:`warn_disagreeing` at restore; a
    writer given the default keeps it: a new run chooses its own rules). No
    state, or one that cannot be read: ``config`` (the restore names it).
    """
    from checkpoint_store.retention.config import CheckpointConfig

    if not read_only or config != CheckpointConfig():
        return config
    try:
        recorded = recorded_config(_TrialOf(storage))
    except CheckpointStoreError:
        return config
    return config if recorded is None else recorded


def warn_disagreeing(config: Any, recorded: Mapping[str, Any], where: str,
                     stacklevel: int) -> None:
    """Warn (:class:`UserWarning`) when ``config`` ranks by another metric or
    order than the ``recorded`` config JSON of the trial at ``where``: its
    ``best_checkpoint`` (and, for a writer, what it evicts from now on)
    then answers by the given config, which must never happen silently.
    Nothing is said when the trial recorded no metric."""
    attr = recorded.get("checkpoint_score_attribute")
    order = recorded.get("checkpoint_score_order", "max")
    given = (config.checkpoint_score_attribute, config.checkpoint_score_order)
    if attr is None or given == (attr, order):
        return
    import warnings

    ranked = (f"{given[0]!r} ({given[1]})" if given[0] is not None
              else "recency (no checkpoint_score_attribute)")
    warnings.warn(
        f"the trial {where} recorded ranking by {attr!r} ({order}), but this manager ranks "
        f"by {ranked}: best_checkpoint answers by the given config. Pass "
        f"CheckpointConfig(checkpoint_score_attribute={attr!r}, "
        f"checkpoint_score_order={order!r}) to rank as the trial did (read-only: "
        "CheckpointConfig() takes the recorded one)",
        UserWarning, stacklevel=stacklevel + 1)


def stored_score(ckpt: Location, metrics: Mapping[str, Any], metric: str) -> float | None:
    """The numeric score of a stored checkpoint, or None when missing or NaN.

    Raises:
        CheckpointStoreError: the stored value is not a number. Not a usage
            error (exit 1): the arguments are fine, the stored data is not.
    """
    from checkpoint_store.retention.scoring import score_of

    try:
        return score_of(metrics, metric)
    except InvalidConfigError:
        value = metric_value(metrics, metric)
        raise CheckpointStoreError(
            f"{ckpt.uri} records metric {metric!r} as {value!r} ({type(value).__name__}), "
            "not a number; rank by another --metric, or delete that checkpoint"
        ) from None


def metric_value(metrics: Mapping[str, Any], attribute: str) -> Any:
    """The stored value of ``attribute`` (``/`` for nested), None when absent."""
    from checkpoint_store.retention.scoring import NOT_FOUND, lookup_metric

    value = lookup_metric(metrics, attribute)
    return None if value is NOT_FOUND else value
