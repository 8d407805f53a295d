"""Directory checkpoints the integrations write (the HF Trainer callback's
folder of ``model.safetensors`` beside ``optimizer.pt``; a DCP save; a
``torch.save`` file) export and import like a saved state, on S3 too."""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import save_file

from checkpoint_store import Checkpoint
from checkpoint_store.formats import detect_format, export_checkpoint, import_checkpoint
from tests.formats.conftest import Place


def _commit_dir(place: Place, src: Any, index: int) -> Checkpoint:
    return place.ctx().persist_checkpoint(Checkpoint.from_directory(str(src)), index, {})


def test_an_hf_trainer_folder_exports_its_weights(make, tmp_path: Any) -> None:
    s3 = make("s3")
    src = tmp_path / "checkpoint-500"
    src.mkdir()
    weights = {"bert.encoder.w": torch.randn(4, 4), "classifier.bias": torch.zeros(2)}
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    torch.save({"state": {}, "param_groups": []}, src / "optimizer.pt")
    (src / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
    ck = _commit_dir(s3, src, 3)
    assert detect_format(ck.backend, ck.path) == "hf"
    out = export_checkpoint(ck, str(tmp_path / "out"), name_prefix="")
    assert out.files == ("model.safetensors",)
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    # As a checkpoint elsewhere: every file of the folder, and a state over it.
    back = import_checkpoint(ck, s3.loc("imported"), **s3.side("dest_"))
    names = {e["path"] for e in back.internal_metadata["manifest"]}
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "state.json"} <= names
    assert torch.equal(back.load_state(keys="model/classifier.bias")["model"]
                       ["classifier.bias"], weights["classifier.bias"])


def test_a_committed_dcp_checkpoint_exports_to_hf_on_s3(make, tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    s3 = make("s3")
    sd = {"model": {"w": torch.randn(3, 5, dtype=torch.bfloat16), "b": torch.arange(5)},
          "step": 4}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    ck = _commit_dir(s3, tmp_path / "dcp", 1)
    assert detect_format(ck.backend, ck.path) == "dcp"
    export_checkpoint(ck, s3.loc("hf"), prefix="model", **s3.side("target_"))
    back = import_checkpoint(s3.loc("hf"), str(tmp_path / "ck"), **s3.side(""))
    got = back.load_state()["model"]
    assert torch.equal(got["w"], sd["model"]["w"]) and torch.equal(got["b"], sd["model"]["b"])
