"""The CLI refuses trees that cannot be copied as they are, before the first byte:
a checkpoint holding a symlink out of it (``cp``), a symlink cycle
(``upload``), a download into the checkpoint itself (``download``)."""

from __future__ import annotations

import os
import posixpath
import uuid

import pytest
from cli_helpers import Store, committed_names, invoke, make_trial, write_tree

from checkpoint_store._util import fs as _fsutil


def _plant_link_out(tmp_path, ctx) -> bytes:
    """Replace checkpoint 0's ``model.bin`` by a symlink to a file of the same
    size outside the store: the checkpoint still lists as committed."""
    model = os.path.join(ctx.checkpoint_path(0), "model.bin")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"S" * os.path.getsize(model))
    os.unlink(model)
    os.symlink(secret, model)
    return secret.read_bytes()


@pytest.mark.parametrize("dest", ["local", "memory"])
def test_cp_of_a_checkpoint_holding_a_symlink_out_is_refused(tmp_path, dest):
    src = Store(str(tmp_path / "src"))
    ctx = make_trial(src, tmp_path, [0.5])
    _plant_link_out(tmp_path, ctx)
    before = sorted(os.listdir(ctx.checkpoint_path(0)))
    dst = (Store(str(tmp_path / "dst")) if dest == "local"
           else Store(f"memory://cli-{uuid.uuid4().hex[:10]}/dst"))
    target = dst.join("exp", "t1", "checkpoint_000000")
    result = invoke(["cp", src.join("exp", "t1", "checkpoint_000000"), target])
    assert result.exit_code == 1, result.output
    assert "'model.bin'" in result.stderr and "symlink leading out" in result.stderr
    assert "nothing was written" in result.stderr
    backend_ctx = dst.ctx("exp", "t1")
    assert not _fsutil.exists(backend_ctx.filesystem, backend_ctx.trial_path)
    assert sorted(os.listdir(ctx.checkpoint_path(0))) == before
    assert os.path.islink(os.path.join(ctx.checkpoint_path(0), "model.bin"))


def test_cp_of_a_trial_skips_the_checkpoint_with_a_link_out(tmp_path):
    """A backup copies every good checkpoint and fails naming the bad one."""
    src = Store(str(tmp_path / "src"))
    ctx = make_trial(src, tmp_path, [0.5, 0.4])
    _plant_link_out(tmp_path, ctx)
    dst = Store(str(tmp_path / "dst"))
    result = invoke(["cp", src.join("exp", "t1"), dst.join("exp", "t1")])
    assert result.exit_code == 1
    assert "checkpoint_000000" in result.stderr and "'model.bin'" in result.stderr
    assert committed_names(dst.ctx()) == ["checkpoint_000001"]
    leaked = [p for p in (tmp_path / "dst").rglob("model.bin")
              if p.read_bytes().startswith(b"SSSS")]
    assert leaked == []


@pytest.mark.parametrize("store_kind", ["local", "memory"])
def test_upload_of_a_directory_with_a_symlink_cycle_is_refused(tmp_path, store_kind):
    d = write_tree(str(tmp_path / "d"), {"model.bin": b"m", "sub/x.bin": b"x"})
    os.symlink("..", os.path.join(d, "sub", "up"))
    store = (Store(str(tmp_path / "store")) if store_kind == "local"
             else Store(f"memory://cli-{uuid.uuid4().hex[:10]}/store"))
    result = invoke(["upload", d, store.join("e", "t")])
    assert result.exit_code == 1, result.output
    assert "'sub/up'" in result.stderr and "symlink cycle" in result.stderr
    ctx = store.ctx("e", "t")
    assert dict(_fsutil.walk_files(ctx.filesystem, posixpath.dirname(ctx.trial_path))) == {}


def test_download_into_the_checkpoint_itself_is_refused(tmp_path):
    store = Store(str(tmp_path / "store"))
    ctx = make_trial(store, tmp_path, [0.5])
    ck = ctx.checkpoint_path(0)
    before = sorted(os.listdir(ck))
    result = invoke(["download", store.join("exp", "t1", "checkpoint_000000"),
                     os.path.join(ck, "restore")])
    assert result.exit_code == 2, result.output  # a usage error, as for cp and upload
    assert "lies inside the source" in result.stderr
    assert sorted(os.listdir(ck)) == before
    assert committed_names(ctx) == ["checkpoint_000000"]


@pytest.mark.parametrize("command", ["upload", "cp"])
def test_a_destination_name_that_cannot_fit_is_refused_and_leaves_nothing(tmp_path, command):
    """Today a 300-character trial name left empty directories and blamed the
    credentials; the name is refused first, naming it."""
    if command == "upload":
        src = write_tree(str(tmp_path / "d"), {"model.bin": b"m"})
    else:
        make_trial(Store(str(tmp_path / "src")), tmp_path, [0.5])
        src = str(tmp_path / "src" / "exp" / "t1")
    store = tmp_path / "store"
    result = invoke([command, src, str(store / "e" / ("t" * 300))])
    assert result.exit_code == 2, result.output
    assert "'tttt" in result.stderr and "300 bytes" in result.stderr
    assert "credentials" not in result.stderr
    assert not store.exists()
