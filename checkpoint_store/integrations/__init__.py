"""Adapters between checkpoint-store and tuning engines (each imported on demand).

* :mod:`checkpoint_store.integrations.optuna`: a function trainable as an
  Optuna objective, with pruning through the trial runner's stop path.
"""
