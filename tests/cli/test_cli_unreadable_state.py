"""`best`, `prune` and `ls` never take an unreadable retention state for "no
state", and `--mode` follows the order the trial records for its metric.

Taking a truncated `.checkpoint_manager.json` for "nothing recorded" made
`prune --keep 1` rank by recency and delete the best checkpoint; `--metric
loss` without `--mode` on a trial keeping the lowest loss ranked by `max` and
deleted it too.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

import pytest
from cli_helpers import Store, committed_names, get, invoke, put

from checkpoint_store import Checkpoint, CheckpointConfig, session
from checkpoint_store._format.layout import MANAGER_STATE

LOSSES = [0.8, 0.3, 0.5, 0.4]  # best by min: checkpoint_000001; newest: checkpoint_000003


def _trial(store: Store, tmp_path: Any) -> tuple[Any, str]:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "w.bin").write_bytes(b"w" * 64)
    config = CheckpointConfig(num_to_keep=None, checkpoint_score_attribute="loss",
                              checkpoint_score_order="min")
    with session.start(storage_path=store.uri, experiment_name="exp", trial_name="t1",
                       checkpoint_config=config, storage_options=dict(store.options) or None):
        for loss in LOSSES:
            session.report({"loss": loss}, checkpoint=Checkpoint(str(src)))
    ctx = store.ctx()
    return ctx, store.join("exp", "t1")


def _spoil_state(ctx: Any, how: str) -> None:
    path = posixpath.join(ctx.trial_path, MANAGER_STATE)
    raw = get(ctx, path)
    spoiled = {"truncated": raw[:100], "empty": b"", "not-an-object": b"[1, 2]",
               "no-config": b'{"format_version": 2}',
               "config-not-object": json.dumps({**json.loads(raw), "config": "x"}).encode()}
    put(ctx, path, spoiled[how])


@pytest.mark.parametrize("how", ["truncated", "config-not-object"])
def test_prune_and_best_refuse_to_guess_over_an_unreadable_state(every_store, tmp_path, how):
    ctx, trial = _trial(every_store, tmp_path)
    _spoil_state(ctx, how)
    before = committed_names(ctx)
    opts = every_store.opt_args()
    for args in (["prune", trial, "--keep", "1"], ["prune", trial], ["best", trial],
                 ["best", trial, "--metric", "loss"]):
        res = invoke([*args, *opts])
        assert res.exit_code == 1, (args, res.output)
        assert MANAGER_STATE in res.stderr and "unreadable" in res.stderr, res.stderr
    assert committed_names(ctx) == before  # nothing deleted on a guess
    res = invoke(["ls", trial, *opts])
    assert res.exit_code == 0, res.output
    assert "unreadable" in res.stderr and "checkpoint_000001" in res.stdout
    # Told how to rank, both work, and agree with the recorded order.
    res = invoke(["best", trial, "--metric", "loss", "--mode", "min", *opts])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].endswith("checkpoint_000001")
    res = invoke(["prune", trial, "--keep", "1", "--metric", "loss", "--mode", "min", *opts])
    assert res.exit_code == 0, res.output
    assert committed_names(ctx) == ["checkpoint_000001", "checkpoint_000003"]


@pytest.mark.parametrize("how", ["empty", "not-an-object", "no-config"])
def test_other_unreadable_states_are_refused_too(tmp_path, how):
    store = Store(str(tmp_path / "store"))
    ctx, trial = _trial(store, tmp_path)
    _spoil_state(ctx, how)
    res = invoke(["prune", trial, "--keep", "1", "--json"])
    assert res.exit_code == 1 and "unreadable" in res.stderr, res.output
    assert len(committed_names(ctx)) == len(LOSSES)


def test_a_trial_without_state_still_ranks_by_recency(tmp_path):
    """No state at all is not a fault: `--keep` without `--metric` keeps the newest,
    as documented."""
    store = Store(str(tmp_path / "store"))
    ctx, trial = _trial(store, tmp_path)
    ctx.filesystem.delete_file(posixpath.join(ctx.trial_path, MANAGER_STATE))
    res = invoke(["prune", trial, "--keep", "1", "--no-keep-latest"])
    assert res.exit_code == 0, res.output
    assert committed_names(ctx) == ["checkpoint_000003"]


def test_metric_without_mode_ranks_by_the_recorded_order(every_store, tmp_path):
    ctx, trial = _trial(every_store, tmp_path)
    opts = every_store.opt_args()
    res = invoke(["best", trial, "--metric", "loss", "--json", *opts])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["score"] == 0.3
    assert json.loads(res.stdout)["mode"] == "min"
    res = invoke(["prune", trial, "--keep", "1", "--metric", "loss", *opts])
    assert res.exit_code == 0, res.output
    assert committed_names(ctx) == ["checkpoint_000001", "checkpoint_000003"]
    # Another metric without --mode: max, as documented.
    res = invoke(["best", trial, "--metric", "training_iteration", "--json", *opts])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["mode"] == "max"


def _rewrite_state(ctx: Any, change: Any) -> None:
    path = posixpath.join(ctx.trial_path, MANAGER_STATE)
    root = json.loads(get(ctx, path))
    change(root)
    put(ctx, path, json.dumps(root).encode())


def _newer_format(root: dict[str, Any]) -> None:
    # A later release's state: rules this one reads in part (keep one, no latest)
    # beside one it does not know at all, which keeps more.
    root["format_version"] = 99
    root["config"].update(num_to_keep=1, keep_latest=False, keep_every_n_steps=1)


def test_a_state_of_a_newer_format_is_not_ranked_or_pruned_by(store, tmp_path):
    """`prune` without `--keep` applied the known half of a newer release's rules
    (it said the state was "not used here") and deleted three checkpoints that
    release keeps; `best` and `ls` ranked by it too. Refused now, as an
    unreadable state is: told how to rank, both work."""
    from checkpoint_store import Experiment

    ctx, trial = _trial(store, tmp_path)
    _rewrite_state(ctx, _newer_format)
    before = committed_names(ctx)
    opts = store.opt_args()
    for args in (["prune", trial], ["prune", trial, "--keep", "1"], ["best", trial]):
        res = invoke([*args, *opts])
        assert res.exit_code == 1, (args, res.output)
        assert "format version 99" in res.stderr and "upgrade" in res.stderr, res.stderr
    assert committed_names(ctx) == before
    res = invoke(["best", store.join("exp"), *opts])  # no metric known: none named
    assert res.exit_code == 2 and not res.stdout, res.output
    res = invoke(["ls", trial, "--json", *opts])
    assert res.exit_code == 0, res.output
    assert "format version 99" in res.stderr
    assert json.loads(res.stdout)["metric"] is None  # no score by half a rule
    listed = Experiment(store.join("exp"), storage_options=dict(store.options) or None)
    assert listed.trials[0].metric is None and listed.trials[0].best_score is None
    res = invoke(["prune", trial, "--keep", "1", "--metric", "loss", "--mode", "min", *opts])
    assert res.exit_code == 0, res.output
    assert committed_names(ctx) == ["checkpoint_000001", "checkpoint_000003"]


@pytest.mark.parametrize("change", [
    pytest.param(lambda r: r["config"].update(checkpoint_score_order="lowest"), id="order"),
    pytest.param(lambda r: r["config"].update(num_to_keep="1"), id="count-as-string"),
])
def test_a_state_whose_rules_no_manager_accepts_is_unreadable(near_store, tmp_path, change):
    """A config no `CheckpointConfig` accepts: `best` ranked by a guess at it (an
    order 'lowest' as min) and `prune` blamed the command line (exit 2, "see
    --help") for a count it was never given. Both name the state now (exit 1)."""
    ctx, trial = _trial(near_store, tmp_path)
    _rewrite_state(ctx, change)
    before = committed_names(ctx)
    opts = near_store.opt_args()
    for args in (["best", trial], ["prune", trial], ["prune", trial, "--keep", "1"]):
        res = invoke([*args, *opts])
        assert res.exit_code == 1, (args, res.output)
        assert MANAGER_STATE in res.stderr and "config is invalid" in res.stderr, res.stderr
    assert committed_names(ctx) == before
    res = invoke(["best", trial, "--metric", "loss", "--mode", "min", *opts])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].endswith("checkpoint_000001")


