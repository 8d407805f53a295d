"""A trial's status and its preemption checkpoints, as ``ls`` and the page show them.

A trial's status follows from three files of its directory, in this order: a
lease (``running`` when its holder is alive, else ``interrupted``), then
``error.txt`` (``errored``: its last run raised), then ``stopped.json``
(``pruned``, ``stopped`` or ``preempted``: its last run was ended early and
said why), else ``finished``. A ``preempted`` trial is resumable: its last
run committed what it could on the signal and a new run resumes from the
newest committed checkpoint.

A preemption checkpoint is the one the first ``report()`` after a
preemption signal committed; its internal metadata records
``{"signal", "signalled_at", "grace_period_s"}`` under ``"preemption"``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from checkpoint_store._browse.locations import Location, list_entries, storage_context
from checkpoint_store._format.layout import LEASE_FILE, STOPPED_FILE
from checkpoint_store._results.trialfiles import STOP_STATUSES, read_stop

__all__ = [
    "PREEMPTED",
    "STATUSES",
    "preemption_label",
    "preemption_of",
    "status_of",
    "stop_of",
    "trial_status",
]

PREEMPTED = "preempted"
#: Every status a trial can show, in the order of the page's filter.
STATUSES = ("running", "finished", *STOP_STATUSES, "errored", "interrupted")


def preemption_of(meta: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The ``"preemption"`` record of a checkpoint's internal metadata
    (``signal``, ``signalled_at``, ``grace_period_s``), or None when it has
    none (or one not of that shape: not a preemption checkpoint then)."""
    if not isinstance(meta, Mapping):
        return None
    rec = meta.get("preemption")
    if not isinstance(rec, Mapping) or not isinstance(rec.get("signal"), str):
        return None
    return {"signal": rec["signal"], "signalled_at": _number(rec.get("signalled_at")),
            "grace_period_s": _number(rec.get("grace_period_s"))}


def preemption_label(rec: Mapping[str, Any]) -> str:
    """``preemption (SIGTERM)``: how a listing marks a preemption checkpoint."""
    return f"preemption ({rec['signal']})"


def stop_of(body: Any) -> dict[str, Any] | None:
    """``{"status", "reason", "time"}`` of a ``stopped.json`` body, or None when
    it is not one (absent, unreadable, or a status this version does not know)."""
    if not isinstance(body, Mapping) or body.get("status") not in STOP_STATUSES:
        return None
    status = body["status"]
    return {"status": status, "reason": str(body.get("reason") or status),
            "time": _number(body.get("time"))}


def status_of(lease: str | None, error: str | None, stop: Mapping[str, Any] | None) -> str:
    """The status of a trial from its lease (None, ``running`` or
    ``interrupted``), the last line of its ``error.txt`` and its ``stopped.json``
    (:func:`stop_of`): the order in the module's docstring."""
    if lease is not None:
        return lease
    if error is not None:
        return "errored"
    if stop is not None:
        return str(stop["status"])
    return "finished"


def trial_status(trial: Location, names: Iterable[str] | None,
                 error: str | None) -> tuple[str, dict[str, Any] | None]:
    """``(status, stop)`` of ``trial``: :func:`status_of` from ``error`` (the
    last line of its ``error.txt``) and the files of its listing ``names``
    (listed here when None). Only the files the listing shows are read: a
    finished trial costs no request beyond the listing."""
    from checkpoint_store.retention import live_lease

    present = set(names if names is not None else (n for n, _ in list_entries(trial)))
    stop = stop_of(read_stop(trial.fs, trial.path)) if STOPPED_FILE in present else None
    lease = None
    if LEASE_FILE in present:
        ctx = storage_context(trial, strict=False)
        try:
            alive = ctx is not None and live_lease(ctx) is not None
        except OSError:
            alive = False
        lease = "running" if alive else "interrupted"
    return status_of(lease, error, stop), stop


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
