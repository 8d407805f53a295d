"""Nothing is written where a store's checkpoints or trials live.

A download into another committed checkpoint (or a directory inside one, or
a trial directory), a plot image inside a checkpoint, and a prune by a metric
no checkpoint records are each refused with a typed error before the first
write or delete, and every checkpoint still verifies.
"""

from __future__ import annotations

import importlib.util
import os
import uuid

import pytest
from click.testing import CliRunner

from checkpoint_store import (
    Checkpoint,
    InvalidConfigError,
    NestedCheckpointError,
    StorageContext,
    session,
)
from checkpoint_store.cli import main


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture(params=["local", "memory"])
def trial(request, tmp_path):
    """A trial of three committed checkpoints (loss 3, 2, 1) on local disk or
    memory, and the local store whose checkpoints the writes must not touch."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(b"weights" * 100)
    uri = str(tmp_path / "store") if request.param == "local" \
        else f"memory://cs-targets-{uuid.uuid4().hex}"
    with session.start(storage_path=uri, experiment_name="exp", trial_name="t"):
        for i in range(3):
            session.report({"loss": 3 - i}, checkpoint=Checkpoint.from_directory(src))
    return f"{uri}/exp/t"


@pytest.fixture
def local_store(tmp_path):
    """A second, local trial: the committed checkpoints downloads aim at."""
    src = tmp_path / "src2"
    src.mkdir()
    (src / "other.bin").write_bytes(b"other")
    root = tmp_path / "local"
    with session.start(storage_path=str(root), experiment_name="exp", trial_name="t"):
        for _ in range(2):
            session.report({"loss": 1}, checkpoint=Checkpoint.from_directory(src))
    return root / "exp" / "t"


def _intact(trial_uri: str) -> None:
    res = _cli("verify", trial_uri)
    assert res.exit_code == 0, res.output
    assert "0 corrupt" in res.output


@pytest.mark.parametrize("where", [("checkpoint_000001",), ("checkpoint_000001", "sub"),
                                   ("checkpoint_000001", "a", "b")])
def test_download_into_another_committed_checkpoint_is_refused(trial, local_store, where):
    dest = local_store.joinpath(*where)
    res = _cli("download", f"{trial}/checkpoint_000000", str(dest))
    assert res.exit_code == 2, res.output  # a refused destination: a usage error
    assert "lies inside the committed checkpoint" in res.output
    assert not os.path.exists(local_store / "checkpoint_000001" / "sub")
    _intact(str(local_store))
    _intact(trial)


@pytest.mark.parametrize("where", [(), ("newdir",), ("checkpoint_000009",)])
def test_to_directory_into_a_trial_directory_is_refused(trial, local_store, where):
    ckpt = Checkpoint(f"{trial}/checkpoint_000000") if "://" in trial \
        else Checkpoint.from_directory(f"{trial}/checkpoint_000000")
    before = sorted(os.listdir(local_store))
    with pytest.raises(InvalidConfigError, match="trial directory|no earlier download") as err:
        ckpt.to_directory(local_store.joinpath(*where))
    if where:
        assert "lies inside the trial directory" in str(err.value)
    assert sorted(os.listdir(local_store)) == before
    _intact(str(local_store))


def test_a_result_json_of_somebody_else_does_not_make_a_trial(trial, tmp_path):
    """A working directory holding a ``result.json`` of its own (a test's output,
    another tool's log) and no checkpoint directory is no trial: a download into
    a folder there goes ahead."""
    ckpt = Checkpoint(f"{trial}/checkpoint_000000") if "://" in trial \
        else Checkpoint.from_directory(f"{trial}/checkpoint_000000")
    work = tmp_path / "work"
    work.mkdir()
    (work / "result.json").write_text('{"rank": 0}\n')
    out = ckpt.to_directory(work / "down")
    assert os.path.isdir(out) and os.listdir(out)


def test_to_directory_inside_a_committed_checkpoint_is_refused(trial, local_store):
    ckpt = Checkpoint(f"{trial}/checkpoint_000002") if "://" in trial \
        else Checkpoint.from_directory(f"{trial}/checkpoint_000002")
    with pytest.raises(NestedCheckpointError) as err:
        ckpt.to_directory(local_store / "checkpoint_000000" / "restore")
    assert err.value.file == "restore"
    assert "restore" not in os.listdir(local_store / "checkpoint_000000")
    _intact(str(local_store))


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs [ui]")
def test_plot_into_a_checkpoint_is_refused(trial, local_store, tmp_path):
    out = local_store / "checkpoint_000001" / "p.png"
    res = _cli("plot", trial, "--metric", "loss", "-o", str(out))
    assert res.exit_code == 2, res.output  # a refused destination: a usage error
    assert "lies inside the committed checkpoint" in res.output
    assert not out.exists()
    _intact(str(local_store))
    # Beside the trial's files a single image is fine.
    ok = _cli("plot", trial, "--metric", "loss", "-o", str(tmp_path / "curve.png"))
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize("args", [("--metric", "nope"), ("--metric", "loss/nested"),
                                  ("--metric", "nope", "--dry-run")])
def test_prune_by_a_metric_no_checkpoint_records_is_refused(trial, args):
    res = _cli("prune", trial, "--keep", "1", "--mode", "min", *args)
    assert res.exit_code == 2, res.output
    assert f"records the metric {args[1]!r}" in res.output
    assert "nothing was deleted" in res.output
    listing = _cli("ls", trial, "--json")
    assert listing.output.count("checkpoint_00000") >= 3
    _intact(trial)


def test_prune_by_a_recorded_metric_still_keeps_the_best(trial):
    res = _cli("prune", trial, "--keep", "1", "--metric", "loss", "--mode", "min",
               "--no-keep-latest")
    assert res.exit_code == 0, res.output
    ctx_uri, _, _ = trial.rpartition("/exp/t")
    kept = [name for _, name in StorageContext(ctx_uri, "exp", "t").checkpoint_dirs()]
    assert kept == ["checkpoint_000002"]


def test_a_download_through_a_symlink_into_a_checkpoint_is_refused(trial, local_store,
                                                                   tmp_path):
    """The target is resolved first: a link elsewhere that leads inside counts."""
    link = tmp_path / "restore-here"
    os.symlink(local_store / "checkpoint_000000", link)
    res = _cli("download", f"{trial}/checkpoint_000001", str(link / "restored"))
    assert res.exit_code == 2, res.output  # a refused destination: a usage error
    assert "lies inside the committed checkpoint" in res.output
    assert not (local_store / "checkpoint_000000" / "restored").exists()
    _intact(str(local_store))
