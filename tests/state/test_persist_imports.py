"""The persist process (state/_persist.py) loads only what writing staged
bytes needs: no pyarrow, numpy or torch, whose libraries would count in its
memory (bounded by budget + 64 MiB, benchmarks/bench_memory.py)."""

from __future__ import annotations

import re

import numpy as np

from checkpoint_store import Checkpoint
from checkpoint_store.state._staging import Stager

MiB = 1 << 20
HEAVY = ("pyarrow", "numpy", "torch")


def test_the_persist_process_imports_neither_pyarrow_nor_numpy_nor_torch(
        tmp_path, monkeypatch, capfd):
    # The real process, started as a save starts it, reports every module it
    # imports (CPython's -X importtime, read from its environment) on the
    # stderr it inherits; it is read once the process has exited.
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    capfd.readouterr()
    state = {"w": np.arange(MiB, dtype=np.float32), "step": 3}
    stager = Stager(MiB)  # a quarter of the state: the area is reused
    try:
        stager.stage(state, str(tmp_path / "s")).write_to()
        assert stager.persist_pid is not None
    finally:
        stager.close()
    imported = re.findall(r"^import time:\s*\d+ \|\s*\d+ \|\s*(\S+)$",
                          capfd.readouterr().err, re.MULTILINE)
    # The process itself (run as __main__) is not listed; its package and
    # the writer it imported to write are.
    assert "checkpoint_store.state" in imported
    assert "checkpoint_store.state._files" in imported
    heavy = [m for m in imported if m.split(".")[0] in HEAVY]
    assert heavy == [], heavy
    got = Checkpoint.from_directory(str(tmp_path / "s")).load_state()
    assert np.array_equal(got["w"], state["w"]) and got["step"] == 3
