"""TrialRunner: step/stop/pause/reset semantics (issue: one report() for training and tuning)."""

from __future__ import annotations

import threading
import traceback

import pytest

from checkpoint_store import Checkpoint, CheckpointConfig, TrialRunner, session
from checkpoint_store.session import TrialStopped


def _runner(tmp_path, fn, config=None, **kw) -> TrialRunner:
    kw.setdefault("trial_name", "t0")
    return TrialRunner(fn, config, storage_path=str(tmp_path / "store"),
                       experiment_name="exp", **kw)


def _save(tmp_path, name: str, payload: bytes) -> Checkpoint:
    d = tmp_path / "src" / name
    d.mkdir(parents=True)
    (d / "model.bin").write_bytes(payload)
    return Checkpoint.from_directory(d)


def test_step_returns_flat_results_then_none_forever(tmp_path):
    def train(config):
        for i in range(3):
            ckpt = _save(tmp_path, f"c{i}", bytes([i])) if i == 1 else None
            session.report({"score": config["base"] + i}, checkpoint=ckpt)

    r = _runner(tmp_path, train, {"base": 10})
    results = [r.step() for _ in range(3)]
    assert [x["score"] for x in results] == [10, 11, 12]
    assert [x["training_iteration"] for x in results] == [1, 2, 3]
    for x in results:
        assert set(x) >= {"timestamp", "time_total_s", "time_this_iter_s", "trial_id",
                          "checkpoint_dir_name", "checkpoint"}
        assert x["trial_id"] == "exp/t0"
    assert results[0]["checkpoint"] is None and results[0]["checkpoint_dir_name"] is None
    ck = results[1]["checkpoint"]
    assert isinstance(ck, Checkpoint) and ck.is_committed
    assert results[1]["checkpoint_dir_name"] == "checkpoint_000000"
    with ck.as_directory() as d:
        assert open(f"{d}/model.bin", "rb").read() == b"\x01"
    assert r.step() is None
    assert r.step() is None
    assert r.status == "finished"


def test_stop_while_blocked_in_report_runs_finally_and_ends_thread(tmp_path):
    finally_ran = threading.Event()
    threads = []

    def train(config):
        threads.append(threading.current_thread())
        try:
            for i in range(100):
                session.report({"i": i})
        finally:
            finally_ran.set()

    r = _runner(tmp_path, train)
    assert r.step()["i"] == 0  # train_fn is now blocked inside report()
    assert r.stop(timeout=10) is True
    assert finally_ran.is_set()
    assert not threads[0].is_alive()
    assert r.step() is None
    assert r.stop() is True and r.pause() is True  # idempotent after the end
    assert r.status == "stopped"


def test_exception_after_two_reports_is_reraised_with_original_traceback(tmp_path):
    def train(config):
        session.report({"i": 1})
        session.report({"i": 2})
        raise KeyError("x")

    r = _runner(tmp_path, train)
    assert r.step()["i"] == 1
    assert r.step()["i"] == 2
    with pytest.raises(KeyError) as info:
        r.step()
    assert info.value.args == ("x",)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "train" in frames  # the frame that raised is in the traceback
    assert r.step() is None
    # A scheduler can still tell a failed trial from a finished one.
    assert r.status == "errored"
    assert r.error is info.value


@pytest.mark.parametrize("sync", [True, False])
def test_counter_never_runs_ahead_of_steps(tmp_path, sync):
    counter = {"n": 0}
    seen = []

    def train(config):
        for i in range(6):
            session.report({"i": i})
            counter["n"] += 1

    r = _runner(tmp_path, train, synchronous_result_reporting=sync)
    steps = 0
    while True:
        res = r.step()
        if res is None:
            break
        steps += 1
        seen.append(counter["n"])
        if sync:
            # Blocked in report() number `steps`: only the earlier ones returned.
            assert counter["n"] == steps - 1
        else:
            assert counter["n"] <= steps
    assert steps == 6 and counter["n"] == 6


