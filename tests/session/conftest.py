"""Helpers for the session tests: run N ranks as threads of this process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.stores import store  # noqa: F401  (fixtures: a storage root on each backend)


def run_ranks(n: int, fn: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank)`` for ``rank in range(n)`` in threads; return each result or
    the exception it raised (in rank order)."""
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


@pytest.fixture
def ranks():
    return run_ranks
