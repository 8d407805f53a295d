"""One trial, many spellings, off local disks: scheme aliases, scheme case, a
trailing ``/`` and ``.`` components name the trial the lease already names, so
a second manager is refused (issue 11, kind 3); ``file://`` paths are
percent-decoded as RFC 8089 and pyarrow read them."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from click.testing import CliRunner

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointConflictError,
    CheckpointManager,
    InvalidConfigError,
    StorageContext,
    TrialInUseError,
    session,
)
from checkpoint_store.cli import main
from checkpoint_store.registry import resolve

_ALIAS = {"s3": "s3a", "s3fs": "s3a", "azure": "abfs", "gcs": "gcs"}


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _spellings(kind: str, uri: str) -> list[str]:
    """Other spellings of ``uri``: alias scheme, upper-case scheme, a trailing
    ``/``, a ``.`` component."""
    scheme, rest = uri.split("://", 1)
    bucket, _, key = rest.partition("/")
    out = [f"{scheme.upper()}://{rest}", f"{uri}/", f"{scheme}://{bucket}/./{key}"]
    if kind in _ALIAS:
        out.insert(0, f"{_ALIAS[kind]}://{rest}")
    return out


@pytest.fixture
def src(tmp_path) -> str:
    d = tmp_path / "src"
    d.mkdir()
    (d / "model.bin").write_bytes(b"weights" * 8)
    return str(d)


@pytest.mark.parametrize("store", ["memory", "s3", "s3fs", "azure", "gcs"], indirect=True)
def test_every_spelling_of_a_held_trial_is_refused(store, src):
    kind = store.kind
    opts = store.options or None
    with session.start(storage_path=store.uri, experiment_name="e", trial_name="t",
                       storage_options=opts):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
        for other in _spellings(kind, store.uri):
            with pytest.raises(TrialInUseError, match="another live checkpoint manager") as ei:
                CheckpointManager(CheckpointConfig(1),
                                  StorageContext(other, "e", "t", storage_options=opts))
            # The lease names this very trial: no advice to delete it as a copy.
            assert "copied" not in str(ei.value)
        # The input: a second session through the first other spelling.
        errors: list[BaseException] = []

        def second() -> None:
            try:
                session.start(storage_path=_spellings(kind, store.uri)[0],
                              experiment_name="e", trial_name="t", storage_options=opts,
                              _thread_only=True).end()
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=second)
        t.start()
        t.join()
        assert len(errors) == 1 and isinstance(errors[0], CheckpointConflictError)
    ctx = store.ctx("e", "t")
    rows = ctx.filesystem.open_input_stream(f"{ctx.trial_path}/result.json").read()
    assert len(rows.splitlines()) == 1  # nobody else appended


@pytest.mark.parametrize("store", ["memory", "s3", "s3fs", "azure", "gcs"], indirect=True)
def test_canonical_uri_is_one_per_location(store):
    kind = store.kind
    want = store.ctx("e", "t")
    want_uri = want.canonical_uri(want.trial_path)
    for other in _spellings(kind, store.uri):
        ctx = StorageContext(other, "e", "t", storage_options=store.options or None)
        assert ctx.canonical_uri(ctx.trial_path) == want_uri
        assert ctx.trial_path == want.trial_path
    assert want_uri == want_uri.lower().split("://")[0] + "://" + want_uri.split("://")[1]
    assert not want_uri.endswith("/") and "/./" not in want_uri


def test_a_lease_copied_from_another_location_is_still_ignored(tmp_path, src):
    # The judgement that spellings no longer fool still tells a real copy: a
    # lease recorded for memory://other/... is not this trial's.
    ctx = StorageContext("memory://lease-moved/store", "e", "t")
    ctx.ensure_trial_dir()
    fs = ctx.filesystem
    body = {"kind": "checkpoint_manager_lease", "holder": "x", "host": "elsewhere",
            "pid": 1, "trial": "memory://somewhere-else/store/e/t", "ttl_s": 3600,
            "renewed_at": 0, "expires_at": 4e9}
    with fs.open_output_stream(f"{ctx.trial_path}/.cs_manager_lease.json") as f:
        f.write(json.dumps(body).encode())
    with CheckpointManager(CheckpointConfig(1), ctx):
        pass
    # An older version's spelling of this very trial is live, not a copy.
    body["trial"] = "MEMORY://lease-moved/./store/e/t/"
    with fs.open_output_stream(f"{ctx.trial_path}/.cs_manager_lease.json") as f:
        f.write(json.dumps(body).encode())
    with pytest.raises(TrialInUseError) as ei:
        CheckpointManager(CheckpointConfig(1), StorageContext("memory://lease-moved/store",
                                                              "e", "t"))
    assert "copied" not in str(ei.value)


# -- hints ------------------------------------------------------------------------------


def test_symlinked_root_refusal_does_not_call_the_live_lease_a_copy(tmp_path):
    (tmp_path / "store").mkdir()
    os.symlink(tmp_path / "store", tmp_path / "link")
    with CheckpointManager(CheckpointConfig(1), StorageContext(tmp_path / "store", "e", "t")):
        with pytest.raises(TrialInUseError) as ei:
            CheckpointManager(CheckpointConfig(1), StorageContext(tmp_path / "link", "e", "t"))
    msg = str(ei.value)
    assert "copied" not in msg and ".cs_manager_lease.json" not in msg
    assert "End the other run" in msg


@pytest.mark.parametrize("command", ["prune", "gc"])
def test_cli_refusal_of_a_live_trial_hints_force_not_another_destination(tmp_path, src,
                                                                          command):
    root = tmp_path / "store"
    with session.start(storage_path=str(root), experiment_name="e", trial_name="t"):
        for i in range(2):
            session.report({"a": i}, checkpoint=Checkpoint.from_directory(src))
        args = [command, str(root / "e" / "t")] + (["--keep", "1"] if command == "prune" else [])
        result = _cli(*args)
    assert result.exit_code != 0
    assert "choose another destination" not in result.output
    assert "wait for the running job to end, or stop it" in result.output
    assert f"checkpoint-store {command} --force" in result.output


def test_cli_demo_on_a_live_trial_is_refused_and_deletes_nothing(tmp_path):
    # Found beside the inputs: the demo starts fresh by deleting its
    # trial, which must never happen under a live run.
    from checkpoint_store.demo._run import EXPERIMENT, TRIAL

    root = tmp_path / "store"
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"w")
    with session.start(storage_path=str(root), experiment_name=EXPERIMENT, trial_name=TRIAL):
        session.report({"epoch": 1, "val_accuracy": 0.5},
                       checkpoint=Checkpoint.from_directory(str(src)))
        result = _cli("demo", "--storage", str(root), "--epochs", "1")
        assert (root / EXPERIMENT / TRIAL / "checkpoint_000000").is_dir()
    assert result.exit_code != 0, result.output
    assert "choose another destination" not in result.output
    assert "wait for the running job to end, or stop it" in result.output


# -- file:// ----------------------------------------------------------------------------


def test_file_uri_is_percent_decoded_like_pyarrow(tmp_path, src):
    uri = (tmp_path / "sp ace").absolute().as_uri()
    with session.start(storage_path=uri, experiment_name="e", trial_name="t"):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
    assert (tmp_path / "sp ace" / "e" / "t" / "checkpoint_000000").is_dir()
    assert not (tmp_path / "sp%20ace").exists()
    _, arrow_path = pafs.FileSystem.from_uri(uri)
    assert resolve(uri)[1] == arrow_path


def test_cli_ls_decodes_a_file_uri(tmp_path, src):
    root = tmp_path / "a[1]"
    with session.start(storage_path=str(root), experiment_name="e", trial_name="t"):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
    result = _cli("ls", Path(root).as_uri(), "--json")
    assert result.exit_code == 0, result.output
    assert [r["name"] for r in json.loads(result.output)["experiments"]] == ["e"]


def test_a_literal_percent_round_trips_through_the_printed_uri(tmp_path, src):
    # Found beside the inputs: once file:// paths are decoded, a name
    # holding a literal "%41" must print escaped, or the printed URI names "A".
    root = tmp_path / "p%41"
    with session.start(storage_path=str(root), experiment_name="e", trial_name="t"):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
    printed = StorageContext(str(root), "e", "t").uri(str(root / "e" / "t"))
    assert resolve(printed)[1] == str(root / "e" / "t")


def test_subtree_trial_prints_a_uri_the_cli_accepts(tmp_path, src):
    base = tmp_path / "base"
    base.mkdir()
    fs = pafs.SubTreeFileSystem(str(base), pafs.LocalFileSystem())
    ctx = StorageContext("pf", "e", "t", storage_filesystem=fs)
    with session.start(storage_path="pf", experiment_name="e", trial_name="t",
                       storage_filesystem=fs):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
    printed = ctx.uri(ctx.trial_path)
    assert printed == f"file://{base}/pf/e/t"
    result = _cli("ls", printed, "--json")
    assert result.exit_code == 0, result.output


def test_file_uri_without_a_path_is_refused(tmp_path):
    with pytest.raises(InvalidConfigError, match="names no path"):
        resolve("file://")
    result = _cli("ls", "file://")
    assert result.exit_code == 2
    assert "names no path" in result.output


def test_subtree_filesystem_is_another_spelling_of_the_local_trial(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    fs = pafs.SubTreeFileSystem(str(base), pafs.LocalFileSystem())
    with CheckpointManager(CheckpointConfig(1), StorageContext(str(base / "pf"), "e", "t")):
        with pytest.raises(TrialInUseError):
            CheckpointManager(CheckpointConfig(1),
                              StorageContext("pf", "e", "t", storage_filesystem=fs))
