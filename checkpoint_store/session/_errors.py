"""Errors and signals of the session layer (multi-rank commits, trial runners)."""

from __future__ import annotations

from checkpoint_store.errors import CheckpointStoreError


class RankTimeoutError(CheckpointStoreError, TimeoutError):
    """A multi-rank wait ran out of time: some ranks never wrote their part.

    Raise ``sync_timeout_s`` in :func:`checkpoint_store.session.start` if the
    ranks are only slow; otherwise look at the missing ranks' logs.

    Attributes:
        missing_ranks: the ranks that had not finished, sorted.
        index: the checkpoint index waited for, or None for the run start.
    """

    def __init__(self, message: str, *, missing_ranks: list[int], index: int | None = None):
        super().__init__(message)
        self.missing_ranks = list(missing_ranks)
        self.index = index


class CheckpointAbortedError(CheckpointStoreError):
    """A multi-rank checkpoint was not committed because some rank failed.

    Raised on the ranks that did not fail themselves (a failing rank raises
    its own error). Nothing of that index is committed; the next report with
    a checkpoint uses the next index.

    Attributes:
        index: the checkpoint index that was abandoned.
        failed_ranks: the ranks that reported a failure, sorted.
    """

    def __init__(self, message: str, *, index: int, failed_ranks: list[int]):
        super().__init__(message)
        self.index = index
        self.failed_ranks = list(failed_ranks)


class TrialStopped(BaseException):
    """Raised inside ``train_fn`` by ``report()`` when its trial was stopped or paused.

    It derives from ``BaseException`` (like ``KeyboardInterrupt``) so that an
    ``except Exception:`` in user code does not swallow it: the function
    unwinds, its ``finally`` blocks run, and the trial runner ends the thread
    quietly. Do not catch it.
    """
