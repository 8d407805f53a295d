"""Staging messages travel to the persist process in batches (state/_persist.py's
protocol): one socket message per stage while the state fits in the area,
one per flush while it does not, and the files are the same either way."""

from __future__ import annotations

import numpy as np

from checkpoint_store import Checkpoint
from checkpoint_store.state._persist import PersistProcess
from checkpoint_store.state._staging import Stager

MiB = 1 << 20


def _counting(monkeypatch) -> list[int]:
    """The number of messages in each batch sent to a persist process."""
    sizes: list[int] = []
    real = PersistProcess.send

    def send(self, msgs):
        sizes.append(len(msgs))
        return real(self, msgs)

    monkeypatch.setattr(PersistProcess, "send", send)
    return sizes


def test_a_state_that_fits_is_one_batch(tmp_path, monkeypatch):
    sizes = _counting(monkeypatch)
    state = {f"w{i}": np.full(1000, i, dtype=np.float32) for i in range(40)}
    stager = Stager(4 * MiB)
    try:
        stager.stage(state, str(tmp_path / "s")).write_to()
    finally:
        stager.close()
    assert sizes == [42]  # open, 40 writes, close
    got = Checkpoint.from_directory(str(tmp_path / "s")).load_state()
    assert all(np.array_equal(got[k], v) for k, v in state.items())


def test_a_state_larger_than_the_area_is_sent_as_it_drains(tmp_path, monkeypatch):
    sizes = _counting(monkeypatch)
    state = {f"w{i}": np.random.default_rng(i).random(MiB // 8) for i in range(6)}  # 6 MiB
    stager = Stager(2 * MiB, piece_bytes=MiB // 2)
    try:
        stager.stage(state, str(tmp_path / "s")).write_to()
    finally:
        stager.close()
    assert len(sizes) > 1 and sum(sizes) == 1 + 12 + 1  # open, 12 pieces, close
    got = Checkpoint.from_directory(str(tmp_path / "s")).load_state()
    assert all(np.array_equal(got[k], v) for k, v in state.items())
