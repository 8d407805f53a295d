"""Adapters between checkpoint-store and tuning engines (each imported on demand).

* :mod:`checkpoint_store.integrations.optuna`: a function trainable as an
  Optuna objective, with pruning through the trial runner's stop path.
* :mod:`checkpoint_store.integrations.lightning` (and
  :mod:`~checkpoint_store.integrations.pytorch_lightning` for the old package
  name): a ``CheckpointIO`` plugin, a report callback and a resume helper.
"""
