"""One trial, many spellings: every spelling of a location meets the same lease,
and a ``file://`` URI never writes outside the path it names (issue 11, kind 3)."""

from __future__ import annotations

import json
import os
import threading
import uuid

import fsspec
import pytest
from click.testing import CliRunner

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointConflictError,
    CheckpointManager,
    InvalidConfigError,
    StorageContext,
    session,
)
from checkpoint_store.cli import main
from checkpoint_store.registry import resolve


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def src(tmp_path) -> str:
    d = tmp_path / "src"
    d.mkdir()
    (d / "model.bin").write_bytes(b"weights" * 8)
    return str(d)


@pytest.fixture
def layout(tmp_path) -> dict[str, str]:
    """ROOT/store (the storage), ROOT/x (a directory) and ROOT/link -> ROOT/store."""
    root = tmp_path / "ROOT"
    (root / "store").mkdir(parents=True)
    (root / "x").mkdir()
    os.symlink(root / "store", root / "link")
    return {"root": str(root), "store": str(root / "store"),
            "dotdot": f"file://{root}/x/../store", "link": str(root / "link")}


@pytest.mark.parametrize("spelling", ["dotdot", "link", "link_uri"])
def test_second_manager_on_another_spelling_is_refused(layout, src, spelling):
    other = {"dotdot": layout["dotdot"], "link": layout["link"],
             "link_uri": "file://" + layout["link"]}[spelling]
    with session.start(storage_path=layout["store"], experiment_name="e", trial_name="t",
                       checkpoint_config=CheckpointConfig(num_to_keep=1)):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
        with pytest.raises(CheckpointConflictError, match="another live checkpoint manager"):
            CheckpointManager(CheckpointConfig(1), StorageContext(other, "e", "t"))
        # A second session (another thread) through that spelling is refused too.
        errors: list[BaseException] = []

        def second() -> None:
            try:
                session.start(storage_path=other, experiment_name="e", trial_name="t",
                              _thread_only=True).end()
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=second)
        t.start()
        t.join()
        assert len(errors) == 1 and isinstance(errors[0], CheckpointConflictError)
    # Released: the other spelling now opens the same trial and sees its checkpoint.
    with CheckpointManager(CheckpointConfig(1), StorageContext(other, "e", "t")) as m:
        assert m.kept_dir_names == ["checkpoint_000000"]


def test_prune_through_a_symlink_refuses_a_live_job(layout, src):
    with session.start(storage_path=layout["store"], experiment_name="e", trial_name="t"):
        for i in range(3):
            session.report({"a": i}, checkpoint=Checkpoint.from_directory(src))
        result = _cli("prune", os.path.join(layout["link"], "e", "t"), "--keep", "1")
        assert result.exit_code != 0
        assert "running job" in result.output
        assert sorted(os.listdir(os.path.join(layout["store"], "e", "t"))).count(
            "checkpoint_000000") == 1
        names = [n for n in os.listdir(os.path.join(layout["store"], "e", "t"))
                 if n.startswith("checkpoint_")]
        assert sorted(names) == ["checkpoint_000000", "checkpoint_000001", "checkpoint_000002"]


def test_lease_names_the_real_path(layout):
    a = StorageContext(layout["link"], "e", "t")
    b = StorageContext(layout["dotdot"], "e", "t")
    want = "file://" + os.path.realpath(os.path.join(layout["store"], "e", "t"))
    assert a.canonical_uri(a.trial_path) == want
    assert b.canonical_uri(b.trial_path) == want


def test_fsspec_local_filesystem_through_a_symlink_is_the_same_trial(layout, src):
    # Found beside the inputs: a user-supplied fsspec local filesystem
    # on the symlinked path is a third spelling of the same trial.
    fs = fsspec.filesystem("file")
    with CheckpointManager(CheckpointConfig(1), StorageContext(layout["store"], "e", "t")):
        with pytest.raises(CheckpointConflictError):
            CheckpointManager(CheckpointConfig(1), StorageContext(
                layout["link"], "e", "t", storage_filesystem=fs))


# -- file:// with a host part --------------------------------------------------------


def _absent_top_level_name() -> str:
    name = f"cs-host-{uuid.uuid4().hex[:10]}"
    assert not os.path.exists("/" + name)
    return name


@pytest.mark.parametrize("scheme", ["file", "local"])
def test_file_uri_with_a_host_is_refused_and_writes_nothing(scheme, src):
    name = _absent_top_level_name()
    with pytest.raises(InvalidConfigError, match=f"names the host '{name}'"):
        StorageContext(f"{scheme}://{name}/x", "e", "t")
    with pytest.raises(InvalidConfigError, match="three slashes"):
        with session.start(storage_path=f"{scheme}://{name}/x", experiment_name="e",
                           trial_name="t") as _:
            session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
    with pytest.raises(InvalidConfigError):
        Checkpoint(f"{scheme}://{name}/x/checkpoint_000000")
    assert not os.path.exists("/" + name)


def test_cli_upload_to_a_file_uri_with_a_host_writes_nothing(src):
    name = _absent_top_level_name()
    result = _cli("upload", src, f"file://{name}/e/t")
    assert result.exit_code != 0
    assert f"names the host '{name}'" in result.output
    assert not os.path.exists("/" + name)


def test_file_localhost_means_the_absolute_path(tmp_path, src):
    backend, path = resolve(f"file://localhost{tmp_path}/store")
    assert backend.scheme == "file" and path == f"{tmp_path}/store"
    assert resolve(f"file://LOCALHOST{tmp_path}/store/")[1] == f"{tmp_path}/store"
    assert resolve(f"file://{tmp_path}/store")[1] == f"{tmp_path}/store"
    with session.start(storage_path=f"file://localhost{tmp_path}/store", experiment_name="e",
                       trial_name="t"):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
    assert os.path.isdir(tmp_path / "store" / "e" / "t" / "checkpoint_000000")
    result = _cli("upload", src, f"file://localhost{tmp_path}/store/e/t2")
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(f"{tmp_path}/store/e/t2/checkpoint_000000")
    listed = json.loads(_cli("ls", f"file://localhost{tmp_path}/store/e", "--json").output)
    assert sorted(r["name"] for r in listed["trials"]) == ["t", "t2"]
