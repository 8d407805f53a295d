"""Deletes of evicted checkpoints off the training loop: one deleter thread per manager.

Retention decides in :meth:`CheckpointManager.register`; the delete itself
(2,000 files of a checkpoint cost 0.2–1 s on a local disk or in memory, and
one request per file batch on object stores) need not happen before
``report()`` returns. The manager records the eviction in its state first
(``pending_deletes``), then hands the names to a :class:`Deleter`, which
deletes them in the background, one directory after another
(:func:`delete_evicted`, also used when the deletes run inline), and records
them deleted. What makes it crash-safe is the order, not the thread:

* the eviction is in the retention state before any byte is deleted, so
  an evicted checkpoint is never ranked, resumed from or listed as kept
  again, and the next manager (:meth:`CheckpointManager._restore`) resumes
  the deletes still pending;
* each delete is the commit in reverse (:meth:`StorageContext.delete_checkpoint`):
  renamed away in one step on local disks, marker first elsewhere, so a kill
  mid-delete leaves a directory that is not a checkpoint and that the next
  session's cleanup (:meth:`StorageContext.remove_uncommitted`) removes;
* with background deletes, that first step runs before ``register`` (and so
  ``report()``) returns (:func:`uncommit_evicted`): every reader then lists
  exactly the kept set, and only the files of what is already not a
  checkpoint are left to the thread.

A delete that fails is logged and stays pending: retried by the next
registration, :meth:`CheckpointManager.retry_deletes` or the next manager.
:meth:`Deleter.wait` (``session.wait()``, the end of a session, the
manager's ``close()``) waits for the deletes scheduled so far.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Callable, Mapping
from typing import Any

from checkpoint_store._util.inspect import read_internal_metadata
from checkpoint_store._util.locks import OneWorker, condition
from checkpoint_store.storage import StorageContext

__all__ = ["Deleter", "delete_evicted", "uncommit_evicted"]

logger = logging.getLogger(__name__)
# The manager's logger: a delete's warnings keep the name they always had.
_manager_logger = logging.getLogger("checkpoint_store.retention.manager")


def delete_evicted(storage: StorageContext, name: str,
                   is_ours: Callable[[Mapping[str, Any]], bool], foreign: list[str],
                   leftover: str | None = None) -> bool:
    """Delete one evicted checkpoint ``name`` of ``storage``'s trial; False
    (logged) to retry it later. True also when its internal metadata now
    names another run (``is_ours`` says no): then it is appended to
    ``foreign`` and left alone for good. Never raises for a failed delete.

    Args:
        leftover: what :func:`uncommit_evicted` left of ``name`` (a directory
            name of the trial): removed instead, no questions asked.
    """
    try:
        if leftover is not None:
            storage.remove_leftover(leftover)
        elif _is_foreign(storage, name, is_ours, foreign):
            return True
        else:
            storage.delete_checkpoint(name)
    except Exception as exc:  # never fail a report for a delete
        _manager_logger.warning("could not delete %s (retried at the next report): %s",
                                name, exc)
        return False
    _collect_chunks(storage)
    return True


def _collect_chunks(storage: StorageContext) -> None:
    """After an eviction: free the chunks no checkpoint of the experiment uses
    any more. A failure is logged and left to the next eviction's collection
    (garbage, never a missing chunk)."""
    try:
        report = storage.collect_chunks()
    except Exception as exc:  # never fail a report for garbage collection
        _manager_logger.warning("could not collect unused chunks (retried at the next "
                                "eviction or by `checkpoint-store gc`): %s", exc)
        return
    if report is not None and report.deleted:
        logger.info("freed %d unused chunk(s), %d bytes", len(report.deleted),
                    report.bytes_freed)


def uncommit_evicted(storage: StorageContext, name: str,
                     is_ours: Callable[[Mapping[str, Any]], bool],
                     foreign: list[str]) -> str | None:
    """Take the evicted checkpoint ``name`` out of every listing now
    (:meth:`StorageContext.uncommit_checkpoint`), so that when ``report()``
    returns every reader sees exactly the kept set; its files are deleted
    later by :func:`delete_evicted` with the name returned.

    Returns:
        The directory name left to remove; None when there is nothing to
        uncommit (absent, now another run's: appended to ``foreign``) or the
        step failed (logged; the full delete retries it later).
    """
    try:
        if _is_foreign(storage, name, is_ours, foreign):
            return None
        return storage.uncommit_checkpoint(name)
    except Exception as exc:  # never fail a report for a delete
        _manager_logger.warning("could not uncommit %s (deleted later): %s", name, exc)
        return None


def _is_foreign(storage: StorageContext, name: str,
                is_ours: Callable[[Mapping[str, Any]], bool], foreign: list[str]) -> bool:
    """True (logged, appended to ``foreign``) when ``name``'s internal metadata
    now names another run: replaced since we evicted it, left alone for good."""
    meta = read_internal_metadata(storage.filesystem, posixpath.join(storage.trial_path, name))
    if meta is None or is_ours(meta):
        return False
    _manager_logger.warning("not deleting %s: it now belongs to run %r",
                            name, meta.get("run_id"))
    if name not in foreign:
        foreign.append(name)
    return True


class Deleter:
    """Runs ``run_once`` on a background thread each time :meth:`kick` asks for it.

    Args:
        run_once: deletes what is due; returns once it tried every name it took.
            Never raises for a failed delete (it logs); an exception it does
            raise is logged here and the thread goes on with the next kick.
        name: the thread's name.

    Kicks while a round runs coalesce into one more round. The thread ends
    whenever nothing is due, so an idle deleter keeps no process alive.
    """

    def __init__(self, run_once: Callable[[], None], name: str = "checkpoint-store-delete"):
        self._run_once = run_once
        self._mutex, self._cond = condition()  # enter _mutex, not the condition
        self._due = False
        self._busy = False
        self._worker = OneWorker(self._loop, name)
        #: Rounds run, and seconds spent deleting (for benchmarks and logs).
        self.rounds = 0
        self.busy_s = 0.0
        #: Unexpected errors of a round (a failed delete is not one: it logs and stays
        #: pending), as logged; the newest last.
        self.errors: list[BaseException] = []

    @property
    def idle(self) -> bool:
        """True when no round is due or running."""
        with self._mutex:
            return not (self._due or self._busy)

    def kick(self) -> None:
        """Ask for a round; never blocks."""
        with self._mutex:
            self._due = True
            self._worker.ensure()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no round is due or running.

        Returns:
            True when idle, False after ``timeout`` seconds.
        """
        if self._worker.running_here():
            return True  # a round asking for itself: it is running
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._mutex:
            while self._due or self._busy:
                if self._due:  # a worker for a round whose kick a signal cut short
                    self._worker.ensure()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _loop(self) -> None:
        with self._mutex:
            if not self._worker.claim():
                return
        while True:
            with self._mutex:
                if not self._due:
                    self._worker.release()
                    self._cond.notify_all()
                    return
                self._due = False
                self._busy = True
            t0 = time.perf_counter()
            try:
                self._run_once()
            except BaseException as exc:  # the names stay pending: retried later
                logger.exception("background delete of evicted checkpoints failed")
                self.errors.append(exc)
            finally:
                with self._mutex:
                    self.rounds += 1
                    self.busy_s += time.perf_counter() - t0
                    self._busy = False
                    self._cond.notify_all()
