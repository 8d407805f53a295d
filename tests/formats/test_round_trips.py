"""Export and import on every backend: bit-exact round trips on every dtype,
through a Hugging Face folder, a torch.save file and a DCP directory, and
the imported checkpoint used as any other (partial loads, verify, resume)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from checkpoint_store import Checkpoint, session
from checkpoint_store.formats import export_checkpoint, import_checkpoint
from checkpoint_store.state import DTYPES
from tests.formats.conftest import Place


def _bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def every_dtype() -> dict[str, torch.Tensor]:
    """One tensor per dtype torch and safetensors share, odd shapes included
    (0-d, empty, NaN payloads, negative zero)."""
    g = torch.Generator().manual_seed(7)
    out: dict[str, torch.Tensor] = {}
    for name, (_, _np, tname) in DTYPES.items():
        dtype = getattr(torch, str(tname), None)
        if dtype is None:
            continue
        raw = torch.randint(0, 256, (3, 5, 8), generator=g, dtype=torch.uint8)
        size = torch.empty((), dtype=dtype).element_size()
        t = raw.reshape(-1)[: 3 * 5 * (8 // size) * size].view(dtype).reshape(3, 5, -1)
        out[f"t_{name.lower()}"] = t.clone()
    out["scalar"] = torch.tensor(-0.0)
    out["empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    out["nan"] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float16)
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert (a[k].dtype, tuple(a[k].shape)) == (b[k].dtype, tuple(b[k].shape)), k
        assert _bytes(a[k]) == _bytes(b[k]), k


def test_hf_round_trip_is_bit_exact_on_every_dtype(place: Place, tmp_path: Any, make) -> None:
    model = every_dtype()
    ck = place.persist_state(tmp_path, {"model": model, "step": 4})
    # Small shards: several files and an index.
    out = export_checkpoint(ck, place.loc("hf"), max_shard_size=200, **place.side("target_"))
    assert "model.safetensors.index.json" in out.files and len(out.files) > 3
    assert out.tensors == len(model)
    # Copied into a checkpoint elsewhere (memory), then in place where it is.
    mem = make("memory")
    copied = import_checkpoint(place.loc("hf"), mem.loc("imported"), **place.side(""))
    copied.verify()
    same_bits(copied.load_state()["model"], model)
    here = import_checkpoint(place.loc("hf"), **place.side(""))
    assert here.is_committed
    here.verify()
    same_bits(here.load_state(keys="model")["model"], model)
    part = here.load_state(keys=["model/t_bf16", "model/scalar"])["model"]
    same_bits(part, {k: model[k] for k in ("t_bf16", "scalar")})


def test_torch_save_and_dcp_round_trips_keep_the_tree(place: Place, tmp_path: Any) -> None:
    tree = {"model": every_dtype(), "optimizer": {"state": {"0": {"step": torch.tensor(3.0)}},
                                                  "lr": 0.5}, "step": 9, "note": "ok"}
    ck = place.persist_state(tmp_path, tree)
    side = place.side("target_")
    export_checkpoint(ck, place.loc("x.pt"), format="torch_save", **side)
    export_checkpoint(ck, place.loc("dcp"), format="dcp", **side)
    for name, dest in (("x.pt", "from_pt"), ("dcp", "from_dcp")):
        back = import_checkpoint(place.loc(name), place.loc(dest), **place.side(""),
                                 **place.side("dest_"))
        back.verify()
        got = back.load_state()
        same_bits(got["model"], tree["model"])
        assert (got["step"], got["note"], got["optimizer"]["lr"]) == (9, "ok", 0.5), name
        assert float(got["optimizer"]["state"]["0"]["step"]) == 3.0
        assert back.load_state(keys="step") == {"step": 9}


def test_torch_save_export_loads_with_torch_alone(tmp_path: Any, make) -> None:
    place = make("local")
    tree = {"model": {"w": torch.randn(4, 4), "b": torch.zeros(4, dtype=torch.int8)}, "step": 2}
    ck = place.persist_state(tmp_path, tree)
    target = str(tmp_path / "sd.pt")
    export_checkpoint(ck, target, format="torch_save", prefix="model")
    got = torch.load(target, weights_only=True)
    same_bits(got, tree["model"])


def test_import_in_place_copies_no_tensor_byte(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "hub"
    folder.mkdir()
    tensors = {"h.0.w": torch.randn(64, 64), "h.1.w": torch.randn(64, 64)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "toy"}))
    before = {n: os.stat(folder / n).st_ino for n in os.listdir(folder)}
    ck = import_checkpoint(str(folder))
    after = {n: os.stat(folder / n).st_ino for n in before}
    assert before == after  # the same files, not copies
    assert sorted(os.listdir(folder)) == [".internal_metadata.json", "config.json",
                                          "model.safetensors", "state.json"]
    manifest = {e["path"] for e in ck.internal_metadata["manifest"]}
    assert manifest == {"config.json", "model.safetensors", "state.json"}
    same_bits(ck.load_state()["model"], tensors)


def test_resume_from_an_imported_checkpoint(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "hub"
    folder.mkdir()
    tensors = {"w": torch.arange(6, dtype=torch.float32)}
    save_file(tensors, str(folder / "model.safetensors"))
    ck = import_checkpoint(str(folder), str(tmp_path / "ckpt"))
    with session.start(storage_path=str(tmp_path / "runs"), experiment_name="exp",
                       trial_name="t", resume_from=ck):
        got = session.get_checkpoint()
        assert got is not None and got.uri == ck.uri
        into = {"model": {"w": torch.zeros(6)}}
        got.load_state(into=into)
        assert torch.equal(into["model"]["w"], tensors["w"])
    assert isinstance(ck, Checkpoint)


@pytest.mark.parametrize("fmt", ["torch_save", "dcp"])
def test_import_source_on_object_store_is_read_locally(fmt: str, tmp_path: Any, make) -> None:
    """A torch.save file or DCP directory on S3 is fetched into a temporary
    directory (torch reads local files only), converted, and the temporary
    copy removed."""
    s3 = make("s3")
    ck = s3.persist_state(tmp_path, {"model": {"w": torch.randn(3)}})
    name = "x.pt" if fmt == "torch_save" else "dcp"
    export_checkpoint(ck, s3.loc(name), format=fmt, **s3.side("target_"))
    back = import_checkpoint(s3.loc(name), str(tmp_path / "back"), **s3.side(""))
    assert torch.equal(back.load_state()["model"]["w"], ck.load_state()["model"]["w"])


def test_tensors_straddling_pieces_keep_their_checksums(monkeypatch, tmp_path: Any,
                                                         make) -> None:
    """Pieces of 96 bytes: every tensor spans several, and pieces start and
    end inside tensors, in the export's reads, the import's one pass over
    each file (per-tensor CRC32C from slices of pieces) and its copy."""
    from checkpoint_store.formats import _api, _shards, _sources, _torch

    for mod in (_api, _shards, _sources, _torch):
        monkeypatch.setattr(mod, "CHUNK_BYTES", 96)
    g = torch.Generator().manual_seed(3)
    model = {f"w{i}": torch.randn(i * 7 + 1, generator=g) for i in range(12)}
    model["e"] = torch.empty(0)
    place = make("memory")
    ck = place.persist_state(tmp_path, {"model": model})
    export_checkpoint(ck, place.loc("hf"), max_shard_size=300)
    copied = import_checkpoint(place.loc("hf"), place.loc("copy"))
    here = import_checkpoint(place.loc("hf"))
    for back in (copied, here):
        back.verify()
        same_bits(back.load_state()["model"], model)  # every tensor's CRC32C checked
    export_checkpoint(here, place.loc("x.pt"), format="torch_save")
    again = import_checkpoint(place.loc("x.pt"), place.loc("from-pt"), shard_bytes=200)
    same_bits(again.load_state()["model"], model)


def test_copied_import_carries_the_tensors_index(place: Place, tmp_path: Any, make) -> None:
    """A copied import's commit marker holds the same ``tensors`` index an
    in-place import's does (and its own ``state.json`` does), so partial
    loads read through the index alike; on every backend and source format."""
    model = {"a": torch.arange(6, dtype=torch.int16), "b": torch.randn(2, 3)}
    ck = place.persist_state(tmp_path, {"model": model, "step": 1})
    side = place.side("target_")
    export_checkpoint(ck, place.loc("hf"), **side)
    export_checkpoint(ck, place.loc("x.pt"), format="torch_save", **side)
    export_checkpoint(ck, place.loc("dcp"), format="dcp", **side)
    for name in ("hf", "x.pt", "dcp"):
        copied = import_checkpoint(place.loc(name), place.loc(f"copy-{name}"), **place.side(""),
                                   **place.side("dest_"))
        meta = copied.internal_metadata
        assert meta["format_version"] == 2, name
        state = json.loads(copied.backend.filesystem.open_input_stream(
            f"{copied.path}/state.json").read())
        assert meta["tensors"] == state["tensors"], name
        assert sorted(meta["tensors"]) == ["model/a", "model/b"], name
        got = copied.load_state(keys="model/a")["model"]
        same_bits(got, {"a": model["a"]})
        if name != "x.pt":
            here = import_checkpoint(place.loc(name), **place.side(""))
            assert here.internal_metadata["tensors"] == meta["tensors"], name


@pytest.mark.parametrize("fmt", ["torch_save", "dcp"])
def test_exports_load_with_torch_alone_bit_exact(fmt: str, tmp_path: Any, make) -> None:
    """The streamed writers' output is what torch itself reads: ``torch.load``
    (weights_only, and mmap) of a torch.save file, ``dcp.load`` and
    ``dcp_to_torch_save`` of a DCP directory; every dtype, a tied tensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model = every_dtype()
    model["tied"] = model["t_f32"]
    ck = make("local").persist_state(tmp_path, {"model": model, "step": 5, "lr": [0.1]})
    out = str(tmp_path / f"out-{fmt}")
    export_checkpoint(ck, out, format=fmt)
    if fmt == "dcp":
        into = {"model": {k: torch.empty_like(v) for k, v in model.items()}}
        dcp.load(into, checkpoint_id=out, no_dist=True)
        same_bits(into["model"], model)
        dcp_to_torch_save(out, str(tmp_path / "back.pt"))
        out = str(tmp_path / "back.pt")
    for mmap in (False, True):
        got = torch.load(out, weights_only=True, mmap=mmap)
        same_bits(got["model"], model)
        assert (got["step"], list(got["lr"])) == (5, [0.1])


