"""The ``checkpoint-store`` commands against local disk, memory, S3 (moto) and Azure (Azurite)."""

from __future__ import annotations

import json
import os
import posixpath
import subprocess
import sys

import pytest
from cli_helpers import (
    STAGING,
    Store,
    committed_names,
    get,
    invoke,
    make_trial,
    put,
    write_tree,
)

from checkpoint_store import Checkpoint
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.cli import EXIT_FAILURE, EXIT_USAGE

# -- ls -------------------------------------------------------------------------------


def test_ls_trial_lists_exactly_the_committed_checkpoints(store: Store, tmp_path) -> None:
    make_trial(store, tmp_path, [0.5, 0.2, 0.4], uncommitted=True)
    trial = store.join("exp", "t1")

    res = invoke(["ls", trial, *store.opt_args(), "--metric", "loss"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert lines[0].split()[:4] == ["INDEX", "CHECKPOINT", "CREATED", "(UTC)"]
    rows = [line.split() for line in lines[1:]]
    assert [r[1] for r in rows] == ["checkpoint_000000", "checkpoint_000001", "checkpoint_000002"]
    assert [r[-1] for r in rows] == ["0.5", "0.2", "0.4"]
    assert "checkpoint_000003" not in res.stdout
    assert "1 uncommitted" in res.stderr

    res = invoke(["ls", trial, *store.opt_args(), "--json", "--long"])
    data = json.loads(res.stdout)
    assert data["kind"] == "trial"
    assert [c["index"] for c in data["checkpoints"]] == [0, 1, 2]
    assert [c["size"] for c in data["checkpoints"]] == [3003, 3106, 3209]
    assert [c["files"] for c in data["checkpoints"]] == [2, 2, 2]
    assert data["uncommitted"] == 1
    short = json.loads(invoke(["ls", trial, *store.opt_args(), "--json"]).stdout)
    assert [c["index"] for c in short["checkpoints"]] == [0, 1, 2]
    assert "size" not in short["checkpoints"][0] and short["uncommitted"] == 1


def test_ls_trial_names_the_error_of_its_last_run(store: Store, tmp_path) -> None:
    from checkpoint_store import session

    make_trial(store, tmp_path, [0.5])
    trial = store.join("exp", "t1")
    res = invoke(["ls", trial, *store.opt_args(), "--json"])
    assert json.loads(res.stdout)["error"] is None
    assert "ended with an error" not in res.stderr
    with pytest.raises(RuntimeError):
        with session.start(storage_path=store.uri, storage_options=dict(store.options) or None,
                           experiment_name="exp", trial_name="t1"):
            raise RuntimeError("CUDA out of memory")
    res = invoke(["ls", trial, *store.opt_args(), "--json"])
    assert json.loads(res.stdout)["error"] == "RuntimeError: CUDA out of memory"
    res = invoke(["ls", trial, *store.opt_args()])
    assert res.exit_code == 0, res.output
    assert "ended with an error: RuntimeError: CUDA out of memory" in res.stderr
    assert "error.txt" in res.stderr
    assert [r.split()[1] for r in res.stdout.strip().splitlines()[1:]] == ["checkpoint_000000"]


def test_ls_root_experiment_and_checkpoint(store: Store, tmp_path) -> None:
    make_trial(store, tmp_path, [0.5, 0.2], experiment="exp", trial="t1")
    make_trial(store, tmp_path, [0.9], experiment="exp", trial="t2")
    make_trial(store, tmp_path, [0.1], experiment="other", trial="t1")
    opts = store.opt_args()

    root = json.loads(invoke(["ls", store.uri, *opts, "--json"]).stdout)
    assert root["kind"] == "root"
    assert {e["name"]: e["trials"] for e in root["experiments"]} == {"exp": 2, "other": 1}

    exp = json.loads(invoke(["ls", store.join("exp"), *opts, "--json"]).stdout)
    assert exp["kind"] == "experiment"
    assert {t["name"]: (t["checkpoints"], t["latest_index"]) for t in exp["trials"]} == {
        "t1": (2, 1), "t2": (1, 0)}

    ck = json.loads(invoke(["ls", store.join("exp", "t1", "checkpoint_000001"), *opts,
                            "--json"]).stdout)
    assert ck["kind"] == "checkpoint"
    assert {f["path"]: f["size"] for f in ck["files"]} == {
        "model.bin": 3100, "optim/state.bin": 6}

    table = invoke(["ls", store.uri, *opts])
    assert table.exit_code == 0
    assert [line.split() for line in table.stdout.strip().splitlines()[1:]] == [
        ["exp", "2"], ["other", "1"]]


def test_ls_missing_location_fails_with_one_line(near_store: Store) -> None:
    res = invoke(["ls", near_store.join("nope", "nothing"), *near_store.opt_args()])
    assert res.exit_code == EXIT_FAILURE
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: ")
    assert "hint:" in res.stderr


# -- show and best --------------------------------------------------------------------


def test_show_prints_user_and_internal_metadata(store: Store, tmp_path) -> None:
    make_trial(store, tmp_path, [0.5, 0.2])
    uri = store.join("exp", "t1", "checkpoint_000001")
    data = json.loads(invoke(["show", uri, *store.opt_args(), "--json"]).stdout)
    assert data["user_metadata"] == {"epoch": 1, "note": "checkpoint 1"}
    assert data["internal_metadata"]["index"] == 1
    assert data["internal_metadata"]["metrics"]["loss"] == 0.2
    assert data["manifest"]["files"] == 2 and data["manifest"]["bytes"] == 3106

    text = invoke(["show", uri, *store.opt_args()])
    assert text.exit_code == 0
    assert "note: checkpoint 1" in text.stdout and "loss: 0.2" in text.stdout


def test_show_refuses_an_uncommitted_directory(near_store: Store, tmp_path) -> None:
    make_trial(near_store, tmp_path, [0.5], uncommitted=True)
    res = invoke(["show", near_store.join("exp", "t1", "checkpoint_000001"),
                  *near_store.opt_args()])
    assert res.exit_code == EXIT_FAILURE
    assert "not a committed checkpoint" in res.stderr


def test_best_ranks_like_the_manager(store: Store, tmp_path) -> None:
    # NaN ranks last in both orders; the tie 0.2/0.2 goes to the newer checkpoint.
    make_trial(store, tmp_path, [0.5, 0.2, float("nan"), 0.2, 0.9])
    trial = store.join("exp", "t1")
    res = invoke(["best", trial, *store.opt_args(), "--metric", "loss", "--mode", "min"])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0] == store.ctx().checkpoint(
        "checkpoint_000003").uri
    assert "loss: 0.2" in res.stdout

    data = json.loads(invoke(["best", trial, *store.opt_args(), "--metric", "loss",
                              "--mode", "max", "--json"]).stdout)
    assert (data["index"], data["score"]) == (4, 0.9)


def test_best_without_metric_is_a_usage_error(near_store: Store, tmp_path) -> None:
    make_trial(near_store, tmp_path, [0.5])
    res = invoke(["best", near_store.join("exp", "t1"), *near_store.opt_args()])
    assert res.exit_code == EXIT_USAGE
    assert "--metric" in res.output


# -- verify ---------------------------------------------------------------------------


def test_verify_flipped_byte_exits_nonzero_and_names_the_file(store: Store, tmp_path) -> None:
    ctx = make_trial(store, tmp_path, [0.5, 0.2, 0.4])
    trial = store.join("exp", "t1")
    ok = invoke(["verify", trial, *store.opt_args()])
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.count("OK ") == 3

    path = posixpath.join(ctx.checkpoint_path(1), "model.bin")
    data = bytearray(get(ctx, path))
    data[1234] ^= 0x01
    put(ctx, path, bytes(data))

    one = invoke(["verify", store.join("exp", "t1", "checkpoint_000001"), *store.opt_args()])
    assert one.exit_code == EXIT_FAILURE
    assert "CORRUPT" in one.stdout and "'model.bin'" in one.stdout

    res = invoke(["verify", store.uri, *store.opt_args(), "--json"])
    assert res.exit_code == EXIT_FAILURE
    report = json.loads(res.stdout)
    assert (report["checked"], report["corrupt"]) == (3, 1)
    bad = [c for c in report["checkpoints"] if not c["ok"]]
    assert bad[0]["file"] == "model.bin"
    assert bad[0]["uri"].endswith("checkpoint_000001")


def test_verify_missing_file_is_corruption(near_store: Store, tmp_path) -> None:
    ctx = make_trial(near_store, tmp_path, [0.5])
    ctx.filesystem.delete_file(posixpath.join(ctx.checkpoint_path(0), "optim/state.bin"))
    res = invoke(["verify", near_store.join("exp", "t1"), *near_store.opt_args()])
    assert res.exit_code == EXIT_FAILURE
    assert "optim/state.bin" in res.stdout


def test_verify_of_nothing_fails(near_store: Store, tmp_path) -> None:
    make_trial(near_store, tmp_path, [], uncommitted=True)
    res = invoke(["verify", near_store.join("exp", "t1"), *near_store.opt_args()])
    assert res.exit_code == EXIT_FAILURE
    assert "no committed checkpoint" in res.stderr


# -- prune ----------------------------------------------------------------------------


def test_prune_dry_run_deletes_nothing_then_deletes_exactly_those(store: Store, tmp_path) -> None:
    ctx = make_trial(store, tmp_path, [0.5, 0.2, 0.4, 0.3])
    args = ["prune", store.join("exp", "t1"), *store.opt_args(),
            "--keep", "1", "--metric", "loss", "--mode", "min"]

    dry = invoke([*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    would = [line.split()[2] for line in dry.stdout.splitlines()
             if line.startswith("would delete")]
    # Best by min loss is index 1; the newest (index 3) is kept too, as the manager does.
    assert [posixpath.basename(u) for u in would] == ["checkpoint_000000", "checkpoint_000002"]
    assert committed_names(ctx) == [f"checkpoint_{i:06d}" for i in range(4)]

    real = invoke(args)
    assert real.exit_code == 0, real.output
    deleted = [line.split()[1] for line in real.stdout.splitlines() if line.startswith("deleted")]
    assert deleted == would
    assert committed_names(ctx) == ["checkpoint_000001", "checkpoint_000003"]
    assert [n for _, n in ctx.checkpoint_dirs()] == ["checkpoint_000001", "checkpoint_000003"]


def test_prune_no_keep_latest_keeps_exactly_n(near_store: Store, tmp_path) -> None:
    ctx = make_trial(near_store, tmp_path, [0.5, 0.2, 0.4, 0.3])
    res = invoke(["prune", near_store.join("exp", "t1"), *near_store.opt_args(), "--keep", "2",
                  "--metric", "loss", "--mode", "min", "--no-keep-latest", "--json"])
    data = json.loads(res.stdout)
    assert [d["index"] for d in data["kept"]] == [1, 3]
    assert [d["index"] for d in data["deleted"]] == [0, 2]
    assert committed_names(ctx) == ["checkpoint_000001", "checkpoint_000003"]


def test_prune_without_metric_keeps_the_most_recent(tmp_path) -> None:
    store = Store(str(tmp_path / "s"))
    ctx = make_trial(store, tmp_path, [0.1, 0.2, 0.3])
    res = invoke(["prune", store.join("exp", "t1"), "--keep", "2"])
    assert res.exit_code == 0, res.output
    assert committed_names(ctx) == ["checkpoint_000001", "checkpoint_000002"]


@pytest.mark.parametrize("body", [b"", b'{"kind": "checkpoint_manager_lea'],
                         ids=["empty", "cut"])
def test_prune_and_gc_refuse_a_trial_whose_lease_is_unreadable_and_young(near_store, tmp_path,
                                                                          body) -> None:
    """A lease file that does not read as one (being rewritten in place, or
    its writer killed half way) counts as live for a ttl: prune and gc
    refuse, saying the file is unreadable (the message named "host None,
    pid None"), and delete nothing."""
    from checkpoint_store.retention import LEASE_FILE

    ctx = make_trial(near_store, tmp_path, [0.1, 0.2, 0.3])
    _fsutil.write_bytes(ctx.filesystem, posixpath.join(ctx.trial_path, LEASE_FILE), body,
                        ctx.backend.capabilities, fsync=False)
    trial = near_store.join("exp", "t1")
    for args in (["prune", trial, "--keep", "1"], ["gc", trial]):
        res = invoke([*args, *near_store.opt_args()])
        assert res.exit_code == EXIT_FAILURE, res.output
        assert "lease file is unreadable" in res.stderr and "None" not in res.stderr
    assert committed_names(ctx) == ["checkpoint_000000", "checkpoint_000001",
                                    "checkpoint_000002"]


def test_prune_on_an_experiment_is_a_usage_error(tmp_path) -> None:
    store = Store(str(tmp_path / "s"))
    make_trial(store, tmp_path, [0.1])
    res = invoke(["prune", store.join("exp"), "--keep", "1"])
    assert res.exit_code == EXIT_USAGE
    assert "not a trial" in res.stderr


# -- gc -------------------------------------------------------------------------------


def test_gc_removes_uncommitted_and_reports_foreign(store: Store, tmp_path) -> None:
    ctx = make_trial(store, tmp_path, [0.5, 0.2], uncommitted=True, staging=True, foreign=True)
    trial = store.join("exp", "t1")

    recent = json.loads(invoke(["gc", trial, *store.opt_args(), "--json"]).stdout)
    assert recent["removed"] == [] and recent["skipped_recent"] == [STAGING]

    dry = json.loads(invoke(["gc", trial, *store.opt_args(), "--min-age", "0", "--dry-run",
                             "--json"]).stdout)
    assert dry["removed"] == [STAGING]
    # A checkpoint-named directory with no trace of our writers may be the user's.
    assert dry["foreign"] == ["checkpoint_000002", "notes.txt"]
    assert _fsutil.exists(ctx.filesystem, posixpath.join(ctx.trial_path, STAGING, "model.bin"))

    res = invoke(["gc", trial, *store.opt_args(), "--min-age", "0"])
    assert res.exit_code == 0, res.output
    assert "foreign" in res.stdout and "notes.txt" in res.stdout
    assert not _fsutil.exists(ctx.filesystem, posixpath.join(ctx.trial_path, STAGING, "model.bin"))
    assert [n for _, n in ctx.checkpoint_dirs()] == [
        "checkpoint_000000", "checkpoint_000001", "checkpoint_000002"]
    assert committed_names(ctx) == ["checkpoint_000000", "checkpoint_000001"]
    assert get(ctx, posixpath.join(ctx.trial_path, "notes.txt")) == b"someone else's file"


# -- transfers ------------------------------------------------------------------------


def _tree(root: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            full = os.path.join(dirpath, n)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if not n.startswith(".cs_") and n != ".internal_metadata.json":
                with open(full, "rb") as f:
                    out[rel] = f.read()
    return out


def test_upload_then_download_round_trip(store: Store, tmp_path) -> None:
    src = write_tree(str(tmp_path / "model"), {
        "weights.bin": os.urandom(200_000), "cfg/params.json": b'{"lr": 0.1}',
        ".user_metadata.json": b'{"tag": "v1"}'})
    trial = store.join("exp", "t1")
    up = invoke(["upload", src, trial, *store.opt_args(), "--metrics", '{"loss": 0.25}'])
    assert up.exit_code == 0, up.output
    uri = up.stdout.strip().splitlines()[-1]
    assert uri.endswith("/exp/t1/checkpoint_000000")

    up2 = invoke(["upload", src, trial, *store.opt_args()])
    assert up2.stdout.strip().splitlines()[-1].endswith("checkpoint_000001")

    meta = store.ctx().committed_checkpoints()[0][1]
    assert meta["metrics"] == {"loss": 0.25}
    assert (meta["experiment_name"], meta["trial_name"]) == ("exp", "t1")

    dest = tmp_path / "out"
    down = invoke(["download", store.join("exp", "t1", "checkpoint_000000"), str(dest),
                   *store.opt_args()])
    assert down.exit_code == 0, down.output
    assert _tree(str(dest)) == _tree(src)


def test_upload_missing_directory_is_a_usage_error(tmp_path) -> None:
    res = invoke(["upload", str(tmp_path / "nope"), str(tmp_path / "s" / "e" / "t")])
    assert res.exit_code == EXIT_USAGE


def test_cp_local_to_remote_and_back_is_byte_identical(remote_store: Store, tmp_path) -> None:
    local = Store(str(tmp_path / "local"))
    src_ctx = make_trial(local, tmp_path, [0.5, 0.2, 0.4], uncommitted=True)
    opts = remote_store.opt_args()

    to_remote = invoke(["cp", local.join("exp", "t1"), remote_store.join("exp", "t1"), *opts])
    assert to_remote.exit_code == 0, to_remote.output
    remote_ctx = remote_store.ctx()
    assert committed_names(remote_ctx) == ["checkpoint_000000", "checkpoint_000001",
                                           "checkpoint_000002"]
    assert invoke(["verify", remote_store.join("exp", "t1"), *opts]).exit_code == 0

    back = Store(str(tmp_path / "back"))
    res = invoke(["cp", remote_store.join("exp", "t1", "checkpoint_000001"),
                  back.join("exp", "t1"), *opts])
    assert res.exit_code == 0, res.output
    got = back.ctx().committed_checkpoints()
    assert [posixpath.basename(c.path) for c, _ in got] == ["checkpoint_000001"]
    src_dir = src_ctx.checkpoint_path(1)
    assert _tree(got[0][0].path) == _tree(src_dir)
    src_meta = dict(src_ctx.checkpoint("checkpoint_000001").internal_metadata)
    assert got[0][1]["manifest"] == src_meta["manifest"]
    assert got[0][1]["metrics"] == src_meta["metrics"]
    got[0][0].verify()

    again = invoke(["cp", local.join("exp", "t1"), remote_store.join("exp", "t1"), *opts])
    assert again.exit_code == 0 and "3 already there" in again.stdout


def test_cp_whole_storage_root(tmp_path) -> None:
    a, b = Store(str(tmp_path / "a")), Store(f"memory://cp-root-{os.getpid()}/b")
    make_trial(a, tmp_path, [0.3, 0.1], experiment="e1", trial="t1")
    make_trial(a, tmp_path, [0.7], experiment="e2", trial="t9")
    res = invoke(["cp", a.uri, b.uri])
    assert res.exit_code == 0, res.output
    assert committed_names(b.ctx("e1", "t1")) == ["checkpoint_000000", "checkpoint_000001"]
    assert committed_names(b.ctx("e2", "t9")) == ["checkpoint_000000"]
    assert invoke(["verify", b.uri]).exit_code == 0


def test_cp_corrupt_source_commits_nothing(tmp_path) -> None:
    local = Store(str(tmp_path / "local"))
    ctx = make_trial(local, tmp_path, [0.5])
    path = posixpath.join(ctx.checkpoint_path(0), "model.bin")
    data = bytearray(get(ctx, path))
    data[0] ^= 0xFF
    put(ctx, path, bytes(data))
    dst = Store(str(tmp_path / "dst"))
    res = invoke(["cp", local.join("exp", "t1", "checkpoint_000000"), dst.join("exp", "t1")])
    assert res.exit_code == EXIT_FAILURE
    assert "model.bin" in res.stderr and "nothing was committed" in res.stderr
    assert committed_names(dst.ctx()) == []


def test_cp_of_a_trial_copies_the_good_checkpoints_and_fails_naming_the_bad(tmp_path) -> None:
    local = Store(str(tmp_path / "local"))
    ctx = make_trial(local, tmp_path, [0.5, 0.6, 0.7])
    path = posixpath.join(ctx.checkpoint_path(1), "model.bin")
    data = bytearray(get(ctx, path))
    data[0] ^= 0xFF
    put(ctx, path, bytes(data))
    dst = Store(str(tmp_path / "dst"))
    res = invoke(["cp", local.join("exp", "t1"), dst.join("exp", "t1")])
    assert res.exit_code == EXIT_FAILURE
    assert "checkpoint_000001" in res.stderr and "model.bin" in res.stderr
    assert committed_names(dst.ctx()) == ["checkpoint_000000", "checkpoint_000002"]


def test_cp_onto_a_different_committed_checkpoint_conflicts(tmp_path) -> None:
    a, b = Store(str(tmp_path / "a")), Store(str(tmp_path / "b"))
    make_trial(a, tmp_path, [0.5])
    other = write_tree(str(tmp_path / "other"), {"model.bin": b"different bytes"})
    assert invoke(["upload", other, b.join("exp", "t1")]).exit_code == 0
    res = invoke(["cp", a.join("exp", "t1", "checkpoint_000000"), b.join("exp", "t1")])
    assert res.exit_code == EXIT_FAILURE
    assert "already a committed checkpoint" in res.stderr
    assert Checkpoint(b.join("exp", "t1", "checkpoint_000000")).internal_metadata[
        "manifest"][0]["size"] == len(b"different bytes")


# -- usage errors, options, help -------------------------------------------------------


def test_bad_scheme_exits_2_with_one_line_listing_known_schemes() -> None:
    res = invoke(["ls", "nosuchscheme://bucket/x"])
    assert res.exit_code == EXIT_USAGE
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1
    for scheme in ("file", "memory", "s3", "az", "gs"):
        assert f" {scheme}," in lines[0] or f" {scheme}." in lines[0]


def test_bad_scheme_through_the_installed_command() -> None:
    exe = os.path.join(os.path.dirname(sys.executable), "checkpoint-store")
    proc = subprocess.run([exe, "verify", "nosuchscheme://b/x"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == EXIT_USAGE
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Registered schemes:" in proc.stderr and "memory" in proc.stderr


def test_malformed_storage_option_is_a_usage_error(tmp_path) -> None:
    res = invoke(["ls", "memory://x", "-o", "no-equals-sign"])
    assert res.exit_code == EXIT_USAGE
    assert "KEY=VALUE" in res.output


def test_storage_option_on_a_local_path_is_a_usage_error(tmp_path) -> None:
    res = invoke(["ls", str(tmp_path), "-o", "region=x"])
    assert res.exit_code == EXIT_USAGE


def test_debug_prints_the_traceback(tmp_path) -> None:
    plain = invoke(["show", str(tmp_path / "missing")])
    assert plain.exit_code == EXIT_FAILURE and "Traceback" not in plain.stderr
    debug = invoke(["--debug", "show", str(tmp_path / "missing")])
    assert debug.exit_code == EXIT_FAILURE and "Traceback" in debug.stderr
    after = invoke(["show", str(tmp_path / "missing"), "--debug"])
    assert "Traceback" in after.stderr


@pytest.mark.parametrize("command", ["ls", "show", "best", "download", "upload", "cp", "export",
                                     "import", "verify",
                                     "prune", "gc", "backends", "demo"])
def test_every_command_has_help_with_examples(command: str) -> None:
    res = invoke([command, "--help"])
    assert res.exit_code == 0
    assert "Examples:" in res.stdout and f"checkpoint-store {command}" in res.stdout


def test_top_level_help_and_version() -> None:
    res = invoke(["--help"])
    assert res.exit_code == 0
    for command in ("ls", "show", "best", "download", "upload", "cp", "verify", "prune", "gc",
                    "backends", "demo"):
        assert f"  {command} " in res.stdout
    assert invoke(["--version"]).stdout.startswith("checkpoint-store, version ")


def test_backends_lists_schemes_and_distributions() -> None:
    data = json.loads(invoke(["backends", "--json"]).stdout)
    by_scheme = {r["scheme"]: r for r in data}
    assert by_scheme["file"]["provided_by"] == "checkpoint-store"
    assert by_scheme["memory"]["installed"] is True
    assert by_scheme["s3"]["provided_by"] == "checkpoint-store-s3"
    assert by_scheme["az"]["provided_by"] == "checkpoint-store-azure"
    table = invoke(["backends"]).stdout
    assert "s3://" in table and "checkpoint-store-s3" in table


# -- progress bars --------------------------------------------------------------------


def test_transfers_are_silent_when_stdout_is_not_a_terminal(tmp_path) -> None:
    src = write_tree(str(tmp_path / "m"), {"w.bin": os.urandom(100_000)})
    res = invoke(["upload", src, str(tmp_path / "s" / "e" / "t")])
    assert res.exit_code == 0
    assert res.stderr == ""
    quiet = invoke(["upload", src, str(tmp_path / "s" / "e" / "t"), "--quiet"])
    assert quiet.stdout.strip().endswith("checkpoint_000001")
    assert len(quiet.stdout.strip().splitlines()) == 1


def test_progress_bar_counts_every_byte_on_a_terminal(tmp_path, monkeypatch) -> None:
    from checkpoint_store.cli import progress as _cli_progress

    monkeypatch.setattr(_cli_progress, "_stdout_is_terminal", lambda: True)
    payload = os.urandom(300_000)
    src = write_tree(str(tmp_path / "m"), {"a.bin": payload, "b/c.bin": payload[:1000]})
    counted: list[int] = []
    drawn: list[bool] = []
    real = _cli_progress.Progress

    class Spy(real):  # type: ignore[misc, valid-type]
        def advance(self, n: int) -> None:
            counted.append(n)
            drawn.append(self._progress is not None)  # a rich bar is live
            super().advance(n)

    monkeypatch.setattr(_cli_progress, "Progress", Spy)
    res = invoke(["upload", src, str(tmp_path / "s" / "e" / "t")])
    assert res.exit_code == 0, res.output
    assert sum(counted) == 301_000
    assert drawn and all(drawn)


# -- the demo still runs through this command group ------------------------------------


def test_demo_command_runs(tmp_path) -> None:
    res = invoke(["demo", "--epochs", "2", "--storage", str(tmp_path / "demo")])
    assert res.exit_code == 0, res.output
    assert "Best checkpoint" in res.stdout
    ls = invoke(["ls", str(tmp_path / "demo" / "digits-demo" / "mlp"), "--json"])
    assert [c["index"] for c in json.loads(ls.stdout)["checkpoints"]] == [0, 1]
    assert Checkpoint(str(tmp_path / "demo" / "digits-demo" / "mlp" /
                          "checkpoint_000001")).is_committed


def test_cp_corrupt_large_source_file_is_not_left_committed(tmp_path) -> None:
    # Files larger than one chunk move as parallel ranged reads; the manifest computed
    # on arrival is compared with the source's before cp reports success.
    local = Store(str(tmp_path / "local"))
    ctx = local.ctx()
    src = write_tree(str(tmp_path / "big"), {"model.bin": os.urandom(9 * 1024 * 1024 + 17)})
    ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {"loss": 1.0}})
    path = posixpath.join(ctx.checkpoint_path(0), "model.bin")
    with open(path, "r+b") as f:
        f.seek(5 * 1024 * 1024)
        byte = f.read(1)
        f.seek(5 * 1024 * 1024)
        f.write(bytes([byte[0] ^ 0x10]))
    dst = Store(str(tmp_path / "dst"))
    res = invoke(["cp", local.join("exp", "t1"), dst.join("exp", "t1")])
    assert res.exit_code == EXIT_FAILURE
    assert "model.bin" in res.stderr
    assert committed_names(dst.ctx()) == []


def test_download_progress_counts_ranged_reads(tmp_path, monkeypatch) -> None:
    from checkpoint_store.cli import progress as _cli_progress

    local = Store(str(tmp_path / "local"))
    payload = os.urandom(9 * 1024 * 1024 + 5)
    src = write_tree(str(tmp_path / "big"), {"model.bin": payload, "small.txt": b"x" * 10})
    local.ctx().persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {}})
    monkeypatch.setattr(_cli_progress, "_stdout_is_terminal", lambda: True)
    counted: list[int] = []
    real = _cli_progress.Progress

    class Spy(real):  # type: ignore[misc, valid-type]
        def advance(self, n: int) -> None:
            counted.append(n)
            super().advance(n)

    monkeypatch.setattr(_cli_progress, "Progress", Spy)
    dest = tmp_path / "out"
    res = invoke(["download", local.join("exp", "t1", "checkpoint_000000"), str(dest)])
    assert res.exit_code == 0, res.output
    assert sum(counted) == len(payload) + 10
    assert (dest / "model.bin").read_bytes() == payload


@pytest.mark.parametrize("kind", ["s3", "azure"])
def test_installed_command_takes_credentials_from_the_standard_variables(
        kind: str, tmp_path, request: pytest.FixtureRequest) -> None:
    loc = request.getfixturevalue(f"{kind}_location")
    store = Store(loc.uri, dict(loc.storage_options))
    make_trial(store, tmp_path, [0.5, 0.2])
    exe = os.path.join(os.path.dirname(sys.executable), "checkpoint-store")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "AZURE_"))}
    env.update(loc.env)
    proc = subprocess.run([exe, "ls", store.join("exp", "t1"), "--json"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert [c["index"] for c in json.loads(proc.stdout)["checkpoints"]] == [0, 1]
    assert proc.stderr == ""


@pytest.mark.filterwarnings("ignore:retention state .* is missing:RuntimeWarning")
def test_prune_and_gc_refuse_a_trial_a_running_job_manages(tmp_path) -> None:
    from checkpoint_store import session

    store = Store(str(tmp_path / "s"))
    ctx = make_trial(store, tmp_path, [0.5, 0.2, 0.4])
    trial = store.join("exp", "t1")
    prune = ["prune", trial, "--keep", "1", "--metric", "loss", "--mode", "min"]
    with session.start(storage_path=store.uri, experiment_name="exp", trial_name="t1"):
        res = invoke(prune)
        assert res.exit_code == EXIT_FAILURE
        assert "running job" in res.stderr and "--force" in res.stderr
        assert invoke(["gc", trial, "--min-age", "0"]).exit_code == EXIT_FAILURE
        assert invoke([*prune, "--dry-run"]).exit_code == 0
        assert committed_names(ctx) == [f"checkpoint_{i:06d}" for i in range(3)]
    res = invoke(prune)
    assert res.exit_code == 0, res.output
    assert committed_names(ctx) == ["checkpoint_000001", "checkpoint_000002"]


def test_unreachable_store_exits_1_with_one_line(monkeypatch) -> None:
    monkeypatch.setenv("CHECKPOINT_STORE_RETRY_ATTEMPTS", "1")
    res = invoke(["ls", "s3://some-bucket/runs", "-o", "endpoint_url=http://127.0.0.1:9",
                  "-o", "access_key_id=a", "-o", "secret_access_key=b", "-o", "region=us-east-1"])
    assert res.exit_code == EXIT_FAILURE
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "(hint: " in lines[0]


def test_commands_on_gcs(gcs_location, tmp_path) -> None:
    # Not required of every command, but gs:// is a shipped plugin: one pass over it.
    store = Store(gcs_location.uri, dict(gcs_location.storage_options))
    ctx = make_trial(store, tmp_path, [0.5, 0.2, 0.4], uncommitted=True)
    opts, trial = store.opt_args(), store.join("exp", "t1")
    listing = json.loads(invoke(["ls", trial, *opts, "--json"]).stdout)
    assert [c["index"] for c in listing["checkpoints"]] == [0, 1, 2]
    assert invoke(["verify", store.uri, *opts]).exit_code == 0
    assert invoke(["best", trial, *opts, "--metric", "loss", "--mode", "min"]).stdout.startswith(
        ctx.checkpoint("checkpoint_000001").uri)
    back = Store(str(tmp_path / "back"))
    assert invoke(["cp", trial, back.join("exp", "t1"), *opts]).exit_code == 0
    assert committed_names(back.ctx()) == committed_names(ctx)
    assert invoke(["prune", trial, *opts, "--keep", "1", "--metric", "loss",
                   "--mode", "min"]).exit_code == 0
    assert committed_names(ctx) == ["checkpoint_000001", "checkpoint_000002"]
