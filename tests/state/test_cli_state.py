"""The command line on a checkpoint saved from a state: ``show`` sums the
tensor index up instead of printing it, ``cp`` keeps it (format version 2)
and ``verify`` names a damaged tensor's file."""

from __future__ import annotations

import json
import os

import torch
from click.testing import CliRunner

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store.cli import main
from checkpoint_store.state import write_state


def _invoke(args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _state_checkpoint(tmp_path):
    tree = {"model": {f"w{i}": torch.full((256,), float(i)) for i in range(5)},
            "tied": None, "step": 3}
    tensors = write_state(tree, tmp_path / "src")
    ctx = StorageContext(str(tmp_path / "store"), "exp", "t")
    return tree, ctx.persist_checkpoint(Checkpoint.from_directory(tmp_path / "src"), 0,
                                        {"tensors": tensors})


def test_show_sums_the_tensor_index_up(tmp_path) -> None:
    _, ck = _state_checkpoint(tmp_path)
    res = _invoke(["show", ck.path])
    assert res.exit_code == 0, res.output
    assert "tensors         5 (5.0 KiB)" in res.stdout
    assert "crc32c" not in res.stdout  # not the index itself
    assert "format          2" in res.stdout


def test_cp_keeps_the_index_and_the_copy_loads(tmp_path) -> None:
    tree, ck = _state_checkpoint(tmp_path)
    dest = tmp_path / "copy" / "exp" / "t"
    res = _invoke(["cp", os.path.dirname(ck.path), str(dest)])
    assert res.exit_code == 0, res.output
    copied = Checkpoint(str(dest / "checkpoint_000000"))
    meta = json.loads((dest / "checkpoint_000000" / ".internal_metadata.json").read_text())
    assert meta["format_version"] == 2 and meta["tensors"] == ck.internal_metadata["tensors"]
    back = copied.load_state()
    assert all(torch.equal(back["model"][k], v) for k, v in tree["model"].items())


def test_verify_exits_1_on_a_damaged_tensor(tmp_path) -> None:
    _, ck = _state_checkpoint(tmp_path)
    e = ck.internal_metadata["tensors"]["model/w2"]
    with open(os.path.join(ck.path, e["file"]), "r+b") as f:
        f.seek(e["offsets"][0] + 1)
        f.write(b"\xff")
    res = _invoke(["verify", ck.path])
    assert res.exit_code == 1
    assert e["file"] in res.output
