"""The ``demo`` command: a digits classifier trained with checkpoints kept and
resumed, or an Optuna study over its learning rate (``--tune``).

The runs themselves live in :mod:`checkpoint_store.demo._run` and
:mod:`checkpoint_store.demo._tune`, imported only when the command runs.
"""

from __future__ import annotations

import sys

import click

from checkpoint_store.cli.options import NumberAtLeast, common_options

__all__ = ["demo"]


@click.command("demo")
@click.option("--storage", default="./checkpoint_store_demo", show_default=True,
              help="Where checkpoints go: a local path or any backend URI.")
@click.option("--epochs", default=15, show_default=True, type=click.IntRange(1))
@click.option("--num-to-keep", default=3, show_default=True, type=click.IntRange(1))
@click.option("--lr", default=0.05, show_default=True, type=NumberAtLeast(min=0, min_open=True))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint.")
@click.option("--fresh", is_flag=True,
              help="Delete the previous demo run (or study) at --storage and start over; "
                   "without it (or --resume) the demo refuses to touch a previous run.")
@click.option("--epoch-delay", default=0.0, type=NumberAtLeast(min=0), hidden=True,
              help="Seconds to sleep after each epoch (to try killing a run mid-way).")
@click.option("--tune", is_flag=True,
              help="Run an Optuna study over the learning rate instead (needs the tune extra).")
@click.option("--trials", default=8, show_default=True, type=click.IntRange(1),
              help="With --tune: number of trials.")
@click.option("--parallel", default=2, show_default=True, type=click.IntRange(1),
              help="With --tune: trials run at the same time.")
@common_options
def demo(storage: str, epochs: int, num_to_keep: int, lr: float, seed: int, resume: bool,
         fresh: bool, epoch_delay: float, tune: bool, trials: int, parallel: int) -> None:
    """Train a digits classifier, keep the best checkpoints, resume after a crash.

    A previous run at --storage is never deleted unasked: without --resume
    (continue it) or --fresh (delete it and start over) the demo refuses to
    start and changes nothing; another --storage starts a new run beside it.

    \b
    Examples:
      checkpoint-store demo
      checkpoint-store demo --epochs 30 --resume
      checkpoint-store demo --storage memory://demo
      checkpoint-store demo --tune --trials 8 --parallel 2
    """
    if resume and fresh:
        raise click.UsageError("--resume continues the previous run and --fresh deletes it: "
                               "pass one of them")
    if tune:
        if resume:
            # The study itself (Optuna's trial history) is kept in memory only,
            # so there is nothing to resume; never start over by deleting.
            raise click.UsageError(
                "--resume continues the single-run demo; a --tune study always starts "
                "fresh (drop --resume; --fresh deletes the old study, another --storage "
                "keeps it)"
            )
        from checkpoint_store.demo._tune import run_tune

        sys.exit(run_tune(storage=storage, trials=trials, parallel=parallel, epochs=epochs,
                          num_to_keep=num_to_keep, seed=seed, fresh=fresh))
    from checkpoint_store.demo._run import run_demo

    sys.exit(run_demo(storage=storage, epochs=epochs, num_to_keep=num_to_keep, lr=lr,
                      seed=seed, resume=resume, epoch_delay=epoch_delay, fresh=fresh))
