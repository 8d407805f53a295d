"""Finding the checkpoint to resume from: ``resume_path`` and its ordering."""

from __future__ import annotations

import io
import math
import os
import posixpath
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import pyarrow.fs as pafs

from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import inspect_checkpoint
from checkpoint_store.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    InvalidConfigError,
)
from checkpoint_store.integrations._lightning.io import _Locator
from checkpoint_store.integrations._lightning.replace import current_dir, orphaned_names
from checkpoint_store.integrations._lightning.state import (
    _to_float,
    state_file,
    verified,
    verified_state,
)
from checkpoint_store.registry import resolve

__all__ = ["_first_verified", "_pick", "checkpoint_file", "resume_path"]


def _pick(
    candidates: Sequence[tuple[Any, Mapping[str, Any]]], monitor: str | None, mode: str,
) -> list[Any]:
    """Candidates in preference order: newest first (index, then created_at),
    or with ``monitor`` best first (missing or NaN scores last, ties: newer)."""
    def newness(meta: Mapping[str, Any]) -> tuple[int, float]:
        return meta.get("index", 0), float(meta.get("created_at", 0.0))

    if monitor is None:
        return [c for c, _ in sorted(candidates, key=lambda cm: newness(cm[1]), reverse=True)]
    if mode not in ("min", "max"):
        raise InvalidConfigError(f"mode must be 'min' or 'max', got {mode!r}")
    from checkpoint_store.retention import rank_key

    def score(meta: Mapping[str, Any]) -> float | None:
        value = _to_float((meta.get("metrics") or {}).get(monitor))
        return None if value is None or math.isnan(value) else value

    if candidates and all(score(m) is None for _, m in candidates):
        # Ranking by a metric nothing recorded would hand out the newest as the best.
        recorded = sorted({k for _, m in candidates for k in (m.get("metrics") or {})})
        raise InvalidConfigError(
            f"no checkpoint records a value of monitor {monitor!r} (they record: "
            f"{', '.join(recorded) or 'nothing'}); pass the metric the checkpoints were "
            "ranked by when saved (ModelCheckpoint's or the callback's monitor), or no "
            "monitor for the newest")

    def key(cm: tuple[Any, Mapping[str, Any]]) -> tuple[int, float, tuple[int, float]]:
        return rank_key(score(cm[1]), newness(cm[1]), mode)

    return [c for c, _ in sorted(candidates, key=key, reverse=True)]


def _latest_run(candidates: list[tuple[str, Mapping[str, Any]]],
                damaged: Sequence[Mapping[str, Any]] = ()) -> list[tuple[str, Mapping[str, Any]]]:
    """The candidates of the run that committed last (its ``run_id``), judged
    with the markers of ``damaged`` checkpoints too.

    A fresh ``fit`` (no ``ckpt_path``) in a ``dirpath`` that holds another
    run's checkpoints is a run of its own, and a resume continues the run it
    resumed from, so the run that committed last is the one a restart
    continues; the highest step of the directory may be an earlier run's.
    When that run's checkpoints are all damaged there is nothing of it to
    resume: an earlier run's is never the answer."""
    metas = [m for _, m in candidates] + list(damaged)
    if not metas:
        return candidates
    run = max(metas, key=lambda m: float(m.get("created_at", 0.0))).get("run_id")
    return [cm for cm in candidates if cm[1].get("run_id") == run]


def _first_verified(checkpoints: list[Any], describe: Callable[[Any], str],
                    verify: Callable[[Any], object]) -> Any | None:
    for c in checkpoints:
        try:
            verify(c)
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
            warnings.warn(f"skipping checkpoint {describe(c)}: it does not verify ({exc})",
                          RuntimeWarning, stacklevel=3)
            continue
        return c
    return None


