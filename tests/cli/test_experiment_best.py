"""Issue 42, items 1 and 2: the best trial of an experiment and its checkpoint,
from Python (``Experiment``), ``checkpoint-store best`` and ``ls``; and "best"
meaning the metric and order the trial recorded wherever a default is taken
(a read-only manager, ``best``, ``ls``, ``prune``, the page)."""

from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec
import pyarrow.fs as pafs
import pytest
from cli_helpers import Store, invoke

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointManager,
    CheckpointNotFoundError,
    Experiment,
    InvalidConfigError,
    MetricMismatchError,
    StorageContext,
    session,
)

LOSS_MIN = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss",
                            checkpoint_score_order="min")
ACC_MAX = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="acc",
                           checkpoint_score_order="max")
# trial -> losses reported, one checkpoint each. b's best (0.2) is not its newest.
SWEEP = {"a": [0.5, 0.3, 0.9], "b": [0.4, 0.2, 0.25], "c": [0.6]}


def _trial(store: Store, tmp_path: Any, name: str, values: Sequence[float], *,
           config: CheckpointConfig = LOSS_MIN, key: str = "loss",
           params: Mapping[str, Any] | None = None, fail: bool = False) -> None:
    try:
        with session.start(storage_path=store.uri, storage_options=dict(store.options) or None,
                           experiment_name="exp", trial_name=name, checkpoint_config=config,
                           config=dict(params or {"lr": len(name) * 0.1, "opt": {"name": name}})):
            for i, value in enumerate(values):
                src = tmp_path / f"src-{name}-{i}"
                src.mkdir(parents=True)
                (src / "w.bin").write_bytes(f"{name}{i}".encode())
                session.report({key: value, "epoch": i},
                               checkpoint=Checkpoint.from_directory(str(src)))
            if fail:
                raise ValueError("loss is nan")
    except ValueError:
        assert fail


def _sweep(store: Store, tmp_path: Any) -> None:
    for name, losses in SWEEP.items():
        _trial(store, tmp_path, name, losses, fail=name == "c")


def _mem_store() -> Store:
    return Store(f"memory://exp-{uuid.uuid4().hex[:10]}/store")


