"""The CLI side of issue 12: odd stored state named with exit 1 (kind 4), input
JSON cannot carry refused before any write (kinds 1 and 2), and argument
errors that never echo a credential (kind 8)."""

from __future__ import annotations

import json
import os

import pytest
from cli_helpers import STAGING, Store, committed_names, invoke, make_trial, write_tree

from checkpoint_store import Checkpoint

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def _trial_with_metrics(store: Store, tmp_path, metrics: list) -> None:
    ctx = store.ctx()
    for i, m in enumerate(metrics):
        src = write_tree(str(tmp_path / f"src{i}"), {"model.bin": bytes([i]) * 100})
        ctx.persist_checkpoint(Checkpoint.from_directory(src), i, {"metrics": m})


# -- kind 4: odd stored state ---------------------------------------------------------------


def test_show_of_a_marker_whose_metrics_is_a_list(store: Store, tmp_path) -> None:
    _trial_with_metrics(store, tmp_path, [[1, 2]])
    uri = store.join("exp", "t1", "checkpoint_000000")
    res = invoke(["show", uri, *store.opt_args()])
    assert res.exit_code == 0, res.output
    assert "(not an object) [1, 2]" in res.output
    assert "user metadata" in res.output
    res = invoke(["show", uri, "--json", *store.opt_args()])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["internal_metadata"]["metrics"] == [1, 2]


@pytest.mark.parametrize("command", [["best", "--mode", "min"], ["prune", "--keep", "1"]])
def test_a_non_numeric_stored_score_is_named_with_exit_1(store: Store, tmp_path,
                                                         command: list[str]) -> None:
    make_trial(store, tmp_path, [0.3, "abc", 0.1])  # type: ignore[list-item]
    res = invoke([command[0], store.join("exp", "t1"), *command[1:], "--metric", "loss",
                  *store.opt_args()])
    assert res.exit_code == 1, res.output
    assert "checkpoint_000001" in res.stderr and "'loss'" in res.stderr
    assert "'abc'" in res.stderr and "usage" not in res.stderr
    assert committed_names(store.ctx()) == [f"checkpoint_{i:06d}" for i in range(3)]


def test_best_and_prune_skip_metrics_that_are_not_an_object(near_store: Store, tmp_path) -> None:
    """Found while fixing the kind: ``best`` died with AttributeError on it too."""
    _trial_with_metrics(near_store, tmp_path, [{"loss": 0.5}, [0.1], {"loss": 0.2}])
    res = invoke(["best", near_store.join("exp", "t1"), "--metric", "loss", "--mode", "min"])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].endswith("checkpoint_000002")
    assert "checkpoint_000001 records 'metrics' as a list" in res.stderr
    res = invoke(["prune", near_store.join("exp", "t1"), "--keep", "1", "--metric", "loss",
                  "--mode", "min", "--no-keep-latest"])
    assert res.exit_code == 0, res.output
    assert committed_names(near_store.ctx()) == ["checkpoint_000002"]


# -- kinds 1 and 2: refused before anything is written ------------------------------------------


@pytest.mark.parametrize("metrics", [
    '{"loss": "\\ud800"}',
    '{"\\ud800": 1}',
    '{"n": ' + "9" * 5000 + "}",
    '{"deep": ' + "[" * 5000 + "]" * 5000 + "}",
])
def test_upload_with_metrics_json_cannot_carry_writes_nothing(near_store: Store, tmp_path,
                                                             metrics: str) -> None:
    src = write_tree(str(tmp_path / "src"), {"model.bin": b"w" * 10})
    res = invoke(["upload", src, near_store.join("exp", "t1"), "--metrics", metrics])
    assert res.exit_code == 2, res.output
    assert "--metrics" in res.stderr and "Traceback" not in res.output
    assert committed_names(near_store.ctx()) == []
    if not near_store.uri.startswith("memory://"):
        assert not os.path.exists(near_store.uri)


# -- kind 8: messages never echo a credential ---------------------------------------------------


@pytest.mark.parametrize("item", [
    f"secret_access_key:{SECRET}",
    f"secret_access_key {SECRET}",
    SECRET,
    f"={SECRET}",
])
@pytest.mark.parametrize("command", [["ls"], ["show"], ["verify"], ["prune", "--keep", "1"]])
def test_a_mistyped_option_names_the_key_and_hides_the_value(tmp_path, item: str,
                                                            command: list[str]) -> None:
    res = invoke([*command, str(tmp_path), "-o", item])
    assert res.exit_code == 2
    assert SECRET not in res.output and SECRET[:16] not in res.output
    if item.startswith("secret_access_key"):
        assert "'secret_access_key'" in res.stderr
    assert "hidden" in res.stderr or "not shown" in res.stderr


def test_cp_source_and_destination_options_hide_values_too(tmp_path) -> None:
    for flag in ("--src-option", "--dst-option", "-o"):
        res = invoke(["cp", str(tmp_path / "a"), str(tmp_path / "b"), flag,
                      f"account_key:{SECRET}"])
        assert res.exit_code == 2
        assert SECRET not in res.output and "'account_key'" in res.stderr


@pytest.mark.parametrize("age", ["nan", "NaN", "-1"])
def test_gc_min_age_that_is_not_a_number_removes_nothing(near_store: Store, tmp_path,
                                                         age: str) -> None:
    """Found while auditing the kind: click's FloatRange lets NaN through, and
    ``min_age > 0`` is False for it, so every staging directory went."""
    ctx = make_trial(near_store, tmp_path, [0.5], staging=True)
    before = near_store.ctx().scan().uncommitted
    assert STAGING in before
    res = invoke(["gc", near_store.join("exp", "t1"), "--min-age", age])
    assert res.exit_code == 2, res.output
    assert ctx.scan().uncommitted == before


def test_best_of_an_experiment_without_a_metric_names_the_flags(tmp_path):
    """The refusal said "pass metric= and mode=": the keyword arguments of
    Experiment.best_trial, not the flags of the command that printed it."""
    store = Store(str(tmp_path / "s"))
    make_trial(store, tmp_path, [0.5], experiment="exp", trial="t1")  # no retention state
    res = invoke(["best", store.join("exp")])
    assert res.exit_code == 2, res.output
    assert "--metric and --mode" in res.stderr, res.stderr


def test_import_in_place_of_a_folder_it_cannot_take_says_what_it_is(tmp_path):
    """A folder of torch.save files imported in place was called "a file", and
    the way out was given as dest=, the Python keyword."""
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "model.bin").write_bytes(b"\x80\x02}q\x00.")  # a pickle, as torch.save writes
    res = invoke(["import", str(folder)])
    assert res.exit_code == 2, res.output
    assert "is a file" not in res.stderr and "folder" in res.stderr, res.stderr
    assert "DEST" in res.stderr