def test_sync_false_lets_train_fn_continue_after_result_is_taken(tmp_path):
    passed = threading.Event()

    def train(config):
        session.report({"i": 0})
        passed.set()
        session.report({"i": 1})

    r = _runner(tmp_path, train, synchronous_result_reporting=False)
    assert r.step()["i"] == 0
    assert passed.wait(10)  # no further step() needed to get past report()
    assert r.step()["i"] == 1
    assert r.step() is None


def test_returned_and_yielded_dicts_are_reported(tmp_path):
    def returns(config):
        session.report({"i": 0})
        return {"final": 1.5}

    def yields(config):
        for i in range(3):
            yield {"i": i}

    r = _runner(tmp_path, returns)
    assert r.step()["i"] == 0
    assert r.step()["final"] == 1.5
    assert r.step() is None
    g = _runner(tmp_path, yields, trial_name="gen")
    got = []
    while (res := g.step()) is not None:
        got.append((res["i"], res["training_iteration"]))
    assert got == [(0, 1), (1, 2), (2, 3)]


def test_stop_and_pause_before_first_step(tmp_path):
    calls = []
    r = _runner(tmp_path, lambda config: calls.append(1))
    assert r.stop() is True and r.stop() is True
    assert r.step() is None
    assert calls == []
    p = _runner(tmp_path, lambda config: session.report({"x": 1}), trial_name="p")
    assert p.pause() is True and p.pause() is True
    assert p.step()["x"] == 1  # a paused trial starts again on step()


def _resumable(tmp_path):
    def train(config):
        start = session.get_checkpoint()
        epoch = 0
        if start is not None:
            with start.as_directory() as d:
                epoch = int(open(f"{d}/model.bin").read())
        for e in range(epoch + 1, 6):
            d = tmp_path / "src" / f"{config['tag']}-{e}-{threading.get_ident()}"
            d.mkdir(parents=True)
            (d / "model.bin").write_text(str(e))
            session.report({"epoch": e, "resumed_from": epoch},
                           checkpoint=Checkpoint.from_directory(d))
    return train


def test_pause_keeps_latest_checkpoint_and_new_runner_resumes(tmp_path):
    cfg = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="epoch",
                           checkpoint_score_order="min")
    train = _resumable(tmp_path)
    r = _runner(tmp_path, train, {"tag": "a"}, checkpoint_config=cfg)
    assert [r.step()["epoch"] for _ in range(2)] == [1, 2]
    assert r.pause() is True
    assert r.status == "paused"
    trial = tmp_path / "store" / "exp" / "t0"
    kept = sorted(p.name for p in trial.iterdir() if p.name.startswith("checkpoint_"))
    # Best by min epoch (000000) plus the latest (000001): nothing deleted by pause.
    assert kept == ["checkpoint_000000", "checkpoint_000001"]
    again = _runner(tmp_path, train, {"tag": "b"}, checkpoint_config=cfg)
    res = again.step()
    assert (res["epoch"], res["resumed_from"]) == (3, 2)
    assert res["training_iteration"] == 3
    # The same runner resumes too after a pause.
    assert again.pause() is True
    res = again.step()
    assert (res["epoch"], res["resumed_from"]) == (4, 3)
    again.stop()


def test_reset_reuses_runner_for_new_config(tmp_path):
    def train(config):
        for i in range(100):
            session.report({"lr": config["lr"], "i": i})

    r = _runner(tmp_path, train, {"lr": 0.1})
    assert r.step()["lr"] == 0.1
    assert r.reset({"lr": 0.5}, trial_name="t1") is True
    res = r.step()
    assert (res["lr"], res["i"], res["trial_id"]) == (0.5, 0, "exp/t1")
    r.stop()