def test_torch_save_export_is_byte_identical_to_torch_save(tmp_path: Any, make) -> None:
    """The record-by-record writer mirrors ``torch.serialization._save``: the
    file equals, byte for byte, what ``torch.save`` writes for the same tree
    (every dtype, a tied tensor, plain values) at a path of the same name."""
    model = every_dtype()
    model["tied"] = model["t_f32"]
    tree = {"model": model, "opt": {"lr": 0.5, "betas": (0.9, 0.99)}, "step": 7}
    ck = make("local").persist_state(tmp_path, tree)
    (tmp_path / "ours").mkdir()
    (tmp_path / "torch").mkdir()
    export_checkpoint(ck, str(tmp_path / "ours" / "x.pt"), format="torch_save")
    torch.save(ck.load_state(), str(tmp_path / "torch" / "x.pt"))
    assert (tmp_path / "ours" / "x.pt").read_bytes() == (tmp_path / "torch" / "x.pt").read_bytes()
    got = torch.load(str(tmp_path / "ours" / "x.pt"), weights_only=True, mmap=True)
    assert got["model"]["tied"].data_ptr() == got["model"]["t_f32"].data_ptr()


@pytest.mark.parametrize("crc32", [True, False])
def test_exports_carry_the_crcs_torch_writes(crc32: bool, tmp_path: Any, make) -> None:
    """The archives are written with torch's CRC-32 off (a third of its
    speed) and their CRCs filled in afterwards: the torch.save export is
    byte for byte torch.save's file (its serialization id is made from the
    CRCs), every record of every archive (the DCP export's tensor files
    too) checks with ``zipfile``, and with torch's CRC option off the
    exports leave the CRCs 0 as torch.save then does."""
    import zipfile

    model = every_dtype()
    ck = make("local").persist_state(tmp_path, {"model": model})
    (tmp_path / "ref").mkdir()
    torch.serialization.set_crc32_options(crc32)
    try:
        export_checkpoint(ck, str(tmp_path / "x.pt"), format="torch_save")
        export_checkpoint(ck, str(tmp_path / "dcp"), format="dcp")
        torch.save(ck.load_state(), str(tmp_path / "ref" / "x.pt"))
    finally:
        torch.serialization.set_crc32_options(True)
    assert (tmp_path / "x.pt").read_bytes() == (tmp_path / "ref" / "x.pt").read_bytes()
    files = [tmp_path / "x.pt", *sorted((tmp_path / "dcp").glob("*.distcp"))]
    assert len(files) > 10
    for path in files:
        with zipfile.ZipFile(path) as z:
            crcs = [i.CRC for i in z.infolist() if i.file_size]
            if crc32:
                assert z.testzip() is None, path
                assert all(crcs), path
            else:
                assert not any(crcs), path