def resume_path(
    dirpath: str | os.PathLike[str],
    *,
    monitor: str | None = None,
    mode: Literal["min", "max"] = "min",
    storage_options: Mapping[str, Any] | None = None,
    storage_filesystem: Any = None,
) -> str | None:
    """The ``ckpt_path`` to give ``trainer.fit`` to resume from ``dirpath``.

    Lists the committed checkpoint directories that :class:`CheckpointStoreIO`
    wrote in ``dirpath`` (``ModelCheckpoint(dirpath=...)``) and returns the
    newest (highest ``global_step``, then latest commit) whose files verify
    (size and CRC32C), among those of the run that committed last (each
    checkpoint records its run: a fresh ``fit`` in a ``dirpath`` holding an
    earlier run's checkpoints is a run of its own; a resumed one continues
    the run it resumed from). A directory without a commit marker (a save
    cut short) is never a candidate; one that is damaged or fails
    verification, or whose pointer (``.cs_current``) names no replacement of
    it, is skipped with a ``RuntimeWarning``. Lightning's own
    ``ckpt_path="last"`` goes by names and modification times instead.

    Args:
        dirpath: the checkpoint directory (local path or URI).
        monitor: pick the best by this metric (recorded at save from each
            ``ModelCheckpoint``'s monitored value) instead of the newest; a
            checkpoint without a value of it ranks last.
        mode: ``"min"`` or ``"max"`` for ``monitor``.
        storage_options, storage_filesystem: as for :class:`CheckpointStoreIO`.

    Returns:
        ``dirpath`` joined with the chosen directory's name (load it with
        ``CheckpointStoreIO``), or None when there is no committed checkpoint.

    Raises:
        InvalidConfigError: a bad ``mode`` or location; a ``monitor`` that no
            candidate checkpoint recorded a value of.
    """
    backend, root = resolve(dirpath, filesystem=storage_filesystem,
                            storage_options=storage_options)
    fs = backend.filesystem
    found: list[tuple[str, Mapping[str, Any]]] = []
    damaged: list[Mapping[str, Any]] = []
    listed = {posixpath.basename(fi.path.rstrip("/")): fi.type
              for fi in _fsutil.list_dir(fs, root)}
    names = {n for n, t in listed.items()
             if t == pafs.FileType.Directory and not n.startswith(".")}
    for name in sorted(names | orphaned_names(set(listed), list(listed))):
        try:
            target = current_dir(backend, posixpath.join(root, name))
        except CheckpointCorruptError as exc:  # a pointer we did not write: skipped
            warnings.warn(f"skipping checkpoint {backend.uri_for(posixpath.join(root, name))}: "
                          f"{exc}", RuntimeWarning, stacklevel=2)
            continue
        insp = inspect_checkpoint(fs, target)
        if insp.state == "committed" and insp.meta is not None:
            found.append((name, insp.meta))
        elif insp.state == "invalid":  # damage a listing shows (a size, a file missing)
            if insp.meta is not None:
                damaged.append(insp.meta)
            warnings.warn(f"skipping checkpoint {backend.uri_for(posixpath.join(root, name))}: "
                          f"it is damaged ({insp.reason})", RuntimeWarning, stacklevel=2)
    chosen = _first_verified(
        _pick(_latest_run(found, damaged), monitor, mode),
        lambda n: backend.uri_for(posixpath.join(root, n)),
        lambda n: verified_state(backend, posixpath.join(root, n), keep=False),
    )
    if chosen is None:
        return None
    base = os.fspath(dirpath)
    return f"{base.rstrip('/')}/{chosen}" if "://" in base else os.path.join(base, chosen)


def checkpoint_file(
    path: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    storage_filesystem: Any = None,
) -> str | io.BytesIO:
    """The checkpoint at Lightning path ``path``, verified, as ``torch.load``
    and ``LightningModule.load_from_checkpoint`` take it.

    ``path`` is what Lightning hands out (``ModelCheckpoint.best_model_path``,
    ``best_k_models``, ``last_model_path``, :func:`resume_path`): with
    :class:`CheckpointStoreIO` it names a directory, which those calls cannot
    open (``IsADirectoryError`` on a local disk, ``EOFError`` on S3)::

        model = MyModel.load_from_checkpoint(checkpoint_file(mc.best_model_path))
        state = torch.load(checkpoint_file(mc.best_model_path), weights_only=False)

    A plain legacy ``.ckpt`` file is taken as it is (unchecked); a path a
    re-save replaced (``last.ckpt``) is followed to its current checkpoint.

    Args:
        path: the checkpoint (local path or URI).
        storage_options, storage_filesystem: as for :class:`CheckpointStoreIO`.

    Returns:
        On the local disk, the state file's path (read once to check its
        size and CRC32C); elsewhere an in-memory binary file of its bytes,
        checked as they arrived (the whole state is held in memory).

    Raises:
        CheckpointNotFoundError: nothing at ``path``, or a directory that is
            not a committed checkpoint (a save cut short).
        CheckpointCorruptError: the state does not match its manifest.
        InvalidConfigError: a bad location.
    """
    backend, fs_path = _Locator(storage_options, storage_filesystem)(path)
    return state_file(verified(backend, fs_path)[0])
