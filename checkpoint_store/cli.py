"""The ``checkpoint-store`` command line: inspect, copy, verify and prune checkpoints.

Every location argument is a local path or any backend URI (``s3://``,
``az://``, ``gs://``, ``memory://`` ...). Backend options (endpoint,
credentials) come from ``-o/--storage-option KEY=VALUE`` or from the usual
environment variables each backend reads (``AWS_*``, ``AZURE_STORAGE_*``,
``GOOGLE_APPLICATION_CREDENTIALS``).

Exit codes: 0 success, 1 failure (not found, corrupt, I/O), 2 usage error
(bad arguments, unknown scheme, invalid configuration). Errors print as one
line with a hint; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import posixpath
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

import click

from checkpoint_store import _clock, _fsutil
from checkpoint_store._layout import (
    ERROR_FILE,
    INTERNAL_METADATA,
    INTERNAL_PREFIX,
    MANAGER_STATE,
    PARAMS_FILE,
    RESULT_FILE,
    check_name_length,
    checkpoint_dir_name,
    is_internal_file,
    parse_checkpoint_dir_name,
)
from checkpoint_store.backends.base import Backend
from checkpoint_store.errors import (
    BackendUnavailableError,
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointStoreError,
    InvalidConfigError,
    PermanentBackendError,
    TransientBackendError,
    UnknownSchemeError,
    UnsafePathError,
)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

_TRIAL_FILES = frozenset({RESULT_FILE, PARAMS_FILE, MANAGER_STATE, ERROR_FILE})
_STAGING_PREFIX = f"{INTERNAL_PREFIX}staging-"


# -- errors -------------------------------------------------------------------------


def _hint_for(exc: BaseException) -> str | None:
    if isinstance(exc, UnknownSchemeError):
        return "`checkpoint-store backends` lists the installed schemes"
    if isinstance(exc, BackendUnavailableError):
        return "install the plugin named above, then `checkpoint-store backends` to check"
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
    # An unsafe file in a tree is a fault of the data, not of the command line.
    usage = isinstance(exc, InvalidConfigError) and not isinstance(exc, UnsafePathError)
    return EXIT_USAGE if usage else EXIT_FAILURE


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _show_warning(message: Warning | str, category: type[Warning], *args: Any,
                  **kwargs: Any) -> None:
    click.echo(f"warning: {_one_line(str(message))}", err=True)


class _OneLineLogHandler(logging.Handler):
    """Log records of warning level and up (ours, and storage clients' such as
    gcsfs's retry errors) as one line each; tracebacks only with --debug.
    Without it Python's last-resort handler prints client tracebacks."""

    def __init__(self, ctx: click.Context):
        super().__init__(logging.WARNING)
        self._ctx = ctx

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self._ctx.meta.get("cs.debug") or os.environ.get("CHECKPOINT_STORE_DEBUG"):
                text = logging.Formatter("%(levelname)s %(name)s: %(message)s").format(record)
            else:
                text = f"{record.levelname.lower()}: {_one_line(record.getMessage())}"
            click.echo(text, err=True)
        except Exception:  # noqa: BLE001 - logging must never fail the command
            self.handleError(record)


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
        except Exception as exc:  # noqa: BLE001 - the one place errors become exit codes
            if ctx.meta.get("cs.debug") or os.environ.get("CHECKPOINT_STORE_DEBUG"):
                traceback.print_exc()
            if isinstance(exc, CheckpointStoreError) or isinstance(exc, OSError):
                msg = _one_line(str(exc) or type(exc).__name__)
            else:
                msg = _one_line(f"unexpected {type(exc).__name__}: {exc}")
            hint = _hint_for(exc)
            if (isinstance(exc, InvalidConfigError)
                    and not isinstance(exc, (UnknownSchemeError, UnsafePathError))
                    and ctx.invoked_subcommand):
                hint = f"`checkpoint-store {ctx.invoked_subcommand} --help` shows the usage"
            click.echo(f"error: {msg}" + (f" (hint: {hint})" if hint else ""), err=True)
            ctx.exit(_exit_code_for(exc))
        finally:
            root.removeHandler(log_handler)


# -- shared options -----------------------------------------------------------------


def _set_meta(key: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value:
            ctx.meta[key] = True

    return callback


def _common(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--quiet`` and ``--debug``, accepted before or after the command name."""
    f = click.option("-q", "--quiet", is_flag=True, expose_value=False,
                     callback=_set_meta("cs.quiet"),
                     help="No progress bars and no summary lines.")(f)
    f = click.option("--debug", is_flag=True, expose_value=False,
                     callback=_set_meta("cs.debug"),
                     help="Print the full traceback on errors.")(f)
    return f


def _coerce_option(value: str) -> Any:
    low = value.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    return value


def parse_storage_options(items: Iterable[str]) -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` -> dict; ``true``/``false`` become booleans.

    Raises:
        click.BadParameter: an item without ``=`` or with an empty key. The
            message names the key but never echoes the value: a mistyped
            ``secret_access_key:...`` must not print the secret.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(
                f"{_redacted_option(item)} is not KEY=VALUE (the value is not shown; "
                "e.g. -o endpoint_url=http://127.0.0.1:9000)"
            )
        out[key.strip()] = _coerce_option(value)
    return out


def _redacted_option(item: str) -> str:
    """``item`` with everything after its key hidden: the key is what a user
    needs to find the mistake, and the value may be a credential."""
    key = item.split("=", 1)[0]
    for sep in (":", " "):  # the usual typos for '='
        key = key.split(sep, 1)[0]
    if key != item.strip() and key.isidentifier():
        return f"{key!r} followed by {len(item) - len(key)} hidden character(s)"
    return f"an option of {len(item)} character(s)"


def _storage_option(*names: str, help_text: str | None = None) -> Callable[..., Any]:
    names = names or ("-o", "--storage-option", "storage_options")
    return click.option(
        *names, multiple=True, metavar="KEY=VALUE",
        callback=lambda ctx, p, v: parse_storage_options(v),
        help=help_text or "Backend option for the location (endpoint, credentials ...); "
        "repeatable. Environment variables of the backend apply too.",
    )


class _NumberAtLeast(click.FloatRange):
    """A float >= ``min`` that is not NaN: click's FloatRange lets NaN through
    (every comparison with it is False), and ``gc --min-age nan`` would then
    remove directories of any age."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if math.isnan(number):
            self.fail(f"{value!r} is not a number", param, ctx)
        return number


def _quiet() -> bool:
    return bool(click.get_current_context().meta.get("cs.quiet"))


def _echo_info(text: str) -> None:
    if not _quiet():
        click.echo(text)


# -- locations ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Location:
    backend: Backend
    path: str

    @property
    def fs(self) -> Any:
        return self.backend.filesystem

    @property
    def uri(self) -> str:
        return self.backend.uri_for(self.path)

    def child(self, *names: str) -> _Location:
        return _Location(self.backend, posixpath.join(self.path, *names))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))


def _is_local_location(text: str) -> bool:
    from checkpoint_store.registry import split_scheme

    return split_scheme(text) in (None, "file", "local")


def _resolve(
    text: str, options: Mapping[str, Any], *, options_if_remote: bool = False
) -> _Location:
    """Resolve a location; with ``options_if_remote`` options are dropped for local paths
    (``cp`` shares one ``-o`` set between its two sides)."""
    from checkpoint_store.registry import resolve

    opts = dict(options)
    if options_if_remote and _is_local_location(text):
        opts = {}
    backend, path = resolve(text, storage_options=opts or None)
    return _Location(backend, path)


def _entries(loc: _Location) -> list[tuple[str, bool]]:
    """``(name, is_dir)`` of the direct children, sorted by name; ``[]`` when absent."""
    out = []
    prefix = loc.path.rstrip("/") + "/"
    for fi in _fsutil.list_dir(loc.fs, loc.path):
        path = fi.path.rstrip("/")
        rel = path[len(prefix):] if path.startswith(prefix) else posixpath.basename(path)
        # Some fsspec stores answer a non-recursive listing with deeper entries too.
        if rel and "/" not in rel:
            out.append((rel, fi.type == _fsutil.pafs.FileType.Directory))
    return sorted(out)


def _looks_like_trial(entries: Iterable[tuple[str, bool]]) -> bool:
    for name, is_dir in entries:
        if name in _TRIAL_FILES or name.startswith(_STAGING_PREFIX):
            return True
        if is_dir and parse_checkpoint_dir_name(name) is not None:
            return True
    return False


def _internal(loc: _Location) -> dict[str, Any] | None:
    from checkpoint_store.transfer import read_internal_metadata

    return read_internal_metadata(loc.fs, loc.path)


@dataclasses.dataclass(frozen=True)
class _State:
    """What a would-be checkpoint directory is: ``committed``, ``invalid`` (a commit
    marker whose manifest does not match the files: corrupt), ``absent`` (no
    marker: an interrupted write) or ``missing``."""

    state: str
    meta: dict[str, Any] | None
    reason: str | None = None
    file: str | None = None


def _inspect(loc: _Location) -> _State:
    from checkpoint_store.transfer import inspect_checkpoint

    insp = inspect_checkpoint(loc.fs, loc.path)
    return _State(insp.state, insp.meta, insp.reason, insp.file)


def _might_be_checkpoint(loc: _Location) -> bool:
    # Cheap test first: inspecting lists the whole tree under loc.
    return parse_checkpoint_dir_name(loc.name) is not None or _fsutil.exists(
        loc.fs, posixpath.join(loc.path, INTERNAL_METADATA))


def _kind(loc: _Location) -> str:
    """What ``loc`` is: checkpoint, corrupt (a checkpoint failing its manifest),
    uncommitted, trial, experiment, root, empty or file.

    Raises:
        CheckpointNotFoundError: nothing exists at ``loc``.
    """
    if _might_be_checkpoint(loc):
        st = _inspect(loc)
        if st.state == "committed":
            return "checkpoint"
        if st.state == "invalid":
            return "corrupt"
        if st.state == "missing":
            raise CheckpointNotFoundError(f"nothing exists at {loc.uri}")
        if parse_checkpoint_dir_name(loc.name) is not None:
            return "uncommitted"
    entries = _entries(loc)
    if not entries:
        fi = _fsutil.info(loc.fs, loc.path)
        if fi.type == _fsutil.pafs.FileType.NotFound:
            raise CheckpointNotFoundError(f"nothing exists at {loc.uri}")
        if fi.type == _fsutil.pafs.FileType.File:
            return "file"
        return "empty"
    if _looks_like_trial(entries):
        return "trial"
    for name, is_dir in entries:
        if is_dir and _looks_like_trial(_entries(loc.child(name))):
            return "experiment"
    return "root"


def _not_committed(
    trial: _Location, committed: Iterable[str]
) -> tuple[list[tuple[str, _State]], list[str]]:
    """Checkpoint directories of ``trial`` that are not committed:
    ``([(name, state) of corrupt ones], [names of uncommitted ones])``."""
    done = set(committed)
    corrupt: list[tuple[str, _State]] = []
    uncommitted: list[str] = []
    for name, is_dir in _entries(trial):
        if not is_dir or name in done:
            continue
        if parse_checkpoint_dir_name(name) is not None:
            st = _inspect(trial.child(name))
            if st.state == "invalid":
                corrupt.append((name, st))
            elif st.state != "committed":
                uncommitted.append(name)
        elif name.startswith(_STAGING_PREFIX):
            uncommitted.append(name)
    return corrupt, uncommitted


def _trials_under(loc: _Location, kind: str) -> list[_Location]:
    """Trial directories at or under ``loc`` (a trial, experiment or storage root)."""
    if kind == "trial":
        return [loc]
    if kind == "experiment":
        return [loc.child(n) for n, d in _entries(loc) if d and _looks_like_trial(
            _entries(loc.child(n)))]
    if kind in ("root", "empty"):
        out: list[_Location] = []
        for name, is_dir in _entries(loc):
            # Dot-named experiments are walked too: session.start accepts them,
            # and a backup that skipped them would lose them silently.
            if is_dir and not name.startswith(INTERNAL_PREFIX):
                out.extend(_trials_under(loc.child(name), "experiment"))
        return out
    return []


def _committed(trial: _Location) -> list[tuple[_Location, dict[str, Any]]]:
    """Committed checkpoints of a trial with their internal metadata, oldest first.

    Same rule as ``StorageContext.committed_checkpoints``: a directory counts
    only with a valid ``.internal_metadata.json``; order is the recorded index.
    """
    ctx = _storage_context(trial, strict=False)
    if ctx is not None:
        return [(_Location(trial.backend, c.path), meta) for c, meta in ctx.committed_checkpoints()]
    out = []
    for name, is_dir in _entries(trial):
        if is_dir and parse_checkpoint_dir_name(name) is not None:
            meta = _internal(trial.child(name))
            if meta is not None:
                out.append((trial.child(name), meta))
    return sorted(out, key=lambda lm: lm[1]["index"])


def _storage_context(trial: _Location, *, strict: bool = True) -> Any:
    """A StorageContext for a trial path ``<storage>/<experiment>/<trial>``."""
    from checkpoint_store.storage import StorageContext

    parent, trial_name = posixpath.split(trial.path.rstrip("/"))
    root, experiment = posixpath.split(parent)
    try:
        return StorageContext.from_backend(trial.backend, root, experiment, trial_name)
    except InvalidConfigError:
        if not strict:
            return None
        raise InvalidConfigError(
            f"{trial.uri} is not a trial directory: a trial lives at "
            "<storage>/<experiment>/<trial>"
        ) from None


_KIND_LABELS = {
    "checkpoint": "a checkpoint", "corrupt": "a corrupt checkpoint",
    "uncommitted": "an uncommitted checkpoint directory", "trial": "a trial",
    "experiment": "an experiment", "root": "a storage root (it holds experiments)",
    "empty": "an empty directory", "file": "a file",
}


def _describe_kind(kind: str) -> str:
    return _KIND_LABELS.get(kind, kind)


def _refuse_if_live(trial: _Location, force: bool, what: str) -> None:
    """Refuse to ``what`` a trial whose checkpoint manager holds a live lease.

    A running session renews ``<trial>/.cs_manager_lease.json``; deleting
    behind its back would fight its own retention. The liveness rule is the
    managers' own (:func:`checkpoint_store.retention.live_lease`).

    Raises:
        CheckpointConflictError: a live lease, unless ``force``.
    """
    from checkpoint_store.retention import live_lease

    if force:
        return
    ctx = _storage_context(trial, strict=False)
    lease = live_lease(ctx) if ctx is not None else None
    if lease is None:
        return
    raise CheckpointConflictError(
        f"a running job manages {trial.uri} (host {lease.get('host')!r}, pid "
        f"{lease.get('pid')}; lease renewed until {_fmt_time(lease['expires_at'])} UTC): "
        f"refusing to {what} behind its back; let it finish, or pass --force if that job "
        "is gone"
    )


def _require_trial(loc: _Location) -> None:
    kind = _kind(loc)
    if kind == "trial":
        return
    if kind == "empty":
        raise CheckpointNotFoundError(f"{loc.uri} is empty: no checkpoints there")
    raise InvalidConfigError(
        f"{loc.uri} is {_describe_kind(kind)}, not a trial directory (one holding "
        "checkpoint_NNNNNN/)"
    )


def _require_checkpoint(loc: _Location) -> dict[str, Any]:
    """The internal metadata of the committed checkpoint at ``loc``.

    Raises:
        CheckpointCorruptError: a commit marker is there but the files do not match it.
        CheckpointNotFoundError: anything else.
    """
    st = _inspect(loc)
    if st.state == "committed" and st.meta is not None:
        return st.meta
    if st.state == "invalid":
        raise CheckpointCorruptError(f"checkpoint {loc.uri} is corrupt: {st.reason}",
                                     path=loc.path, file=st.file)
    if st.state == "missing":
        raise CheckpointNotFoundError(f"nothing exists at {loc.uri}")
    if parse_checkpoint_dir_name(loc.name) is not None:
        raise CheckpointNotFoundError(
            f"{loc.uri} is not a committed checkpoint (no {INTERNAL_METADATA}): an "
            "interrupted write, which `checkpoint-store gc` removes, or a directory made by "
            "hand, which gc reports and leaves alone"
        )
    raise CheckpointNotFoundError(
        f"{loc.uri} is {_describe_kind(_kind(loc))}, not a checkpoint; pass a "
        "checkpoint_NNNNNN directory"
    )


# -- formatting ---------------------------------------------------------------------


def _fmt_time(ts: Any) -> str:
    if not isinstance(ts, (int, float)) or not math.isfinite(ts):
        return "-"
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _fmt_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}" if abs(v) < 1e6 else f"{v:.3f}"
    if v is None:
        return "-"
    return str(v) if not isinstance(v, (dict, list)) else json.dumps(v, sort_keys=True)


