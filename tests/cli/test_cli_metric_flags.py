"""Issue 38, kind 5: every metric-taking flag of every command refuses an
empty name as a usage error (exit 2), and a metric no checkpoint records
naming the metrics there are, before anything is printed as an answer or
deleted: for `best` it names no best (not found, exit 1), for the others it
is a usage error (exit 2), as docs/cli.md says.

`ls --metric ""` was accepted; `best --metric absent` printed the newest
checkpoint with exit 0 (only `prune` refused, with exit 2).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from cli_helpers import Store, committed_names, invoke, make_trial, write_tree

from checkpoint_store import Checkpoint, CheckpointConfig, session

ALL = [f"checkpoint_{i:06d}" for i in range(3)]


def _commands(trial: str, metric: str, tmp_path) -> dict[str, list[str]]:
    out = {
        "ls": ["ls", trial, "--metric", metric],
        "ls --long": ["ls", trial, "--long", "--metric", metric],
        "ls --json": ["ls", trial, "--json", "--metric", metric],
        "best": ["best", trial, "--metric", metric],
        "best --mode": ["best", trial, "--metric", metric, "--mode", "min"],
        "prune": ["prune", trial, "--keep", "1", "--metric", metric, "--mode", "min"],
        "prune --dry-run": ["prune", trial, "--keep", "1", "--metric", metric, "--dry-run"],
    }
    if importlib.util.find_spec("matplotlib") is not None:
        out["plot"] = ["plot", trial, "--metric", metric, "-o", str(tmp_path / "p.png")]
    return out


@pytest.fixture
def trial(near_store: Store, tmp_path) -> str:
    """Reports with checkpoints (``plot`` draws the reports' rows)."""
    with session.start(storage_path=near_store.uri, experiment_name="exp", trial_name="t1"):
        for i, loss in enumerate([0.5, 0.1, 0.3]):
            src = write_tree(str(tmp_path / f"src{i}"), {"m.bin": bytes([i]) * 50})
            session.report({"loss": loss}, checkpoint=Checkpoint.from_directory(src))
    return near_store.join("exp", "t1")


@pytest.mark.parametrize("command", ["ls", "ls --long", "ls --json", "best", "best --mode",
                                     "prune", "prune --dry-run", "plot"])
def test_an_empty_metric_is_a_usage_error(near_store: Store, trial: str, tmp_path,
                                          command: str) -> None:
    args = _commands(trial, "", tmp_path).get(command)
    if args is None:
        pytest.skip("plot needs the [ui] extra")
    res = invoke(args)
    assert res.exit_code == 2, res.output
    assert "--metric" in res.stderr and "names no metric" in res.stderr
    assert res.stdout == ""
    assert committed_names(near_store.ctx()) == ALL
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("metric", ["absent", "loss/nested", "Loss"])
@pytest.mark.parametrize("command", ["ls", "ls --long", "ls --json", "best", "best --mode",
                                     "prune", "prune --dry-run", "plot"])
def test_a_metric_no_checkpoint_records_is_a_usage_error_naming_those_there(
        near_store: Store, trial: str, tmp_path, command: str, metric: str) -> None:
    args = _commands(trial, metric, tmp_path).get(command)
    if args is None:
        pytest.skip("plot needs the [ui] extra")
    res = invoke(args)
    # `best`: a metric no checkpoint records names no best (not found, exit 1);
    # elsewhere it is a usage error (exit 2).
    assert res.exit_code == (1 if command.startswith("best") else 2), res.output
    assert repr(metric) in res.stderr
    assert "loss" in res.stderr.replace(repr(metric), "")  # the metrics there are
    assert res.stdout == ""  # `best` named the newest checkpoint here, with exit 0
    assert committed_names(near_store.ctx()) == ALL
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("root", [False, True])
def test_an_empty_metric_is_refused_above_a_trial_too(near_store: Store, trial: str,
                                                      root: bool) -> None:
    where = near_store.uri if root else near_store.join("exp")
    res = invoke(["ls", where, "--metric", ""])
    assert res.exit_code == 2, res.output


def test_a_metric_some_checkpoint_records_is_accepted(near_store: Store, tmp_path) -> None:
    """The counterpart: one checkpoint recording it is enough; the others rank last."""
    ctx = near_store.ctx()
    make_trial(near_store, tmp_path, [0.5, 0.1])
    src = write_tree(str(tmp_path / "acc"), {"m.bin": b"m" * 10})
    ctx.persist_checkpoint(Checkpoint.from_directory(src), 2, {"metrics": {"acc": 0.7}})
    trial = near_store.join("exp", "t1")
    res = invoke(["best", trial, "--metric", "acc", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["index"] == 2
    res = invoke(["ls", trial, "--metric", "acc", "--json"])
    assert res.exit_code == 0, res.output
    assert [r["score"] for r in json.loads(res.stdout)["checkpoints"]] == [None, None, 0.7]


def test_prune_refuses_metric_and_mode_without_keep(near_store: Store, tmp_path) -> None:
    """Without --keep the recorded policy ranks by its own attribute: --metric
    was taken and ignored."""
    config = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss",
                              checkpoint_score_order="min")
    with session.start(storage_path=near_store.uri, experiment_name="exp", trial_name="t1",
                       checkpoint_config=config):
        for i, loss in enumerate([0.5, 0.1]):
            src = write_tree(str(tmp_path / f"src{i}"), {"m.bin": bytes([i]) * 50})
            session.report({"loss": loss}, checkpoint=Checkpoint.from_directory(src))
    trial = near_store.join("exp", "t1")
    for flags in (["--metric", "acc"], ["--mode", "max"], ["--metric", "loss"]):
        res = invoke(["prune", trial, *flags, "--dry-run"])
        assert res.exit_code == 2, (flags, res.output)
        assert "rank with --keep" in res.stderr
    assert invoke(["prune", trial, "--dry-run"]).exit_code == 0  # the recorded policy
