"""Every name session.start accepts is seen by every walk of a storage root; the
one prefix walks cannot tell from our own files, ``.cs_``, is refused at
session.start (issue 11, kind 8)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from checkpoint_store import Checkpoint, InvalidConfigError, StorageContext, session
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.cli import main


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _report_one(store, experiment: str, trial: str, src) -> None:
    with session.start(storage_path=store.uri, experiment_name=experiment, trial_name=trial,
                       storage_options=store.options or None):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    (d / "model.bin").write_bytes(b"weights" * 8)
    return d


def test_walks_of_a_root_see_a_dot_named_experiment(store, src, tmp_path):
    _report_one(store, ".sweep-hidden", "t", src)
    _report_one(store, "visible", "t", src)
    opts = store.opt_args()

    listed = json.loads(_cli("ls", store.uri, *opts, "--json").output)
    assert sorted(r["name"] for r in listed["experiments"]) == [".sweep-hidden", "visible"]

    verified = json.loads(_cli("verify", store.uri, *opts, "--json").output)
    assert verified["checked"] == 2 and verified["corrupt"] == 0
    assert any("/.sweep-hidden/t/checkpoint_000000" in c["uri"]
               for c in verified["checkpoints"])

    backup = tmp_path / "backup"
    result = _cli("cp", store.uri, str(backup), *opts)
    assert result.exit_code == 0, result.output
    Checkpoint(str(backup / ".sweep-hidden" / "t" / "checkpoint_000000")).verify()
    Checkpoint(str(backup / "visible" / "t" / "checkpoint_000000")).verify()


def test_the_ui_sees_a_dot_named_experiment(store, src):
    from checkpoint_store.ui._model import StoreView

    _report_one(store, ".sweep-hidden", "t", src)
    view = StoreView(store.uri, store.options or None)
    assert view.experiments() == {".sweep-hidden": ["t"]}
    assert view.trial(".sweep-hidden", "t")["checkpoints"][0]["name"] == "checkpoint_000000"


def test_walks_see_a_dot_named_trial(store, src):
    # Found beside the input: trials are walked by the same rule.
    _report_one(store, "exp", ".t-hidden", src)
    opts = store.opt_args()
    root = json.loads(_cli("ls", store.uri, *opts, "--json").output)
    assert root["experiments"] == [{"name": "exp", "uri": root["experiments"][0]["uri"],
                                    "trials": 1}]
    exp = json.loads(_cli("ls", store.join("exp"), *opts, "--json").output)
    assert [r["name"] for r in exp["trials"]] == [".t-hidden"]
    assert json.loads(_cli("verify", store.uri, *opts, "--json").output)["checked"] == 1


@pytest.mark.parametrize("field", ["experiment_name", "trial_name"])
def test_names_with_our_internal_prefix_are_refused_at_start(store, field):
    names = {"experiment_name": "exp", "trial_name": "t", field: ".cs_staging-x"}
    with pytest.raises(InvalidConfigError, match="reserves for its own files"):
        session.start(storage_path=store.uri, storage_options=store.options or None, **names)
    probe = StorageContext(store.uri, "exp", "t", storage_options=store.options or None)
    assert _fsutil.list_tree(probe.filesystem, probe.storage_path) == []
