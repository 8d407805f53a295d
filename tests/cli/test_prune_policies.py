"""``prune`` applies the trial's recorded retention policy and names, per checkpoint,
the policy that keeps it (issue 14)."""

from __future__ import annotations

import json
import posixpath

from cli_helpers import Store, committed_names, invoke, make_trial

from checkpoint_store._format.layout import MANAGER_STATE
from checkpoint_store.retention import AnyOf, BestN, CheckpointConfig, EveryNSteps
from checkpoint_store.retention.state import ManagerState
from checkpoint_store.retention.statelog import save_state

LOSSES = [5, 4, 6, 3, 7, 8, 2, 9, 9, 9]


def _record(ctx, config: CheckpointConfig) -> None:
    """The state a manager with ``config`` leaves (its policy recorded)."""
    path = posixpath.join(ctx.trial_path, MANAGER_STATE)
    assert save_state(ctx, path, ManagerState(run_id="r", config=config.to_json()))


def test_dry_run_names_the_keeping_policy_then_prune_applies_it(store: Store, tmp_path) -> None:
    ctx = make_trial(store, tmp_path, LOSSES)  # metrics: loss, epoch = index
    _record(ctx, CheckpointConfig(policy=AnyOf(BestN(2, "loss", "min"), EveryNSteps(4, "epoch"))))
    trial = store.join("exp", "t1")

    dry = invoke(["prune", trial, *store.opt_args(), "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    data = json.loads(dry.stdout)
    kept_by = {d["index"]: d["kept_by"] for d in data["kept"]}
    assert kept_by == {
        0: ["EveryNSteps(4)"],
        3: ["BestN(2, 'loss', 'min')"],
        4: ["EveryNSteps(4)"],
        6: ["BestN(2, 'loss', 'min')"],
        8: ["EveryNSteps(4)"],
        9: ["LatestN(1)"],
    }
    assert [d["index"] for d in data["evicted"]] == [1, 2, 5, 7]
    assert len(committed_names(ctx)) == 10

    text = invoke(["prune", trial, *store.opt_args(), "--dry-run"])
    assert "checkpoint_000003 (loss=3)  by BestN(2, 'loss', 'min')" in text.output

    real = invoke(["prune", trial, *store.opt_args()])
    assert real.exit_code == 0, real.output
    assert committed_names(ctx) == [f"checkpoint_{i:06d}" for i in (0, 3, 4, 6, 8, 9)]


def test_without_keep_and_without_a_recorded_policy_is_a_usage_error(tmp_path) -> None:
    store = Store(str(tmp_path / "s"))
    ctx = make_trial(store, tmp_path, [1, 2])
    res = invoke(["prune", store.join("exp", "t1")])
    assert res.exit_code == 2
    assert "--keep is required" in res.output
    assert len(committed_names(ctx)) == 2


def test_shorthand_lines_name_best_and_latest(tmp_path) -> None:
    store = Store(str(tmp_path / "s"))
    make_trial(store, tmp_path, [0.5, 0.2, 0.4, 0.3])
    res = invoke(
        [
            "prune",
            store.join("exp", "t1"),
            "--keep",
            "1",
            "--metric",
            "loss",
            "--mode",
            "min",
            "--dry-run",
            "--json",
        ]
    )
    kept_by = {d["index"]: d["kept_by"] for d in json.loads(res.stdout)["kept"]}
    assert kept_by == {1: ["BestN(1, 'loss', 'min')"], 3: ["LatestN(1)"]}
