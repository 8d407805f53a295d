"""The CLI follows a re-saved Lightning path's pointer (``last.ckpt/.cs_current``).

``ModelCheckpoint(save_last=True)`` through ``CheckpointStoreIO`` saves
``last.ckpt`` again and again: from the first re-save on, its checkpoint is
the ``.cs_replace-last.ckpt-<writer>`` sibling the pointer names. ``ls``,
``verify``, ``cp``, ``show``, ``download`` and ``gc`` must all see it as the
committed checkpoint ``last.ckpt``, and ``gc`` must never remove the sibling.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pyarrow.fs as pafs
import pytest

pytest.importorskip("lightning")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from cli_helpers import invoke  # noqa: E402

from checkpoint_store._pointer import POINTER_FILE  # noqa: E402
from checkpoint_store.integrations.lightning import CheckpointStoreIO  # noqa: E402
from checkpoint_store.registry import resolve  # noqa: E402


def _state(step: int) -> dict:
    return {"global_step": step, "w": torch.full((16,), float(step))}


def _resaved(uri: str) -> tuple[object, str, str]:
    """``<uri>/ck`` with ``s1.ckpt`` and ``last.ckpt`` saved three times:
    ``(backend, ck path, the pointed sibling's name)``."""
    ck = f"{uri.rstrip('/')}/ck"
    io = CheckpointStoreIO(fsync=False)
    io.save_checkpoint(_state(1), f"{ck}/s1.ckpt")
    for step in (1, 2, 3):
        io.save_checkpoint(_state(step), f"{ck}/last.ckpt")
    io.teardown()
    backend, path = resolve(ck)
    with backend.filesystem.open_input_stream(f"{path}/last.ckpt/{POINTER_FILE}") as f:
        sibling = f.read().decode().strip()
    assert sibling.startswith(".cs_replace-last.ckpt-")
    return backend, ck, sibling


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "lt")
    return f"memory://lit-{uuid.uuid4().hex[:10]}/lt"


def _load(uri_dir: str) -> int:
    return CheckpointStoreIO().load_checkpoint(uri_dir)["global_step"]


def test_ls_and_verify_list_last_ckpt(root):
    _, ck, _ = _resaved(root)
    out = invoke(["ls", ck, "--json"])
    assert out.exit_code == 0, out.output
    names = {c["name"] for c in json.loads(out.output)["checkpoints"]}
    assert names == {"s1.ckpt", "last.ckpt"}
    out = invoke(["verify", ck])
    assert out.exit_code == 0, out.output
    assert f"{ck}/last.ckpt" in out.output.replace("file://", "")
    assert "2 checkpoints checked, 0 corrupt" in out.output


def test_cp_of_the_parent_copies_last_ckpt(root, tmp_path):
    _, ck, _ = _resaved(root)
    dest = str(tmp_path / "backup")
    out = invoke(["cp", ck, dest])
    assert out.exit_code == 0, out.output
    assert "copied 2 checkpoints" in out.output
    assert sorted(p.name for p in Path(dest).iterdir() if not p.name.startswith(".cs_")) \
        == ["last.ckpt", "s1.ckpt"]
    assert _load(f"{dest}/last.ckpt") == 3  # a plain committed checkpoint there


def test_show_and_download_follow_the_pointer(root, tmp_path):
    _, ck, _ = _resaved(root)
    out = invoke(["show", f"{ck}/last.ckpt", "--json"])
    assert out.exit_code == 0, out.output
    shown = json.loads(out.output)
    assert shown["uri"].endswith("/ck/last.ckpt")
    assert shown["internal_metadata"]["index"] == 3
    out = invoke(["download", f"{ck}/last.ckpt", str(tmp_path / "dl")])
    assert out.exit_code == 0, out.output
    assert torch.load(tmp_path / "dl" / "checkpoint.ckpt")["global_step"] == 3


def test_gc_keeps_the_pointed_sibling(root):
    backend, ck, sibling = _resaved(root)
    _, path = resolve(ck)
    out = invoke(["gc", ck, "--min-age", "0", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["removed"] == [] and report["foreign"] == []
    assert sorted(report["committed"]) == ["last.ckpt", "s1.ckpt"]
    kind = backend.filesystem.get_file_info(f"{path}/{sibling}").type
    assert kind == pafs.FileType.Directory
    assert _load(f"{ck}/last.ckpt") == 3