def _json_safe(value: Any) -> Any:
    """NaN and infinities become null: strict JSON for jq and friends."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _print_json(obj: Any) -> None:
    click.echo(json.dumps(_json_safe(obj), indent=2, sort_keys=False, allow_nan=False))


def _table(headers: list[str], rows: list[list[str]], right: Iterable[int] = ()) -> None:
    right = set(right)
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: list[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(parts).rstrip()

    click.echo(line(headers))
    for row in rows:
        click.echo(line(row))


def _manifest_size(meta: Mapping[str, Any]) -> int:
    return sum(int(e.get("size", 0)) for e in meta.get("manifest", []))


def _score_attribute(trial: _Location) -> tuple[str | None, str | None]:
    """The score attribute and order recorded in the trial's retention state, if any."""
    try:
        raw = _fsutil.read_bytes(trial.fs, posixpath.join(trial.path, MANAGER_STATE))
        config = json.loads(raw)["config"]
        return config.get("checkpoint_score_attribute"), config.get("checkpoint_score_order")
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def _stored_metrics(ckpt: _Location, meta: Mapping[str, Any], *,
                    warn: bool = True) -> Mapping[str, Any]:
    """The metrics recorded with ``ckpt``; ``{}`` (with a warning naming it) when
    what is stored is not a JSON object: another tool or a hand edit wrote it."""
    metrics = meta.get("metrics")
    if metrics is None or isinstance(metrics, Mapping):
        return metrics or {}
    if warn:
        click.echo(f"warning: {ckpt.uri} records 'metrics' as a {type(metrics).__name__}, "
                   "not an object; treating it as no metrics", err=True)
    return {}


