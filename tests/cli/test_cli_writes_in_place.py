"""Commands that write check first: never into a trial a running job holds, never
into their own source, and a corrupt source checkpoint fails the copy by name."""

from __future__ import annotations

import os
import posixpath
import socket
import subprocess
import sys
import time

import pytest
from cli_helpers import Store, committed_names, invoke, make_trial, write_tree

from checkpoint_store import Checkpoint, CheckpointConfig, session
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.cli import EXIT_BROKEN_PIPE, EXIT_FAILURE, EXIT_USAGE

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
        session.wait()  # retention deletes evicted checkpoints in the background
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


# -- exit codes and messages of the same family ----------------------------------------


def _exe() -> str:
    return os.path.join(os.path.dirname(sys.executable), "checkpoint-store")


@pytest.mark.parametrize("args", [["show", "{ck}"], ["ls", "{trial}", "--json"]])
def test_a_closed_stdout_ends_quietly(tmp_path, args) -> None:
    """`checkpoint-store show CKPT | head -1` printed `error: [Errno 32] Broken pipe`."""
    store = Store(str(tmp_path / "s"))
    make_trial(store, tmp_path, [0.5, 0.4])
    trial = store.join("exp", "t1")
    argv = [a.format(ck=f"{trial}/checkpoint_000000", trial=trial) for a in args]
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first byte, as after `head -1`
    try:
        proc = subprocess.run([_exe(), *argv], stdout=w, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    finally:
        os.close(w)
    assert proc.returncode == EXIT_BROKEN_PIPE
    assert proc.stderr == ""


def test_ui_on_a_busy_port_is_one_error_line(tmp_path) -> None:
    pytest.importorskip("flask")
    busy = socket.create_server(("127.0.0.1", 0))
    try:
        port = busy.getsockname()[1]
        res = invoke(["ui", str(tmp_path), "--port", str(port)])
    finally:
        busy.close()
    assert res.exit_code == EXIT_FAILURE, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot serve on 127.0.0.1:")
    assert "--port" in lines[0]


def test_a_location_of_the_wrong_kind_is_a_usage_error_for_every_command(
        near_store: Store, tmp_path) -> None:
    make_trial(near_store, tmp_path, [0.5, 0.4])
    trial = near_store.join("exp", "t1")
    ck = f"{trial}/checkpoint_000000"
    ctx = near_store.ctx("exp", "t1")
    _fsutil.write_bytes(ctx.filesystem, posixpath.join(ctx.trial_path, "notes.txt"), b"n",
                        ctx.backend.capabilities)
    for args in (["best", ck, "--metric", "loss"], ["prune", ck, "--keep", "1"],
                 ["download", trial, str(tmp_path / "d")], ["show", trial],
                 ["show", near_store.join("exp")], ["show", f"{trial}/notes.txt"],
                 ["download", f"{trial}/notes.txt", str(tmp_path / "d")]):
        res = invoke(args)
        assert res.exit_code == EXIT_USAGE, (args, res.output)
        assert "not a" in res.stderr
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("scheme,key", [("s3", "anonymous"), ("s3", "anon"),
                                        ("az", "anon")])
def test_a_boolean_option_parses_strictly(scheme, key) -> None:
    res = invoke(["ls", f"{scheme}://bucket/runs", "-o", f"{key}=maybe"])
    assert res.exit_code == EXIT_USAGE, res.output
    # S3 names its alias ``anon`` by the canonical ``anonymous``.
    assert "must be a boolean" in res.stderr and key in res.stderr
    assert "maybe" in res.stderr


@pytest.mark.parametrize("engine", ["pyarrow", "s3fs"])
def test_an_s3_endpoint_without_a_scheme_is_refused_at_once(engine) -> None:
    started = time.monotonic()
    res = invoke(["ls", "s3://bucket/runs", "-o", "endpoint_url=127.0.0.1:9", "-o",
                  f"engine={engine}", "-o", "access_key_id=a", "-o", "secret_access_key=b"])
    assert res.exit_code == EXIT_USAGE, res.output
    assert "has no scheme" in res.stderr and "http://" in res.stderr
    assert time.monotonic() - started < 5  # no connection attempts, no retries


def test_library_boolean_options_parse_strictly() -> None:
    from checkpoint_store import StorageContext
    from checkpoint_store.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="'anonymous' must be a boolean"):
        StorageContext("s3://bucket/runs", "e", "t", storage_options={"anonymous": "maybe"})


def test_demo_checks_for_a_live_demo_before_it_says_it_starts_fresh(tmp_path) -> None:
    pytest.importorskip("sklearn")
    storage = str(tmp_path / "demo")
    src = write_tree(str(tmp_path / "c"), {"model.bin": b"x"})
    with session.start(storage_path=storage, experiment_name="digits-demo", trial_name="mlp"):
        session.report({"val_accuracy": 0.5}, checkpoint=Checkpoint.from_directory(src))
        res = invoke(["demo", "--storage", storage, "--epochs", "1", "--fresh"])
        assert res.exit_code == EXIT_FAILURE, res.output
        assert "Starting fresh" not in res.stdout and "running job" in res.stderr
        assert os.path.isdir(tmp_path / "demo" / "digits-demo" / "mlp" / "checkpoint_000000")
