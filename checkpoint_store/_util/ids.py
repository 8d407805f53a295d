"""Who writes: run ids and writer ids.

A *run* is one launch of a training job (every rank of a torchrun attempt
shares it); a *writer* is one uploader within a run. Cleanup leaves alone
what a writer of the current run may still be writing (docs/format.md).
Pure functions of the environment and the process: any thread may call them.
"""

from __future__ import annotations

import os
import re
import uuid

__all__ = [
    "RUN_ID_ENV",
    "default_run_id",
    "new_writer_id",
    "run_of_writer",
    "sanitize_run_id",
    "torchrun_attempt",
]


_RUN_SAFE = re.compile(r"[^A-Za-z0-9_]")
RUN_ID_ENV = ("CHECKPOINT_STORE_RUN_ID", "TORCHELASTIC_RUN_ID")
_PROCESS_RUN_ID = f"p{uuid.uuid4().hex[:12]}"


def _new_process_run_id() -> None:
    """A forked child is another process, so another run: without a new id
    it would share its parent's, and the cleanup of a later fork (or of the
    parent) would take a dead child's unfinished checkpoint for one the
    current run may still be writing (``_commit/leftovers.py``: "active")
    and keep it for good."""
    global _PROCESS_RUN_ID
    _PROCESS_RUN_ID = f"p{uuid.uuid4().hex[:12]}"


if hasattr(os, "register_at_fork"):  # not on Windows (no fork there)
    os.register_at_fork(after_in_child=_new_process_run_id)


def sanitize_run_id(run_id: str) -> str:
    """``run_id`` with anything but letters, digits and ``_`` replaced by ``_``
    (so names built from it split unambiguously on ``-`` and ``.``)."""
    return _RUN_SAFE.sub("_", str(run_id))[:64] or "_"


def default_run_id() -> tuple[str, bool]:
    """``(run id, shared)``: the launcher's run id (``CHECKPOINT_STORE_RUN_ID``,
    then torchrun's ``TORCHELASTIC_RUN_ID`` + restart count) with shared=True,
    else one id for this process with shared=False (a forked child gets a
    new one: it is another run)."""
    value = os.environ.get("CHECKPOINT_STORE_RUN_ID")
    if value:
        return sanitize_run_id(value), True
    launch = torchrun_attempt()
    if launch is not None:
        # A new attempt cleans the old one's leftovers.
        return sanitize_run_id(f"{launch[0]}_r{launch[1]}"), True
    return _PROCESS_RUN_ID, False


def torchrun_attempt() -> tuple[str, str] | None:
    """``(rendezvous id, restart count)`` of a torchrun launch, from
    ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT``; None outside
    one, or where the id is torchrun's default ``none`` (the same for every
    launch). The rendezvous id is the same on every restart of an elastic
    job; the restart count tells its attempts apart."""
    value = os.environ.get("TORCHELASTIC_RUN_ID")
    if not value or value.lower() == "none":
        return None
    return value, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def new_writer_id(run_id: str | None = None) -> str:
    """A unique id for one writer: ``<run>.<pid>.<random>``. The run part lets
    cleanup leave alone whatever another rank of the same run may be writing."""
    run = sanitize_run_id(run_id) if run_id else default_run_id()[0]
    return f"{run}.{os.getpid()}.{uuid.uuid4().hex[:10]}"


def run_of_writer(writer: str) -> str:
    """The run id part of a writer id (the whole string for ids without dots)."""
    return writer.split(".", 1)[0]
