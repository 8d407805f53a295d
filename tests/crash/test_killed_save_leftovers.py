"""A save killed while it writes straight into ``checkpoint_<index>`` (a
state, sync or async; ``next_checkpoint_dir()``), on a local tier or on the
storage_path: the next run removes what it left, or numbers past it, and its
own save of the next step succeeds (issue 37, the fleet harness's
``child_error``: "'tensors-00001-of-00001.safetensors' exists there already").

Each run is a real process (forked from a forkserver); the kill is a real SIGKILL, sent by the
process to itself at the moment the files are written and the commit of the
index begins (``commit_in_place`` of the tier or the storage_path).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import numpy as np
import pytest

from checkpoint_store import Checkpoint, LocalTier, StorageContext, session

# Each kill is at a fixed line, not a moment: nothing here races the clock.
pytestmark = [pytest.mark.skipif(not hasattr(os, "fork"), reason="forks real processes"),
              pytest.mark.no_deadline]

TIER_CUT = "checkpoint_store.tiers.local:FastTier.commit_in_place"
DURABLE_CUT = "checkpoint_store.storage:StorageContext.commit_in_place"


def _die(*_a, **_k):
    os.kill(os.getpid(), signal.SIGKILL)


def _run(root: str, how: str, tier: bool, step: int, kill_at: str | None) -> None:
    """One run: resume, then save ``step`` (a state ``how`` = "sync"/"async",
    or "in_place": files written into ``next_checkpoint_dir()``)."""
    import importlib

    if kill_at is not None:
        mod, attr = kill_at.split(":")
        cls, meth = attr.split(".")
        setattr(getattr(importlib.import_module(mod), cls), meth, _die)
    local = LocalTier(os.path.join(root, "tier"), num_to_keep=1, fsync=False) if tier else None
    with session.start(storage_path=os.path.join(root, "s"), local_tier=local) as s:
        got = s.get_checkpoint()
        assert (got is None) == (step == 0)
        if how == "in_place":
            d = s.next_checkpoint_dir()
            with open(os.path.join(d, "w.bin"), "wb") as f:
                f.write(bytes([step]) * 1024)
            s.report({"step": step}, checkpoint=Checkpoint(d))
        else:
            s.report({"step": step}, state={"w": np.full(256, step, dtype=np.int64)},
                     upload_mode=how)
        s.wait()


def _child_main(root: str, how: str, tier: bool, step: int, kill_at: str | None,
                run_id: str | None) -> None:
    if run_id is not None:
        os.environ["CHECKPOINT_STORE_RUN_ID"] = run_id
    _run(root, how, tier, step, kill_at)


def _in_child(root: str, how: str, tier: bool, step: int, kill_at: str | None = None,
              run_id: str | None = None) -> int:
    # Forked from the forkserver (a fresh single-threaded process that
    # imported the package), never from pytest's own process: a fork of a
    # process whose earlier tests left threads running can hang in the child
    # on a lock one of them held.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["checkpoint_store", "numpy"])
    p = ctx.Process(target=_child_main, args=(root, how, tier, step, kill_at, run_id))
    p.start()
    p.join(120)
    if p.exitcode is None:
        p.kill()
        p.join()
        raise AssertionError(f"the run of step {step} did not end within 120 s")
    return p.exitcode


def _trial(root: str, where: str) -> str:
    return os.path.join(root, where, "default", "default")


def _ckpt_dirs(trial: str) -> list[str]:
    return sorted(n for n in os.listdir(trial) if n.startswith("checkpoint_"))


PATHS = [pytest.param(how, tier, id=f"{how}-{'tier' if tier else 'storage_path'}")
         for tier in (True, False) for how in ("sync", "async", "in_place")]


@pytest.mark.parametrize(("how", "tier"), PATHS)
@pytest.mark.parametrize("run_id", [None, "same-run"], ids=["forked", "same-run-id"])
def test_a_save_killed_inside_its_index_does_not_fail_the_next_run(tmp_path, how, tier,
                                                                     run_id):
    root = str(tmp_path)
    assert _in_child(root, how, tier, 0, run_id=run_id) == 0
    cut = TIER_CUT if tier else DURABLE_CUT
    assert _in_child(root, how, tier, 1, kill_at=cut, run_id=run_id) == -signal.SIGKILL
    where = _trial(root, "tier" if tier else "s")
    assert _ckpt_dirs(where)[-1] == "checkpoint_000001"  # the kill's leftover is there
    assert _in_child(root, how, tier, 1, run_id=run_id) == 0
    durable = StorageContext(os.path.join(root, "s"), "default", "default")
    steps = [m["metrics"]["step"] for _, m in durable.committed_checkpoints()]
    assert steps[-1] == 1
    unfinished = [n for n in _ckpt_dirs(where)
                  if not os.path.exists(os.path.join(where, n, ".internal_metadata.json"))]
    # Removed: the tier is locked for its session (every writer there is dead
    # at open); on the storage_path, another run's claim, or with one rank the
    # same run id's too (no other rank of this run can be writing it).
    assert unfinished == []
    rows = durable.read_results()
    its = [r["training_iteration"] for r in rows]
    assert [r["step"] for r in rows][-1] == 1 and its == sorted(set(its))


def test_a_foreign_directory_on_the_tier_is_kept_and_its_index_skipped(tmp_path):
    """Found by ourselves: a ``checkpoint_<index>`` directory with none of our
    traces (copied in by hand) is never deleted, and never written into."""
    root = str(tmp_path)
    assert _in_child(root, "sync", True, 0) == 0
    foreign = os.path.join(_trial(root, "tier"), "checkpoint_000001")
    os.makedirs(foreign)
    with open(os.path.join(foreign, "tensors-00001-of-00001.safetensors"), "wb") as f:
        f.write(b"not ours")
    assert _in_child(root, "sync", True, 1) == 0
    with open(os.path.join(foreign, "tensors-00001-of-00001.safetensors"), "rb") as f:
        assert f.read() == b"not ours"
    durable = StorageContext(os.path.join(root, "s"), "default", "default")
    assert [os.path.basename(c.path) for c, _ in durable.committed_checkpoints()] == \
        ["checkpoint_000000", "checkpoint_000002"]


def test_a_forked_process_is_another_run(tmp_path):
    """Found by ourselves: a child forked from a process that imported the
    package gets its own run id (else a dead child's leftovers look like the
    current run's to the next fork's cleanup, and stay for good)."""
    from checkpoint_store._util.ids import default_run_id

    parent = default_run_id()[0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.write(w, default_run_id()[0].encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(r, 100).decode()
    os.close(r)
    os.close(w)
    assert child and child != parent and default_run_id()[0] == parent
