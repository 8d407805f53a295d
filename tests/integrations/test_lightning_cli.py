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

from checkpoint_store._commit.pointer import POINTER_FILE  # noqa: E402
from checkpoint_store.integrations.lightning import CheckpointStoreIO  # noqa: E402
from checkpoint_store.registry import resolve  # noqa: E402


def _state(step: int) -> dict:
    return {"global_step": step, "w": torch.full((16,), float(step))}


def _resaved(uri: str, opts: dict) -> tuple[object, str, str]:
    """``<uri>/ck`` with ``s1.ckpt`` and ``last.ckpt`` saved three times:
    ``(backend, ck path, the pointed sibling's name)``."""
    ck = f"{uri.rstrip('/')}/ck"
    io = CheckpointStoreIO(fsync=False, storage_options=opts or None)
    io.save_checkpoint(_state(1), f"{ck}/s1.ckpt")
    for step in (1, 2, 3):
        io.save_checkpoint(_state(step), f"{ck}/last.ckpt")
    io.teardown()
    backend, path = resolve(ck, storage_options=opts or None)
    with backend.filesystem.open_input_stream(f"{path}/last.ckpt/{POINTER_FILE}") as f:
        sibling = f.read().decode().strip()
    assert sibling.startswith(".cs_replace-last.ckpt-")
    return backend, ck, sibling


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.slow)])
def root(request, tmp_path) -> tuple[str, dict]:
    """A storage root and its backend options."""
    if request.param == "local":
        return str(tmp_path / "lt"), {}
    if request.param == "memory":
        return f"memory://lit-{uuid.uuid4().hex[:10]}/lt", {}
    loc = request.getfixturevalue("s3_location")
    return loc.uri, dict(loc.storage_options)


def _load(uri_dir: str, opts: dict) -> int:
    io = CheckpointStoreIO(storage_options=opts or None)
    return io.load_checkpoint(uri_dir)["global_step"]


def _cli(args: list[str], opts: dict) -> object:
    out = invoke([*args, *(a for k, v in opts.items() for a in ("-o", f"{k}={v}"))])
    assert out.exit_code == 0, out.output
    return out


def test_ls_and_verify_list_last_ckpt(root):
    uri, opts = root
    _, ck, _ = _resaved(uri, opts)
    out = _cli(["ls", ck, "--json"], opts)
    names = {c["name"] for c in json.loads(out.output)["checkpoints"]}
    assert names == {"s1.ckpt", "last.ckpt"}
    out = _cli(["verify", ck], opts)
    assert "/ck/last.ckpt" in out.output
    assert "2 checkpoints checked, 0 corrupt" in out.output


def test_cp_of_the_parent_copies_last_ckpt(root, tmp_path):
    uri, opts = root
    _, ck, _ = _resaved(uri, opts)
    dest = str(tmp_path / "backup")
    out = _cli(["cp", ck, dest], opts)
    assert "copied 2 checkpoints" in out.output
    copied = sorted(p.name for p in Path(dest).iterdir() if not p.name.startswith(".cs_"))
    assert copied == ["last.ckpt", "s1.ckpt"]
    assert _load(f"{dest}/last.ckpt", {}) == 3  # a plain committed checkpoint there


def test_show_and_download_follow_the_pointer(root, tmp_path):
    uri, opts = root
    _, ck, _ = _resaved(uri, opts)
    shown = json.loads(_cli(["show", f"{ck}/last.ckpt", "--json"], opts).output)
    assert shown["uri"].endswith("/ck/last.ckpt")
    assert shown["internal_metadata"]["index"] == 3
    _cli(["download", f"{ck}/last.ckpt", str(tmp_path / "dl")], opts)
    assert torch.load(tmp_path / "dl" / "checkpoint.ckpt")["global_step"] == 3


def test_gc_keeps_the_pointed_sibling(root):
    uri, opts = root
    backend, ck, sibling = _resaved(uri, opts)
    _, path = resolve(ck, storage_options=opts or None)
    report = json.loads(_cli(["gc", ck, "--min-age", "0", "--json"], opts).output)
    assert report["removed"] == [] and report["foreign"] == []
    assert sorted(report["committed"]) == ["last.ckpt", "s1.ckpt"]
    kind = backend.filesystem.get_file_info(f"{path}/{sibling}").type
    assert kind == pafs.FileType.Directory
    assert _load(f"{ck}/last.ckpt", opts) == 3


def test_prune_of_last_ckpt_removes_sibling_and_pointer(root):
    """An evicted last.ckpt goes whole: deleting its pointer alone would leave
    the sibling, which readers take for last.ckpt again."""
    uri, opts = root
    backend, ck, sibling = _resaved(uri, opts)
    _, path = resolve(ck, storage_options=opts or None)
    # Index 3 (last.ckpt) is newer than index 1 (s1.ckpt): keep the older one.
    report = json.loads(_cli(["prune", ck, "--keep", "1", "--metric", "step", "--mode", "min",
                              "--no-keep-latest", "--json"], opts).output)
    assert [d["name"] for d in report["deleted"]] == ["last.ckpt"]
    for name in (sibling, "last.ckpt"):
        kind = backend.filesystem.get_file_info(f"{path}/{name}").type
        assert kind == pafs.FileType.NotFound, name
    names = {c["name"] for c in json.loads(_cli(["ls", ck, "--json"], opts).output)["checkpoints"]}
    assert names == {"s1.ckpt"}


def test_resume_path_skips_a_pointer_it_did_not_write(root):
    """A `.cs_current` naming no replacement of its directory is one corrupt
    entry: `resume_path` skips it with a warning, as it skips a checkpoint that
    does not verify, instead of failing the resume."""
    from checkpoint_store.integrations.lightning import resume_path

    uri, opts = root
    backend, ck, _ = _resaved(uri, opts)
    _, path = resolve(ck, storage_options=opts or None)
    fs = backend.filesystem
    if backend.capabilities.directories:
        fs.create_dir(f"{path}/x.ckpt", recursive=True)
    with fs.open_output_stream(f"{path}/x.ckpt/{POINTER_FILE}") as f:
        f.write(b"garbage\n")
    with pytest.warns(RuntimeWarning, match="x.ckpt"):
        chosen = resume_path(ck, storage_options=opts or None)
    assert chosen is not None and chosen.endswith("/last.ckpt")
    assert _load(chosen, opts) == 3


def test_a_pointer_to_a_sibling_that_is_gone_is_named(root, tmp_path):
    """A removal cut short after the sibling went leaves `last.ckpt` holding only
    its pointer: `show`, `ls` and `download` say so, instead of "nothing
    exists" at a path that does."""
    uri, opts = root
    backend, ck, sibling = _resaved(uri, opts)
    _, path = resolve(ck, storage_options=opts or None)
    backend.filesystem.delete_dir(f"{path}/{sibling}")
    cli_opts = [a for k, v in opts.items() for a in ("-o", f"{k}={v}")]
    for args in (["show", f"{ck}/last.ckpt"], ["ls", f"{ck}/last.ckpt"],
                 ["download", f"{ck}/last.ckpt", str(tmp_path / "dl")]):
        out = invoke([*args, *cli_opts])
        assert out.exit_code == 1, out.output
        assert "holds a pointer to" in out.stderr and "nothing exists" not in out.stderr
