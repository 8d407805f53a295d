"""The end of a Session: ``Session.close()`` (finish the background uploads,
flush the rows, record how the trial ended in ``error.txt``, release the
trial's lease).

Functions of a :class:`~checkpoint_store.session.Session` (passed first), as
:mod:`~checkpoint_store.session._tiered` is.
"""

from __future__ import annotations

import logging
from typing import Any

from checkpoint_store.errors import TrialStopped
from checkpoint_store.session import _state_report
from checkpoint_store.session._background import drain_uploads
from checkpoint_store.session._reporting import settle
from checkpoint_store.session._uploads import first_error


def close(session: Any, error: BaseException | None = None) -> None:
    """:meth:`Session.close() <checkpoint_store.session.Session.close>`."""
    first_close = not session._closed
    # Queued uploads finish before retention's lease is released.
    upload_errors = drain_uploads(session, wait=first_close)
    if first_close:
        with session._lock:
            settle(session)
    session._closed = True
    results_error: Exception | None = None
    try:
        if session._results is not None:
            try:  # the last rows, and result.json assembled, under the lease
                session._results.close()
            except Exception as exc:
                results_error = exc
        upload_error = first_error(upload_errors)
        if first_close and session.world_rank == 0:
            record_end(session, error if error is not None else upload_error)
    finally:
        if session._tier is not None:
            session._tier.wait_deletes()  # the local tier's evictions
        # Releases the trial's retention lease (also when an exception ends the session).
        session.manager.close()
        if session._coordinator is not None:
            session._coordinator.close()
        _state_report.close_stager(session)
    if upload_error is not None:
        raise upload_error
    if results_error is not None:
        raise results_error


def record_end(session: Any, error: BaseException | None) -> None:
    clean = (error is None or isinstance(error, (TrialStopped, GeneratorExit))
             or (isinstance(error, SystemExit) and error.code in (0, None)))
    try:
        if isinstance(error, TrialStopped) and error.status is not None:
            session.storage.record_stop(error.status, error.reason or "")
        elif session.storage.read_stop() is not None:
            session.storage.clear_stop()  # this run ended otherwise
        if clean:
            session.storage.clear_error()
        else:
            assert error is not None
            session.storage.record_error(error)
    except Exception as exc:
        logging.getLogger("checkpoint_store.session._session").warning(
            "could not %s error.txt of %s: %s", "clear" if clean else "write",
            session.storage.uri(session.storage.trial_path), exc)
