"""A trial's small files besides its results: ``params.json`` (its config),
``error.txt`` (the failures of its runs) and ``stopped.json`` (why its last run
ended early), as :class:`~checkpoint_store.storage.StorageContext` writes and
reads them (docs/format.md). Each write is one PUT on object stores, an atomic
replace on local disks.
"""

from __future__ import annotations

import posixpath
import time
import traceback
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import ERROR_FILE, PARAMS_FILE, STOPPED_FILE
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.backends.base import Capabilities
from checkpoint_store.errors import InvalidConfigError

__all__ = ["STOP_STATUSES", "read_error", "read_params", "read_stop", "write_error",
           "write_params", "write_stop"]


def write_params(filesystem: Any, trial_path: str, config: Mapping[str, Any],
                 caps: Capabilities) -> None:
    """Write ``config`` as the trial's ``params.json``.

    Raises:
        InvalidConfigError: ``config`` is not a JSON object.
    """
    data = _json.dumps(_json.to_json_object(config, "config"))
    _fsutil.write_bytes(filesystem, posixpath.join(trial_path, PARAMS_FILE), data, caps)


def read_params(filesystem: Any, trial_path: str) -> dict[str, Any]:
    """The trial's ``params.json`` (its config as :func:`write_params` wrote it),
    without the records the library adds under ``_``-prefixed keys (such as
    ``_resume_from``); ``{}`` when absent, unreadable or not a JSON object."""
    try:
        body = _json.loads(_fsutil.read_bytes(filesystem, posixpath.join(trial_path, PARAMS_FILE)))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(body, dict):
        return {}
    return {k: v for k, v in body.items() if not (isinstance(k, str) and k.startswith("_"))}


def write_error(filesystem: Any, trial_path: str, text: str, error: BaseException,
                now: float | None, caps: Capabilities) -> None:
    """Write ``error.txt`` as ``text`` (its former content) plus a block
    ``Failure # N (occurred at YYYY-MM-DD_HH-MM-SS)`` for ``error`` (see
    :meth:`~checkpoint_store.storage.StorageContext.record_error`)."""
    number = sum(line.startswith("Failure # ") for line in text.splitlines()) + 1
    when = datetime.fromtimestamp(time.time() if now is None else now)
    block = (f"Failure # {number} (occurred at {when:%Y-%m-%d_%H-%M-%S})\n"
             + "".join(traceback.format_exception(type(error), error, error.__traceback__)))
    if text and not text.endswith("\n"):
        text += "\n"
    _fsutil.write_bytes(
        filesystem, posixpath.join(trial_path, ERROR_FILE),
        (text + block).encode("utf-8", "backslashreplace"), caps,
    )


#: Why a run was ended early: a pruner, its driver, a preemption signal.
STOP_STATUSES = ("pruned", "stopped", "preempted")


def write_stop(filesystem: Any, trial_path: str, status: str, reason: str,
               now: float | None, caps: Capabilities) -> None:
    """Write ``stopped.json`` (see
    :meth:`~checkpoint_store.storage.StorageContext.record_stop`).

    Raises:
        InvalidConfigError: ``status`` is not ``"pruned"``, ``"stopped"`` or
            ``"preempted"``.
    """
    if status not in STOP_STATUSES:
        raise InvalidConfigError(
            f"status must be one of {', '.join(map(repr, STOP_STATUSES))}, got {status!r}")
    body = {"status": status, "reason": str(reason),
            "time": time.time() if now is None else now}
    _fsutil.write_bytes(filesystem, posixpath.join(trial_path, STOPPED_FILE),
                        _json.dumps(body), caps)


def read_stop(filesystem: Any, trial_path: str) -> dict[str, Any] | None:
    """``stopped.json`` as a dict, or None when absent or unreadable."""
    try:
        raw = _fsutil.read_bytes(filesystem, posixpath.join(trial_path, STOPPED_FILE))
        body = _json.loads(raw)
    except (FileNotFoundError, OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def read_error(filesystem: Any, trial_path: str) -> str | None:
    """The text of ``error.txt``, or None when absent."""
    try:
        raw = _fsutil.read_bytes(filesystem, posixpath.join(trial_path, ERROR_FILE))
    except (FileNotFoundError, OSError):
        return None
    return raw.decode("utf-8", errors="replace")
