"""The end of a Session: finish the background work, settle the commits of
unknown outcome, flush the rows, record how the trial ended in
``error.txt``, release what the session holds (``Session.close()``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from checkpoint_store.errors import TrialStopped
from checkpoint_store.session._executors import BackgroundWork
from checkpoint_store.session._ledger import CommitRecorder, ReportLedger
from checkpoint_store.session._uploads import first_error
from checkpoint_store.storage import StorageContext

__all__ = ["close_session", "record_end"]


def close_session(ledger: ReportLedger, recorder: CommitRecorder, work: BackgroundWork, *,
                  first_close: bool, record: Callable[[BaseException | None], None] | None,
                  error: BaseException | None, finish: Callable[[], None]) -> None:
    """``Session.close()``: queued uploads finish before retention's lease is
    released (``finish``, called whatever happens); ``record`` (rank 0, first
    close) writes how the trial ended. Raises the first background error,
    then a failure to write the rows.

    Whatever cuts the wait for the uploads or the settling of the commits
    (a second Ctrl-C's ``KeyboardInterrupt``, a SIGTERM handler's
    ``SystemExit``, an error) still ends the session: the rows are closed,
    the end is recorded with that exception, ``finish`` runs, then it is
    raised. Commits still running go on; their leftovers are settled by
    the next session of the trial."""
    try:
        try:
            upload_errors = work.drain(wait=first_close)
        finally:
            work.close()  # the lanes' idle workers end
        if first_close:
            with ledger.lock:
                ledger.open_txn()  # raises once the session has ended
                recorder.settle()
    except BaseException as cut:
        _end(ledger, record, error if error is not None else cut, finish)
        raise
    upload_error = first_error(upload_errors)
    results_error = _end(ledger, record, error if error is not None else upload_error,
                         finish)
    if upload_error is not None:
        raise upload_error
    if results_error is not None:
        raise results_error


def _end(ledger: ReportLedger, record: Callable[[BaseException | None], None] | None,
         cause: BaseException | None, finish: Callable[[], None]) -> Exception | None:
    """Refuse later reports, write the last rows (and ``result.json``) under the
    lease, record ``cause``, then ``finish``, whatever happens; returns the
    rows' failure, not raised."""
    results_error: Exception | None = None
    try:
        # Inside the try: a signal's exception here still releases the lease.
        ledger.end()
        try:
            ledger.close_rows()
        except Exception as exc:
            results_error = exc
        if record is not None:
            record(cause)
    finally:
        finish()
    return results_error


def record_end(storage: StorageContext, error: BaseException | None) -> None:
    """Rank 0: record how the trial ended (``error.txt``, a runner's stop);
    a clean end clears an earlier run's error. Never raises."""
    clean = (error is None or isinstance(error, (TrialStopped, GeneratorExit))
             or (isinstance(error, SystemExit) and error.code in (0, None)))
    try:
        if isinstance(error, TrialStopped) and error.status is not None:
            storage.record_stop(error.status, error.reason or "")
        elif storage.read_stop() is not None:
            storage.clear_stop()  # this run ended otherwise
        if clean:
            storage.clear_error()
        else:
            assert error is not None
            storage.record_error(error)
    except Exception as exc:
        logging.getLogger("checkpoint_store.session._session").warning(
            "could not %s error.txt of %s: %s", "clear" if clean else "write",
            storage.uri(storage.trial_path), exc)
