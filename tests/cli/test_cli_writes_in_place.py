"""Commands that write check first: never into a trial a running job holds, never
into their own source, and a corrupt source checkpoint fails the copy by name."""

from __future__ import annotations

import os
import posixpath

import pytest
from cli_helpers import Store, committed_names, invoke, make_trial, write_tree

from checkpoint_store import Checkpoint, CheckpointConfig, _fsutil, session
from checkpoint_store.cli import EXIT_FAILURE, EXIT_USAGE

pytestmark = pytest.mark.filterwarnings("ignore:retention state .* is missing:RuntimeWarning")


def _add_file(store: Store, trial: str, checkpoint: str, rel: str, data: bytes) -> None:
    ctx = store.ctx("exp", trial)
    path = posixpath.join(ctx.trial_path, checkpoint, rel)
    _fsutil.write_bytes(ctx.filesystem, path, data, ctx.backend.capabilities)


def test_upload_and_cp_refuse_a_trial_a_running_job_manages(store: Store, tmp_path) -> None:
    make_trial(store, tmp_path, [0.0], trial="other")
    updir = write_tree(str(tmp_path / "updir"), {"model.bin": b"foreign"})
    config = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss",
                              checkpoint_score_order="min")
    trial = store.join("exp", "t1")
    with session.start(storage_path=store.uri, experiment_name="exp", trial_name="t1",
                       checkpoint_config=config, storage_options=dict(store.options) or None):
        for i in range(3):
            src = write_tree(str(tmp_path / f"r{i}"), {"model.bin": bytes([i]) * 10})
            session.report({"loss": 1.0 - i / 10}, checkpoint=Checkpoint.from_directory(src))
            if i == 1:
                up = invoke(["upload", updir, trial, *store.opt_args(),
                             "--metrics", '{"loss": 0.0}'])
                cp = invoke(["cp", store.join("exp", "other"), trial, *store.opt_args()])
                one = invoke(["cp", store.join("exp", "other", "checkpoint_000000"), trial,
                              *store.opt_args()])
        for res in (up, cp, one):
            assert res.exit_code == EXIT_FAILURE, res.output
            assert "running job" in res.stderr and "--force" not in res.stderr
        ctx = store.ctx("exp", "t1")
        # The job's own third report went through; nothing foreign is best.
        assert committed_names(ctx) == ["checkpoint_000001", "checkpoint_000002"]
    best = invoke(["best", trial, "--metric", "loss", "--mode", "min", *store.opt_args()])
    assert best.exit_code == 0, best.output
    assert best.stdout.splitlines()[0].endswith("/exp/t1/checkpoint_000002")


def test_cp_into_a_checkpoint_of_its_own_source_is_refused(store: Store, tmp_path) -> None:
    ctx = make_trial(store, tmp_path, [0.5, 0.4, 0.3, 0.2])
    trial = store.join("exp", "t1")
    before = committed_names(ctx)
    for src, dst in [(trial, f"{trial}/checkpoint_000003"),  # destination inside the source
                     (f"{trial}/checkpoint_000001", store.join("exp")),  # source inside it
                     (trial, trial)]:
        res = invoke(["cp", src, dst, *store.opt_args()])
        assert res.exit_code == EXIT_USAGE, res.output
        assert "source" in res.stderr and "nothing was written" in res.stderr
    assert committed_names(ctx) == before
    assert invoke(["verify", trial, *store.opt_args()]).exit_code == 0


def test_upload_of_a_directory_into_itself_is_refused(tmp_path) -> None:
    root = tmp_path / "store"
    write_tree(str(root), {"model.bin": b"x"})
    res = invoke(["upload", str(root), str(root / "exp" / "t1")])
    assert res.exit_code == EXIT_USAGE, res.output
    assert "lies inside the source" in res.stderr
    assert sorted(os.listdir(root)) == ["model.bin"]
    # Also through a symlink to the directory (one place, two spellings).
    os.symlink(root, tmp_path / "alias")
    res = invoke(["upload", str(tmp_path / "alias"), str(root / "exp" / "t1")])
    assert res.exit_code == EXIT_USAGE, res.output
    assert sorted(os.listdir(root)) == ["model.bin"]


def test_cp_names_a_checkpoint_holding_a_file_its_manifest_does_not_list(
        store: Store, tmp_path) -> None:
    make_trial(store, tmp_path, [0.5, 0.4, 0.3])
    _add_file(store, "t1", "checkpoint_000001", "extra.txt", b"hi\n")
    dest = tmp_path / "cpz"
    res = invoke(["cp", store.join("exp", "t1"), str(dest), *store.opt_args()])
    assert res.exit_code == EXIT_FAILURE, res.output
    assert "checkpoint_000001" in res.stderr and "corrupt" in res.stderr
    assert "extra.txt" in res.stderr
    assert {"checkpoint_000000", "checkpoint_000002"} <= set(os.listdir(dest))
    assert "checkpoint_000001" not in os.listdir(dest)


def test_cp_of_an_experiment_names_a_corrupt_checkpoint_of_any_trial(
        near_store: Store, tmp_path) -> None:
    make_trial(near_store, tmp_path, [0.5], trial="a")
    make_trial(near_store, tmp_path, [0.5, 0.4], trial="b")
    _add_file(near_store, "b", "checkpoint_000000", "sub/extra.bin", b"\0")
    res = invoke(["cp", near_store.join("exp"), str(tmp_path / "backup")])
    assert res.exit_code == EXIT_FAILURE, res.output
    assert "b/checkpoint_000000" in res.stderr
    assert os.listdir(tmp_path / "backup" / "a") and os.listdir(tmp_path / "backup" / "b")


def test_resume_warns_when_the_newest_checkpoint_is_corrupt(near_store: Store, tmp_path) -> None:
    make_trial(near_store, tmp_path, [0.5, 0.4, 0.3])
    _add_file(near_store, "t1", "checkpoint_000002", "extra.txt", b"hi\n")
    with pytest.warns(RuntimeWarning, match=r"checkpoint_000002, is corrupt .*extra\.txt.*"
                                            r"falls back to checkpoint_000001"), \
            session.start(storage_path=near_store.uri, experiment_name="exp",
                          trial_name="t1"):
        ck = session.get_checkpoint()
    assert ck is not None and posixpath.basename(ck.path) == "checkpoint_000001"