def test_reset_returns_false_when_old_thread_does_not_stop(tmp_path):
    release = threading.Event()

    def train(config):
        session.report({"i": 0})
        release.wait(30)  # busy outside report(): cannot be stopped until it reports

    r = _runner(tmp_path, train, synchronous_result_reporting=False)
    assert r.step()["i"] == 0
    assert r.reset({"lr": 1}, timeout=0.2) is False
    release.set()
    assert r.stop(timeout=10) is True


def test_stopped_signal_is_not_swallowed_by_except_exception(tmp_path):
    caught = []

    def train(config):
        for i in range(100):
            try:
                session.report({"i": i})
            except Exception as exc:  # user code that catches too much
                caught.append(exc)

    r = _runner(tmp_path, train)
    r.step()
    assert r.stop(timeout=10) is True
    assert caught == []
    assert issubclass(TrialStopped, BaseException)


def test_two_runners_in_parallel_keep_their_own_sessions(tmp_path):
    def train(config):
        for _ in range(3):
            session.report({"who": config["who"], "trial": session.get_context().trial_name})

    a = _runner(tmp_path, train, {"who": "a"}, trial_name="a")
    b = _runner(tmp_path, train, {"who": "b"}, trial_name="b")
    for _ in range(3):
        ra, rb = a.step(), b.step()
        assert (ra["who"], ra["trial"]) == ("a", "a")
        assert (rb["who"], rb["trial"]) == ("b", "b")
    assert a.step() is None and b.step() is None


def test_step_timeout(tmp_path):
    gate = threading.Event()

    def train(config):
        gate.wait(30)
        session.report({"i": 0})

    r = _runner(tmp_path, train)
    with pytest.raises(TimeoutError):
        r.step(timeout=0.1)
    gate.set()
    assert r.step(timeout=10)["i"] == 0
    r.stop()


def test_bad_train_fn_and_config(tmp_path):
    from checkpoint_store import InvalidConfigError, MetadataError

    with pytest.raises(InvalidConfigError):
        _runner(tmp_path, "not callable")
    with pytest.raises(MetadataError, match="bad"):
        _runner(tmp_path, lambda c: None, {"bad": object()})


def test_train_fn_without_arguments(tmp_path):
    def train():
        session.report({"ok": True})

    r = _runner(tmp_path, train)
    assert r.step()["ok"] is True
    assert r.step() is None


def test_successive_halving_pauses_losers_and_resumes_winners(tmp_path):
    """A hand-written scheduler: two rungs, the better half goes on, the rest pause."""
    def train(config):
        start = session.get_checkpoint()
        epoch = 0
        if start is not None:
            with start.as_directory() as d:
                epoch = int(open(f"{d}/epoch.txt").read())
        while True:
            epoch += 1
            d = tmp_path / "src" / f"{config['lr']}-{epoch}-{threading.get_ident()}"
            d.mkdir(parents=True)
            (d / "epoch.txt").write_text(str(epoch))
            session.report({"score": config["lr"] * epoch, "epoch": epoch},
                           checkpoint=Checkpoint.from_directory(d))

    runners = {lr: _runner(tmp_path, train, {"lr": lr}, trial_name=f"lr{lr}")
               for lr in (1, 2, 3, 4)}
    scores = {lr: [r.step()["score"] for _ in range(2)][-1] for lr, r in runners.items()}
    survivors = sorted(scores, key=scores.get)[2:]
    for lr, r in runners.items():
        if lr not in survivors:
            assert r.pause() is True
    for lr in survivors:
        res = [runners[lr].step() for _ in range(2)]
        assert [x["epoch"] for x in res] == [3, 4]  # resumed where rung 1 ended
        assert [x["training_iteration"] for x in res] == [3, 4]
    assert survivors == [3, 4]
    # Paused trials kept their latest checkpoint; a later runner resumes it.
    late = _runner(tmp_path, train, {"lr": 1}, trial_name="lr1")
    assert late.step()["epoch"] == 3
    for r in [*runners.values(), late]:
        assert r.stop() is True
