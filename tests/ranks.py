"""Ranks as threads of this process, for tests of multi-rank code that meets
through storage (markers, polls) rather than a process group.

``run_ranks(n, fn)`` is the one helper; the ``ranks`` fixture
(tests/conftest.py) hands it to tests that take it as an argument.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def run_ranks(n: int, fn: Callable[[int], Any], timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank)`` for ``rank in range(n)``, each in its own thread, all
    at once; return each rank's result or the exception it raised, in rank
    order. Fails the test if a rank has not finished within ``timeout``
    seconds (each join waits at most that long)."""
    out: list[Any] = [None] * n

    def target(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as exc:  # collected for the test to inspect
            out[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), name=f"rank-{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), f"{t.name} did not finish within {timeout}s"
    return out
