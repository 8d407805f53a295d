"""Long library transfers say at INFO what moved, how much, how long and how
fast: a state's background commit and the wait() for it, load_state() (also
from S3), to_directory(); quick ones stay silent."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from checkpoint_store import StorageContext, session
from checkpoint_store._util import transferlog

_LINE = re.compile(r": 8\.0 MiB in \d+\.\d\d s \(\d+(\.\d)? [KMG]?i?B/s\)$")


def _info(caplog, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.INFO and r.getMessage().startswith(start)]


def _save_and_load(storage_path: str, options: dict | None, tmp_path) -> None:
    state = {"model": {"w": np.ones((8, 1024, 1024), dtype=np.uint8)}, "step": 3}
    with session.start(storage_path=storage_path, experiment_name="e", trial_name="t",
                       storage_options=options):
        session.report({"loss": 1.0}, state=state)
        session.wait()
    [(ckpt, _)] = StorageContext(storage_path, "e", "t",
                                 storage_options=options).committed_checkpoints()
    assert ckpt.load_state()["step"] == 3
    ckpt.to_directory(tmp_path / "down")


@pytest.mark.parametrize("where", ["local", "s3"])
def test_long_transfers_log_size_rate_and_duration(where, tmp_path, caplog, monkeypatch,
                                                   request) -> None:
    monkeypatch.setattr(transferlog, "LONG_S", 0.0)  # every transfer counts as long here
    if where == "s3":
        loc = request.getfixturevalue("s3_location")
        storage_path, options = loc.uri, loc.storage_options
    else:
        storage_path, options = str(tmp_path / "store"), None
    with caplog.at_level(logging.INFO, logger="checkpoint_store"):
        _save_and_load(storage_path, options, tmp_path)
    [commit] = _info(caplog, "commit ")
    assert "/e/t/checkpoint_000000: 8.0 MiB in " in commit and _LINE.search(commit), commit
    [wait] = _info(caplog, "wait for background saves")
    assert re.search(r": \d+\.\d\d s$", wait), wait
    [load] = _info(caplog, "load_state ")
    assert _LINE.search(load), load
    [down] = [m for m in _info(caplog, "download ") if " MiB in " in m]
    assert _LINE.search(down), down


def test_quick_transfers_stay_silent(tmp_path, caplog) -> None:
    assert transferlog.LONG_S == 1.0
    state = {"w": np.zeros(16, dtype=np.float32)}
    with caplog.at_level(logging.INFO, logger="checkpoint_store"):
        with session.start(storage_path=str(tmp_path / "s"), experiment_name="e",
                           trial_name="t"):
            session.report({"loss": 1.0}, state=state)
            session.wait()
        [(ckpt, _)] = StorageContext(str(tmp_path / "s"), "e", "t").committed_checkpoints()
        ckpt.load_state()
    assert not [m for m in (r.getMessage() for r in caplog.records)
                if " in " in m and "/s)" in m]


def test_sizes_read_as_people_write_them() -> None:
    assert transferlog.fmt_bytes(512) == "512 B"
    assert transferlog.fmt_bytes(256 << 20) == "256.0 MiB"
    assert transferlog.fmt_bytes(3 << 30) == "3.0 GiB"
