"""The ordered background queue behind ``CheckpointStoreIO(async_save=True)``."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Literal

from checkpoint_store._util.locks import OneWorker, condition

__all__ = ["_OrderedQueue"]

# The name the integration has always logged under, so filters set on it
# keep working now that it spans several modules.
logger = logging.getLogger("checkpoint_store.integrations._lightning")


class _OrderedQueue:
    """One worker thread runs saves and removes in the order they were asked for.

    Called from the training thread (``submit``, ``wait``, ``take_error``); the
    worker thread runs the jobs. After a save fails, later removes are skipped
    (the checkpoint a remove would make redundant may be the failed one), so
    the newest committed checkpoint is never removed for a save that did not
    happen. The worker ends when the queue is empty; the next submit starts one.

    The worker is joined by ``wait()`` and is not a daemon, so the interpreter
    waits for it before finalising. A daemon worker still dropping a queued
    snapshot's tensors when the process exits is killed by ``pthread_exit``
    inside torch's (noexcept) tensor destructor as it takes the GIL back,
    which aborts the process (``terminate called without an active
    exception``, SIGABRT). For the same reason each job, and the snapshot it
    holds, is released on the worker before the job is reported done.
    """

    def __init__(self, max_pending_saves: int):
        self._max = max_pending_saves
        self._mutex, self._cond = condition()  # enter _mutex, not the condition
        # Every job not done yet, the running one first. What is pending is
        # counted from it, never kept apart: a signal's exception in the
        # training thread can cut ``submit`` anywhere and skew no counter.
        self._jobs: deque[tuple[str, str, Callable[[], None]]] = deque()
        self._error: BaseException | None = None
        self._save_failed = False
        self._worker = OneWorker(self._run, "cs-lightning-io")

    def submit(self, kind: Literal["save", "remove"], key: str, job: Callable[[], None]) -> None:
        """Queue ``job``; a save blocks while ``max_pending_saves`` saves are queued."""
        with self._mutex:
            while kind == "save" and self._count("save", 0) >= self._max:
                self._worker.ensure()
                self._cond.wait()
            self._jobs.append((kind, key, job))
            self._worker.ensure()

    def _count(self, kind: str, field: int) -> int:
        return sum(1 for j in self._jobs if j[field] == kind)

    def _run(self) -> None:
        with self._mutex:
            if not self._worker.claim():
                return
        while True:
            with self._mutex:
                if not self._jobs:
                    self._worker.release()
                    self._cond.notify_all()
                    return
                kind, key, job = self._jobs[0]
                skip = kind == "remove" and self._save_failed
            if skip:
                logger.warning("not removing %s: an earlier checkpoint save failed", key)
            else:
                try:
                    job()
                except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                    logger.error("background checkpoint %s of %s failed: %s", kind, key, exc)
                    with self._mutex:
                        self._error = self._error or exc
                        self._save_failed |= kind == "save"
            job = None  # type: ignore[assignment]  # the deque's copy goes below
            with self._mutex:
                self._jobs.popleft()
                self._cond.notify_all()

    def wait(self, key: str | None = None) -> None:
        """Until every queued job (or every job for ``key``) has run; without
        ``key``, also until the worker thread has ended."""
        with self._mutex:
            while self._count(key, 1) if key is not None else self._jobs:
                self._worker.ensure()  # for a job whose submit a signal cut short
                self._cond.wait()
            thread = self._worker.last if key is None else None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def take_error(self) -> BaseException | None:
        """The first error of a job since the last call (each error is raised once)."""
        with self._mutex:
            error, self._error = self._error, None
            return error

    def reset(self) -> None:
        with self._mutex:
            self._save_failed = False
