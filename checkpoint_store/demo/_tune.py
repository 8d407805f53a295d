"""``checkpoint-store demo --tune``: an Optuna study over the learning rate of the digits MLP.

Every trial runs the same :func:`checkpoint_store.demo.train_digits` the
plain demo runs, inside a :class:`~checkpoint_store.TrialRunner` (two at a
time), keeping its own best checkpoints under
``<storage>/digits-tune/trial_<n>/``. A median pruner stops weak trials
through the runner's stop path. At the end the best trial's best checkpoint
is loaded and measured on the held-out test split.
"""

from __future__ import annotations

import click

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.errors import CheckpointStoreError

EXPERIMENT = "digits-tune"


def run_tune(*, storage: str, trials: int = 8, parallel: int = 2, epochs: int = 10,
             num_to_keep: int = 2, seed: int = 0, fresh: bool = False) -> int:
    """Run the study and print the trials, the best one and its test accuracy.

    Returns:
        The process exit code (0).

    Raises:
        CheckpointStoreError: no trial completed with a checkpoint.
        ImportError: Optuna is missing (``pip install 'checkpoint-store[tune]'``).
    """
    try:
        import optuna
    except ImportError:
        raise click.ClickException(
            "demo --tune needs Optuna: pip install 'checkpoint-store[tune]'"
        ) from None
    from checkpoint_store.demo import test_accuracy_of, train_digits
    from checkpoint_store.integrations.optuna import ATTR_BEST_CHECKPOINT, objective

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ctx = StorageContext(storage, EXPERIMENT, "probe")
    if _fsutil.exists(ctx.filesystem, ctx.experiment_path):
        if not fresh:
            raise click.ClickException(
                f"a previous study is at {ctx.uri(ctx.experiment_path)}; nothing was changed. "
                "Pass --fresh to delete it and start over, or --storage elsewhere for a new "
                "study beside it")
        click.echo(f"Starting fresh (--fresh): removing the previous study "
                   f"{ctx.uri(ctx.experiment_path)}")
        _fsutil.delete_dir(ctx.filesystem, ctx.experiment_path)

    study = optuna.create_study(
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=seed),
        # Compare from the third epoch on, once two trials have finished.
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2),
    )

    def config(trial: optuna.Trial) -> dict:
        return {"lr": trial.suggest_float("lr", 1e-3, 1.0, log=True), "epochs": epochs,
                "seed": seed}

    click.echo(f"Tuning the learning rate: {trials} trials, {parallel} at a time, "
               f"{epochs} epochs each, median pruning")
    study.optimize(
        objective(train_digits, config, storage_path=storage, experiment_name=EXPERIMENT,
                  metric="val_accuracy", mode="max",
                  checkpoint_config=CheckpointConfig(
                      num_to_keep=num_to_keep, checkpoint_score_attribute="val_accuracy",
                      checkpoint_score_order="max")),
        n_trials=trials, n_jobs=parallel,
    )

    click.echo("")
    click.echo(f"{'trial':>5}  {'lr':>9}  {'state':>8}  {'epochs':>6}  {'best val_accuracy':>17}")
    for t in sorted(study.trials, key=lambda t: t.number):
        values = t.intermediate_values
        best = max(values.values()) if values else float("nan")
        click.echo(f"{t.number:>5}  {t.params.get('lr', float('nan')):>9.5f}  "
                   f"{t.state.name.lower():>8}  {len(values):>6}  {best:>17.4f}")
    completed = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not completed:
        raise CheckpointStoreError("no trial completed; try more trials or epochs")
    best_trial = study.best_trial
    uri = best_trial.user_attrs.get(ATTR_BEST_CHECKPOINT)
    if not uri:
        raise CheckpointStoreError(f"trial {best_trial.number} kept no checkpoint")
    checkpoint = Checkpoint(uri)
    epoch = checkpoint.internal_metadata.get("metrics", {}).get("epoch")
    acc = test_accuracy_of(checkpoint, seed)
    click.echo("")
    click.echo(f"Best trial: {best_trial.number} (lr {best_trial.params['lr']:.5f}, "
               f"val_accuracy {study.best_value:.4f})")
    click.echo(f"Its best checkpoint: {uri} (epoch {epoch})")
    click.echo(f"Test accuracy of the model loaded from it: {acc:.4f}")
    return 0
