"""The ``ui`` and ``plot`` commands, registered on the CLI group in :mod:`checkpoint_store.cli`.

Flask and matplotlib (the ``[ui]`` extra) are imported when a command runs,
so ``checkpoint-store --help`` and every other command work without them.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from typing import Any

import click

from checkpoint_store.cli.metrics import metric_option
from checkpoint_store.cli.options import common_options, storage_option

_INSTALL_HINT = "install it with: pip install 'checkpoint-store[ui]'"

__all__ = ["plot_cmd", "ui_cmd"]


def _require(module: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise click.ClickException(f"{module} is needed here but not installed ({exc}); "
                                   f"{_INSTALL_HINT}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.command("ui")
@click.argument("location")
@storage_option()
@click.option("--host", default=None, metavar="ADDRESS",
              help="Address to listen on (default 127.0.0.1: this machine only). Any other "
                   "address lets whoever reaches it read the metadata; a warning says so.")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Port to listen on; 0 picks a free one.")
@click.option("--open", "open_browser", is_flag=True, help="Open the page in a web browser.")
@click.option("--refresh", type=click.FloatRange(min=0.2), default=2.0, show_default=True,
              metavar="SECONDS", help="How often an open page looks for new reports.")
@common_options
def ui_cmd(location: str, storage_options: dict[str, Any], host: str | None, port: int,
           open_browser: bool, refresh: float) -> None:
    """Serve a read-only web page over the checkpoints under LOCATION.

    LOCATION is a storage root, an experiment or a trial, on any backend.
    The page shows a table of trials per experiment (status, reports,
    checkpoints, best score, size, params.json values), a trial's metric
    curves with its checkpoints marked (kept for the best score, kept as the
    latest, reported and then evicted), several trials overlaid, and each
    checkpoint's manifest and metadata with a Verify button. An open page
    refreshes as reports arrive. Nothing is written to storage. Needs the
    [ui] extra.

    \b
    Examples:
      checkpoint-store ui ./results
      checkpoint-store ui s3://bucket/runs/sweep --open
      checkpoint-store ui ./results --port 8765
    """
    _require("flask")
    from checkpoint_store.ui._model import StoreView
    from checkpoint_store.ui._server import Server

    view = StoreView(location, storage_options)
    bind = host or "127.0.0.1"
    if not _is_loopback(bind):
        click.echo(f"warning: serving on {bind}: anyone who can reach this address can read "
                   f"the metadata of every checkpoint under {view.uri} and run Verify; there "
                   "is no authentication. Storage credentials stay in this process.", err=True)
    if not click.get_current_context().meta.get("cs.debug"):
        # One line per request would drown the URL; --debug shows them.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = Server(view, bind, port, refresh_s=refresh)
    click.echo(f"Serving {view.uri} at {server.url} (read-only; Ctrl-C to stop)")
    if open_browser:
        import webbrowser

        webbrowser.open(server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        click.echo("stopped", err=True)


@click.command("plot")
@click.argument("trials", nargs=-1, required=True)
@storage_option("--storage-option", "storage_options")
@metric_option(metavar="NAME",
               help="Metric to plot; nested metrics use '/'. Default: the first trial's "
                    "retention score attribute. One no report of the trials records is "
                    "refused.")
@click.option("--x", "x_axis", type=click.Choice(["step", "time"]), default="step",
              show_default=True, help="x axis: the report number (training_iteration) or "
                                      "seconds since the trial started (time_total_s).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Image to write: .png or .svg (.pdf works too).")
@common_options
def plot_cmd(trials: tuple[str, ...], storage_options: dict[str, Any], metric: str | None,
             x_axis: str, output: str) -> None:
    """Plot TRIAL...'s metric curves with their checkpoints marked, as an image.

    The chart of the `ui` page for reports and CI artifacts: one curve per
    trial, a star on each checkpoint kept for its score, a triangle on the
    kept latest one, a cross on each reported and since evicted. Backend
    options are --storage-option KEY=VALUE here (-o names the image). Needs
    the [ui] extra.

    \b
    Examples:
      checkpoint-store plot ./results/exp/trial1 --metric val_accuracy -o curve.png
      checkpoint-store plot ./results/sweep/t0 ./results/sweep/t1 --metric loss -o sweep.svg
    """
    _require("matplotlib")
    from checkpoint_store._commit.nesting import refuse_local_store_target
    from checkpoint_store.ui._model import StoreView

    # Before any trial is read: an image inside a checkpoint would corrupt it.
    refuse_local_store_target(os.path.dirname(os.path.abspath(output)), "plot output folder",
                              trials=False)
    from checkpoint_store.ui._plot import plot_trials

    data = []
    for trial in trials:
        view = StoreView(trial, storage_options)
        if view.scope_trial is None or view.scope_experiment is None:
            raise click.BadParameter(f"{view.uri} is not a trial directory", param_hint="TRIAL")
        data.append(view.trial(view.scope_experiment, view.scope_trial))
    used = plot_trials(data, output, metric=metric, x_key="time_total_s" if x_axis == "time"
                       else "training_iteration")
    if not click.get_current_context().meta.get("cs.quiet"):
        click.echo(f"wrote {output} ({used} of {len(data)} trial(s))")
