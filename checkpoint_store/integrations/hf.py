"""Hugging Face ``Trainer``: every checkpoint it saves, committed on any storage.

Usage::

    from checkpoint_store import CheckpointConfig
    from checkpoint_store.integrations.hf import CheckpointStoreCallback, restore_latest

    callback = CheckpointStoreCallback(
        storage_path="s3://bucket/runs", experiment_name="bert", trial_name="run0",
        checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="eval_loss",
                                           checkpoint_score_order="min"))
    restore_latest("out", storage_path="s3://bucket/runs", experiment_name="bert",
                   trial_name="run0")          # after a crash or on a new machine
    with callback:                             # ends the session however train() ends
        trainer = Trainer(model, args, ..., callbacks=[callback])
        trainer.train(resume_from_checkpoint=restore_latest(...) is not None)

Each ``on_save`` of the Trainer reports the metrics of the last evaluation
(plus ``global_step`` and ``epoch``) with ``<output_dir>/checkpoint-<step>``,
so our retention (``checkpoint_config``), ``result.json`` and the commit
protocol apply to the remote copy; HF's ``save_total_limit`` then only trims
the local disk. Requires ``pip install 'checkpoint-store[hf]'``.

Where HF fails and this does not (see docs/hf.md):

* ``resume_from_checkpoint=True`` takes the highest-numbered local
  ``checkpoint-*`` directory even when its save was cut short
  (transformers #35782); :func:`restore_latest` puts the newest *committed*
  checkpoint there instead, verified file by file.
* With ``load_best_model_at_end``, a run resumed where the best
  checkpoint's directory is missing (a new machine, a lost ``output_dir``)
  drops it and ends with the last weights; :func:`restore_latest` restores
  the best checkpoint beside the latest, and the callback fetches it when
  it is still missing.
* Rotation by ``save_total_limit`` runs inside the next save; the upload
  here is finished when ``on_save`` returns, so rotation never removes a
  directory that is still being uploaded.

Preemption (``preemption=``, docs/preemption.md): on the signal, the step
under way finishes; at its end the callback sets ``control.should_save``
and ``control.should_training_stop``, so the Trainer saves
``checkpoint-<global_step>`` at once; ``on_save`` reports it, the session
commits it as a preemption checkpoint, records the trial as ``preempted``
and :class:`~checkpoint_store.errors.Preempted` (a ``SystemExit`` with the
scheduler's exit status) ends ``trainer.train()``. :func:`restore_latest`
then resumes from it.

A ``TrainerCallback`` hears of no exception: when ``trainer.train()`` raises,
``on_train_end`` never runs. ``with callback:`` around training ends the
session with that exception (``error.txt``, lease released). Without it, the
session is ended when the interpreter exits, with the exception that ended
the program if there was one (``sys.last_exc``).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any

import filelock
import pyarrow.fs as pafs

from checkpoint_store._format.layout import (
    download_lock_name,
    download_marker_name,
    is_internal_file,
    share_dir_prefix,
)
from checkpoint_store._util.inspect import verify_files
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointStoreError,
    InvalidConfigError,
    Preempted,
)
from checkpoint_store.registry import local_path_argument
from checkpoint_store.retention import CheckpointConfig
from checkpoint_store.session import PreemptionConfig, Session
from checkpoint_store.session._preemption import check_preemption
from checkpoint_store.storage import StorageContext
from checkpoint_store.tiers import LocalTier, check_local_tier
from checkpoint_store.tiers.history import HistoryCopy, trial_copies

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer import TRAINER_STATE_NAME
except ImportError:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "checkpoint_store.integrations.hf needs transformers: pip install "
        "'checkpoint-store[hf]' (install torch first, e.g. torch==2.13.0, on the same command line)"
    ) from None

__all__ = ["CheckpointStoreCallback", "restore_latest", "STEP_METRIC"]

logger = logging.getLogger(__name__)

#: The metric under which each report records the Trainer's ``global_step``.
STEP_METRIC = "global_step"
_HF_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_RESTORE_LOCK = ".checkpoint-store-restore.lock"


def _run_dir(args: TrainingArguments, state: TrainerState) -> str:
    """Where the Trainer saves: ``output_dir``, or ``output_dir/<trial name>``
    during a hyperparameter search (``Trainer._get_output_dir``)."""
    # Typed Optional, but TrainingArguments.__post_init__ replaces None.
    assert args.output_dir is not None
    if state.trial_name:
        return os.path.join(args.output_dir, state.trial_name)
    return args.output_dir


def _process_group() -> Any:
    """``torch.distributed`` when a process group is initialised, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _local_files(directory: str) -> dict[str, int]:
    """``{relative POSIX path: size}`` of the user files under ``directory``
    as this rank sees it (empty when it does not exist here)."""
    out: dict[str, int] = {}
    for dirpath, _, names in os.walk(directory):
        for name in names:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, directory).replace(os.sep, "/")
            if os.path.isfile(full) and not is_internal_file(rel):
                out[rel] = os.path.getsize(full)
    return out


