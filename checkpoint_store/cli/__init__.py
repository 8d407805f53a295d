"""The ``checkpoint-store`` command line: inspect, copy, verify and prune checkpoints.

Every location argument is a local path or any backend URI (``s3://``,
``az://``, ``gs://``, ``memory://`` ...). Backend options (endpoint,
credentials) come from ``-o/--storage-option KEY=VALUE`` or from the usual
environment variables each backend reads (``AWS_*``, ``AZURE_STORAGE_*``,
``GOOGLE_APPLICATION_CREDENTIALS``).

Exit codes: 0 success, 1 failure (not found, corrupt, conflict, I/O), 2
usage error (bad arguments, unknown scheme, invalid configuration, a location
of the wrong kind), 141 when stdout's reader went away (as SIGPIPE would).
Errors print as one line with a hint; ``--debug`` adds the traceback.

This module owns the command group :func:`main` and the mapping of errors to
one line and an exit code; the options every command shares
(:func:`common_options`, :func:`storage_option`) are :mod:`.options`. Where
the rest lives:

* :mod:`checkpoint_store._browse` (shared with the web page): what a URI
  points at (``locations``), tables, JSON, sizes and times as printed
  (``output``);
* :mod:`checkpoint_store.retention.recorded`: what a trial's retention state
  records; :mod:`.metrics`: the metric a command ranks by;
* :mod:`.progress`: byte counting and progress bars of transfers;
* one module per command group: :mod:`.inspection` (ls, show), :mod:`.best`, :mod:`.verify`,
  :mod:`.transfers` (download, upload, cp), :mod:`.formats` (export, import),
  :mod:`.maintenance` (prune, gc), :mod:`.chunks` (du), :mod:`.backends`, :mod:`.demo`, :mod:`.ui`
  (ui, plot; the page itself is :mod:`checkpoint_store.ui`).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
import warnings
from typing import Any

import click

from checkpoint_store._browse.output import one_line
from checkpoint_store._util.retry import is_storage_full
from checkpoint_store.cli.options import EXIT_BROKEN_PIPE as EXIT_BROKEN_PIPE
from checkpoint_store.cli.options import EXIT_FAILURE as EXIT_FAILURE
from checkpoint_store.cli.options import EXIT_OK as EXIT_OK
from checkpoint_store.cli.options import EXIT_USAGE as EXIT_USAGE
from checkpoint_store.cli.options import NumberAtLeast as NumberAtLeast
from checkpoint_store.cli.options import common_options as common_options
from checkpoint_store.cli.options import echo_info as echo_info
from checkpoint_store.cli.options import parse_storage_options as parse_storage_options
from checkpoint_store.cli.options import quiet as quiet
from checkpoint_store.cli.options import scrub
from checkpoint_store.cli.options import storage_option as storage_option
from checkpoint_store.errors import (
    BackendUnavailableError,
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointStoreError,
    InvalidConfigError,
    NestedCheckpointError,
    PermanentBackendError,
    SourceChangedError,
    StorageFullError,
    TransientBackendError,
    TrialInUseError,
    UnknownSchemeError,
    UnreadableSourceError,
    UnsafePathError,
)

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "NumberAtLeast",
    "common_options",
    "echo_info",
    "main",
    "parse_storage_options",
    "quiet",
    "storage_option",
]



# -- errors -------------------------------------------------------------------------


#: Commands that may act on a trial whose job is gone behind a live lease.
_FORCE_COMMANDS = frozenset({"prune", "gc"})


def _in_use_hint(subcommand: str | None) -> str:
    hint = "wait for the running job to end, or stop it"
    if subcommand in _FORCE_COMMANDS:
        hint += f"; if it is gone, `checkpoint-store {subcommand} --force`"
    return hint


def _hint_for(exc: BaseException, subcommand: str | None = None) -> str | None:
    if isinstance(exc, TrialInUseError):
        return _in_use_hint(subcommand)
    if isinstance(exc, UnknownSchemeError):
        return "`checkpoint-store backends` lists the installed schemes"
    if isinstance(exc, BackendUnavailableError):
        return "install the plugin named above, then `checkpoint-store backends` to check"
    if isinstance(exc, NestedCheckpointError):
        return "choose a destination outside every committed checkpoint; nothing was written"
    if isinstance(exc, UnsafePathError):
        return "rename, replace or remove the file named above; nothing was written"
    if isinstance(exc, InvalidConfigError):
        return "see `checkpoint-store COMMAND --help` for the expected arguments"
    if isinstance(exc, CheckpointCorruptError):
        return ("the data changed after the commit; copy the checkpoint again from a good "
                "source or delete it")
    if isinstance(exc, CheckpointNotFoundError):
        return "`checkpoint-store ls` on the parent location shows what is there"
    if isinstance(exc, CheckpointConflictError):
        return "choose another destination, or delete the existing checkpoint first"
    if isinstance(exc, StorageFullError) or (isinstance(exc, OSError)
                                             and is_storage_full(exc)):
        return "the disk is full: free space on it (or raise its quota), then retry"
    if isinstance(exc, SourceChangedError):
        return ("the file named above changed while it was copied (or is a pseudo file); "
                "copy it again once nothing writes it; nothing was committed")
    if isinstance(exc, UnreadableSourceError):
        return "make the directory named above readable, or move it out; nothing was written"
    if isinstance(exc, (PermissionError, PermanentBackendError)):
        return ("check the credentials and the bucket: --storage-option KEY=VALUE or the "
                "backend's environment variables")
    if isinstance(exc, TransientBackendError):
        return ("check the endpoint (-o endpoint_url=... or AWS_ENDPOINT_URL and friends) "
                "and the network; --debug shows the traceback")
    if isinstance(exc, (CheckpointStoreError, OSError)):
        return "rerun with --debug for the full traceback"
    return "this is likely a bug; rerun with --debug and report the traceback"


def _exit_code_for(exc: BaseException) -> int:
    # An unsafe file in a tree is a fault of the data, not of the command line;
    # a destination inside a committed checkpoint is the command line's, as
    # every other refused destination (docs/cli.md: exit codes).
    usage = isinstance(exc, InvalidConfigError) and (
        not isinstance(exc, UnsafePathError) or isinstance(exc, NestedCheckpointError))
    return EXIT_USAGE if usage else EXIT_FAILURE


def _error_line(exc: Exception, subcommand: str | None) -> str:
    """``error: <message> (hint: <what to do>)``, on one line."""
    if isinstance(exc, (CheckpointStoreError, OSError)):
        msg = one_line(str(exc) or type(exc).__name__)
    else:
        msg = one_line(f"unexpected {type(exc).__name__}: {exc}")
    hint = _hint_for(exc, subcommand)
    if (isinstance(exc, InvalidConfigError)
            and not isinstance(exc, (UnknownSchemeError, UnsafePathError))
            and subcommand):
        hint = f"`checkpoint-store {subcommand} --help` shows the usage"
    return f"error: {msg}" + (f" (hint: {hint})" if hint else "")


def _debugging(ctx: click.Context) -> bool:
    return bool(ctx.meta.get("cs.debug") or os.environ.get("CHECKPOINT_STORE_DEBUG"))


def _show_warning(message: Warning | str, category: type[Warning], *args: Any,
                  **kwargs: Any) -> None:
    click.echo(scrub(f"warning: {one_line(str(message))}"), err=True)


class _OneLineLogHandler(logging.Handler):
    """Log records of warning level and up (ours, and storage clients' such as
    gcsfs's retry errors) as one line each; tracebacks only with --debug.
    Without it Python's last-resort handler prints client tracebacks."""

    def __init__(self, ctx: click.Context):
        super().__init__(logging.WARNING)
        self._ctx = ctx

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if _debugging(self._ctx):
                text = logging.Formatter("%(levelname)s %(name)s: %(message)s").format(record)
            else:
                text = f"{record.levelname.lower()}: {one_line(record.getMessage())}"
            click.echo(scrub(text, self._ctx), err=True)
        except Exception:  # noqa: BLE001 - logging must never fail the command
            self.handleError(record)


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the pipe's reader is gone, and the flush at
    exit would otherwise raise BrokenPipeError again (Python's signal docs)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (a test runner's capture)
        pass


class _Group(click.Group):
    """Turns every error of a command into one line and an exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        log_handler = _OneLineLogHandler(ctx)
        root = logging.getLogger()
        root.addHandler(log_handler)
        try:
            with warnings.catch_warnings():
                # Library warnings (a missing score, an untested fsspec backend) as
                # one line each, like the errors.
                warnings.simplefilter("default")
                warnings.showwarning = _show_warning
                return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except BrokenPipeError:
            _silence_stdout()
            ctx.exit(EXIT_BROKEN_PIPE)
        except Exception as exc:  # noqa: BLE001 - the one place errors become exit codes
            if _debugging(ctx):  # scrubbed too: a chained engine error may quote a secret
                click.echo(scrub(traceback.format_exc(), ctx), err=True, nl=False)
            click.echo(scrub(_error_line(exc, ctx.invoked_subcommand), ctx), err=True)
            ctx.exit(_exit_code_for(exc))
        finally:
            root.removeHandler(log_handler)


# -- shared options -----------------------------------------------------------------


















# -- the command group --------------------------------------------------------------


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"],
                                           "max_content_width": 100})
@click.version_option(package_name="checkpoint-store", prog_name="checkpoint-store")
@common_options
def main() -> None:
    """Save, keep and load ML training checkpoints on any storage.

    Inspect, copy, verify and prune checkpoints on a local disk, S3, Azure,
    GCS, memory or any plugin's storage. Locations are paths or URIs; backend
    options come from -o KEY=VALUE or the backend's environment variables.

    \b
    Examples:
      checkpoint-store ls ./results
      checkpoint-store ls s3://bucket/runs/exp/trial1
      checkpoint-store best ./results/exp/trial1 --metric loss --mode min
      checkpoint-store cp ./results/exp/trial1 s3://bucket/runs/exp/trial1
      checkpoint-store verify s3://bucket/runs
      checkpoint-store prune ./results/exp/trial1 --keep 3 --metric loss --mode min --dry-run

    Exit codes: 0 success, 1 failure, 2 usage error.
    """


def _add_commands() -> None:
    """Register every command, in the order ``--help`` lists them."""
    from checkpoint_store.cli import (
        backends,
        best,
        chunks,
        demo,
        formats,
        inspection,
        maintenance,
        transfers,
        verify,
    )
    from checkpoint_store.cli.ui import plot_cmd, ui_cmd

    for command in (inspection.ls_cmd, inspection.show_cmd, best.best_cmd,
                    transfers.download_cmd, transfers.upload_cmd, transfers.cp_cmd,
                    formats.export_cmd, formats.import_cmd,
                    verify.verify_cmd, maintenance.prune_cmd, maintenance.gc_cmd, chunks.du_cmd,
                    backends.backends_cmd, demo.demo, ui_cmd, plot_cmd):
        main.add_command(command)


_add_commands()

if __name__ == "__main__":  # pragma: no cover
    main()
