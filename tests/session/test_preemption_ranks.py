"""Two ranks as real processes, a SIGTERM to one of them or to both at
different steps: every rank saves the same checkpoint index, marked as a
preemption checkpoint, the trial is recorded as preempted, every process exits
with the configured code, and a rank that is gone never holds the other past
the grace period. With a torch.distributed process group (gloo) and through
storage alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from checkpoint_store import StorageContext, session

CODE = 42  # PreemptionConfig(exit_code=...)

WORKER = textwrap.dedent("""
    import json, os, signal, sys, tempfile, time
    mode, rank, store, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    plan = json.loads(sys.argv[5])
    kw = {}
    if mode == "group":
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://" + out + "/pg-" + plan["run"],
                                rank=rank, world_size=2)
    else:
        kw["attempt_id"] = plan["run"]
    from checkpoint_store import Checkpoint, LocalTier, PreemptionConfig, session
    if plan.get("tier"):  # a local tier that never copies to the storage_path by itself
        kw["local_tier"] = LocalTier(os.path.join(out, "tier-" + plan["run"], f"node{rank}"),
                                     persist=lambda index, metrics: False)
    result = {"rank": rank, "reports": [], "reached": None}

    def dump():
        with open(os.path.join(out, f"{plan['run']}-rank{rank}.json"), "w") as f:
            json.dump(result, f)

    try:
        with session.start(storage_path=store, experiment_name="e", trial_name="t",
                           world_rank=rank, world_size=2, sync_timeout_s=60,
                           preemption=PreemptionConfig(grace_period_s=plan["grace"],
                                                       exit_code=42), **kw) as s:
            start = s.get_checkpoint()
            if start is not None:
                with start.as_directory() as d:
                    shard = open(os.path.join(d, f"shard_{rank}.txt")).read()
                result["resumed"] = [start.internal_metadata["index"], shard]
            for step in range(plan["steps"]):
                time.sleep(0.02)  # the step's work
                if plan["signal"].get(str(rank)) == step:
                    result["signalled"] = time.time()
                    os.kill(os.getpid(), signal.SIGTERM)
                if plan["die"].get(str(rank)) == step:
                    dump()
                    os._exit(7)  # this rank is gone (no report, no goodbye)
                if session.reached_preemption() and result["reached"] is None:
                    result["reached"] = step
                with tempfile.TemporaryDirectory() as tmp:
                    with open(os.path.join(tmp, f"shard_{rank}.txt"), "w") as f:
                        f.write(str(step))
                    result["reports"].append(step)
                    session.report({"step": step}, checkpoint=Checkpoint.from_directory(tmp))
    except SystemExit as exc:
        result["exit"] = [type(exc).__name__, exc.code, time.time(),
                          type(exc.__cause__).__name__ if exc.__cause__ else None]
        raise
    finally:
        dump()
        if mode == "group":
            dist.destroy_process_group()
