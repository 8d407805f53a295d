"""Integrations that read a checkpoint's files from storage themselves meet a
checkpoint whose large files live as chunks (saved with dedup): Lightning's
state reader reads and checks them through the chunks; DCP's StorageReader,
which reads files in place, refuses with what to do instead, and that way
loads the same state."""

from __future__ import annotations

import os

import pyarrow.fs as pafs
import pytest
import torch

from checkpoint_store import Checkpoint, UploadConfig, session
from checkpoint_store.errors import CheckpointCorruptError, InvalidConfigError
from checkpoint_store.registry import backend_for_filesystem
from checkpoint_store.testing.chunked import write_chunked_checkpoint


def test_lightning_reads_and_checks_a_chunked_state_file(tmp_path) -> None:
    from checkpoint_store.integrations._lightning.state import STATE_FILE, verified

    fs = pafs.LocalFileSystem()
    path = str(tmp_path / "root" / "exp" / "t" / "checkpoint_000000")
    state = os.urandom(3 << 20)
    extra = os.urandom(2 << 20)
    write_chunked_checkpoint(fs, path, {STATE_FILE: state, "extra.bin": extra,
                                        "small.json": b"{}"},
                             chunked=[STATE_FILE, "extra.bin"])
    got, meta = verified(backend_for_filesystem(fs), path)
    assert got == state and meta is not None and meta["format_version"] == 3
    # A damaged chunk of another file fails the check, naming that file.
    chunk = next(e for e in meta["manifest"] if e["path"] == "extra.bin")["chunks"][0][0]
    obj = tmp_path / "root" / "exp" / ".cs_chunks" / chunk[:2] / chunk
    obj.write_bytes(obj.read_bytes()[:-1] + b"\0")
    with pytest.raises(CheckpointCorruptError) as err:
        verified(backend_for_filesystem(fs), path)
    assert err.value.file == "extra.bin"


def test_dcp_refuses_a_chunked_checkpoint_and_loads_it_from_a_local_copy(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    from checkpoint_store.integrations.torch import StorageReader

    state = {"w": torch.randn(512, 1024), "b": torch.arange(10)}
    src = tmp_path / "dcp"
    dcp.save(state, checkpoint_id=str(src))
    with session.start(storage_path=f"memory://dcp-{os.getpid()}/s", experiment_name="e",
                       trial_name="t", upload_config=UploadConfig(dedup=True)) as s:
        s.report({"step": 0}, checkpoint=Checkpoint.from_directory(src))
        ckpt = s.get_checkpoint()
    assert any("chunks" in e for e in ckpt.internal_metadata["manifest"])
    into = {"w": torch.zeros(512, 1024), "b": torch.zeros(10, dtype=torch.int64)}
    with pytest.raises(InvalidConfigError, match="as_directory"):
        dcp.load(into, storage_reader=StorageReader(ckpt.uri))
    with ckpt.as_directory() as d:
        dcp.load(into, checkpoint_id=d)
    assert torch.equal(into["w"], state["w"]) and torch.equal(into["b"], state["b"])


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_the_page_shows_and_verifies_a_chunked_state_checkpoint(kind, request, tmp_path) -> None:
    from checkpoint_store.ui._model import StoreView
    from tests.stores import make_store

    store = make_store(kind, request, tmp_path)
    tree = {"w": torch.randn(1 << 19), "b": torch.arange(4), "step": 3}
    with session.start(storage_path=store.uri, experiment_name="e", trial_name="t",
                       upload_config=UploadConfig(dedup=True)) as s:
        s.report({"step": 3}, state=tree)
    view = StoreView(store.uri)
    page = view.checkpoint("e", "t", "checkpoint_000000")
    assert page["state"] == "committed"
    assert {t["name"] for t in page["tensors"]} == {"w", "b"}
    assert any("chunks" in e for e in page["manifest"])
    assert page["size"] >= 4 << 19  # logical bytes, as loaded
    assert view.verify("e", "t", "checkpoint_000000")["ok"] is True


@pytest.mark.parametrize("fmt", ["hf", "torch_save", "dcp"])
def test_export_of_a_directory_checkpoint_whose_files_are_chunks(fmt, tmp_path) -> None:
    """A folder of model.safetensors, a torch.save file or a DCP save,
    reported with dedup: its large files live as chunks, and export reads
    them (detection by the manifest, a verified local copy to read from)."""
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    from checkpoint_store.formats import detect_format, export_checkpoint

    state = {"w": torch.randn(512, 1024), "b": torch.arange(10)}
    src = tmp_path / "src"
    src.mkdir()
    if fmt == "hf":
        safetensors.torch.save_file(state, str(src / "model.safetensors"))
    elif fmt == "torch_save":
        torch.save(state, str(src / "model.pt"))
    else:
        dcp.save(state, checkpoint_id=str(src))
    with session.start(storage_path=f"memory://exp-{fmt}-{os.getpid()}/s",
                       experiment_name="e", trial_name="t",
                       upload_config=UploadConfig(dedup=True)) as s:
        s.report({"step": 0}, checkpoint=Checkpoint.from_directory(src))
        ckpt = s.get_checkpoint()
    assert any("chunks" in e for e in ckpt.internal_metadata["manifest"])
    assert detect_format(ckpt.backend, ckpt.path) == ("hf" if fmt == "hf" else fmt)
    out = tmp_path / "out"
    export_checkpoint(ckpt, str(out / "model.pt"), format="torch_save")
    got = torch.load(str(out / "model.pt"), weights_only=True)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
