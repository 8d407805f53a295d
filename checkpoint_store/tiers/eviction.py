"""The local tier's retention: eviction beyond ``num_to_keep`` and
``max_bytes``, the deletes off the report thread, and the backpressure of
:meth:`~checkpoint_store.tiers.local.FastTier.make_room`.

:class:`TierRetention` is a part of :class:`~checkpoint_store.tiers.local.FastTier`
(a base class of it); it works on the tier's entries under the tier's
condition variable, as the rest of the class does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from checkpoint_store._format.layout import checkpoint_dir_name
from checkpoint_store.retention.deletes import Deleter
from checkpoint_store.storage import StorageContext
from checkpoint_store.tiers.config import LocalTier
from checkpoint_store.tiers.statefile import TierEntry

__all__ = ["TierRetention"]

logger = logging.getLogger("checkpoint_store.tiers.local")


class TierRetention:
    """Eviction and backpressure of :class:`~checkpoint_store.tiers.local.FastTier`."""

    config: LocalTier
    storage: StorageContext
    blocked_s: float
    _mutex: threading.RLock
    _cond: threading.Condition
    _entries: dict[int, TierEntry]
    _verified: set[int]
    _evicting: set[int]
    # Evicting index -> the directory name its uncommit left (for the deleter).
    _tier_leftovers: dict[int, str]
    _deleter: Deleter

    if TYPE_CHECKING:
        @property
        def trial_dir(self) -> str: ...

        def _save(self) -> None: ...

    def make_room(self, nbytes: int, can_wait: Callable[[], bool] | None = None) -> float:
        """Backpressure: wait until ``nbytes`` more fit in ``max_bytes``.

        While they do not fit and a copy to the persistent tier is pending
        (``can_wait()`` says whether one is still running; default: any
        pending), waits for it; checkpoints the tier's retention may delete
        are deleted first (oldest first; never a pending one, nor the newest
        unless its durable copy is committed).
        When nothing more can be freed, returns anyway (with a warning): one
        checkpoint larger than the budget is still committed.

        Returns:
            Seconds spent waiting.
        """
        limit = self.config.max_bytes
        if limit is None:
            return 0.0
        t0 = time.perf_counter()
        waited = False
        while True:
            self._evict(extra=nbytes)
            self._deleter.wait()  # the budget counts bytes on disk: the deletes end first
            with self._mutex:
                used = sum(e.bytes for e in self._entries.values())
                if used + nbytes <= limit:
                    break
                busy = any(e.durable == "pending" for e in self._entries.values())
                if busy and (can_wait is None or can_wait()):
                    waited = True
                    self._cond.wait(0.5)
                    continue
            logger.warning("the local tier %s holds %d bytes; the next checkpoint (%d bytes) "
                           "goes over max_bytes=%d", self.trial_dir, used, nbytes, limit)
            break
        spent = time.perf_counter() - t0 if waited else 0.0
        self.blocked_s += spent
        return spent

    def _evict(self, extra: int = 0) -> list[int]:
        """Delete what this tier's retention no longer keeps: beyond the newest
        ``num_to_keep`` (fewer when ``extra`` more bytes must fit in
        ``max_bytes``), never a copy whose durable copy is pending, never the
        newest unless its durable copy is committed and room is needed. The
        state records the eviction first (the checkpoint leaves its entries,
        joins its ``"evicting"`` list), then the deleter thread deletes
        (:meth:`_delete_evicted`), off the report path; a kill in between
        leaves a directory the next start deletes.

        Returns:
            The indexes evicted by this call."""
        keep = self.config.num_to_keep
        limit = self.config.max_bytes
        with self._mutex:
            order = sorted(self._entries)
            newest = order[-keep:]
            protected = set(newest) | {i for i in order if self._entries[i].durable == "pending"}
            victims = [i for i in order if i not in protected]
            if limit is not None and extra:
                # Over the byte budget: older copies go too, oldest first; a
                # pending one never, and the newest only when its durable
                # copy is committed (never the last copy of a checkpoint).
                used = sum(e.bytes for i, e in self._entries.items() if i not in victims)
                for i in order:
                    if used + extra <= limit:
                        break
                    status = self._entries[i].durable
                    if i in victims or status == "pending" or (
                            i == order[-1] and status != "durable"):
                        continue
                    victims.append(i)
                    used -= self._entries[i].bytes
            evicted = sorted(set(victims))
            for i in evicted:
                self._entries.pop(i, None)
                self._verified.discard(i)
                self._evicting.add(i)
            if evicted:
                self._save()
                self._uncommit(evicted)
                self._cond.notify_all()
            due = bool(self._evicting)
        if due:  # also retries deletes that failed before
            self._deleter.kick()
        return evicted

    def _uncommit(self, evicted: list[int]) -> None:
        """Take the just evicted checkpoints out of every listing of the tier
        before the report that evicted them returns (the caller holds
        ``_cond``, the state already records them as evicting): one rename on
        the tier's local disk each. The deleter removes what is left; a kill
        in between leaves ``.cs_deleting`` directories the next start removes.
        A failed step is logged; the deleter's full delete retries it."""
        for i in evicted:
            try:
                left = self.storage.uncommit_checkpoint(checkpoint_dir_name(i))
            except Exception as exc:
                logger.warning("could not uncommit %s of the local tier (deleted later): %s",
                               checkpoint_dir_name(i), exc)
                continue
            if left is not None:
                self._tier_leftovers[i] = left

    def _delete_evicted(self) -> None:
        """The deleter thread's round: delete the evicted checkpoints (or what
        :meth:`_uncommit` left of them), then drop them from the state's
        ``"evicting"`` list. A failed delete is logged and retried at the next
        eviction (or the next start)."""
        with self._mutex:
            todo = sorted(self._evicting)
            left = {i: self._tier_leftovers[i] for i in todo if i in self._tier_leftovers}
        done = []
        for i in todo:
            try:
                if i in left:
                    self.storage.remove_leftover(left[i])
                else:
                    self.storage.delete_checkpoint(checkpoint_dir_name(i))
            except Exception as exc:
                logger.warning("could not delete %s from the local tier (retried at the next "
                               "eviction): %s", checkpoint_dir_name(i), exc)
                continue
            done.append(i)
        if done:
            with self._mutex:
                self._evicting.difference_update(done)
                for i in done:
                    self._tier_leftovers.pop(i, None)
                self._save()

    def wait_deletes(self, timeout: float | None = None) -> bool:
        """Wait for the deletes of evicted checkpoints scheduled so far.

        Returns:
            True when none is running, False after ``timeout`` seconds.
        """
        return self._deleter.wait(timeout)
