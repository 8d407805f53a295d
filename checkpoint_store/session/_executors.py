"""When a report's commit runs: inline, or on one of a session's two
background lanes, with one error channel for both.

- ``"durable"``: commits to the storage_path (``upload_mode="async"``, state
  reports, a local tier's durable copies), one at a time in report order;
  bounded by ``max_pending_uploads``.
- ``"local"``: a local tier's commits of staged states, so a slow durable
  copy never holds staging memory.

An error of either lane is raised once, by the next report of any kind,
:meth:`BackgroundWork.wait` or the end of the session (as DCP's and Orbax's
async savers raise the previous save's error at the next save). An inline
commit first waits for both lanes (:meth:`BackgroundWork.admit`): commits
keep report order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Literal

from checkpoint_store._results.writer import finish_before_exit_flush
from checkpoint_store.session._uploads import BackgroundUploader, first_error

__all__ = ["BackgroundWork", "Lane"]

Lane = Literal["local", "durable"]
# The local lane first: its jobs queue durable copies.
_ORDER: tuple[Lane, ...] = ("local", "durable")

# The Session's logger: its records keep the name they always had.
_logger = logging.getLogger("checkpoint_store.session._session")


class BackgroundWork:
    """The session's background lanes (made on first use) and their errors.

    Args:
        max_pending: ``UploadConfig.max_pending_uploads`` (the durable lane's bound).
        at_exit: called at interpreter exit, before the rows are flushed,
            for a session never ended (:func:`finish_before_exit_flush`).
    """

    def __init__(self, max_pending: int, at_exit: object):
        self._max_pending = max_pending
        self._at_exit = at_exit
        self._lanes: dict[Lane, BackgroundUploader] = {}

    def lane(self, lane: Lane) -> BackgroundUploader:
        found = self._lanes.get(lane)
        if found is None:
            found = BackgroundUploader(self._max_pending if lane == "durable" else 1)
            self._lanes[lane] = found
            # A process that exits without ending the session still commits them.
            finish_before_exit_flush(self._at_exit)
        return found

    @property
    def uploader(self) -> BackgroundUploader | None:
        """The durable lane, if one was started."""
        return self._lanes.get("durable")

    def pending(self) -> int:
        return sum(up.pending for up in self._lanes.values())

    def durable_busy(self) -> bool:
        up = self._lanes.get("durable")
        return up is not None and up.pending > 0

    def raise_errors(self) -> None:
        """Raise the first error of a finished background job, once (local lane first)."""
        for name in _ORDER:
            up = self._lanes.get(name)
            if up is not None:
                up.raise_error()

    def take_error(self) -> BaseException | None:
        """The first error of a finished background job, taken once (local lane
        first; the others logged), or None."""
        errors: list[tuple[str, BaseException]] = []
        for name in _ORDER:
            up = self._lanes.get(name)
            if up is not None:
                errors += up.take_errors()
        return first_error(errors)

    def admit(self, reserve: Lane | None, after: tuple[Lane, ...]) -> None:
        """Before a report's commit: wait for a free slot on the lane ``reserve``
        (``max_pending_uploads``), and until every job queued on the lanes
        ``after`` is done (an inline commit after the queued ones: commits
        keep report order). Then raise the error of a job that just finished."""
        if reserve is not None:
            self.lane(reserve).reserve()
        for name in after:
            up = self._lanes.get(name)
            if up is not None:
                up.wait()
        self.raise_errors()

    def prefer_newest(self) -> None:
        """Run the durable lane's queued copies newest first from now on (a
        preemption signal; one rank only: see
        :meth:`BackgroundUploader.prefer_newest`)."""
        up = self._lanes.get("durable")
        if up is not None:  # else nothing is queued yet
            up.prefer_newest()

    def wait_queued(self) -> None:
        """Wait until every queued job of every lane is done, raising nothing
        (several ranks: errors are published at the next rendezvous)."""
        for name in _ORDER:
            up = self._lanes.get(name)
            if up is not None:
                up.wait()

    def submit(self, lane: Lane, run: Callable[[], object], cleanup: Callable[[], None],
               what: str) -> None:
        """Queue ``run`` (then ``cleanup``, whatever happens) on ``lane``; never blocks."""
        self.lane(lane).submit(run, cleanup, what)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for both lanes, then raise their first error.

        Raises:
            TimeoutError: jobs still pending after ``timeout`` seconds.
        """
        local = self._lanes.get("local")
        if local is not None:
            local.wait(timeout)  # staged local commits queue the durable copies
            local.raise_error()
        up = self._lanes.get("durable")
        if up is not None:
            if not up.wait(timeout):
                raise TimeoutError(
                    f"{up.pending} checkpoint upload(s) still pending after {timeout} s")
            up.raise_error()

    def drain(self, wait: bool = True) -> list[tuple[str, BaseException]]:
        """Wait for every job (the local lane first: it queues durable copies),
        then take their errors: ``(checkpoint_dir_name, exception)``, each
        checkpoint not committed."""
        errors: list[tuple[str, BaseException]] = []
        for name in _ORDER:
            up = self._lanes.get(name)
            if up is None:
                continue
            if wait:
                up.wait()
            errors += up.take_errors()
        return errors

    def close(self) -> None:
        """The session ended: each lane's worker ends once its queue is empty
        (:meth:`BackgroundUploader.close`)."""
        for up in self._lanes.values():
            up.close()

    def finish_at_exit(self, ended: bool, where: str) -> list[tuple[str, BaseException]]:
        """At the exit of a process that never ended its session: commit what is
        pending (each job bounded by the retry policy); the errors, to be logged."""
        up = self._lanes.get("durable")
        if ended or up is None or up.pid != os.getpid():
            return []  # ended; or a forked child, whose parent owns the uploads
        if self.pending():
            _logger.warning(
                "the session of %s was not ended (session.end(), or `with "
                "session.start(...)`); finishing its %d pending checkpoint upload(s) "
                "before the process exits", where, self.pending())
        return self.drain()


def first_background_error(errors: list[tuple[str, BaseException]]) -> BaseException | None:
    """The first of ``errors`` (:meth:`BackgroundWork.drain`), the others logged."""
    return first_error(errors)
