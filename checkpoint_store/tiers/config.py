"""``LocalTier``: the configuration of a fast local tier in front of the storage_path."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from checkpoint_store._format.layout import checkpoint_dir_name
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.retention.policies import PolicyCheckpoint, RetentionPolicy, _answer

__all__ = ["LocalTier", "PersistPolicy", "check_local_tier"]

#: What :attr:`LocalTier.persist` accepts: None (every checkpoint), a
#: retention policy object (``EveryNSteps(4)``, ``Steps([...])``,
#: ``EveryNSeconds(600)``, ``AnyOf(...)``), or ``fn(index, metrics) -> bool``.
PersistPolicy = RetentionPolicy | Callable[[int, Mapping[str, Any]], bool] | None


@dataclass(frozen=True)
class LocalTier:
    """A fast local tier (node-local disk, NVMe, tmpfs) in front of the storage_path,
    the persistent tier. Given to ``session.start(local_tier=...)``.

    ``report(metrics, checkpoint=...)`` commits the checkpoint on this tier
    (same commit protocol as any local storage: staging, CRC32C manifest,
    marker last) at ``<path>/<experiment>/<trial>/checkpoint_<index>`` and
    returns; the checkpoints ``persist`` selects are copied to the storage_path
    in the background, in report order, committed and registered with the
    session's ``CheckpointConfig`` retention there. Orbax's multi-tier
    checkpointing calls these the local and the persistent tier.

    Args:
        path: a local directory (``~`` expanded, made absolute; a
            ``file://`` URI is accepted). With several ranks every rank has
            its own part under ``<path>/<experiment>/<trial>/rank_<rank>/``,
            so ranks may share one path (one node) or each have their own.
        num_to_keep: checkpoints kept on this tier, newest first (>= 1). A
            checkpoint whose copy to the storage_path is still pending is
            never deleted, whatever this number.
        persist: which checkpoints go to the storage_path. None (default):
            every one. A retention policy object (``EveryNSteps(n)`` on
            ``training_iteration``, ``Steps``, ``EveryNSeconds``, ``AnyOf``)
            selects a checkpoint when it would preserve it (given the last
            selected one and this one). A plain callable is called as
            ``persist(index, metrics) -> bool`` (``metrics``: the result row).
            With several ranks it must decide the same on every rank (use the
            index or ``training_iteration``).
        max_bytes: the most bytes of checkpoints this tier holds (per rank);
            a report that would go over waits for pending copies to the
            storage_path to finish and the tier's retention to free space
            (backpressure; a checkpoint ``persist`` selects is never dropped).
            None (default): no limit.
        fsync: fsync files and directories before each commit on this tier
            (default True; False survives process crashes, not machine crashes).
        persist_timeout_s: how long the background copy of one checkpoint to
            the storage_path keeps retrying transient failures, in seconds
            (default 600). After that its error is raised by the next
            ``report()``, ``wait()`` or the end of the session; the copy on
            this tier stays, recorded as pending, and the next session on
            this trial persists it.

    Raises:
        InvalidConfigError: at construction, for any other value.
    """

    path: str
    num_to_keep: int = 2
    persist: PersistPolicy = None
    max_bytes: int | None = None
    fsync: bool = True
    persist_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", _check_path(self.path))
        n = self.num_to_keep
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidConfigError(f"LocalTier num_to_keep must be an int >= 1, got {n!r}")
        m = self.max_bytes
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise InvalidConfigError(
                f"LocalTier max_bytes must be None or an int >= 1 (bytes), got {m!r}")
        p = self.persist
        if p is not None and not isinstance(p, RetentionPolicy) and not callable(p):
            raise InvalidConfigError(
                f"LocalTier persist must be None (every checkpoint), a retention policy "
                f"(EveryNSteps(n), Steps([...]) ...) or a callable(index, metrics) -> bool, "
                f"got {p!r}")
        if not isinstance(self.fsync, bool):
            raise InvalidConfigError(f"LocalTier fsync must be True or False, got {self.fsync!r}")
        t = self.persist_timeout_s
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t < math.inf:
            raise InvalidConfigError(
                f"LocalTier persist_timeout_s must be a finite number >= 0 (seconds), got {t!r}")

    def selects(self, index: int, metrics: Mapping[str, Any],
                previous: PolicyCheckpoint | None = None, created_at: float | None = None) -> bool:
        """Whether ``persist`` sends checkpoint ``index`` to the storage_path.

        Args:
            index: the checkpoint index.
            metrics: the result row reported with it.
            previous: the last checkpoint selected before it (for
                ``EveryNSeconds``), or None.
            created_at: when it was reported (Unix seconds).

        Raises:
            InvalidConfigError: the policy failed or answered something else
                than a bool (a callable) or a collection of indexes (a policy).
        """
        p = self.persist
        if p is None:
            return True
        if isinstance(p, RetentionPolicy):
            this = PolicyCheckpoint(index, checkpoint_dir_name(index), dict(metrics), created_at)
            given = [this] if previous is None or previous.index == index else [previous, this]
            return index in _answer(p, given)
        try:
            answer = p(index, metrics)
        except Exception as exc:
            raise InvalidConfigError(f"LocalTier persist policy {p!r} failed: {exc!r}") from exc
        if not isinstance(answer, (bool, int)) or answer not in (0, 1):
            raise InvalidConfigError(
                f"LocalTier persist policy {p!r} returned {answer!r}; it must return True or False")
        return bool(answer)


def _check_path(path: Any) -> str:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise InvalidConfigError(f"LocalTier path must be a local directory, got {path!r}")
    if path.startswith("file://"):
        path = path[len("file://"):] or "/"
    elif "://" in path:
        raise InvalidConfigError(
            f"LocalTier path must be a local directory (a node-local disk), got {path!r}; the "
            "remote store is the session's storage_path")
    return os.path.abspath(os.path.expanduser(path))


def check_local_tier(value: Any, durable: Any = None) -> LocalTier | None:
    """``value`` if it is None or a :class:`LocalTier`; with ``durable`` (the
    session's :class:`~checkpoint_store.StorageContext`), also that the local
    tier's trial directory and the storage_path's are apart (neither inside
    the other). Also that the tier's path is not, nor lies under, a file
    (anything but a directory), nor below a directory this process cannot
    write (a read-only mount). Writes nothing.

    Raises:
        InvalidConfigError: anything else.
    """
    if value is not None and not isinstance(value, LocalTier):
        raise InvalidConfigError(
            f"local_tier must be a LocalTier(path, ...) or None, got {type(value).__name__}")
    if value is not None and durable is not None:
        where = durable.canonical_uri(durable.trial_path)
        if where.startswith("file://"):
            durable_dir = where[len("file://"):]
            local = os.path.realpath(os.path.join(value.path, durable.experiment_name,
                                                  durable.trial_name))
            if os.path.commonpath([durable_dir, local]) in (durable_dir, local):
                raise InvalidConfigError(
                    f"the local tier's trial directory {local} and the storage_path's "
                    f"{durable_dir} overlap; give LocalTier a path on another disk (or "
                    "another directory) than storage_path")
    if value is not None:
        _refuse_an_unwritable_path(value.path)
    return value


def _refuse_an_unwritable_path(path: str) -> None:
    """Refuse a tier path that is, or lies under, something other than a
    directory (a file, a broken link), or whose nearest existing directory
    cannot be written: the tier could never create its trial directory there,
    and the session would fail only after writing to the storage_path."""
    here = path
    while True:
        if os.path.lexists(here):
            if not os.path.isdir(here):
                raise InvalidConfigError(
                    f"LocalTier path {path!r} cannot hold a directory: {here!r} exists and is "
                    "not a directory; give LocalTier a directory (or a path that does not "
                    "exist yet)")
            # The trial directory is made below the nearest directory that
            # exists: that one must take new entries. access() also answers
            # EROFS for root, whom no permission bit stops.
            if not os.access(here, os.W_OK | os.X_OK):
                raise InvalidConfigError(
                    f"LocalTier path {path!r} cannot be written: {here!r} is read-only for "
                    "this process (a read-only file system, or its permissions); give "
                    "LocalTier a writable node-local directory, or start without local_tier")
            return
        parent = os.path.dirname(here)
        if parent == here:
            return
        here = parent
