"""Adapters between checkpoint-store and training or tuning frameworks.

Each module is imported on demand and needs its framework (an extra);
importing ``checkpoint_store`` imports none of them.

* :mod:`checkpoint_store.integrations.optuna`: a function trainable as an
  Optuna objective, with pruning through the trial runner's stop path.
* :mod:`checkpoint_store.integrations.lightning` (and
  :mod:`~checkpoint_store.integrations.pytorch_lightning` for the old package
  name): a ``CheckpointIO`` plugin, a report callback and a resume helper.
* :mod:`checkpoint_store.integrations.hf`: a Hugging Face ``Trainer``
  callback that commits every save, and ``restore_latest`` for resume
  (extra ``[hf]``).
* :mod:`checkpoint_store.integrations.torch`: ``StorageWriter`` and
  ``StorageReader`` for ``torch.distributed.checkpoint`` on any backend
  (extra ``[torch]``); in-place commits need only
  ``session.next_checkpoint_dir()``.
* :mod:`checkpoint_store.integrations.ray`: our backends as Ray's storage
  filesystem, committed Ray Train checkpoints, and ``session.report()``
  inside Ray Train workers and Ray Tune trials.
"""
