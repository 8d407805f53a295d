"""Restore from the local tier: which of its copies verify (sizes and
CRC32C), newest first; a copy that fails is dropped from the tier.

:class:`TierVerification` is a part of :class:`~checkpoint_store.tiers.local.FastTier`
(a base class of it); it works on the tier's entries under the tier's
condition variable, as the rest of the class does.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from checkpoint_store._format.layout import checkpoint_dir_name
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import CheckpointCorruptError, CheckpointNotFoundError
from checkpoint_store.storage import StorageContext
from checkpoint_store.tiers.statefile import TierEntry

__all__ = ["TierVerification"]

logger = logging.getLogger("checkpoint_store.tiers.local")


class TierVerification:
    """Verification of the copies of :class:`~checkpoint_store.tiers.local.FastTier`."""

    storage: StorageContext
    _mutex: threading.RLock
    _cond: threading.Condition
    _entries: dict[int, TierEntry]
    _verified: set[int]

    if TYPE_CHECKING:
        def checkpoint(self, index: int) -> Checkpoint: ...

        def _save(self) -> None: ...

    def verified_indexes(self, above: int | None = None) -> list[int]:
        """Indexes of copies that verify (sizes and CRC32C), oldest first; those
        at or below ``above`` are not checked. A copy that fails is dropped from
        the tier (deleted, with a warning) and never listed again."""
        with self._mutex:
            todo = sorted(i for i in self._entries if above is None or i > above)
        good = []
        for index in todo:
            if self._verify(index):
                good.append(index)
        return good

    def newest_verified(self, above: int | None = None,
                        among: Iterable[int] | None = None) -> Checkpoint | None:
        """The newest copy above ``above`` (and in ``among``) that verifies,
        or None. Copies committed by this session count as verified; one that
        fails is dropped (see :meth:`verified_indexes`)."""
        allowed = None if among is None else set(among)
        with self._mutex:
            todo = sorted((i for i in self._entries
                           if (above is None or i > above)
                           and (allowed is None or i in allowed)), reverse=True)
        for index in todo:
            if self._verify(index):
                return self._handout(index)
        return None

    def _handout(self, index: int) -> Checkpoint:
        """The copy of ``index``, reporting back here when a read of it
        (``verify()``, ``load_state()``, ``to_directory()``) finds it damaged:
        it is dropped then, so it is never handed out again and the durable
        copy of the same index (or an older one) is restored instead."""
        ref = weakref.ref(self)

        def found(exc: CheckpointCorruptError) -> None:
            tier = ref()
            if tier is not None:
                tier._damaged(index, exc)

        return self.checkpoint(index)._report_corrupt_to(found)

    def _damaged(self, index: int, exc: CheckpointCorruptError) -> None:
        with self._mutex:
            if index not in self._entries:
                return
            self._verified.discard(index)
        warnings.warn(f"the local tier's copy {self.checkpoint(index).uri} failed a read "
                      f"({' '.join(str(exc).split())}); it is removed from the local tier: the "
                      "next get_checkpoint() returns the durable copy of that index when there "
                      "is one, else the newest older checkpoint", RuntimeWarning, stacklevel=4)
        self._drop(index)

    def _verify(self, index: int) -> bool:
        if index in self._verified:
            return index in self._entries
        ckpt = self.checkpoint(index)
        try:
            ckpt.verify()
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
            warnings.warn(f"skipping the local tier's copy {ckpt.uri}: it does not verify "
                          f"({exc}); it is removed from the local tier",
                          RuntimeWarning, stacklevel=3)
            self._drop(index)
            return False
        self._verified.add(index)
        return True

    def _drop(self, index: int) -> None:
        with self._mutex:
            self._entries.pop(index, None)
            self._save()
            self._cond.notify_all()
        try:
            self.storage.delete_checkpoint(checkpoint_dir_name(index))
        except Exception as exc:
            logger.warning("could not delete %s from the local tier: %s",
                           checkpoint_dir_name(index), exc)
