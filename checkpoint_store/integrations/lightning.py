"""PyTorch Lightning: checkpoints committed, verified and kept on any storage.

Two ways to plug in (``pip install 'checkpoint-store[lightning]'``):

* :class:`CheckpointStoreIO`, a ``CheckpointIO`` plugin, with Lightning's own
  ``ModelCheckpoint`` (which owns top-K). Each ``.ckpt`` path names a committed
  checkpoint directory on any backend; loads verify; removes never touch
  what this run did not write (a run resumed from a checkpoint is that
  checkpoint's run). :func:`resume_path` gives ``fit(ckpt_path=...)`` the
  newest (or best) complete checkpoint. Where the store's credentials are
  only in the plugin's ``storage_options`` (not in the environment), use
  :class:`StoreModelCheckpoint` for ``ModelCheckpoint``: it lists its
  dirpath with those options.
* :class:`ReportCheckpointCallback` with ``enable_checkpointing=False``: each
  validation is a ``report()`` to a session, so our retention, ``result.json``
  and resume apply; ``callback.best_path()`` is the best checkpoint.

The paths Lightning hands out (``best_model_path``) name checkpoint
directories: :func:`checkpoint_file` turns one into what ``torch.load`` and
``LightningModule.load_from_checkpoint`` take.

Usage::

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from checkpoint_store.integrations.lightning import CheckpointStoreIO, resume_path

    trainer = L.Trainer(
        plugins=[CheckpointStoreIO(async_save=True)],
        callbacks=[ModelCheckpoint(dirpath="s3://bucket/run/checkpoints",
                                   monitor="val_loss", save_top_k=2)],
    )
    trainer.fit(model, ckpt_path=resume_path("s3://bucket/run/checkpoints"))

This module binds to the ``lightning`` package, or to ``pytorch_lightning``
when only that is installed; :mod:`checkpoint_store.integrations.pytorch_lightning`
always binds to ``pytorch_lightning``.
"""

from __future__ import annotations

from checkpoint_store.integrations._lightning import (
    STATE_FILE,
    _ReportCallback,
    _StoreIO,
    _StoreModelCheckpoint,
    checkpoint_file,
    resume_path,
)

try:
    from lightning.fabric.plugins import CheckpointIO as _CheckpointIO
    from lightning.pytorch import Callback as _Callback
    from lightning.pytorch.callbacks import ModelCheckpoint as _ModelCheckpoint
except ImportError:
    try:
        # The standalone packages ship the same classes; mypy sees each
        # import as a distinct type, so the fallback cannot type-check.
        from lightning_fabric.plugins import CheckpointIO as _CheckpointIO  # type: ignore[assignment]
        from pytorch_lightning import Callback as _Callback  # type: ignore[assignment]
        from pytorch_lightning.callbacks import (  # type: ignore[assignment]
            ModelCheckpoint as _ModelCheckpoint,
        )
    except ImportError:
        raise ImportError(
            "checkpoint_store.integrations.lightning needs PyTorch Lightning: pip install "
            "'checkpoint-store[lightning]'"
        ) from None

__all__ = [
    "STATE_FILE",
    "CheckpointStoreIO",
    "ReportCheckpointCallback",
    "StoreModelCheckpoint",
    "checkpoint_file",
    "resume_path",
]


class CheckpointStoreIO(_StoreIO, _CheckpointIO):
    """A ``CheckpointIO`` plugin (``Trainer(plugins=[CheckpointStoreIO()])``)
    that commits each checkpoint on any checkpoint-store backend.

    * ``save_checkpoint(checkpoint, path, storage_options=None)``: ``path``
      (``<dirpath>/epoch=3-step=8.ckpt``, a local path or a URI such as
      ``s3://``, ``az://``, ``gs://``) names a directory; the state goes inside
      as one file, :data:`STATE_FILE`, streamed to the backend by
      ``torch.save`` with its CRC32C computed on the way (no local copy), and
      the directory is committed by our protocol (rename on local disks,
      marker last elsewhere). Saving to a path that holds a checkpoint
      (``last.ckpt``) replaces it with no moment without a complete one: the
      new one is committed beside it (``.cs_replace-<name>-<writer>``), a
      pointer file ``<path>/.cs_current`` is switched to it in one write,
      then the old one is removed; loads and :func:`resume_path` follow the
      pointer.
    * ``load_checkpoint(path, map_location=None, weights_only=None, **kwargs)``:
      checks the state file's size and CRC32C against the manifest before
      ``torch.load`` (``kwargs`` go to it); also loads a plain legacy ``.ckpt``
      file. ``checkpoint_file(path)`` gives the verified state as
      ``torch.load`` and ``load_from_checkpoint`` take it. Raises
      :class:`~checkpoint_store.CheckpointNotFoundError` (a
      ``FileNotFoundError``) for nothing there or an uncommitted directory,
      :class:`~checkpoint_store.CheckpointCorruptError` for a mismatch.
    * ``remove_checkpoint(path)``: uncommits, then deletes. Refuses (a
      ``RuntimeWarning``, the checkpoint kept) anything outside :attr:`root`,
      the checkpoint this run resumed from (Lightning keeps it on local disks
      and deletes it on remote ones, Lightning #21813), and anything this run
      did not write (another run's, a plain file). A run that loaded a
      checkpoint of this plugin (``fit(ckpt_path=...)``) continues that
      checkpoint's run: the checkpoints written before the restart are its
      own, so ``ModelCheckpoint``'s top-K holds on storage after any number
      of restarts.

    Lightning's ``ModelCheckpoint`` owns top-K; this plugin never evicts on its own.

    Args:
        async_save: save in a background thread. One ordered queue carries
            saves *and* removes, so a remove never overtakes the save that made
            it redundant; a load waits for pending saves of its path; the save
            works on a snapshot of the tensors taken at the call (see
            ``staging_budget``). ``teardown`` (end of
            ``fit``) waits for the queue and raises the first error; an error
            also surfaces at the next save or remove. After a failed save,
            queued removes are skipped. Use this instead of wrapping the
            plugin in Lightning's ``AsyncCheckpointIO``, whose removes and
            loads run beside its queue (Lightning #14035).
        max_pending_saves: with ``async_save``, a save blocks while this many
            are queued.
        staging_budget: with ``async_save``, bytes of shared memory the
            snapshot of each save is staged in (default min(2 GiB, 25 % of
            RAM)); a save copies its tensors there (blocking only while it is
            full) and a persist process writes them to local safetensors
            files, from which the background save streams the state file
            (memory-mapped: no second copy of the state in the training
            process, however many saves are pending). Tensors off the CPU or
            of a dtype safetensors lacks are cloned instead; staged tensors
            are saved as CPU tensors.
        root: URI or path of the only directory removes may touch (default:
            the directory of the first checkpoint saved, i.e. the
            ``ModelCheckpoint`` dirpath).
        storage_options: backend options for URIs (endpoint, credentials).
        storage_filesystem: a pyarrow or fsspec filesystem; paths are then
            paths inside it.
        fsync: on local disks, fsync before each commit (default True).
        retry: retry policy for storage calls (default from the environment).

    Attributes:
        run_id: recorded in each checkpoint this plugin writes; what "written
            by this run" means. A new id per plugin; a load of a checkpoint
            this plugin class wrote, before the first save, takes that
            checkpoint's run id on (the resumed run is the same run).

    Raises:
        InvalidConfigError: a bad argument; ``storage_options`` passed to
            ``save_checkpoint`` (give them here).
    """


