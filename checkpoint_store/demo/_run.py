"""``checkpoint-store demo``: the digits run with retention, a table, and resume."""

from __future__ import annotations

import posixpath

import click

from checkpoint_store import CheckpointConfig, StorageContext, session
from checkpoint_store.errors import CheckpointStoreError, TrialInUseError

EXPERIMENT = "digits-demo"
TRIAL = "mlp"


def _refuse_if_running(ctx: StorageContext) -> None:
    """Starting fresh deletes the demo trial: never while a live run manages it."""
    from checkpoint_store.retention import live_lease

    lease = live_lease(ctx)
    if lease is not None:
        raise TrialInUseError(
            f"a running demo manages {ctx.uri(ctx.trial_path)} (host {lease.get('host')!r}, "
            f"pid {lease.get('pid')}); refusing to start another run on it"
        )


def run_demo(*, storage: str, epochs: int, num_to_keep: int, lr: float, seed: int,
             resume: bool, epoch_delay: float = 0.0, fresh: bool = False) -> int:
    """Run the demo; returns the process exit code.

    A previous run at ``storage`` is continued with ``resume``, deleted with
    ``fresh``, and otherwise left alone: the demo refuses to start
    (:class:`click.ClickException`) rather than delete it unasked.
    """
    from checkpoint_store._util import fs as _fsutil
    from checkpoint_store.demo import test_accuracy_of, train_digits

    ctx = StorageContext(storage, EXPERIMENT, TRIAL)
    _refuse_if_running(ctx)
    if not resume and _fsutil.exists(ctx.filesystem, ctx.trial_path):
        if not fresh:
            raise click.ClickException(
                f"a previous demo run is at {ctx.uri(ctx.trial_path)}; nothing was changed. "
                "Pass --resume to continue it, --fresh to delete it and start over, or "
                "--storage elsewhere for a new run beside it")
        from checkpoint_store._browse.live import refuse_if_live
        from checkpoint_store._browse.locations import Location

        # Check first, then say what happens: a demo still running there keeps its trial.
        refuse_if_live(Location(ctx.backend, ctx.trial_path), None,
                       "remove it for a fresh demo (or pass --storage elsewhere)")
        click.echo(f"Starting fresh (--fresh): removing the previous demo trial "
                   f"{ctx.uri(ctx.trial_path)}")
        _fsutil.delete_dir(ctx.filesystem, ctx.trial_path)
    config = CheckpointConfig(
        num_to_keep=num_to_keep,
        checkpoint_score_attribute="val_accuracy",
        checkpoint_score_order="max",
    )
    trial_config = {"lr": lr, "epochs": epochs, "seed": seed, "epoch_delay_s": epoch_delay,
                    "verbose": True}
    with session.start(
        storage_path=storage, experiment_name=EXPERIMENT, trial_name=TRIAL,
        checkpoint_config=config, config=trial_config,
    ) as s:
        if resume and s.get_checkpoint() is None:
            click.echo("Nothing to resume from: starting at epoch 1")
        train_digits(trial_config)
        best = s.manager.best_checkpoints
    if not best:
        raise CheckpointStoreError("the run produced no checkpoint")
    click.echo("")
    click.echo(f"Kept checkpoints (best {num_to_keep} by val_accuracy, plus the latest):")
    click.echo(f"{'index':>6}  {'epoch':>5}  {'val_accuracy':>12}  path")
    for ckpt, metrics in sorted(best, key=lambda cm: cm[0].internal_metadata["index"]):
        index = ckpt.internal_metadata["index"]
        click.echo(
            f"{index:>6}  {metrics['epoch']:>5}  {metrics['val_accuracy']:>12.4f}  {ckpt.uri}"
        )
    best_ckpt, best_metrics = best[0]
    acc = test_accuracy_of(best_ckpt, seed)
    click.echo("")
    click.echo(
        f"Best checkpoint: {posixpath.basename(best_ckpt.path)} (epoch {best_metrics['epoch']}, "
        f"val_accuracy {best_metrics['val_accuracy']:.4f})"
    )
    click.echo(f"Test accuracy of the model loaded from it: {acc:.4f}")
    return 0
