"""The ``checkpoint-store`` command line."""

from __future__ import annotations

import sys

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Save, keep and load ML training checkpoints on any storage."""


@main.command()
@click.option("--storage", default="./checkpoint_store_demo", show_default=True,
              help="Where checkpoints go: a local path or any backend URI.")
@click.option("--epochs", default=15, show_default=True, type=click.IntRange(1))
@click.option("--num-to-keep", default=3, show_default=True, type=click.IntRange(1))
@click.option("--lr", default=0.05, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint.")
@click.option("--epoch-delay", default=0.0, type=click.FloatRange(min=0), hidden=True,
              help="Seconds to sleep after each epoch (to try killing a run mid-way).")
def demo(storage: str, epochs: int, num_to_keep: int, lr: float, seed: int, resume: bool,
         epoch_delay: float) -> None:
    """Train a digits classifier, keep the best checkpoints, resume after a crash.

    \b
    Examples:
      checkpoint-store demo
      checkpoint-store demo --epochs 30 --resume
      checkpoint-store demo --storage memory://demo
    """
    from checkpoint_store._demo_cli import run_demo

    sys.exit(run_demo(storage=storage, epochs=epochs, num_to_keep=num_to_keep, lr=lr,
                      seed=seed, resume=resume, epoch_delay=epoch_delay))


if __name__ == "__main__":  # pragma: no cover
    main()
