"""An experiment or trial may not take a name our layout uses inside a trial
(``checkpoint_NNNNNN``, ``result.json``, ``params.json``, ``error.txt``, the
manager state, the metadata files, ``.cs_*``): walks read a directory holding
such a name as a trial, so ``ls`` would call the whole experiment a trial.
Refused with ``InvalidConfigError`` before anything is written, at
``session.start``, ``StorageContext``, ``TrialRunner`` and the CLI's
destinations (docs/format.md)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from checkpoint_store import Checkpoint, InvalidConfigError, StorageContext, TrialRunner, session
from checkpoint_store._format.layout import (
    ERROR_FILE,
    INTERNAL_METADATA,
    MANAGER_STATE,
    PARAMS_FILE,
    RESULT_FILE,
    USER_METADATA,
    is_reserved_name,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.cli import main

RESERVED = ["checkpoint_000001", "checkpoint_1234567", RESULT_FILE, PARAMS_FILE, ERROR_FILE,
            MANAGER_STATE, INTERNAL_METADATA, USER_METADATA, ".cs_staging-x"]
# Close to reserved names, and fine: walks never read them as trial files.
ALLOWED = ["checkpoint_1", "checkpoint_000001x", "result.json.bak", "Result.json",
           "params", ".hidden", "cs_x"]


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _nothing_written(store) -> bool:
    probe = StorageContext(store.uri, "exp", "t", storage_options=store.options or None)
    fs, root = probe.filesystem, probe.storage_path
    return not _fsutil.exists(fs, root) or _fsutil.list_tree(fs, root) == []


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    (d / "model.bin").write_bytes(b"weights" * 8)
    return d


def test_the_predicate_names_exactly_the_layout_names() -> None:
    assert [n for n in RESERVED if not is_reserved_name(n)] == []
    assert [n for n in ALLOWED if is_reserved_name(n)] == []


def test_reserved_names_are_refused_at_start_on_every_backend(store) -> None:
    opts = store.options or None
    for name in RESERVED:
        for field in ("experiment_name", "trial_name"):
            names = {"experiment_name": "exp", "trial_name": "t", field: name}
            with pytest.raises(InvalidConfigError, match=f"{field} {name!r}"):
                session.start(storage_path=store.uri, storage_options=opts, **names)
            with pytest.raises(InvalidConfigError, match=f"{field} {name!r}"):
                StorageContext(store.uri, names["experiment_name"], names["trial_name"],
                               storage_options=opts)
    assert _nothing_written(store)


def test_a_trial_runner_refuses_a_reserved_trial_name(tmp_path) -> None:
    def train(config):
        session.report({"a": 1})

    for field in ("experiment_name", "trial_name"):
        names = {"experiment_name": "exp", "trial_name": "t", field: RESULT_FILE}
        with pytest.raises(InvalidConfigError, match=f"{field} 'result.json'"):
            TrialRunner(train, storage_path=str(tmp_path / "store"), **names)
    runner = TrialRunner(train, storage_path=str(tmp_path / "store"),
                         experiment_name="exp", trial_name="t")
    with pytest.raises(InvalidConfigError, match="'checkpoint_000001'"):
        runner.reset({}, trial_name="checkpoint_000001")
    assert not (tmp_path / "store").exists()


def test_names_beside_the_reserved_ones_work_and_ls_sees_the_trial(near_store, src) -> None:
    # The walk's rule, seen from the allowed side: each such trial is a trial
    # of an experiment, never mistaken for trial files.
    for name in ("checkpoint_1", "result.json.bak"):
        with session.start(storage_path=near_store.uri, experiment_name="exp", trial_name=name,
                           storage_options=near_store.options or None):
            session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
    exp = json.loads(_cli("ls", near_store.join("exp"), *near_store.opt_args(), "--json").output)
    assert sorted(r["name"] for r in exp["trials"]) == ["checkpoint_1", "result.json.bak"]


@pytest.mark.parametrize("target", [("exp", RESULT_FILE), ("checkpoint_000001", "t"),
                                    ("exp", "error.txt", "checkpoint_000000")])
def test_upload_refuses_a_reserved_destination_name(near_store, src, target) -> None:
    res = _cli("upload", str(src), near_store.join(*target), *near_store.opt_args())
    assert res.exit_code != 0
    assert "name checkpoint-store uses inside a trial" in res.output
    assert _nothing_written(near_store)


def test_cp_refuses_a_reserved_destination_trial(store, src, tmp_path) -> None:
    with session.start(storage_path=str(tmp_path / "from"), experiment_name="exp",
                       trial_name="t"):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
    res = _cli("cp", str(tmp_path / "from" / "exp" / "t"), store.join("exp", PARAMS_FILE),
               *store.opt_args())
    assert res.exit_code != 0
    assert "'params.json'" in res.output
    assert _nothing_written(store)


@pytest.mark.parametrize("name", ["a\nb", "tab\there", "bell\x07", "del\x7f", "\r"])
def test_run_names_with_control_characters_are_refused(tmp_path, name) -> None:
    """A newline in a trial name broke `ls` (one trial per line) and S3's XML
    listings cannot carry most control characters: refused everywhere a run
    name comes in, before anything is written."""
    root = str(tmp_path / "store")
    for field in ("experiment_name", "trial_name"):
        names = {"experiment_name": "exp", "trial_name": "t", field: name}
        with pytest.raises(InvalidConfigError, match="control character"):
            session.start(storage_path=root, **names)
        with pytest.raises(InvalidConfigError, match="control character"):
            StorageContext(root, names["experiment_name"], names["trial_name"])
        with pytest.raises(InvalidConfigError, match="control character"):
            TrialRunner(lambda config: None, storage_path=root, **names)
    assert not (tmp_path / "store").exists()
    # Printable non-ASCII names stay fine.
    with session.start(storage_path=root, experiment_name="exp", trial_name="trial é ü 試"):
        session.report({"a": 1})
