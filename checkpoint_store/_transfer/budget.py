"""Memory accounting of a transfer: how many bytes of file data it may hold.

Owns the default limit (:data:`DEFAULT_MEMORY_LIMIT`, sized from the
machine's RAM) and :class:`_Budget`, the byte semaphore every thread of one
transfer (:mod:`checkpoint_store._transfer.plan`) takes its buffers' bytes from.
"""

from __future__ import annotations

import os

from checkpoint_store._util.locks import condition

__all__ = ["DEFAULT_MEMORY_LIMIT", "_Budget"]


def _default_memory_limit() -> int:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 * 1024**3
    return max(32 * 1024 * 1024, min(256 * 1024 * 1024, ram // 16))


#: Bytes of file data held in memory at once by one transfer (all its threads)
#: when the storage sets no ``memory_budget``: 256 MiB, at most 1/16 of RAM.
#: Enough for 8 streamed ranged GETs read 8 MiB at a time (S3), 8 ranged
#: GETs of 16 MiB (other stores) or 4 upload parts of 21 MiB in flight
#: (each counted twice or three times, see _REMOTE_COPIES), the point past
#: which more parallel requests stopped paying on S3 and Azure (docs/benchmarks.md).
DEFAULT_MEMORY_LIMIT = _default_memory_limit()


class _Budget:
    """A byte semaphore: at most ``limit`` bytes held at once (one oversize
    request is let through when nothing else is held)."""

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self._held = 0
        self._mutex, self._cond = condition()  # enter _mutex, not the condition

    def try_acquire(self, n: int) -> bool:
        with self._mutex:
            if self._held == 0 or self._held + n <= self.limit:
                self._held += n
                return True
            return False

    def acquire(self, n: int) -> None:
        with self._mutex:
            while not (self._held == 0 or self._held + n <= self.limit):
                self._cond.wait()
            self._held += n

    def release(self, n: int) -> None:
        with self._mutex:
            self._held -= n
            self._cond.notify_all()
