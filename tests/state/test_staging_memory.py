"""Memory stays bounded over many saves of a state larger than the staging
budget (state/_staging.py): the training process allocates nothing of the
state's size, and the persist process holds the staging area's pages and a
fixed amount of its own, save after save (benchmarks/bench_memory.py measures
the same at 2 GiB)."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

from checkpoint_store import Checkpoint
from checkpoint_store.state._staging import Stager

MiB = 1 << 20
BUDGET = 2 * MiB
SAVES = 10

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                                reason="reads Linux /proc")


def _status(pid: int) -> dict[str, int]:
    """RssAnon, RssShmem, ... of ``/proc/PID/status`` in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key.startswith("Rss"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def test_a_state_8x_the_budget_saved_10_times_keeps_both_processes_bounded(tmp_path):
    state = {f"w{i}": np.random.default_rng(i).random(MiB // 4, dtype=np.float64)
             for i in range(8)}  # 16 MiB: 8x the budget
    stager = Stager(BUDGET)
    anon, shmem = [], []
    traced_base = 0
    try:
        tracemalloc.start()
        try:
            for i in range(SAVES):
                for a in state.values():
                    a[i] += 1.0
                stager.stage(state, str(tmp_path / f"s{i}")).write_to()
                pid = stager.persist_pid
                assert pid is not None
                st = _status(pid)
                anon.append(st["RssAnon"])
                shmem.append(st["RssShmem"])
                if i == 0:  # imports and first-use set-up done: the baseline
                    tracemalloc.reset_peak()
                    traced_base, _ = tracemalloc.get_traced_memory()
            _, traced_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        stager.close()
    assert stager.peak_in_use <= BUDGET
    # The training process: no buffer of a piece's size (budget / 4), let
    # alone a tensor's or the state's.
    assert traced_peak - traced_base < BUDGET // 8
    # The persist process: the area's pages (at most the budget) and its own
    # interpreter, the same after the tenth save as after the second.
    assert max(shmem) <= BUDGET
    assert max(anon) + max(shmem) <= BUDGET + 64 * MiB
    assert anon[-1] - anon[1] <= MiB, [a // 1024 for a in anon]  # KiB after each save
    # What was saved last is the state as it was then.
    got = Checkpoint.from_directory(str(tmp_path / f"s{SAVES - 1}")).load_state()
    assert all(np.array_equal(got[k], v) for k, v in state.items())