class StoreModelCheckpoint(_StoreModelCheckpoint, _ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same arguments, same top-K) whose
    dirpath is listed and probed with the storage options of the trainer's
    :class:`CheckpointStoreIO`, so credentials and endpoints given only to
    the plugin reach every ``ModelCheckpoint`` call (the non-empty dirpath
    check at ``setup``, version-counter ``exists``, ``last.ckpt`` lookups).

    Use it instead of ``ModelCheckpoint`` wherever the store's options are
    not in the environment: Lightning's own ``ModelCheckpoint`` builds its
    filesystem with no options (``NoCredentialsError`` at ``setup`` on S3
    with keys in ``storage_options`` alone). The filesystem is the fsspec
    client of the plugin's backend for the dirpath (s3fs, adlfs, gcsfs, a
    plugin scheme's client); on local disks Lightning's own. Nothing
    process-wide changes.

    Raises:
        InvalidConfigError: at ``setup``, a trainer whose checkpoint IO is not
            :class:`CheckpointStoreIO`.
    """


class ReportCheckpointCallback(_ReportCallback, _Callback):
    """Report every validation to a checkpoint-store session, with a checkpoint
    (use with ``Trainer(enable_checkpointing=False)``).

    After each validation (the sanity check skipped) every rank saves the
    trainer's state through ``trainer.save_checkpoint`` into a temporary local
    directory and calls ``report()`` with ``trainer.callback_metrics`` (as
    floats; non-scalars dropped) plus ``epoch`` and ``step`` (the global
    step). Our retention, ``result.json`` and resume then apply; the
    committed checkpoint holds :data:`STATE_FILE`. :meth:`resume_path` (the
    newest), :meth:`best_path` (the best by ``monitor``, downloaded: Lightning's
    ``ckpt_path="best"`` needs a ``ModelCheckpoint``) and
    :meth:`best_checkpoint` (on storage) reach the trial's checkpoints from
    any process. When the session is asked
    to stop (a :class:`~checkpoint_store.TrialRunner` stopped by a tuner), the
    callback sets ``trainer.should_stop`` and ``fit`` ends after that epoch.

    Args:
        monitor: the metric retention ranks by (``checkpoint_score_attribute``),
            or None for the newest.
        mode: ``"min"`` or ``"max"`` (``checkpoint_score_order``).
        num_to_keep: how many checkpoints to keep (None: all).
        storage_path: where the trial lives (with ``experiment_name``,
            ``trial_name``, ``storage_options``, ``storage_filesystem``,
            ``local_tier``: a :class:`~checkpoint_store.LocalTier`); the
            callback starts a session there on each rank at ``setup`` (rank
            and world size from the trainer) and ends it at ``teardown``.
            Without it the callback reports into the session already active
            (say, a trial run by a ``TrialRunner``); retention is then that
            session's.
        preemption: a :class:`~checkpoint_store.PreemptionConfig` (or True
            for its defaults) for the session the callback starts
            (docs/preemption.md); a session already active has its own. On
            the signal, the batch under way finishes; at its end every rank
            saves the trainer's state (with several ranks they agree at
            each batch's end through ``strategy.reduce_boolean_decision``:
            any rank's signal counts), the session commits it as a
            preemption checkpoint and records the trial as ``preempted``,
            the callback sets ``trainer.should_stop`` and
            :class:`~checkpoint_store.errors.Preempted` (a ``SystemExit``
            with the scheduler's exit status) ends ``fit``; a restart
            resumes from it with ``fit(ckpt_path=callback.resume_path())``.

    Raises:
        InvalidConfigError: a bad ``mode``, retention or ``preemption``
            setting; ``monitor``, ``num_to_keep`` or ``preemption`` without
            ``storage_path``; at ``setup``, a trainer
            whose checkpoint IO is :class:`CheckpointStoreIO`.
        CheckpointStoreError: at ``setup`` without ``storage_path`` and no
            active session.
    """
