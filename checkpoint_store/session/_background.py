"""A Session's background uploads (``upload_mode="async"``, and a local
tier's durable copies): the report path through the uploader,
``Session.wait()``, and the drain at the end of the session or at the exit
of a process that never ended it.

Functions of a :class:`~checkpoint_store.session.Session` (passed first), as
:mod:`~checkpoint_store.session._tiered` is; the uploader itself is
:class:`~checkpoint_store.session._uploads.BackgroundUploader`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from checkpoint_store._results.writer import finish_before_exit_flush
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.session import _tiered
from checkpoint_store.session._uploads import BackgroundUploader

# The Session's logger: its records keep the name they always had.
_logger = logging.getLogger("checkpoint_store.session._session")


def report_with_uploader(
    session: Any, metrics: Mapping[str, Any], checkpoint: Checkpoint | None, mode: str,
    staging: str | None,
) -> tuple[dict[str, Any], Checkpoint | None]:
    from checkpoint_store.session import _uploads as _async

    _async.check_upload_mode(mode)
    if session._coordinator is not None:
        raise InvalidConfigError(
            "upload_mode='async' supports one rank only; use 'sync' with world_size > 1"
        )
    if session._uploader is None:
        session._uploader = BackgroundUploader(session.upload_config.max_pending_uploads)
        # A process that exits without ending the session still commits them.
        finish_before_exit_flush(session)
    up = session._uploader
    up.raise_error()
    if checkpoint is None:
        return session._report_single(metrics, None)
    if mode == "sync":
        # Commits keep report order: earlier background uploads go first.
        up.wait()
        up.raise_error()
        return session._report_single(metrics, checkpoint)
    return _async.report_async(session, up, metrics, checkpoint,
                               staging or session.upload_config.staging)


def wait(session: Any, timeout: float | None = None, *, checkpoint: Any = None) -> None:
    """:meth:`Session.wait() <checkpoint_store.session.Session.wait>`."""
    if checkpoint is not None:
        _tiered.wait(session, timeout, checkpoint)
        return
    deadline = None if timeout is None else time.monotonic() + timeout
    if session._tier is not None and session._tier_worker is not None:
        session._tier_worker.wait(timeout)  # staged local commits queue the durable copies
        session._tier_worker.raise_error()
    up = session._uploader
    if up is not None:
        if not up.wait(timeout):
            raise TimeoutError(
                f"{up.pending} checkpoint upload(s) still pending after {timeout} s")
        up.raise_error()
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not session.manager.wait_deletes(left) or (
            session._tier is not None and not session._tier.wait_deletes(
                None if deadline is None else max(0.0, deadline - time.monotonic()))):
        raise TimeoutError(f"deletes of evicted checkpoints still running after {timeout} s")


def drain_uploads(session: Any, wait: bool = True) -> list[tuple[str, BaseException]]:
    """Wait for every background upload (the end of the session, and the exit
    of a process that never ended it), then take their errors:
    ``(checkpoint_dir_name, exception)``, each checkpoint not committed."""
    staged = _tiered.drain(session, wait) if session._tier is not None else []
    up = session._uploader
    if up is None:
        return staged
    if wait:
        up.wait()
    return staged + up.take_errors()


def finish_at_exit(session: Any) -> None:
    """Called at interpreter exit, before the rows are flushed
    (:func:`~checkpoint_store._results.writer.finish_before_exit_flush`), for a
    session never ended: commit its pending uploads, waiting as long as they
    take (each bounded by the retry policy); log, never raise, what was lost."""
    up = session._uploader
    if session._closed or up is None or up.pid != os.getpid():
        return  # ended; or a forked child, whose parent owns the uploads
    where = session.storage.uri(session.storage.trial_path)
    if up.pending:
        _logger.warning(
            "the session of %s was not ended (session.end(), or `with "
            "session.start(...)`); finishing its %d pending checkpoint upload(s) "
            "before the process exits", where, up.pending)
    errors = drain_uploads(session)
    session.manager.wait_deletes()  # else resumed by the next session
    if errors:
        _logger.error(
            "at exit, the background upload of %s failed: not committed (lost); the "
            "result.json rows naming them point to no checkpoint, and "
            "get_checkpoint() returns an older one. First error: %r",
            ", ".join(what for what, _ in errors), errors[0][1])
