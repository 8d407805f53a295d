"""The body of ``ReportCheckpointCallback``: Lightning checkpoints reported to a session."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any, Literal

from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.integrations._lightning.io import _StoreIO
from checkpoint_store.integrations._lightning.resume import _first_verified, _pick
from checkpoint_store.integrations._lightning.state import STATE_FILE, _to_float

__all__ = ["_ReportCallback"]

# The name the integration has always logged under, so filters set on it
# keep working now that it spans several modules.
logger = logging.getLogger("checkpoint_store.integrations._lightning")


class _ReportCallback:
    """The body of ``ReportCheckpointCallback`` (see its docstring in lightning.py)."""

    def __init__(
        self,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        num_to_keep: int | None = None,
        *,
        storage_path: str | os.PathLike[str] | None = None,
        experiment_name: str = "default",
        trial_name: str = "default",
        storage_options: Mapping[str, Any] | None = None,
        storage_filesystem: Any = None,
        local_tier: Any = None,
        preemption: Any = None,
    ):
        from checkpoint_store.retention import CheckpointConfig
        from checkpoint_store.session._preemption import check_preemption
        from checkpoint_store.tiers import check_local_tier

        super().__init__()
        if mode not in ("min", "max"):
            raise InvalidConfigError(f"mode must be 'min' or 'max', got {mode!r}")
        self.monitor = monitor
        self.mode = mode
        self.num_to_keep = num_to_keep
        self._storage = None
        self._preemption = check_preemption(preemption)
        if storage_path is None:
            if self._preemption is not None:
                raise InvalidConfigError(
                    "without storage_path the callback reports into the active session, "
                    "whose preemption setting applies: pass preemption= to session.start()")
            if monitor is not None or num_to_keep is not None:
                raise InvalidConfigError(
                    "without storage_path the callback reports into the active session, whose "
                    "checkpoint_config decides retention: pass monitor/num_to_keep to "
                    "session.start(checkpoint_config=...), or give storage_path here"
                )
            self._config = None
        else:
            # Validates now, in the main process, before any rank starts.
            self._config = CheckpointConfig(
                num_to_keep=num_to_keep, checkpoint_score_attribute=monitor,
                checkpoint_score_order=mode,
            )
            self._storage = dict(
                storage_path=storage_path, experiment_name=experiment_name,
                trial_name=trial_name, storage_options=storage_options,
                storage_filesystem=storage_filesystem,
                local_tier=check_local_tier(local_tier),
            )
        self._active: Any = None
        self._session: Any = None
        self.stopped_by_session = False
        #: Temporary directories :meth:`resume_path` downloaded into: removed
        #: once the trainer has loaded the checkpoint (:meth:`on_train_start`),
        #: else at teardown, on an exception, or at interpreter exit.
        self._resume_copies: list[str] = []

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_active"] = state["_session"] = None
        return state

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        from checkpoint_store import session

        if isinstance(trainer.strategy.checkpoint_io, _StoreIO):
            raise InvalidConfigError(
                "ReportCheckpointCallback saves through the trainer into a temporary local "
                "file and reports it; it cannot be combined with CheckpointStoreIO. Use one: "
                "the callback (our retention), or CheckpointStoreIO with ModelCheckpoint"
            )
        if self._storage is None:
            self._session = session.get_session()
            return
        self._active = session.start(
            **self._storage, checkpoint_config=self._config,
            world_rank=trainer.global_rank, world_size=trainer.world_size,
            local_rank=trainer.local_rank, preemption=self._preemption,
        )
        self._session = self._active.session

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # fit() has restored the model, optimizers and loops from ckpt_path
        # (resume_end) before this hook: the downloaded copy is not read again.
        self._drop_resume_copies()

    def _drop_resume_copies(self) -> None:
        copies, self._resume_copies = getattr(self, "_resume_copies", []), []
        for path in copies:
            shutil.rmtree(path, ignore_errors=True)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking or self._session is None:
            return
        self._save_and_report(trainer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """After a preemption signal (the session's ``preemption=``): save the
        trainer's state at the end of this batch as a preemption checkpoint
        and end ``fit`` with :class:`~checkpoint_store.errors.Preempted`."""
        sess = self._session
        if sess is None or sess.preemption is None:
            return
        flagged = sess.preemption_signalled
        if trainer.world_size > 1:
            # Every rank saves the same step: any rank's signal counts.
            flagged = trainer.strategy.reduce_boolean_decision(flagged, all=False)
        if flagged:
            sess.join_preemption()
            self._save_and_report(trainer)

    def _save_and_report(self, trainer: Any) -> None:
        from checkpoint_store.checkpoint import Checkpoint
        from checkpoint_store.errors import Preempted
        from checkpoint_store.session import TrialStopped

        metrics = {k: v for k, v in ((str(k), _to_float(v))
                                     for k, v in trainer.callback_metrics.items())
                   if v is not None}
        metrics.update(epoch=trainer.current_epoch, step=trainer.global_step)
        tmp = tempfile.mkdtemp(prefix="cs-lightning-")
        try:
            state = os.path.join(tmp, STATE_FILE)
            trainer.save_checkpoint(state)  # every rank: sharded strategies gather here
            ckpt = Checkpoint.from_directory(tmp) if os.path.exists(state) else None
            try:
                self._session.report(metrics, checkpoint=ckpt)
            except Preempted as exc:
                # Committed as the preemption checkpoint and the session ended
                # as "preempted": stop here, within the grace period (a
                # should_stop alone may run a validation first, or be ignored
                # before min_steps), and let the exception end fit().
                self.stopped_by_session = True
                trainer.should_stop = True
                active, self._active, self._session = self._active, None, None
                if active is not None:
                    active.end(exc)
                raise
            except TrialStopped:
                # The row and its checkpoint are in; end fit() cleanly.
                self.stopped_by_session = True
                trainer.should_stop = True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._drop_resume_copies()
        active, self._active, self._session = self._active, None, None
        if active is not None:
            active.end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning skips teardown hooks when fit() raises: end the session
        # here, or its lease and this thread's session would outlive the run.
        self._drop_resume_copies()
        from checkpoint_store.errors import Preempted

        sess = self._active.session if self._active is not None else None
        if (sess is not None and sess.preemption_signalled
                and not isinstance(exception, Preempted)):
            # The signal reached Lightning's own handler too, which stops fit
            # (SIGTERMException) where our batch-end hook does not run (in a
            # validation): save the trainer's state here, as the preemption
            # checkpoint; _save_and_report ends the session and raises Preempted.
            sess.join_preemption()
            self._save_and_report(trainer)
        active, self._active, self._session = self._active, None, None
        if active is not None:
            try:
                active.end(exception)  # recorded in the trial's error.txt
            except Exception as exc:  # noqa: BLE001 - the run's own error comes first
                logger.warning("ending the session after %r failed: %s", exception, exc)

    def resume_path(
        self, local_dir: str | os.PathLike[str] | None = None, *, best: bool = False
    ) -> str | None:
        """Download the newest (or, with ``best``, the best by ``monitor``)
        committed checkpoint that verifies and return its local ``.ckpt`` file
        for ``trainer.fit(ckpt_path=...)``; None when the trial has none.

        Call it before ``fit``, on every rank (each downloads its own copy).
        ``local_dir`` receives the files (the caller's to remove). Without it
        they go to a new temporary directory that this callback removes once
        ``fit`` has loaded the checkpoint (``on_train_start``), or at
        teardown, on an exception, or at interpreter exit if ``fit`` never runs.

        Raises:
            InvalidConfigError: ``best`` without ``monitor`` on the callback,
                or with one that no checkpoint of the trial reported.
        """
        chosen = self._chosen(best)
        if chosen is None:
            return None
        if local_dir is None:
            local_dir = tempfile.mkdtemp(prefix="cs-lightning-resume-")
            self._resume_copies.append(local_dir)
            # A resume_path() whose fit() never runs must not leave a model copy.
            atexit.register(shutil.rmtree, local_dir, True)
        target = chosen.to_directory(local_dir)
        return os.path.join(target, STATE_FILE)

    def best_path(self, local_dir: str | os.PathLike[str] | None = None) -> str | None:
        """The best checkpoint by ``monitor`` (``mode``) as a local ``.ckpt``
        file: ``resume_path(local_dir, best=True)``. What Lightning's
        ``ckpt_path="best"`` is for a ``ModelCheckpoint`` (which this callback
        is not, so Lightning refuses ``"best"`` here)::

            trainer.test(model, ckpt_path=callback.best_path())
            model = MyModel.load_from_checkpoint(callback.best_path())

        The file is verified, and removed as :meth:`resume_path` says (pass
        ``local_dir`` to keep it).

        Raises:
            InvalidConfigError: the callback has no ``monitor``, or one that
                no checkpoint of the trial reported.
        """
        return self.resume_path(local_dir, best=True)

    def best_checkpoint(self) -> Any:
        """The best committed checkpoint by ``monitor`` that verifies, as a
        :class:`~checkpoint_store.Checkpoint` on storage (nothing downloaded:
        ``.uri``, ``.internal_metadata["metrics"]``, ``.to_directory()``), or
        None when the trial has none.

        Raises:
            InvalidConfigError: the callback has no ``monitor``, or one that
                no checkpoint of the trial reported.
        """
        return self._chosen(best=True)

    def _chosen(self, best: bool) -> Any:
        """The newest (or best) committed checkpoint of the trial that verifies."""
        if best and self.monitor is None:
            raise InvalidConfigError(
                "the best checkpoint needs monitor= on the callback (the metric to rank by)")
        from checkpoint_store.tiers.history import trial_copies

        # The local tier's copies and the storage_path's, as one history.
        tier = self._storage.get("local_tier") if self._storage is not None else None
        copies = [(c.checkpoint, c.meta) for c in trial_copies(self._trial_storage(), tier)]
        order = _pick(copies, self.monitor if best else None, self.mode)
        return _first_verified(order, lambda c: c.uri, lambda c: c.verify())

    def _trial_storage(self) -> Any:
        from checkpoint_store.storage import StorageContext

        if self._storage is None:
            from checkpoint_store import session

            return session.get_context().storage
        s = self._storage
        return StorageContext(
            s["storage_path"], s["experiment_name"], s["trial_name"],
            storage_filesystem=s["storage_filesystem"], storage_options=s["storage_options"],
        )