@pytest.fixture(params=["local", "memory"])
def sweep(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    store = Store(str(tmp_path / "store")) if request.param == "local" else _mem_store()
    _sweep(store, tmp_path)
    return store


def test_experiment_names_the_best_trial_its_checkpoint_and_params(sweep: Store) -> None:
    exp = Experiment(sweep.uri, "exp")
    assert [t.name for t in exp.trials] == ["a", "b", "c"]
    by = {t.name: t for t in exp.trials}
    assert {n: t.status for n, t in by.items()} == {
        "a": "finished", "b": "finished", "c": "errored"}
    assert by["c"].reason == "ValueError: loss is nan"
    assert by["b"].params == {"lr": 0.1, "opt": {"name": "b"}}
    assert (by["b"].metric, by["b"].mode, by["b"].best_score) == ("loss", "min", 0.2)
    assert by["b"].best_checkpoint is not None
    assert by["b"].best_checkpoint.uri.endswith("/exp/b/checkpoint_000001")

    best = exp.best_trial()
    assert best.name == "b"
    ckpt = exp.best_checkpoint()
    assert ckpt.uri == by["b"].best_checkpoint.uri
    assert ckpt.internal_metadata["metrics"]["loss"] == 0.2
    # Another metric or order when given: a's 0.9 is the highest loss.
    assert exp.best_trial(metric="loss", mode="max").name == "a"
    assert exp.best_checkpoint("loss", "max").uri.endswith("/exp/a/checkpoint_000002")
    assert exp.best_trial(metric="epoch", mode="max").name in ("a", "b")

    frame = exp.to_dataframe()
    rows = frame.to_dict("records") if hasattr(frame, "to_dict") else frame
    assert [(r["trial"], r["status"], r["best_score"], r["param/opt/name"]) for r in rows] == [
        ("a", "finished", 0.3, "a"), ("b", "finished", 0.2, "b"), ("c", "errored", 0.6, "c")]


def test_experiment_opens_from_a_uri_a_pyarrow_and_an_fsspec_filesystem(
        tmp_path: Any) -> None:
    local = Store(str(tmp_path / "store"))
    _sweep(local, tmp_path)
    mem = _mem_store()
    _sweep(mem, tmp_path / "m")
    mem_path = mem.uri[len("memory://"):]
    forms = [
        Experiment(local.uri, "exp"),
        Experiment(str(tmp_path / "store" / "exp")),  # the experiment directory itself
        Experiment(str(tmp_path / "store"), "exp", storage_filesystem=pafs.LocalFileSystem()),
        Experiment(str(tmp_path / "store"), "exp",
                   storage_filesystem=fsspec.filesystem("file")),
        Experiment(mem.uri, "exp"),
        Experiment(mem_path, "exp", storage_filesystem=fsspec.filesystem("memory")),
        Experiment(mem_path, "exp", storage_filesystem=pafs.PyFileSystem(
            pafs.FSSpecHandler(fsspec.filesystem("memory")))),
    ]
    for exp in forms:
        assert exp.best_trial().name == "b", exp
        assert exp.best_checkpoint().path.endswith("exp/b/checkpoint_000001"), exp


def test_experiment_refuses_what_is_not_an_experiment(tmp_path: Any) -> None:
    store = Store(str(tmp_path / "store"))
    _trial(store, tmp_path, "a", [0.1])
    assert Experiment(store.uri, "exp").trial("a").checkpoints == 1
    with pytest.raises(InvalidConfigError, match="a trial, not an experiment"):
        Experiment(str(tmp_path / "store" / "exp" / "a"))
    with pytest.raises(InvalidConfigError, match="pass experiment_name"):
        Experiment(store.uri)
    with pytest.raises(CheckpointNotFoundError):
        Experiment(store.uri, "nope")


def test_trials_ranking_differently_are_refused_until_metric_and_mode_given(
        tmp_path: Any) -> None:
    store = Store(str(tmp_path / "store"))
    _trial(store, tmp_path, "a", [0.5, 0.3])
    _trial(store, tmp_path, "d", [0.7, 0.8], config=ACC_MAX, key="acc")
    exp = Experiment(store.uri, "exp")
    with pytest.raises(MetricMismatchError, match="pass metric= and mode="):
        exp.best_trial()
    # Only a records loss: it is the only trial with a numeric loss.
    assert exp.best_trial(metric="loss", mode="min").name == "a"
    assert exp.best_trial(metric="acc").name == "d"  # d's recorded order (max)

    res = invoke(["best", store.join("exp")])
    assert res.exit_code == 2, res.output
    assert "--metric and --mode" in res.output
    res = invoke(["best", store.join("exp"), "--metric", "acc", "--mode", "max", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert (out["trial"], out["score"], out["metric"], out["mode"]) == ("d", 0.8, "acc", "max")


def test_cli_best_and_ls_of_an_experiment(sweep: Store) -> None:
    exp_uri = sweep.join("exp")
    res = invoke(["best", exp_uri])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].endswith("/exp/b/checkpoint_000001")
    assert "  trial: b (finished)" in lines
    assert "  loss (min): 0.2" in lines
    assert "  param opt/name: b" in lines
    out = json.loads(invoke(["best", exp_uri, "--json"]).stdout)
    assert (out["trial"], out["index"], out["score"], out["params"]["lr"]) == ("b", 1, 0.2, 0.1)

    listed = json.loads(invoke(["ls", exp_uri, "--json"]).stdout)
    rows = {r["name"]: r for r in listed["trials"]}
    assert {n: (r["status"], r["metric"], r["mode"], r["best_score"])
            for n, r in rows.items()} == {
        "a": ("finished", "loss", "min", 0.3), "b": ("finished", "loss", "min", 0.2),
        "c": ("errored", "loss", "min", 0.6)}
    assert rows["b"]["params"] == {"lr": 0.1, "opt": {"name": "b"}}
    assert rows["b"]["best_checkpoint"].endswith("/exp/b/checkpoint_000001")
    table = invoke(["ls", exp_uri]).stdout.splitlines()
    assert table[0].split()[:5] == ["TRIAL", "STATUS", "METRIC", "BEST", "PARAMS"]
    assert table[2].split()[:6] == ["b", "finished", "loss", "(min)", "0.2",
                                    "lr=0.1,opt/name=b"]

    # A trial directory: as before, its own best.
    res = invoke(["best", sweep.join("exp", "b")])
    assert res.exit_code == 0 and res.stdout.splitlines()[0].endswith("/b/checkpoint_000001")


def test_cli_best_of_an_experiment_on_s3(s3_location: Any, tmp_path: Any) -> None:
    store = Store(s3_location.uri, dict(s3_location.storage_options))
    _trial(store, tmp_path, "a", [0.3])
    _trial(store, tmp_path, "b", [0.2, 0.25])
    res = invoke(["best", store.join("exp"), *store.opt_args()])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].endswith("/exp/b/checkpoint_000000")
    exp = Experiment(store.uri, "exp", storage_options=store.options)
    assert exp.best_checkpoint().uri.endswith("/exp/b/checkpoint_000000")


# -- item 2: "best" is the recorded metric wherever a default is taken ---------------------


def _ctx(store: Store, trial: str = "b") -> StorageContext:
    return StorageContext(store.uri, "exp", trial, storage_options=dict(store.options) or None)


def test_read_only_manager_with_the_default_config_ranks_by_the_recorded_metric(
        sweep: Store) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default takes the recorded config: silent
        manager = CheckpointManager(CheckpointConfig(), _ctx(sweep), read_only=True)
    assert manager.config.checkpoint_score_attribute == "loss"
    assert manager.config.checkpoint_score_order == "min"
    assert manager.best_checkpoint is not None
    assert manager.best_checkpoint.path.endswith("/b/checkpoint_000001")  # 0.2, not newest
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # agreeing with the recorded one: silent too
        CheckpointManager(LOSS_MIN, _ctx(sweep), read_only=True)


def test_a_config_disagreeing_with_the_recorded_one_warns(sweep: Store) -> None:
    given = CheckpointConfig(checkpoint_score_attribute="loss")  # order "max"
    with pytest.warns(UserWarning, match=r"recorded ranking by 'loss' \(min\)") as caught:
        manager = CheckpointManager(given, _ctx(sweep), read_only=True)
    assert caught[0].filename == __file__  # points at the caller
    assert manager.best_checkpoint is not None
    assert manager.best_checkpoint.path.endswith("/b/checkpoint_000002")  # 0.25 by max
    with pytest.warns(UserWarning, match="ranks by recency"):
        CheckpointManager(CheckpointConfig(num_to_keep=5), _ctx(sweep), read_only=True)


def test_prune_refuses_a_ranking_other_than_the_recorded_one(sweep: Store) -> None:
    trial = sweep.join("exp", "a")  # 0.5, 0.3, 0.9 by loss (min): best 0.3
    res = invoke(["prune", trial, "--keep", "1", "--metric", "loss", "--mode", "max"])
    assert res.exit_code == 2, res.output
    assert "records ranking by 'loss' (min)" in res.output and "--rerank" in res.output
    assert Experiment(sweep.uri, "exp").trial("a").checkpoints == 3  # nothing deleted

    res = invoke(["prune", trial, "--keep", "1", "--metric", "loss", "--mode", "max",
                  "--dry-run", "--json"])
    assert res.exit_code == 0 and "warning:" in res.stderr
    # Defaults: the recorded metric and order (keeps 0.3 and the newest, 0.9).
    res = invoke(["prune", trial, "--keep", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert [d["name"] for d in json.loads(res.stdout)["deleted"]] == ["checkpoint_000000"]
    res = invoke(["prune", trial, "--keep", "1", "--metric", "loss", "--mode", "max",
                  "--no-keep-latest", "--rerank", "--json"])
    assert res.exit_code == 0, res.output
    assert [d["name"] for d in json.loads(res.stdout)["deleted"]] == ["checkpoint_000001"]


def test_the_page_and_the_experiment_agree_on_the_best(sweep: Store) -> None:
    from checkpoint_store.ui._model import StoreView

    view = StoreView(sweep.uri)
    exp = Experiment(sweep.uri, "exp")
    for t in exp.trials:
        page = view.summary("exp", t.name)
        assert t.best_checkpoint is not None
        assert (page["best_checkpoint"], page["best_score"], page["metric"]) == (
            t.best_checkpoint.path.rsplit("/", 1)[1], t.best_score, t.metric)


def test_a_best_checkpoint_whose_marker_is_gone_is_skipped(tmp_path: Any) -> None:
    store = Store(str(tmp_path / "store"))
    _sweep(store, tmp_path)
    exp = Experiment(store.uri, "exp")
    (tmp_path / "store" / "exp" / "b" / "checkpoint_000001" / ".internal_metadata.json").unlink()
    with pytest.warns(UserWarning, match="no valid commit marker"):
        ckpt = exp.best_checkpoint()
    assert ckpt.path.endswith("/exp/b/checkpoint_000002")  # 0.25, the next best
    res = invoke(["best", store.join("exp")])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].endswith("/exp/b/checkpoint_000002")