@pytest.mark.parametrize("inside", [None, "stray.json"])
def test_a_directory_in_the_states_place_is_an_unreadable_state(store, tmp_path, inside):
    """`.checkpoint_manager.json` as a directory (a sync tool's folder marker, a
    mkdir; on an object store, any object under that prefix): `ls` of the trial
    and of its experiment, `best` and `prune` failed with a store error telling
    the user to check the credentials and the bucket. It is an unreadable
    state: listed with a warning, ranked when told how."""
    ctx, trial = _trial(store, tmp_path)
    path = posixpath.join(ctx.trial_path, MANAGER_STATE)
    ctx.filesystem.delete_file(path)
    if inside is None and not ctx.backend.capabilities.directories:
        pytest.skip("an object store holds no empty directory")
    if inside is None:
        ctx.filesystem.create_dir(path)
    else:
        put(ctx, posixpath.join(path, inside), b"{}")
    opts = store.opt_args()
    for args in (["ls", trial], ["ls", store.join("exp")]):
        res = invoke([*args, *opts])
        assert res.exit_code == 0, (args, res.output)
    assert "a directory" in invoke(["ls", trial, *opts]).stderr
    for args in (["best", trial], ["prune", trial, "--keep", "1"]):
        res = invoke([*args, *opts])
        assert res.exit_code == 1 and "unreadable (a directory" in res.stderr, res.output
        assert "credentials" not in res.stderr
    res = invoke(["best", trial, "--metric", "loss", "--mode", "min", *opts])
    assert res.exit_code == 0 and res.stdout.splitlines()[0].endswith("checkpoint_000001")