def _stored_score(ckpt: _Location, metrics: Mapping[str, Any], metric: str) -> float | None:
    """The numeric score of a stored checkpoint, or None when missing or NaN.

    Raises:
        CheckpointStoreError: the stored value is not a number. Not a usage
            error (exit 1): the arguments are fine, the stored data is not.
    """
    from checkpoint_store.retention import score_of

    try:
        return score_of(metrics, metric)
    except InvalidConfigError:
        value = _metric_value(metrics, metric)
        raise CheckpointStoreError(
            f"{ckpt.uri} records metric {metric!r} as {value!r} ({type(value).__name__}), "
            "not a number; rank by another --metric, or delete that checkpoint"
        ) from None


def _metric_value(metrics: Mapping[str, Any], attribute: str) -> Any:
    from checkpoint_store.retention import lookup_metric

    value = lookup_metric(metrics, attribute)
    return None if value is not None and type(value) is object else value


# -- the command group --------------------------------------------------------------


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"],
                                           "max_content_width": 100})
@click.version_option(package_name="checkpoint-store", prog_name="checkpoint-store")
@_common
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


# -- ls -----------------------------------------------------------------------------


def _ls_trial(trial: _Location, metric: str | None) -> dict[str, Any]:
    if metric is None:
        metric, _ = _score_attribute(trial)
    rows = []
    for ckpt, meta in _committed(trial):
        metrics = _stored_metrics(ckpt, meta)
        rows.append({
            "index": meta["index"],
            "name": ckpt.name,
            "uri": ckpt.uri,
            "created_at": meta.get("created_at"),
            "size": _manifest_size(meta),
            "files": len(meta.get("manifest", [])),
            "score": _metric_value(metrics, metric) if metric else None,
        })
    corrupt, uncommitted = _not_committed(trial, (r["name"] for r in rows))
    return {"kind": "trial", "uri": trial.uri, "metric": metric, "checkpoints": rows,
            "error": _last_error(trial), "uncommitted": len(uncommitted),
            "corrupt": [{"name": n, "file": st.file, "reason": st.reason} for n, st in corrupt]}


def _last_error(trial: _Location) -> str | None:
    """The last line of the trial's ``error.txt`` (its last run's exception), or None."""
    try:
        text = _fsutil.read_bytes(trial.fs, posixpath.join(trial.path, ERROR_FILE))
    except (FileNotFoundError, OSError):
        return None
    lines = [line.strip() for line in text.decode("utf-8", "replace").splitlines()
             if line.strip()]
    return lines[-1] if lines else None


def _ls_experiment(exp: _Location) -> dict[str, Any]:
    rows = []
    for trial in _trials_under(exp, "experiment"):
        committed = _committed(trial)
        rows.append({
            "name": trial.name,
            "uri": trial.uri,
            "checkpoints": len(committed),
            "latest_index": committed[-1][1]["index"] if committed else None,
            "latest_created_at": committed[-1][1].get("created_at") if committed else None,
            "size": sum(_manifest_size(m) for _, m in committed),
        })
    return {"kind": "experiment", "uri": exp.uri, "trials": rows}


def _ls_root(root: _Location) -> dict[str, Any]:
    rows = []
    for name, is_dir in _entries(root):
        if not is_dir or name.startswith(INTERNAL_PREFIX):
            continue
        exp = root.child(name)
        trials = _trials_under(exp, "experiment")
        if trials:
            rows.append({"name": name, "uri": exp.uri, "trials": len(trials)})
    return {"kind": "root", "uri": root.uri, "experiments": rows}


def _ls_checkpoint(loc: _Location, meta: Mapping[str, Any]) -> dict[str, Any]:
    files = [dict(e) for e in meta.get("manifest", [])]
    return {"kind": "checkpoint", "uri": loc.uri, "index": meta.get("index"),
            "created_at": meta.get("created_at"), "size": _manifest_size(meta),
            "files": files}


