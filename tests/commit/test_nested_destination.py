"""A write destination inside a committed checkpoint is refused before anything
is written (a session's storage_path, a Lightning ``.ckpt``, a CLI upload), and
``verify`` of a tree names a corrupt checkpoint of any name."""

from __future__ import annotations

import os
from typing import Any

import pyarrow.fs as pafs
import pytest
from click.testing import CliRunner

from checkpoint_store import Checkpoint, NestedCheckpointError, session
from checkpoint_store.cli import main
from checkpoint_store.registry import resolve

pytest.importorskip("lightning")
from checkpoint_store.integrations.lightning import CheckpointStoreIO  # noqa: E402


@pytest.fixture(params=["local", "memory", "s3"])
def nstore(request: pytest.FixtureRequest, tmp_path) -> Any:
    return request.getfixturevalue("make_store_for")(request.param)


def _tree(store: Any) -> dict[str, int]:
    backend, root = resolve(store.uri, storage_options=store.options or None)
    infos = backend.filesystem.get_file_info(pafs.FileSelector(root, recursive=True))
    return {i.path: i.size or 0 for i in infos if i.type == pafs.FileType.File}


def _cli(store: Any, *args: str):
    return CliRunner().invoke(main, [*args, *store.opt_args()])


def _report_one(store: Any, src: str) -> None:
    with session.start(storage_path=store.uri, experiment_name="exp", trial_name="t",
                       storage_options=store.options or None):
        session.report({"loss": 0.5}, checkpoint=Checkpoint.from_directory(src))


@pytest.fixture
def src(tmp_path) -> str:
    d = tmp_path / "src"
    d.mkdir()
    (d / "m.bin").write_bytes(os.urandom(1000))
    return str(d)


def test_storage_path_inside_checkpoint_is_refused(nstore, src):
    _report_one(nstore, src)
    before = _tree(nstore)
    inside = nstore.join("exp", "t", "checkpoint_000000")
    with pytest.raises(NestedCheckpointError, match="inside the committed checkpoint") as exc:
        session.start(storage_path=inside, experiment_name="exp", trial_name="t",
                      storage_options=nstore.options or None)
    assert exc.value.path.endswith("exp/t/checkpoint_000000")
    assert exc.value.file == "exp/t"
    assert _tree(nstore) == before
    # The original trial still resumes from its checkpoint, which verifies.
    with session.start(storage_path=nstore.uri, experiment_name="exp", trial_name="t",
                       storage_options=nstore.options or None):
        assert session.get_checkpoint().path.endswith("checkpoint_000000")
    result = _cli(nstore, "verify", nstore.uri)
    assert result.exit_code == 0, result.output
    assert "1 checkpoints checked, 0 corrupt" in result.output


def test_lightning_ckpt_inside_ckpt_is_refused(nstore):
    io = CheckpointStoreIO(storage_options=nstore.options or None)
    outer = nstore.join("ck", "a.ckpt")
    io.save_checkpoint({"step": 1, "state_dict": {}}, outer)
    before = _tree(nstore)
    with pytest.raises(NestedCheckpointError):
        io.save_checkpoint({"step": 2, "state_dict": {}}, nstore.join("ck", "a.ckpt", "inner.ckpt"))
    assert _tree(nstore) == before
    assert io.load_checkpoint(outer)["step"] == 1
    # A storage_path inside the Lightning checkpoint is refused the same way.
    with pytest.raises(NestedCheckpointError):
        session.start(storage_path=outer, experiment_name="exp", trial_name="t",
                      storage_options=nstore.options or None)
    assert _tree(nstore) == before


def test_upload_into_checkpoint_subdirectory_is_refused(nstore, src):
    _report_one(nstore, src)
    before = _tree(nstore)
    target = nstore.join("exp", "t", "checkpoint_000000", "sub", "t2")
    result = _cli(nstore, "upload", src, target)
    assert result.exit_code != 0
    assert "inside the committed checkpoint" in result.output
    assert _tree(nstore) == before


def test_verify_names_a_corrupt_lightning_checkpoint(nstore):
    io = CheckpointStoreIO(storage_options=nstore.options or None)
    io.save_checkpoint({"step": 1, "state_dict": {}}, nstore.join("ck", "a.ckpt"))
    io.save_checkpoint({"step": 2, "state_dict": {}}, nstore.join("ck", "b.ckpt"))
    backend, path = resolve(nstore.join("ck", "a.ckpt", "extra.bin"),
                            storage_options=nstore.options or None)
    with backend.filesystem.open_output_stream(path) as f:  # what the old bug wrote
        f.write(b"x")
    result = _cli(nstore, "verify", nstore.join("ck"))
    assert result.exit_code == 1, result.output
    assert "CORRUPT" in result.output and "a.ckpt" in result.output
    assert "1 corrupt" in result.output


def test_lightning_ckpt_inside_a_resaved_ckpt_is_refused(nstore):
    """Saved twice, ``a.ckpt`` is a pointer to its current replacement: still a
    committed checkpoint, so nothing may be written under it."""
    io = CheckpointStoreIO(storage_options=nstore.options or None)
    outer = nstore.join("ck", "a.ckpt")
    io.save_checkpoint({"step": 1, "state_dict": {}}, outer)
    io.save_checkpoint({"step": 2, "state_dict": {}}, outer)
    before = _tree(nstore)
    with pytest.raises(NestedCheckpointError):
        io.save_checkpoint({"step": 3, "state_dict": {}}, nstore.join("ck", "a.ckpt", "in.ckpt"))
    with pytest.raises(NestedCheckpointError):
        session.start(storage_path=outer, experiment_name="exp", trial_name="t",
                      storage_options=nstore.options or None)
    assert _tree(nstore) == before
    assert io.load_checkpoint(outer)["step"] == 2
