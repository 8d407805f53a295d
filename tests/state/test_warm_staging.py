"""``UploadConfig.warm_staging``: the staging area and its persist process are
ready before the first ``report(state=...)`` where a save is expected."""

from __future__ import annotations

import time

import numpy as np
import pytest

from checkpoint_store import StorageContext, session
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.testing import session_internals

MiB = 1 << 20


def _state(step: int) -> dict:
    return {"w": np.full(2 * MiB // 4, step, dtype=np.float32), "step": step}


def _persist_pid(s: session.Session, timeout: float = 20.0) -> int | None:
    stager = session_internals(s).pipeline.staging._stager
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stager is not None and stager.persist_pid is not None:
            return stager.persist_pid
        time.sleep(0.02)
        stager = session_internals(s).pipeline.staging._stager
    return None


def _start(tmp_path, warm=None, budget=64 * MiB):
    return session.start(storage_path=str(tmp_path / "store"), experiment_name="e",
                         trial_name="t", upload_config=session.UploadConfig(
                             staging_budget=budget, warm_staging=warm))


@pytest.mark.parametrize("value", [1, "yes", 0.5])
def test_warm_staging_takes_none_true_or_false(value):
    with pytest.raises(InvalidConfigError, match="warm_staging"):
        session.UploadConfig(warm_staging=value)


def test_a_new_trial_starts_no_persist_process_until_its_first_state(tmp_path):
    with _start(tmp_path) as s:
        s.report({"step": 0})
        assert session_internals(s).pipeline.staging._stager is None
        s.report({"step": 1}, state=_state(1))
        assert _persist_pid(s) is not None


def test_warm_staging_true_starts_the_persist_process_and_faults_the_area(tmp_path):
    with _start(tmp_path, warm=True, budget=32 * MiB) as s:
        pid = _persist_pid(s)
        assert pid is not None and _alive(pid)
        stager = session_internals(s).stager
        area_pages = stager._area  # the training process's mapping of the area
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _resident(area_pages) < 31 * MiB:
            time.sleep(0.05)
        assert _resident(area_pages) >= 31 * MiB
        s.report({"step": 1}, state=_state(1))
        s.wait()
        assert _persist_pid(s) == pid  # the warm process wrote it
    assert not _alive(pid)  # ended with the session
    ctx = StorageContext(str(tmp_path / "store"), "e", "t")
    assert [m["metrics"]["step"] for _, m in ctx.committed_checkpoints()] == [1]


def test_a_restart_of_a_state_trial_warms_for_its_size(tmp_path):
    with _start(tmp_path, budget=64 * MiB) as s:
        s.report({"step": 1}, state=_state(1))
    with _start(tmp_path, budget=64 * MiB) as s:
        assert _persist_pid(s) is not None  # before any report
        stager = session_internals(s).stager
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _resident(stager._area) < 2 * MiB:
            time.sleep(0.05)
        assert 2 * MiB <= _resident(stager._area) < 16 * MiB  # the state's size, not the budget
        assert int(s.get_checkpoint().load_state()["step"]) == 1
        s.report({"step": 2}, state=_state(2))
    with _start(tmp_path, warm=False) as s:
        time.sleep(0.2)
        assert session_internals(s).pipeline.staging._stager is None


def test_a_restart_on_ranks_warms_each_rank_for_its_share(tmp_path, ranks):
    """Saved on 2 ranks (an 8 MiB tensor split by rows), resumed on 2: each
    rank's persist process runs before any report, and each rank faults
    about half the state, not the whole state nor the budget."""

    def start(r: int, attempt: str):
        return session.start(storage_path=str(tmp_path / "store"), experiment_name="e",
                             trial_name="t", world_rank=r, world_size=2, attempt_id=attempt,
                             sync_timeout_s=30, upload_config=session.UploadConfig(
                                 staging_budget=64 * MiB))

    state = {"w": np.arange(8 * MiB // 4, dtype=np.float32).reshape(2048, -1), "step": 1}

    def save(r: int) -> None:
        with start(r, "a1") as s:
            s.report({"step": 1}, state=state)

    def resume(r: int) -> tuple[bool, int]:
        with start(r, "a2") as s:
            started = _persist_pid(s) is not None  # before any report
            stager = session_internals(s).stager
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and _resident(stager._area) < 4 * MiB:
                time.sleep(0.05)
            resident = _resident(stager._area)
            s.report({"step": 2}, state=state)
            return started, resident

    assert ranks(2, save) == [None, None]
    got = ranks(2, resume)
    for started, resident in got:
        assert started, got
        assert 4 * MiB <= resident < 6 * MiB, got  # its half of 8 MiB, not all of it


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _resident(area) -> int:
    """Bytes of ``area`` whose pages are in memory (mincore(2))."""
    import ctypes
    import mmap

    if area is None:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    size = len(area)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    buf = (ctypes.c_char * size).from_buffer(area)
    try:
        addr = ctypes.addressof(buf)
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(v & 1 for v in vec) * mmap.PAGESIZE
    finally:
        del buf