@main.command("ls")
@click.argument("uri")
@_storage_option()
@click.option("--metric", default=None, metavar="M",
              help="Metric shown as SCORE for checkpoints (default: the trial's retention "
                   "score attribute). Nested metrics use '/', e.g. eval/loss.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_common
def ls_cmd(uri: str, storage_options: dict[str, Any], metric: str | None, as_json: bool) -> None:
    """List experiments, trials or checkpoints under URI.

    What is listed depends on what URI is: a storage root lists its
    experiments, an experiment its trials, a trial its committed checkpoints
    (index, creation time in UTC, size, score), a checkpoint its files.
    Uncommitted directories (interrupted writes) are never listed as
    checkpoints; their count is reported on stderr.

    \b
    Examples:
      checkpoint-store ls ./results
      checkpoint-store ls ./results/exp/trial1 --metric val/accuracy
      checkpoint-store ls s3://bucket/runs -o endpoint_url=http://127.0.0.1:9000
      checkpoint-store ls az://container/runs/exp --json
    """
    loc = _resolve(uri, storage_options)
    kind = _kind(loc)
    if kind in ("checkpoint", "corrupt"):
        data = _ls_checkpoint(loc, _require_checkpoint(loc))
    elif kind == "trial":
        data = _ls_trial(loc, metric)
    elif kind == "experiment":
        data = _ls_experiment(loc)
    elif kind in ("root", "empty"):
        data = _ls_root(loc)
    elif kind == "uncommitted":
        raise CheckpointNotFoundError(
            f"{loc.uri} is an uncommitted checkpoint directory (an interrupted write); "
            "`checkpoint-store gc` on its trial removes it"
        )
    else:
        raise InvalidConfigError(f"{loc.uri} is a file, not a directory of checkpoints")
    if as_json:
        _print_json(data)
        return
    if kind == "checkpoint":
        _table(["SIZE", "CRC32C", "FILE"],
               [[_fmt_size(f["size"]), f.get("crc32c", "-"), f["path"]] for f in data["files"]],
               right=[0])
    elif kind == "trial":
        score_header = f"SCORE ({data['metric']})" if data["metric"] else "SCORE"
        _table(["INDEX", "CHECKPOINT", "CREATED (UTC)", "SIZE", score_header],
               [[str(r["index"]), r["name"], _fmt_time(r["created_at"]), _fmt_size(r["size"]),
                 _fmt_value(r["score"])] for r in data["checkpoints"]],
               right=[0, 3])
        if data["uncommitted"] and not _quiet():
            click.echo(f"({data['uncommitted']} uncommitted directories not listed; "
                       "`checkpoint-store gc` removes those this tool left and reports "
                       "the rest)", err=True)
        for c in data["corrupt"]:
            click.echo(f"(corrupt, not listed: {c['name']}: {c['reason']}; "
                       "`checkpoint-store verify` checks the others)", err=True)
        if data["error"] is not None:
            click.echo(f"(the trial's last run ended with an error: {data['error']}; "
                       f"its traceback is in {loc.child(ERROR_FILE).uri})", err=True)
    elif kind == "experiment":
        _table(["TRIAL", "CHECKPOINTS", "LATEST", "LATEST CREATED (UTC)", "SIZE"],
               [[r["name"], str(r["checkpoints"]), _fmt_value(r["latest_index"]),
                 _fmt_time(r["latest_created_at"]), _fmt_size(r["size"])]
                for r in data["trials"]], right=[1, 2, 4])
    else:
        _table(["EXPERIMENT", "TRIALS"],
               [[r["name"], str(r["trials"])] for r in data["experiments"]], right=[1])


# -- show ---------------------------------------------------------------------------


@main.command("show")
@click.argument("checkpoint")
@_storage_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@_common
def show_cmd(checkpoint: str, storage_options: dict[str, Any], as_json: bool) -> None:
    """Show a checkpoint's user and internal metadata and a manifest summary.

    \b
    Examples:
      checkpoint-store show ./results/exp/trial1/checkpoint_000004
      checkpoint-store show s3://bucket/runs/exp/trial1/checkpoint_000004 --json
    """
    from checkpoint_store.checkpoint import Checkpoint

    loc = _resolve(checkpoint, storage_options)
    meta = _require_checkpoint(loc)
    user = Checkpoint._from_backend(loc.backend, loc.path).get_metadata()
    manifest = list(meta.get("manifest", []))
    largest = sorted(manifest, key=lambda e: -int(e.get("size", 0)))[:5]
    internal = {k: v for k, v in meta.items() if k != "manifest"}
    summary = {"files": len(manifest), "bytes": _manifest_size(meta),
               "largest": [{"path": e["path"], "size": e["size"]} for e in largest]}
    if as_json:
        _print_json({"uri": loc.uri, "internal_metadata": internal, "user_metadata": user,
                     "manifest": summary})
        return
    click.echo(f"checkpoint      {loc.uri}")
    click.echo(f"index           {meta.get('index')}")
    click.echo(f"created (UTC)   {_fmt_time(meta.get('created_at'))}")
    click.echo(f"format          {meta.get('format_version')}")
    for key in sorted(internal):
        if key not in ("index", "created_at", "format_version", "metrics"):
            click.echo(f"{key:<15} {_fmt_value(internal[key])}")
    click.echo(f"files           {len(manifest)} ({_fmt_size(_manifest_size(meta))})")
    for e in largest:
        click.echo(f"  {_fmt_size(e['size']):>10}  {e['path']}")
    click.echo("metrics")
    metrics = meta.get("metrics") or {}
    if not isinstance(metrics, Mapping):  # not ours to fix: show what is stored
        click.echo(f"  (not an object) {_fmt_value(metrics)}")
        metrics = {}
    for key, value in sorted(metrics.items()):
        click.echo(f"  {key}: {_fmt_value(value)}")
    from checkpoint_store.ui._spark import BARS, checkpoint_score_line

    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    spark = checkpoint_score_line(loc.backend, loc.path,
                                  unicode=BARS.encode(encoding, "replace").decode(encoding) == BARS)
    if spark:
        click.echo(spark)
    click.echo("user metadata")
    if not user:
        click.echo("  (none)")
    for key, value in sorted(user.items()):
        click.echo(f"  {key}: {_fmt_value(value)}")


# -- best ---------------------------------------------------------------------------


def _rank_key(score: float | None, index: int, mode: str) -> tuple[int, float, int]:
    """Bigger is better; the manager's order: valid scores first, then the score in
    ``mode``'s direction, then the newer index (ties go to the newer checkpoint)."""
    if score is None:
        return (0, 0.0, index)
    return (1, score if mode == "max" else -score, index)


def _resolve_metric(trial: _Location, metric: str | None, mode: str | None,
                    required: bool) -> tuple[str | None, str]:
    if metric is None:
        recorded, recorded_mode = _score_attribute(trial)
        metric = recorded
        mode = mode or recorded_mode
        if metric is None and required:
            raise click.UsageError(
                "--metric is required: this trial records no retention score attribute"
            )
    return metric, (mode or "max")


@main.command("best")
@click.argument("trial")
@_storage_option()
@click.option("--metric", default=None, metavar="M",
              help="Metric to rank by; nested metrics use '/'. Default: the trial's "
                   "retention score attribute.")
@click.option("--mode", type=click.Choice(["min", "max"]), default=None,
              help="min: lower is better; max: higher is better (default max, or the "
                   "trial's recorded order).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@_common
def best_cmd(trial: str, storage_options: dict[str, Any], metric: str | None, mode: str | None,
             as_json: bool) -> None:
    """Print the best checkpoint of TRIAL (its URI on the first line) and its metrics.

    Ranking is the retention manager's: NaN or missing scores rank last, ties
    go to the newer checkpoint.

    \b
    Examples:
      checkpoint-store best ./results/exp/trial1 --metric loss --mode min
      checkpoint-store best s3://bucket/runs/exp/trial1 --metric eval/accuracy --mode max
      checkpoint-store download "$(checkpoint-store best ./results/exp/t1 --metric loss \\
          --mode min | head -n1)" ./best
    """
    loc = _resolve(trial, storage_options)
    _require_trial(loc)
    metric, mode = _resolve_metric(loc, metric, mode, required=True)
    assert metric is not None
    committed = _committed(loc)
    if not committed:
        raise CheckpointNotFoundError(f"trial {loc.uri} has no committed checkpoint")
    scored = [(ckpt, meta, _stored_score(ckpt, _stored_metrics(ckpt, meta), metric))
              for ckpt, meta in committed]
    best_ckpt, best_meta, best_score = max(
        scored, key=lambda t: _rank_key(t[2], t[1]["index"], mode))
    if best_score is None:
        click.echo(f"warning: no checkpoint of {loc.uri} has a numeric {metric!r}; "
                   "picked the newest", err=True)
    metrics = _stored_metrics(best_ckpt, best_meta, warn=False)
    if as_json:
        _print_json({"uri": best_ckpt.uri, "index": best_meta["index"], "metric": metric,
                     "mode": mode, "score": best_score, "metrics": metrics})
        return
    click.echo(best_ckpt.uri)
    for key, value in sorted(metrics.items()):
        click.echo(f"  {key}: {_fmt_value(value)}")


# -- transfers ----------------------------------------------------------------------


def _counting(loc: _Location, on_bytes: Callable[[int], None],
              expected: Mapping[str, tuple[str, int, str]] | None = None,
              track: Callable[[str], bool] | None = None) -> _Location:
    from checkpoint_store._cli_progress import counting_filesystem

    fs = counting_filesystem(loc.fs, on_bytes, expected, track)
    return _Location(dataclasses.replace(loc.backend, filesystem=fs), loc.path)


def _expected(loc: _Location, meta: Mapping[str, Any]) -> dict[str, tuple[str, int, str]]:
    return {posixpath.join(loc.path, e["path"]): (e["path"], int(e["size"]), e["crc32c"])
            for e in meta.get("manifest", [])}


def _progress(description: str, total: int | None) -> Any:
    from checkpoint_store._cli_progress import Progress

    return Progress(description, total, enabled=not _quiet())


@main.command("download")
@click.argument("checkpoint")
@click.argument("dest", type=click.Path(file_okay=False))
@_storage_option()
@click.option("--no-verify", is_flag=True,
              help="Skip the size and CRC32C check of each file against the manifest.")
@_common
def download_cmd(checkpoint: str, dest: str, storage_options: dict[str, Any],
                 no_verify: bool) -> None:
    """Download CHECKPOINT's files into the local directory DEST, checking each file.

    DEST is created if needed. Internal files (.internal_metadata.json) are
    not copied; .user_metadata.json is.

    \b
    Examples:
      checkpoint-store download s3://bucket/runs/exp/t1/checkpoint_000007 ./ckpt
      checkpoint-store download az://c/runs/exp/t1/checkpoint_000007 ./ckpt -q
    """
    from checkpoint_store.checkpoint import Checkpoint

    loc = _resolve(checkpoint, storage_options)
    meta = _require_checkpoint(loc)
    total = _manifest_size(meta)
    tracked = set(_expected(loc, meta))
    with _progress(f"download {loc.name}", total) as bar:
        # Counting costs a copy per read: only when a bar shows the count.
        src = _counting(loc, bar.advance, track=tracked.__contains__) if bar.enabled else loc
        target = Checkpoint._from_backend(src.backend, loc.path).to_directory(
            dest, verify=not no_verify)
    _echo_info(f"downloaded {len(tracked)} files ({_fmt_size(total)}) of {loc.uri} to {target}")


def _checkpoint_meta_for(dest: _Location, base: Mapping[str, Any] | None,
                         index: int) -> dict[str, Any]:
    """Internal metadata fields for a checkpoint committed at ``dest`` by this tool."""
    meta = {k: v for k, v in (base or {}).items() if k not in ("manifest", "format_version")}
    trial_path = posixpath.dirname(dest.path.rstrip("/"))
    meta["index"] = index
    meta.setdefault("created_at", time.time())
    trial_name = posixpath.basename(trial_path)
    experiment_name = posixpath.basename(posixpath.dirname(trial_path))
    if trial_name:
        meta["trial_name"] = trial_name
    if experiment_name:
        meta["experiment_name"] = experiment_name
    return meta


def _checkpoint_dest(dst: _Location, default_name: str | None) -> tuple[_Location, int]:
    """``dst`` itself when named ``checkpoint_NNNNNN``, else a checkpoint inside the
    trial directory ``dst`` (``default_name``, or the next free index)."""
    index = parse_checkpoint_dir_name(dst.name)
    if index is not None:
        return dst, index
    if default_name is not None:
        parsed = parse_checkpoint_dir_name(default_name)
        assert parsed is not None
        return dst.child(default_name), parsed
    _require_trial_target(dst)
    dirs = [parse_checkpoint_dir_name(n) for n, d in _entries(dst)]
    taken = [i for i in dirs if i is not None]
    index = max(taken) + 1 if taken else 0
    return dst.child(checkpoint_dir_name(index)), index


def _require_fitting_names(dst: _Location) -> None:
    """Refuse, before anything is written, a destination whose name has a
    component no local disk keeps (over 255 bytes): a checkpoint must stay
    copyable anywhere."""
    for part in dst.path.split("/"):
        check_name_length(part, "destination name")


def _require_trial_target(dst: _Location) -> None:
    """Refuse to make ``dst`` a trial where that would hide or nest trials: it
    must be a trial already, empty, or new, and not inside another trial."""
    try:
        kind = _kind(dst)
    except CheckpointNotFoundError:
        kind = None
    if kind not in (None, "empty", "trial"):
        what = {"experiment": "an experiment (it holds trials)", "file": "a file"}.get(
            kind, "a directory that holds other data, not checkpoints")
        raise click.UsageError(
            f"{dst.uri} is {what}, not a trial directory; give a trial directory "
            "(e.g. .../<experiment>/<trial>) or a .../checkpoint_NNNNNN path"
        )
    parent = _Location(dst.backend, posixpath.dirname(dst.path.rstrip("/")))
    if kind is None and parent.path != dst.path:
        try:
            parent_kind = _kind(parent)
        except CheckpointNotFoundError:
            return
        if parent_kind == "trial":
            raise click.UsageError(
                f"{parent.uri} is a trial: a trial inside it would be hidden. Upload into "
                f"the trial itself, or name the checkpoint {parent.uri}/checkpoint_NNNNNN"
            )


@main.command("upload")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.argument("uri")
@_storage_option()
@click.option("--metrics", "metrics_json", default=None, metavar="JSON",
              help='Metrics recorded with the checkpoint, e.g. \'{"loss": 0.12}\'.')
@_common
def upload_cmd(directory: str, uri: str, storage_options: dict[str, Any],
               metrics_json: str | None) -> None:
    """Upload a local DIRECTORY as a committed checkpoint at URI.

    URI is either a checkpoint path (.../checkpoint_000012) or a trial
    directory, where the next free index is used. The checkpoint is
    committed the usual way (manifest with CRC32C, internal metadata last),
    so readers never see a partial upload. Prints the checkpoint's URI.

    \b
    Examples:
      checkpoint-store upload ./model_dir s3://bucket/runs/exp/trial1
      checkpoint-store upload ./model_dir ./results/exp/t1/checkpoint_000003 \\
          --metrics '{"loss": 0.12}'
    """
    from checkpoint_store import _json
    from checkpoint_store.transfer import commit_checkpoint, source_files

    metrics: dict[str, Any] = {}
    if metrics_json is not None:
        try:
            metrics = _json.to_json_object(_json.loads(metrics_json), "metrics")
        except ValueError as exc:
            raise click.BadParameter(f"not a JSON object: {exc}", param_hint="--metrics") from None
    src = _resolve(os.path.abspath(directory), {})
    dst, index = _checkpoint_dest(_resolve(uri, storage_options), None)
    _require_fitting_names(dst)
    files = source_files(src.fs, src.path)  # every name checked before the first write
    total = sum(size for rel, size in files if not is_internal_file(rel))
    meta = _checkpoint_meta_for(dst, {"metrics": metrics, "world_size": 1}, index)
    with _progress(f"upload {dst.name}", total) as bar:
        source = _counting(src, bar.advance) if bar.enabled else src
        written = commit_checkpoint(source.fs, src.path, dst.backend, dst.path, meta)
    _echo_info(f"uploaded {len(written['manifest'])} files ({_fmt_size(total)}) as:")
    click.echo(dst.uri)


def _same_manifest(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    def key(m: Mapping[str, Any]) -> set[tuple[str, int, str]]:
        return {(e["path"], int(e["size"]), e["crc32c"]) for e in m.get("manifest", [])}

    return key(a) == key(b)


def _copy_checkpoint(src: _Location, meta: Mapping[str, Any], dst: _Location, index: int,
                     on_bytes: Callable[[int], None]) -> str:
    """Copy one committed checkpoint; returns "copied" or "skipped" (identical there).

    The source is checked against its manifest while it streams, so a corrupt
    source fails before the destination is committed.
    """
    from checkpoint_store.transfer import commit_checkpoint, source_files

    existing = _internal(dst)
    if existing is not None:
        if _same_manifest(existing, meta):
            on_bytes(_manifest_size(meta))
            return "skipped"
        raise CheckpointConflictError(
            f"{dst.uri} is already a committed checkpoint with different contents"
        )
    # A checkpoint's files are its own: a symlink leading out of it is refused
    # here, on the unwrapped source, before the first write.
    source_files(src.fs, src.path, confine_links=True)
    counted = _counting(src, on_bytes, expected=_expected(src, meta))
    try:
        written = commit_checkpoint(counted.fs, src.path, dst.backend, dst.path,
                                    _checkpoint_meta_for(dst, meta, index))
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(
            f"source {src.uri} is corrupt: {exc}; nothing was committed at {dst.uri}",
            path=src.path, file=exc.file,
        ) from None
    # Ranged reads of large files are not checksummed while they stream; the
    # manifest computed on the bytes that arrived must equal the source's.
    if not _same_manifest(written, meta):
        bad = _first_difference(meta, written)
        _fsutil.delete_file(dst.fs, posixpath.join(dst.path, INTERNAL_METADATA))
        _fsutil.delete_dir(dst.fs, dst.path)
        raise CheckpointCorruptError(
            f"source {src.uri} is corrupt: file {bad!r} does not match its manifest; "
            f"the copy at {dst.uri} was removed", path=src.path, file=bad,
        )
    return "copied"


def _first_difference(want: Mapping[str, Any], got: Mapping[str, Any]) -> str | None:
    have = {e["path"]: (int(e["size"]), e["crc32c"]) for e in got.get("manifest", [])}
    for e in sorted(want.get("manifest", []), key=lambda e: e["path"]):
        if have.get(e["path"]) != (int(e["size"]), e["crc32c"]):
            return str(e["path"])
    extra = sorted(set(have) - {e["path"] for e in want.get("manifest", [])})
    return extra[0] if extra else None


def _copy_trial_files(src: _Location, dst: _Location) -> None:
    for name in sorted(_TRIAL_FILES):
        path = posixpath.join(src.path, name)
        try:
            data = _fsutil.read_bytes(src.fs, path)
        except (FileNotFoundError, OSError):
            if _fsutil.exists(src.fs, path):
                raise
            continue
        _fsutil.write_bytes(dst.fs, posixpath.join(dst.path, name), data,
                            dst.backend.capabilities)


@main.command("cp")
@click.argument("src")
@click.argument("dst")
@_storage_option(help_text="Backend option for both SRC and DST when they are not local; "
                           "repeatable.")
@_storage_option("--src-option", "src_options",
                 help_text="Backend option for SRC only (overrides -o); repeatable.")
@_storage_option("--dst-option", "dst_options",
                 help_text="Backend option for DST only (overrides -o); repeatable.")
@_common
def cp_cmd(src: str, dst: str, storage_options: dict[str, Any], src_options: dict[str, Any],
           dst_options: dict[str, Any]) -> None:
    """Copy checkpoints from SRC to DST, between any two backends.

    \b
    SRC may be:
      a checkpoint   copied to DST if DST is named checkpoint_NNNNNN,
                     else into the trial directory DST under its own name;
      a trial        every committed checkpoint plus result.json, params.json
                     and the retention state, into the trial directory DST;
      an experiment  or a storage root: every trial under it, same layout.

    Each file is checked against the source manifest while it streams and the
    destination is committed only after all its files arrived. Checkpoints
    already present with identical contents are skipped, so an interrupted
    cp can be rerun. Uncommitted directories are not copied.

    \b
    Examples:
      checkpoint-store cp ./results/exp/t1 s3://bucket/runs/exp/t1
      checkpoint-store cp s3://bucket/runs/exp/t1/checkpoint_000004 ./restore/exp/t1
      checkpoint-store cp s3://a/runs az://b/runs --src-option endpoint_url=http://...
    """
    s = _resolve(src, {**storage_options, **src_options}, options_if_remote=True)
    d = _resolve(dst, {**storage_options, **dst_options}, options_if_remote=True)
    kind = _kind(s)
    jobs: list[tuple[_Location, dict[str, Any], _Location, int]] = []
    trial_pairs: list[tuple[_Location, _Location]] = []
    if kind == "checkpoint":
        meta = _require_checkpoint(s)
        target, index = _checkpoint_dest(d, s.name)
        jobs.append((s, meta, target, index))
    elif kind in ("trial", "experiment", "root"):
        for trial in _trials_under(s, kind):
            rel = posixpath.relpath(trial.path, s.path)
            dt = d if rel == "." else d.child(rel)
            trial_pairs.append((trial, dt))
            for ckpt, cmeta in _committed(trial):
                jobs.append((ckpt, cmeta, dt.child(ckpt.name), int(cmeta["index"])))
    elif kind in ("uncommitted", "corrupt"):
        _require_checkpoint(s)  # raises, saying which
    else:
        raise CheckpointNotFoundError(f"no checkpoints under {s.uri}")
    if not jobs and not trial_pairs:
        raise CheckpointNotFoundError(f"no checkpoints under {s.uri}")
    for target in [t for _, _, t, _ in jobs] + [dt for _, dt in trial_pairs]:
        _require_fitting_names(target)
    total = sum(_manifest_size(m) for _, m, _, _ in jobs)
    results: dict[str, int] = {"copied": 0, "skipped": 0}
    copied_bytes = 0
    corrupt: list[CheckpointCorruptError] = []
    with _progress(f"cp {s.name}", total) as bar:
        for src_ckpt, cmeta, target, index in jobs:
            try:
                outcome = _copy_checkpoint(src_ckpt, cmeta, target, index, bar.advance)
            except CheckpointCorruptError as exc:
                if len(jobs) == 1:
                    raise
                # A backup copies every good checkpoint; the bad ones fail the
                # command at the end, each named, and are never committed there.
                corrupt.append(exc)
                _echo_info(f"skipped corrupt {src_ckpt.uri}: {_one_line(str(exc))}")
                continue
            results[outcome] += 1
            if outcome == "copied":
                copied_bytes += _manifest_size(cmeta)
    for trial, dt in trial_pairs:
        _copy_trial_files(trial, dt)
    _echo_info(f"copied {results['copied']} checkpoints ({_fmt_size(copied_bytes)}) to {d.uri}"
               + (f", {results['skipped']} already there" if results["skipped"] else ""))
    if corrupt:
        raise CheckpointCorruptError(
            f"{len(corrupt)} source checkpoint(s) failed their manifest and were not copied: "
            + "; ".join(_one_line(str(e)) for e in corrupt)
        )


# -- verify -------------------------------------------------------------------------


def _verify_one(ckpt: _Location, meta: Mapping[str, Any], on_bytes: Callable[[int], None],
                counting: bool = True) -> None:
    """Read every manifest file of one checkpoint and check its size and CRC32C
    (:meth:`Checkpoint.verify`), counting the bytes for the progress bar.

    Raises:
        CheckpointCorruptError: naming the first bad or missing file.
    """
    from checkpoint_store.checkpoint import Checkpoint

    expected = _expected(ckpt, meta)
    counted = _counting(ckpt, on_bytes, track=expected.__contains__) if counting else ckpt
    Checkpoint._from_backend(counted.backend, ckpt.path).verify()


@main.command("verify")
@click.argument("uri")
@_storage_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@_common
def verify_cmd(uri: str, storage_options: dict[str, Any], as_json: bool) -> None:
    """Check the sizes and CRC32C checksums of one checkpoint, or of every checkpoint
    under URI (a trial, an experiment or a storage root).

    Exits 1 if any checkpoint is corrupt (each one is named with its first bad
    file) or if there is no committed checkpoint under URI.

    \b
    Examples:
      checkpoint-store verify ./results/exp/t1/checkpoint_000004
      checkpoint-store verify s3://bucket/runs
    """
    loc = _resolve(uri, storage_options)
    kind = _kind(loc)
    report: list[dict[str, Any]] = []
    targets: list[tuple[_Location, dict[str, Any]]] = []
    if kind == "checkpoint":
        targets = [(loc, _require_checkpoint(loc))]
    elif kind == "corrupt":
        st = _inspect(loc)
        report.append({"uri": loc.uri, "ok": False, "file": st.file,
                       "error": f"checkpoint {loc.uri} is corrupt: {st.reason}"})
    elif kind == "uncommitted":
        _require_checkpoint(loc)
    else:
        for trial in _trials_under(loc, kind):
            committed = _committed(trial)
            targets.extend(committed)
            corrupt, _ = _not_committed(trial, (c.name for c, _ in committed))
            for name, st in corrupt:
                report.append({"uri": trial.child(name).uri, "ok": False, "file": st.file,
                               "error": f"checkpoint {trial.child(name).uri} is corrupt: "
                                        f"{st.reason}"})
    if not targets and not report:
        raise CheckpointNotFoundError(f"no committed checkpoint under {loc.uri}")
    total = sum(_manifest_size(m) for _, m in targets)
    with _progress(f"verify {loc.name}", total) as bar:
        for ckpt, cmeta in targets:
            try:
                _verify_one(ckpt, cmeta, bar.advance, bar.enabled)
            except CheckpointCorruptError as exc:
                report.append({"uri": ckpt.uri, "ok": False, "file": exc.file,
                               "error": _one_line(str(exc))})
            else:
                report.append({"uri": ckpt.uri, "ok": True, "file": None, "error": None})
    bad = [r for r in report if not r["ok"]]
    if as_json:
        _print_json({"uri": loc.uri, "checked": len(report), "corrupt": len(bad),
                     "checkpoints": report})
    else:
        for r in report:
            if r["ok"]:
                if not _quiet():
                    click.echo(f"OK       {r['uri']}")
            else:
                click.echo(f"CORRUPT  {r['uri']}: {r['error']}")
        _echo_info(f"{len(report)} checkpoints checked, {len(bad)} corrupt")
    if bad:
        click.get_current_context().exit(EXIT_FAILURE)


# -- prune --------------------------------------------------------------------------


def _select(committed: list[tuple[_Location, dict[str, Any]]], keep: int, metric: str | None,
            mode: str, keep_latest: bool) -> tuple[list[int], list[int]]:
    """Positions (into ``committed``) kept and evicted, decided by
    :func:`checkpoint_store.retention.select_kept`: the manager's exact semantics."""
    from checkpoint_store.retention import CheckpointConfig, select_kept

    config = CheckpointConfig(num_to_keep=keep, checkpoint_score_attribute=metric,
                              checkpoint_score_order=mode, keep_latest=keep_latest)  # type: ignore[arg-type]
    records = [(int(meta["index"]), ckpt.name, _stored_metrics(ckpt, meta))
               for ckpt, meta in committed]
    if metric is not None:  # a stored non-number is named here, not as a usage error
        for (ckpt, _), (_, _, metrics) in zip(committed, records, strict=True):
            _stored_score(ckpt, metrics, metric)
    kept, evicted = select_kept(records, config)
    position = {ckpt.name: i for i, (ckpt, _) in enumerate(committed)}
    return [position[r.dir_name] for r in kept], [position[r.dir_name] for r in evicted]


@main.command("prune")
@click.argument("trial")
@_storage_option()
@click.option("--keep", type=click.IntRange(min=1), required=True, metavar="N",
              help="How many best checkpoints to keep.")
@click.option("--metric", default=None, metavar="M",
              help="Metric to rank by; nested metrics use '/'. Without it (and without a "
                   "recorded retention attribute) the N most recent are kept.")
@click.option("--mode", type=click.Choice(["min", "max"]), default=None,
              help="min: lower is better; max: higher is better (default max).")
@click.option("--keep-latest/--no-keep-latest", default=True, show_default=True,
              help="Also keep the newest checkpoint (resume needs it), as the manager does.")
@click.option("--dry-run", is_flag=True, help="Print what would be deleted; delete nothing.")
@click.option("--force", is_flag=True,
              help="Prune even while a running job's checkpoint manager holds the trial.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@_common
def prune_cmd(trial: str, storage_options: dict[str, Any], keep: int, metric: str | None,
              mode: str | None, keep_latest: bool, dry_run: bool, force: bool,
              as_json: bool) -> None:
    """Apply retention to TRIAL after the fact: keep the best N, delete the rest.

    Same semantics as CheckpointManager (CheckpointConfig(num_to_keep=N,
    checkpoint_score_attribute=M, checkpoint_score_order=MODE)): NaN or
    missing scores rank last, ties go to the newer checkpoint, and the newest
    checkpoint is kept besides the best N unless --no-keep-latest. Each
    deletion removes the commit marker first, so an interrupted prune never
    leaves a half-deleted checkpoint that still lists as committed. A trial
    whose running job holds the manager's lease is refused (--force overrides).

    \b
    Examples:
      checkpoint-store prune ./results/exp/t1 --keep 3 --metric loss --mode min --dry-run
      checkpoint-store prune s3://bucket/runs/exp/t1 --keep 1 --metric acc --mode max
    """
    loc = _resolve(trial, storage_options)
    _require_trial(loc)
    metric, mode = _resolve_metric(loc, metric, mode, required=False)
    committed = _committed(loc)
    kept, evicted = _select(committed, keep, metric, mode, keep_latest)

    def describe(i: int) -> dict[str, Any]:
        ckpt, meta = committed[i]
        metrics = _stored_metrics(ckpt, meta, warn=False)
        return {"name": ckpt.name, "uri": ckpt.uri, "index": meta["index"],
                "score": _metric_value(metrics, metric) if metric else None}

    ctx = _storage_context(loc)
    deleted = []
    if not dry_run:
        _refuse_if_live(loc, force, "prune it")
        for i in evicted:
            ctx.delete_checkpoint(committed[i][0].name)
            deleted.append(describe(i))
    if as_json:
        _print_json({"uri": loc.uri, "dry_run": dry_run, "metric": metric, "mode": mode,
                     "kept": [describe(i) for i in kept],
                     "evicted": [describe(i) for i in evicted],
                     "deleted": deleted})
        return
    verb = "would delete" if dry_run else "deleted"
    label = f" ({metric}=" if metric else ""
    for i in evicted:
        d = describe(i)
        suffix = f"{label}{_fmt_value(d['score'])})" if metric else ""
        click.echo(f"{verb}  {d['uri']}{suffix}")
    for i in kept:
        d = describe(i)
        suffix = f"{label}{_fmt_value(d['score'])})" if metric else ""
        pad = " " * (len(verb) - len("kept"))
        _echo_info(f"kept{pad}  {d['uri']}{suffix}")
    _echo_info(f"{len(evicted)} {verb}, {len(kept)} kept")


# -- gc -----------------------------------------------------------------------------


def _newest_mtime(loc: _Location) -> float | None:
    newest = None
    for fi in loc.fs.get_file_info(_fsutil.pafs.FileSelector(loc.path, allow_not_found=True,
                                                             recursive=True)):
        if fi.mtime is not None:
            ts = fi.mtime.timestamp()
            newest = ts if newest is None else max(newest, ts)
    if newest is None:
        fi = _fsutil.info(loc.fs, loc.path)
        if fi.mtime is not None:
            newest = fi.mtime.timestamp()
    return newest


def _scan(trial: _Location) -> tuple[list[str], list[str], list[str], list[str]]:
    """``(committed, uncommitted ours, active, foreign)`` entry names of a trial.

    Directories are classified by :meth:`StorageContext.scan` (a partial upload
    is ours only when it carries a trace of our writers); plain files that are
    neither trial files nor ours are reported as foreign too.
    """
    ctx = _storage_context(trial)
    found = ctx.scan()
    entries = _entries(trial)
    # Only direct children: some stores (adlfs) answer a shallow listing with deeper entries.
    children = {name for name, is_dir in entries if is_dir}
    active = [n for n in found.active if n in children]
    ours = [n for n in found.uncommitted if n not in set(active) and n in children]
    foreign = [n for n in found.foreign if n in children]
    for name, is_dir in entries:
        if not is_dir and name not in _TRIAL_FILES and not name.startswith(INTERNAL_PREFIX) \
                and not name.endswith(".cs_tmp"):
            foreign.append(name)
    return [n for n in found.committed if n in children], ours, active, sorted(foreign)


@main.command("gc")
@click.argument("trial")
@_storage_option()
@click.option("--min-age", type=_NumberAtLeast(min=0), default=3600.0, show_default=True,
              metavar="SECONDS",
              help="Only remove directories untouched for this long, so a checkpoint still "
                   "being written by a running job is left alone.")
@click.option("--dry-run", is_flag=True, help="Print what would be removed; remove nothing.")
@click.option("--force", is_flag=True,
              help="Remove even while a running job's checkpoint manager holds the trial.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@_common
def gc_cmd(trial: str, storage_options: dict[str, Any], min_age: float, dry_run: bool,
           force: bool, as_json: bool) -> None:
    """Remove the uncommitted directories this tool's writers left in TRIAL.

    Removes staging directories, deletions cut short and partial uploads that
    carry a trace of our writers (see docs/format.md). Anything else that is
    not a committed checkpoint (a directory copied in by hand, a checkpoint
    whose marker we cannot read) is reported as foreign and never deleted.
    Committed checkpoints are never touched.

    \b
    Examples:
      checkpoint-store gc ./results/exp/t1 --dry-run
      checkpoint-store gc s3://bucket/runs/exp/t1 --min-age 0
    """
    loc = _resolve(trial, storage_options)
    _require_trial(loc)
    if not dry_run:
        _refuse_if_live(loc, force, "remove directories from it")
    committed, ours, active, foreign = _scan(loc)
    removed, too_young = [], []
    # Ages on the storage's clock, never this machine's: a clock running ahead
    # would make a live upload look abandoned.
    ages = _clock.age_on_storage(
        loc.fs, loc.path, loc.backend.capabilities,
        {name: _newest_mtime(loc.child(name)) for name in ours},
    ) if min_age > 0 and ours else {}
    for name in ours:
        child = loc.child(name)
        age = ages.get(name)
        # An unknown age (stores without modification times) counts as recent.
        if min_age > 0 and (age is None or age < min_age):
            too_young.append(name)
            continue
        if not dry_run:
            _fsutil.delete_dir(loc.fs, child.path)
        removed.append(name)
    too_young.extend(active)
    if as_json:
        _print_json({"uri": loc.uri, "dry_run": dry_run, "committed": committed,
                     "removed": removed, "skipped_recent": sorted(too_young),
                     "foreign": foreign})
        return
    verb = "would remove" if dry_run else "removed"
    for name in removed:
        click.echo(f"{verb}  {loc.child(name).uri}")
    for name in sorted(too_young):
        _echo_info(f"skipped (in use or modified less than {min_age:g}s ago)  "
                   f"{loc.child(name).uri}")
    for name in foreign:
        click.echo(f"foreign (not ours, left alone)  {loc.child(name).uri}")
    _echo_info(f"{len(removed)} {verb}, {len(too_young)} too recent, {len(foreign)} foreign, "
               f"{len(committed)} committed checkpoints untouched")


# -- backends -----------------------------------------------------------------------


@main.command("backends")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_common
def backends_cmd(as_json: bool) -> None:
    """List the registered URI schemes and the distribution providing each.

    Known cloud schemes whose plugin is not installed are listed with the
    pip command that adds them.

    \b
    Examples:
      checkpoint-store backends
      checkpoint-store backends --json
    """
    from checkpoint_store.registry import KNOWN_PLUGINS, available_backends

    rows: list[dict[str, Any]] = [{"scheme": s, "provided_by": src, "installed": True}
                                  for s, src in available_backends().items()]
    have = {r["scheme"] for r in rows}
    for scheme, dist in sorted(KNOWN_PLUGINS.items()):
        if scheme not in have:
            rows.append({"scheme": scheme, "provided_by": dist, "installed": False})
    if as_json:
        _print_json(rows)
        return
    _table(["SCHEME", "PROVIDED BY", "STATUS"],
           [[f"{r['scheme']}://", str(r["provided_by"]),
             "installed" if r["installed"] else f"not installed: pip install {r['provided_by']}"]
            for r in rows])


# -- demo ---------------------------------------------------------------------------


@main.command()
@click.option("--storage", default="./checkpoint_store_demo", show_default=True,
              help="Where checkpoints go: a local path or any backend URI.")
@click.option("--epochs", default=15, show_default=True, type=click.IntRange(1))
@click.option("--num-to-keep", default=3, show_default=True, type=click.IntRange(1))
@click.option("--lr", default=0.05, show_default=True, type=_NumberAtLeast(min=0, min_open=True))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint.")
@click.option("--epoch-delay", default=0.0, type=_NumberAtLeast(min=0), hidden=True,
              help="Seconds to sleep after each epoch (to try killing a run mid-way).")
@click.option("--tune", is_flag=True,
              help="Run an Optuna study over the learning rate instead (needs the tune extra).")
@click.option("--trials", default=8, show_default=True, type=click.IntRange(1),
              help="With --tune: number of trials.")
@click.option("--parallel", default=2, show_default=True, type=click.IntRange(1),
              help="With --tune: trials run at the same time.")
@_common
def demo(storage: str, epochs: int, num_to_keep: int, lr: float, seed: int, resume: bool,
         epoch_delay: float, tune: bool, trials: int, parallel: int) -> None:
    """Train a digits classifier, keep the best checkpoints, resume after a crash.

    \b
    Examples:
      checkpoint-store demo
      checkpoint-store demo --epochs 30 --resume
      checkpoint-store demo --storage memory://demo
      checkpoint-store demo --tune --trials 8 --parallel 2
    """
    if tune:
        if resume:
            # The study itself (Optuna's trial history) is kept in memory only,
            # so there is nothing to resume; never start over by deleting.
            raise click.UsageError(
                "--resume continues the single-run demo; a --tune study always starts "
                "fresh (drop --resume, or use another --storage to keep the old study)"
            )
        from checkpoint_store._demo_tune import run_tune

        sys.exit(run_tune(storage=storage, trials=trials, parallel=parallel, epochs=epochs,
                          num_to_keep=num_to_keep, seed=seed))
    from checkpoint_store._demo_cli import run_demo

    sys.exit(run_demo(storage=storage, epochs=epochs, num_to_keep=num_to_keep, lr=lr,
                      seed=seed, resume=resume, epoch_delay=epoch_delay))


# -- the web page and plots (checkpoint_store/ui) -------------------------------------

from checkpoint_store.ui._commands import plot_cmd, ui_cmd  # noqa: E402

main.add_command(ui_cmd)
main.add_command(plot_cmd)


if __name__ == "__main__":  # pragma: no cover
    main()