""")


def _launch(mode, store, out, run, *, steps=8, signal=None, die=None, grace=20.0, tier=False):
    plan = {"run": run, "steps": steps, "signal": signal or {}, "die": die or {},
            "grace": grace, "tier": tier}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, mode, str(r), str(store), str(out),
                               json.dumps(plan)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    codes = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        codes.append((p.returncode, err[-3000:]))
    results = [json.loads((out / f"{run}-rank{r}.json").read_text()) for r in range(2)]
    return codes, results


def _preemption_checkpoint(store):
    ctx = StorageContext(store, "e", "t")
    committed = ctx.committed_checkpoints()
    ckpt, meta = committed[-1]
    return ctx, ckpt, meta


def _check_preempted_at(store, codes, results, index):
    """Both ranks' shards of step ``index`` in checkpoint ``index``, the last
    one, marked a preemption checkpoint; the trial preempted; exit CODE."""
    assert [c for c, _ in codes] == [CODE, CODE], codes
    for r in results:
        assert r["exit"][:2] == ["Preempted", CODE]
        assert r["reports"][-1] == index  # its last report: the preemption report
    ctx, ckpt, meta = _preemption_checkpoint(store)
    assert meta["index"] == index and meta["world_size"] == 2
    assert meta["preemption"]["signal"] == "SIGTERM"
    assert meta["preemption"]["grace_period_s"] == 20.0
    assert sorted(e["path"] for e in meta["manifest"]) == ["shard_0.txt", "shard_1.txt"]
    with ckpt.as_directory() as d:
        # Both ranks saved the same step into it.
        assert [open(os.path.join(d, f"shard_{r}.txt")).read() for r in range(2)] == [
            str(index)] * 2
    assert ctx.read_stop()["status"] == "preempted"
    return ctx


def _resume_one_rank(store, index):
    """A restart with world_size 1 resumes from the preemption checkpoint."""
    with session.start(storage_path=str(store), experiment_name="e", trial_name="t") as s:
        start = s.get_checkpoint()
        assert start.internal_metadata["index"] == index
        assert "preemption" in start.internal_metadata


# -- storage only (no process group): the flag travels in the rank markers --------------


@pytest.mark.parametrize("signal", [{"1": 2}, {"0": 2}, {"0": 2, "1": 3}, {"1": 2, "0": 3}],
                         ids=["rank1", "rank0", "both-0-first", "both-1-first"])
def test_storage_only_every_rank_saves_the_index_of_the_first_signal(tmp_path, signal):
    store = tmp_path / "store"
    codes, results = _launch("storage", store, tmp_path, "a1", signal=signal)
    # The first checkpoint report at or after the first signal is every rank's
    # preemption checkpoint: step 2 here, whichever rank got it.
    _check_preempted_at(store, codes, results, 2)
    _resume_one_rank(store, 2)
    if signal == {"1": 2}:  # a restart of both ranks resumes from it too
        codes, results = _launch("storage", store, tmp_path, "a2", steps=1)
        assert [c for c, _ in codes] == [0, 0], codes
        assert [r["resumed"] for r in results] == [[2, "2"], [2, "2"]]


def test_storage_only_a_gone_rank_holds_the_other_at_most_the_grace(tmp_path):
    store = tmp_path / "store"
    start = time.time()
    codes, results = _launch("storage", store, tmp_path, "a1", signal={"0": 2}, die={"1": 2},
                             grace=3.0)
    assert codes[1][0] == 7
    assert codes[0][0] == CODE, codes[0]
    r0 = results[0]
    # Rank 0 waited for rank 1's part of checkpoint 2 until the stop margin
    # (0.6 s) before the grace's end, not sync_timeout_s (60 s), then ended
    # the session: about 2.5 s after the signal (the slack is for closing on
    # a loaded machine).
    assert r0["exit"][:2] == ["Preempted", CODE] and r0["exit"][3] == "RankTimeoutError"
    assert 2.0 < r0["exit"][2] - r0["signalled"] < 3.0 + 3.0
    assert time.time() - start < 60
    ctx, _, meta = _preemption_checkpoint(store)
    assert meta["index"] == 1 and "preemption" not in meta  # the newest complete one
    assert ctx.read_stop()["status"] == "preempted"


# -- a torch.distributed process group (gloo): the flag rides on every report's gather --


@pytest.mark.slow  # two processes importing torch per launch
@pytest.mark.parametrize("signal", [{"1": 2}, {"0": 2}, {"0": 2, "1": 3}],
                         ids=["rank1", "rank0", "both"])
def test_group_every_rank_saves_the_report_after_the_exchange(tmp_path, signal):
    pytest.importorskip("torch")
    store = tmp_path / "store"
    codes, results = _launch("group", store, tmp_path, "g1", signal=signal)
    # Report 2 exchanged the flag: reached_preemption() turned True on every
    # rank at once, and report 3 was every rank's preemption checkpoint.
    assert [r["reached"] for r in results] == [3, 3]
    _check_preempted_at(store, codes, results, 3)
    if len(signal) == 1:  # a restart of one rank, and of both, resumes from it
        _resume_one_rank(store, 3)
        codes, results = _launch("group", store, tmp_path, "g2", steps=1)
        assert [c for c, _ in codes] == [0, 0], codes
        assert [r["resumed"] for r in results] == [[3, "3"], [3, "3"]]


@pytest.mark.slow
def test_group_with_a_local_tier_the_preemption_checkpoint_is_made_durable(tmp_path):
    pytest.importorskip("torch")
    store = tmp_path / "store"
    # persist never selects a checkpoint: only the preemption one reaches the
    # storage_path, forced on every rank (the signal reached rank 1 only).
    codes, results = _launch("group", store, tmp_path, "g1", signal={"1": 2}, tier=True)
    assert [r["reached"] for r in results] == [3, 3]
    ctx = _check_preempted_at(store, codes, results, 3)
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [3]
    _resume_one_rank(store, 3)


@pytest.mark.slow
def test_group_a_gone_rank_never_holds_the_other(tmp_path):
    pytest.importorskip("torch")
    store = tmp_path / "store"
    codes, results = _launch("group", store, tmp_path, "g1", signal={"1": 2}, die={"1": 3},
                             grace=20.0)
    assert codes[1][0] == 7
    assert codes[0][0] == CODE, codes[0]
    r0 = results[0]
    # The preemption report's gather fails as soon as rank 1's process is gone.
    assert r0["exit"][:2] == ["Preempted", CODE] and r0["exit"][3] == "RuntimeError"
    ctx, _, meta = _preemption_checkpoint(store)
    assert meta["index"] == 2 and "preemption" not in meta
    assert ctx.read_stop()["status"] == "preempted"


# -- the flag's exchange, in one process ---------------------------------------------------


def test_a_flag_from_another_rank_then_our_own_signal_is_not_a_second_signal():
    from checkpoint_store.errors import Preempted
    from checkpoint_store.session._preemption import PreemptionConfig, PreemptionWatch

    watch = PreemptionWatch(PreemptionConfig(grace_period_s=30.0, exit_code=CODE))
    try:
        assert watch.shared() is None
        assert not watch.adopt([None, None]) and not watch.agreed
        # Rank 1 was signalled 10 s ago: this rank takes its signal and its deadline.
        peer = {"signal": "SIGTERM", "signalled_at": time.time() - 10, "grace_period_s": 30.0,
                "left_s": 20.0}
        assert watch.adopt([None, peer]) and watch.agreed and watch.requested
        assert 19.0 < watch.left_s() <= 20.0
        assert watch.metadata()["signalled_at"] == peer["signalled_at"]
        assert watch.shared()["left_s"] <= 20.0
        # Its own SIGTERM now is this process's first: no stop at once.
        watch.request(15)
        # A second one is.
        with pytest.raises(Preempted) as info:
            watch.request(15)
        assert info.value.code == CODE
        # A shorter grace elsewhere moves the deadline earlier, never later.
        watch.adopt([{**peer, "left_s": 5.0}])
        assert watch.left_s() <= 5.0
        watch.adopt([{**peer, "left_s": 25.0}])
        assert watch.left_s() <= 5.0
    finally:
        watch.closed = True


def test_a_signal_read_from_storage_keeps_its_time():
    from checkpoint_store.session._preemption import PreemptionConfig, PreemptionWatch

    watch = PreemptionWatch(PreemptionConfig(grace_period_s=30.0))
    try:
        # A committed checkpoint's "preemption" has no left_s: its time tells.
        watch.adopt([{"signal": "SIGUSR1", "signalled_at": time.time() - 12.0,
                      "grace_period_s": 30.0, "left_s": None}])
        assert 17.0 < watch.left_s() <= 18.0
        assert watch.metadata()["signal"] == "SIGUSR1"
    finally:
        watch.closed = True

