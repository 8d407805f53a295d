"""One job per local tier trial directory (checkpoint_store/tiers/lock.py).

Two jobs with their own storage paths and the default experiment/trial names,
started at the same moment on one ``LocalTier`` path, both passed the tier's
foreign-state check (it reads the state file; the state is written later)
and committed into one tier directory; a restart was then refused, or
resumed the other job's checkpoint. The tier's trial directory is now taken
by an OS file lock held for the session's life: the second job gets a
``TrialInUseError`` naming the first, and a killed job's lock goes with it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from checkpoint_store import Checkpoint, StorageContext, session
from checkpoint_store.errors import InvalidConfigError, TrialInUseError
from checkpoint_store.session import Session
from checkpoint_store.tiers import LocalTier

_REPO = str(Path(__file__).resolve().parents[2])


def _ckpt(root: Path, payload: bytes) -> Checkpoint:
    root.mkdir(parents=True, exist_ok=True)
    (root / "w.bin").write_bytes(payload)
    return Checkpoint.from_directory(str(root))


def _job(name: str, storage: str, tier: str, src: str, start: Any, done: Any, out: Any) -> None:
    """One job: wait for the other at ``start``, open a session on the shared
    tier, report once, and keep the session open until both have tried."""
    start.wait(60)
    try:
        with session.start(storage_path=storage, local_tier=LocalTier(tier)) as s:
            s.report({"job": name}, checkpoint=_ckpt(Path(src), name.encode() * 64))
            out.put((name, "ok", os.getpid()))
            done.wait(60)
    except TrialInUseError as exc:
        out.put((name, "refused", str(exc)))
        done.wait(60)


def test_two_jobs_started_at_once_on_one_tier_path(tmp_path):
    """The handed input: two processes released by one barrier; exactly one
    owns the tier directory, the other is refused with who holds it, and a
    restart of each resumes its own checkpoint only."""
    ctx = mp.get_context("spawn")
    start, done, out = ctx.Barrier(2), ctx.Barrier(2), ctx.Queue()
    tier = str(tmp_path / "fast")
    jobs = {n: ctx.Process(target=_job, args=(n, str(tmp_path / n), tier,
                                              str(tmp_path / f"src-{n}"), start, done, out))
            for n in ("A", "B")}
    for p in jobs.values():
        p.start()
    got = {}
    for _ in jobs:
        name, outcome, detail = out.get(timeout=120)
        got[name] = (outcome, detail)
    for p in jobs.values():
        p.join(60)
        assert p.exitcode == 0
    assert sorted(o for o, _ in got.values()) == ["ok", "refused"]
    winner = next(n for n, (o, _) in got.items() if o == "ok")
    loser = "B" if winner == "A" else "A"
    message = got[loser][1]
    assert f"process {got[winner][1]}" in message and winner in message
    assert "another path" in message
    # Only the winner's checkpoint is in the tier: the winner resumes it; the
    # loser's restart is told the directory is another job's (never resumes it).
    with session.start(storage_path=str(tmp_path / winner), local_tier=LocalTier(tier)) as s:
        with s.get_checkpoint().as_directory() as d:
            assert Path(d, "w.bin").read_bytes() == winner.encode() * 64
    with pytest.raises(InvalidConfigError, match="another path"):
        session.start(storage_path=str(tmp_path / loser), local_tier=LocalTier(tier))
    assert StorageContext(str(tmp_path / loser), "default", "default").committed_checkpoints() \
        == []


def test_a_second_session_in_one_process_is_refused_until_the_first_ends(tmp_path):
    """Found by myself: the same race inside one process (two sessions on two
    threads or one after another without closing): refused, then free."""
    tier = str(tmp_path / "fast")
    with session.start(storage_path=str(tmp_path / "A"), local_tier=LocalTier(tier)) as s:
        s.report({"x": 1}, checkpoint=_ckpt(tmp_path / "s1", b"a" * 8))
        with pytest.raises(TrialInUseError, match=f"process {os.getpid()}"):
            Session(StorageContext(str(tmp_path / "B"), "default", "default"),
                    local_tier=LocalTier(tier))
    # The first one ended: the lock is free again (for its own restart).
    with session.start(storage_path=str(tmp_path / "A"), local_tier=LocalTier(tier)) as s:
        assert s.get_checkpoint() is not None


_HOLDER = textwrap.dedent("""
    import sys, time
    from checkpoint_store import Checkpoint, session
    from checkpoint_store.tiers import LocalTier
    storage, tier, src, ready = sys.argv[1:5]
    with session.start(storage_path=storage, local_tier=LocalTier(tier)) as s:
        s.report({"x": 1}, checkpoint=Checkpoint.from_directory(src))
        open(ready, "w").close()
        time.sleep(600)
""")


def test_a_killed_jobs_lock_does_not_block_its_restart(tmp_path):
    """Found by myself: the holder is SIGKILLed; its restart takes the tier at once."""
    src = tmp_path / "src"
    _ckpt(src, b"k" * 16)
    ready = tmp_path / "ready"
    tier = str(tmp_path / "fast")
    env = dict(os.environ, PYTHONPATH=_REPO)
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "A"), tier,
                              str(src), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        # While it lives, another job is refused.
        with pytest.raises(TrialInUseError, match=f"process {child.pid}"):
            with session.start(storage_path=str(tmp_path / "B"), local_tier=LocalTier(tier)):
                pass
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    t0 = time.monotonic()
    with session.start(storage_path=str(tmp_path / "A"), local_tier=LocalTier(tier)) as s:
        ck = s.get_checkpoint()
        assert ck is not None and ck.internal_metadata["index"] == 0
    assert time.monotonic() - t0 < 30



def test_a_job_refused_before_the_holder_wrote_its_name_still_names_it(tmp_path):
    """Found by myself (the handed two-job test failed once under load): the
    holder writes ``.cs_tier_holder.json`` just after it takes the lock, so a
    job refused in between read no holder, or a dead one's. The refusal now
    waits briefly for a live holder's name."""
    import json
    import threading

    import filelock

    from checkpoint_store._format.layout import TIER_HOLDER_FILE, TIER_LOCK_FILE
    from checkpoint_store.tiers.lock import TierLock

    trial = tmp_path / "fast" / "default" / "default"
    trial.mkdir(parents=True)
    # A dead holder's file from an earlier job, as a kill leaves it.
    (trial / TIER_HOLDER_FILE).write_text(json.dumps(
        {"pid": 2**22 + 12345, "host": os.uname().nodename, "durable_uri": "file:///old",
         "since": 0}))
    held = filelock.FileLock(str(trial / TIER_LOCK_FILE), timeout=0)
    held.acquire()
    try:
        def name_it() -> None:
            time.sleep(0.3)
            (trial / TIER_HOLDER_FILE).write_text(json.dumps(
                {"pid": os.getpid(), "host": os.uname().nodename,
                 "durable_uri": "file:///live", "since": time.time()}))

        t = threading.Thread(target=name_it)
        t.start()
        with pytest.raises(TrialInUseError) as err:
            TierLock(str(trial), "file:///me")
        t.join()
        assert f"process {os.getpid()}" in str(err.value)
        assert "file:///live" in str(err.value) and "file:///old" not in str(err.value)
    finally:
        held.release()