def _owned_files(dist: Any, directory: str, rank: int, world_size: int) -> list[str]:
    """The files of ``directory`` this rank uploads: each relative path that
    any rank sees goes to the lowest such rank. On a shared filesystem rank 0
    owns them all; on node-local disks each node's shards (DeepSpeed ZeRO
    partitions, FSDP shards, ``rng_state_<rank>.pth``) go from the lowest
    rank of that node; a file several nodes wrote (``save_on_each_node``)
    goes once."""
    seen: list[Any] = [None] * world_size
    dist.all_gather_object(seen, sorted(_local_files(directory)))
    owner: dict[str, int] = {}
    for r, rels in enumerate(seen):
        for rel in rels:
            owner.setdefault(rel, r)
    return sorted(rel for rel, r in owner.items() if r == rank)


@contextlib.contextmanager
def _share(directory: str, rels: list[str]) -> Iterator[Checkpoint | None]:
    """A checkpoint of ``rels`` of ``directory`` alone: the directory itself
    when they are all of it, else a sibling of hard links (copies across
    devices), removed afterwards."""
    if not rels:
        yield None
        return
    if set(rels) == set(_local_files(directory)):
        yield Checkpoint.from_directory(directory)
        return
    parent, name = os.path.split(directory.rstrip(os.sep))
    # Not "checkpoint-*": out of reach of HF's resume lookup and rotation.
    share = tempfile.mkdtemp(prefix=share_dir_prefix(name), dir=parent)
    try:
        for rel in rels:
            src, dst = os.path.join(directory, rel), os.path.join(share, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
        yield Checkpoint.from_directory(share)
    finally:
        shutil.rmtree(share, ignore_errors=True)


class CheckpointStoreCallback(TrainerCallback):
    """A ``TrainerCallback`` that commits each checkpoint the Trainer saves.

    Args:
        storage_path: where experiments live (local path or URI, as in
            :func:`checkpoint_store.session.start`).
        experiment_name, trial_name: layout names, one path component each.
        checkpoint_config: our retention of the committed checkpoints (default
            keep all); score by an eval metric as the Trainer logs it
            (``"eval_loss"``).
        storage_filesystem: a pyarrow or fsspec filesystem for all I/O.
        storage_options: backend options for a URI ``storage_path``.
        config: the trial's hyperparameters, written to ``params.json``.
        sync_timeout_s: with several ranks, the longest wait for the others.
        local_tier: a :class:`~checkpoint_store.LocalTier` in front of
            ``storage_path`` (docs/tiers.md): checkpoints commit on a local
            disk first and reach ``storage_path`` in the background.
        preemption: a :class:`~checkpoint_store.PreemptionConfig` (or True
            for its defaults: SIGTERM, 30 s of grace) for the session
            (docs/preemption.md). On the signal the Trainer saves at the end
            of the step under way (``control.should_save``, then
            ``control.should_training_stop``), that save is committed as a
            preemption checkpoint, and :class:`~checkpoint_store.errors.Preempted`
            ends ``trainer.train()``. With several ranks the ranks agree at
            each step's end (one all-reduce of a flag): a signal that reached
            any rank makes every rank save that step. Build the Trainer in
            the main thread (the signal handler is installed there).

    The session starts at ``on_train_begin`` (rank, world size from
    ``TrainingArguments``) and ends at ``on_train_end``. With
    ``load_best_model_at_end``, ``on_train_begin`` of a resumed run also
    points ``state.best_model_checkpoint`` at
    ``<run dir>/checkpoint-<best_global_step>``, downloading that committed
    checkpoint first when it is not there (another machine, another
    ``output_dir``), so the run ends with the best model. HF calls no
    callback when ``trainer.train()`` raises, so use the callback as a
    context manager around training: leaving the ``with`` block ends the
    session with the exception (recorded in the trial's ``error.txt``, see
    docs/sessions.md) and releases the trial's lease. A session still open
    when the interpreter exits is ended then, with the exception that ended
    the program, if any. Every rank calls
    ``on_save``. Alone, rank 0 uploads ``checkpoint-<global_step>`` of the
    run directory. With several ranks (``torch.distributed`` initialised),
    after a barrier the ranks exchange the lists of files each sees in its
    ``checkpoint-<global_step>``, and every rank uploads the files no lower
    rank sees: per-rank shards written on node-local disks (DeepSpeed ZeRO
    partitions, FSDP shards, ``rng_state_<rank>.pth``) all land in the one
    checkpoint, each file once (on a shared filesystem rank 0 uploads them
    all). Rank 0 commits it once every rank's part is in (docs/format.md,
    "Multi-rank commit"), so a crash mid-upload on
    any rank never lists it; a rank whose upload fails makes every rank's
    ``report`` raise and nothing is committed. Errors of the upload
    (``CheckpointStoreError`` and subclasses, ``OSError``) propagate out of
    ``trainer.train()``.

    Attributes:
        session: the :class:`~checkpoint_store.session.Session` while training
            runs (None before and after).
    """

    def __init__(
        self,
        storage_path: str | os.PathLike[str],
        experiment_name: str = "default",
        trial_name: str = "default",
        checkpoint_config: CheckpointConfig | None = None,
        storage_filesystem: Any = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        sync_timeout_s: float = 1800.0,
        local_tier: LocalTier | None = None,
        preemption: PreemptionConfig | bool | None = None,
    ):
        # Built now, so bad names or an unknown scheme fail before training starts.
        self._storage = StorageContext(
            storage_path, experiment_name, trial_name,
            storage_filesystem=storage_filesystem, storage_options=storage_options,
        )
        self._checkpoint_config = checkpoint_config
        self._config = config
        self._sync_timeout_s = sync_timeout_s
        self._local_tier = check_local_tier(local_tier)
        self._preemption = check_preemption(preemption)
        self._metrics: dict[str, Any] = {}
        self.session: Session | None = None

    def __enter__(self) -> CheckpointStoreCallback:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(exc)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is None:
            self.session = Session(
                self._storage, self._checkpoint_config, config=self._config,
                world_rank=args.process_index, world_size=args.world_size,
                local_rank=max(args.local_process_index, 0),
                sync_timeout_s=self._sync_timeout_s, local_tier=self._local_tier,
                preemption=self._preemption,
            )
            _OPEN.add(self)
        if args.load_best_model_at_end:
            self._find_best(args, state)

    def _find_best(self, args: TrainingArguments, state: TrainerState) -> None:
        """Point ``state.best_model_checkpoint`` at a local copy of the best
        checkpoint the resumed state records, fetched from storage into
        ``<run dir>/checkpoint-<best step>`` when it is not there. HF has
        dropped a recorded path that does not exist here (another machine,
        another ``output_dir``), and would end with the last weights."""
        step = getattr(state, "best_global_step", None)
        best = state.best_model_checkpoint
        if not step or (best is not None and os.path.isdir(best)):
            return
        run_dir = _run_dir(args, state)
        local = os.path.join(run_dir, f"checkpoint-{step}")
        if not os.path.isdir(local):
            root = os.path.abspath(run_dir)
            os.makedirs(root, exist_ok=True)
            with _restore_lock(root):
                copies = trial_copies(self._storage, self._local_tier)
                _restore_best(root, step, [(c.checkpoint, c.meta) for c in reversed(copies)])
        if os.path.isdir(local):
            state.best_model_checkpoint = local

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        sess = self.session
        if sess is None or self._preemption is None:
            return
        flagged = sess.preemption_signalled
        dist = _process_group()
        if dist is not None and args.world_size > 1:
            # Any rank's signal counts: every rank saves this step.
            flagged = _any_rank(dist, flagged)
        if flagged:
            sess.join_preemption()  # this step's save is every rank's preemption report
            # The Trainer saves checkpoint-<global_step> right after this
            # hook (on_save reports it as the preemption checkpoint), then stops.
            control.should_save = True
            control.should_training_stop = True

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
        metrics: Mapping[str, Any] | None = None, **kwargs: Any,
    ) -> None:
        # Kept for the save that follows in the same step (HF evaluates first).
        self._metrics = {k: v for k, v in (metrics or {}).items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        sess = self.session
        if sess is None:
            raise CheckpointStoreError(
                "CheckpointStoreCallback.on_save ran before on_train_begin; pass the callback "
                "to Trainer(callbacks=[...]) rather than calling it by hand"
            )
        dist = _process_group()
        if dist is not None:
            dist.barrier()  # every rank's part of the save is on its disk
        step = state.global_step
        # The directory this save just wrote, by name: listing the run directory
        # could pick a newer leftover of an earlier run.
        local = os.path.join(_run_dir(args, state), f"checkpoint-{step}")
        metrics = {**self._metrics, STEP_METRIC: step, "epoch": state.epoch}
        self._metrics = {}
        try:
            if dist is None or args.world_size <= 1:
                checkpoint = (Checkpoint.from_directory(local) if state.is_world_process_zero
                              else None)
                sess.report(metrics, checkpoint=checkpoint)
                return
            # Each rank uploads the files only it sees into the one checkpoint,
            # which rank 0 commits once every rank's part is in.
            rels = _owned_files(dist, local, args.process_index, args.world_size)
            with _share(local, rels) as checkpoint:
                sess.report(metrics, checkpoint=checkpoint)
        except Preempted:
            # Committed, and the session ended as "preempted": nothing is left
            # to close; the exception ends trainer.train().
            self.session = None
            _OPEN.discard(self)
            raise

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()

    def close(self, error: BaseException | None = None) -> None:
        """End the session (idempotent); ``on_train_end`` and leaving a
        ``with callback:`` block call it.

        Args:
            error: the exception that ended training, recorded in the trial's
                ``error.txt`` (:meth:`Session.close`); None for a clean end.
        """
        sess, self.session = self.session, None
        _OPEN.discard(self)
        if sess is not None:
            sess.close(error)


def _any_rank(dist: Any, flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (an all-reduce of one integer, on
    the device the process group's backend uses)."""
    import torch

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# Callbacks whose session is open: ended at interpreter exit if training
# raised outside a ``with callback:`` block (HF calls no callback then).
_OPEN: weakref.WeakSet[CheckpointStoreCallback] = weakref.WeakSet()


def _close_at_exit() -> None:
    # The interpreter sets sys.last_exc (3.12+) or sys.last_value to an
    # uncaught exception after printing it, before atexit handlers run.
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if error is None:
        error = CheckpointStoreError(
            "the process exited while trainer.train() was running (on_train_end never ran)")
    for callback in list(_OPEN):
        try:
            callback.close(error)
        except Exception:  # one failure must not keep other sessions open
            logger.exception("could not end the session of %r at exit", callback)


atexit.register(_close_at_exit)


def restore_latest(
    output_dir: str | os.PathLike[str],
    *,
    storage_path: str | os.PathLike[str],
    experiment_name: str = "default",
    trial_name: str = "default",
    storage_filesystem: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    local_tier: LocalTier | None = None,
) -> str | None:
    """Put the newest committed checkpoint of the trial into
    ``output_dir/checkpoint-<global_step>``, so that
    ``trainer.train(resume_from_checkpoint=True)`` continues from it.

    The newest committed checkpoint whose files verify (sizes, CRC32C) is
    downloaded. A local directory of that name whose files all match the
    manifest is used as it is (nothing downloaded); one that does not (a
    deleted ``trainer_state.json``, a truncated weight file) is renamed to
    ``incomplete-checkpoint-<step>-<unix time>`` with a warning and replaced
    by the download. Local ``checkpoint-<N>`` directories with a higher step, which HF's own
    lookup would pick although nothing says they are complete (transformers
    #35782), are renamed to ``uncommitted-checkpoint-<N>-<unix time>`` (kept,
    and out of reach of HF's rotation, which globs ``checkpoint-*``) with a
    warning. When its ``trainer_state.json`` names a best checkpoint of
    another step (``load_best_model_at_end``), that one is restored the same
    way beside it, as ``output_dir/checkpoint-<best step>``, if it is on
    storage (else a warning: HF will then end with the last weights).
    With a local tier (``local_tier=``, the one given to the callback; or,
    when not given, the one-rank tier the trial's pointer file records for
    this host, docs/tiers.md) the local tier's copies and the storage_path's
    are one history: the newest copy that verifies wins, a tier copy newer
    than every durable one included (its durable copy may still be pending);
    a tier copy another run's report superseded (the storage_path names
    another report for its index) is never restored.
    Safe to call from every rank at once (a lock file in ``output_dir``
    serialises them). When it returns, ``output_dir`` holds nothing of ours:
    the lock and the download's bookkeeping files are removed; a restore
    that was killed part-way is finished by the next call.

    Returns:
        The local checkpoint directory, or None when the trial has no
        committed checkpoint (start from scratch: ``resume_from_checkpoint=None``).

    Raises:
        InvalidConfigError: bad names or location, or ``output_dir`` is no
            local path (not a str or PathLike, a NUL byte, another store's URI).
        CheckpointStoreError: the newest checkpoint was not written by
            :class:`CheckpointStoreCallback` (no ``global_step`` metric).
        CheckpointCorruptError: a download failed verification.
    """
    root = local_path_argument(output_dir, "restore_latest(output_dir)")
    storage = StorageContext(
        storage_path, experiment_name, trial_name,
        storage_filesystem=storage_filesystem, storage_options=storage_options,
    )
    local_tier = check_local_tier(local_tier)
    copies = trial_copies(storage, local_tier)
    latest = _newest_verified(copies)
    if latest is None:
        return None
    step = latest.internal_metadata.get("metrics", {}).get(STEP_METRIC)
    if isinstance(step, bool) or not isinstance(step, int):
        raise CheckpointStoreError(
            f"checkpoint {latest.uri} has no integer {STEP_METRIC!r} metric, so it was not "
            "written by CheckpointStoreCallback; download it with Checkpoint.to_directory()"
        )
    _make_output_dir(root)
    with _restore_lock(root):
        _move_aside_newer(root, step)
        target = _restore_step(root, step, latest)
        best = _best_step(target)
        if best is not None and best != step:
            _restore_best(root, best, [(c.checkpoint, c.meta) for c in reversed(copies)])
    return target


def _newest_verified(copies: list[HistoryCopy]) -> Checkpoint | None:
    """The first of ``copies`` whose files verify; each that fails is skipped
    with a warning naming it."""
    for copy in copies:
        try:
            copy.checkpoint.verify()
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
            warnings.warn(f"skipping {copy.checkpoint.uri}: it does not verify ({exc})",
                          RuntimeWarning, stacklevel=3)
            continue
        return copy.checkpoint
    return None


def _make_output_dir(root: str) -> None:
    """Create ``output_dir`` (and its parents) for :func:`restore_latest`.

    Raises:
        InvalidConfigError: it, or a directory above it, is a file; nothing written.
    """
    try:
        os.makedirs(root, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise InvalidConfigError(
            f"restore_latest(output_dir) {root!r}: it, or a directory above it, is a file, "
            "not a directory; give the Trainer's output_dir (a directory, created when "
            "missing)") from exc


def _restore_step(root: str, step: int, checkpoint: Checkpoint) -> str:
    """``root/checkpoint-<step>`` holding exactly ``checkpoint``'s files: kept
    when it matches, else set aside and downloaded. Under :func:`_restore_lock`."""
    name = f"checkpoint-{step}"
    target = os.path.join(root, name)
    try:
        if os.path.isdir(target):
            if _matches(target, checkpoint.internal_metadata["manifest"]):
                return target
            _move_aside(target, "incomplete", "does not match the committed checkpoint of that "
                        "step (a file is missing or differs); downloading it again")
        return checkpoint.to_directory(target)
    finally:
        # The download's lock and marker beside the target: restore_latest
        # checks a local copy against the manifest, never by the marker.
        for helper in (download_lock_name(name), download_marker_name(name)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(root, helper))


def _best_step(checkpoint_dir: str) -> int | None:
    """The step of the best checkpoint the ``trainer_state.json`` in
    ``checkpoint_dir`` records (``load_best_model_at_end``), or None."""
    try:
        with open(os.path.join(checkpoint_dir, TRAINER_STATE_NAME), "rb") as f:
            state = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    step = state.get("best_global_step")
    if isinstance(step, int) and not isinstance(step, bool) and step > 0:
        return step
    m = _HF_CHECKPOINT_RE.match(os.path.basename(str(state.get("best_model_checkpoint") or "")))
    return int(m.group(1)) if m else None


def _restore_best(root: str, step: int,
                  committed: list[tuple[Checkpoint, dict[str, Any]]]) -> str | None:
    """Restore the committed checkpoint of ``step`` into ``root/checkpoint-<step>``
    (the newest of that step); None, with a warning, when storage has none."""
    found = [c for c, meta in committed if meta.get("metrics", {}).get(STEP_METRIC) == step]
    if not found:
        logger.warning(
            "the best checkpoint (step %d) that trainer_state.json records is not on storage "
            "(retention did not keep it); load_best_model_at_end will end with the last "
            "weights. Keep it with a checkpoint_config scoring the Trainer's "
            "metric_for_best_model", step)
        return None
    return _restore_step(root, step, found[-1])


@contextlib.contextmanager
def _restore_lock(root: str) -> Iterator[None]:
    """Exclusive among the processes restoring into ``root`` (every rank,
    every node sharing it), through ``root/.checkpoint-store-restore.lock``,
    which the holder removes before it lets go. A waiter that then wins the
    lock of the removed file sees it is no longer the one at that path and
    takes the lock again, so two holders never overlap."""
    path = os.path.join(root, _RESTORE_LOCK)
    fd = _flock_at(path) if fcntl is not None else None
    if fd is None:  # pragma: no cover - no flock here (Windows, some NFS mounts)
        # filelock's own fallbacks; its lock file stays.
        with filelock.FileLock(path):
            yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        os.close(fd)


def _flock_at(path: str) -> int | None:
    """An open descriptor of ``path`` holding its exclusive flock, or None
    where the filesystem has no flock."""
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
                return None
            raise
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)  # the holder removed the file we locked: lock the new one


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _matches(local: str, manifest: list[dict[str, Any]]) -> bool:
    """Every manifest file in ``local`` with its size and CRC32C (reads them once)."""
    try:
        verify_files(pafs.LocalFileSystem(), local, manifest)
    except CheckpointCorruptError:
        return False
    return True


def _move_aside(path: str, prefix: str, why: str) -> None:
    """Rename ``path`` to ``<prefix>-<name>-<unix time>`` beside it: out of
    reach of HF's lookup and rotation (both glob ``checkpoint-*``), never deleted."""
    parent, name = os.path.split(path)
    aside = os.path.join(parent, f"{prefix}-{name}-{int(time.time())}")
    os.rename(path, aside)
    logger.warning("%s %s; renamed it to %s", path, why, aside)


def _move_aside_newer(root: str, step: int) -> None:
    for name in sorted(os.listdir(root)):
        m = _HF_CHECKPOINT_RE.match(name)
        if m is None or int(m.group(1)) <= step or not os.path.isdir(os.path.join(root, name)):
            continue
        _move_aside(os.path.join(root, name), "uncommitted",
                    f"is newer than the newest committed checkpoint (step {step}) and may be "
                    "incomplete, so resume_from_checkpoint=True must not pick it")
