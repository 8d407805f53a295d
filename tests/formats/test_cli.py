"""``checkpoint-store export`` and ``import`` from the command line, on a
local disk and on S3 (moto), with the exit codes of docs/cli.md."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch

from checkpoint_store import Checkpoint

CLI = [sys.executable, "-m", "checkpoint_store"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_export_then_import_through_s3(make, tmp_path: Any) -> None:
    s3 = make("s3")
    tree = {"model": {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
            "step": 5}
    ck = s3.persist_state(tmp_path, tree)
    opts = [a for k, v in s3.options.items() for a in ("-o", f"{k}={v}")]
    hf = str(tmp_path / "hf")
    r = _run("export", ck.uri, hf, "--max-shard-size", "40", *opts)
    assert r.returncode == 0, r.stderr
    assert "exported 2 tensors" in r.stdout
    assert "model.safetensors.index.json" in os.listdir(hf)
    dest = s3.loc("imported/checkpoint_000003")
    r = _run("import", hf, dest, *opts)
    assert r.returncode == 0, r.stderr
    back = Checkpoint(dest, storage_options=s3.options)
    assert back.internal_metadata["index"] == 3
    got = back.load_state()["model"]
    assert all(torch.equal(got[k], tree["model"][k]) for k in tree["model"])
    r = _run("export", ck.uri, str(tmp_path / "x.pt"), "--format", "torch_save", *opts)
    assert r.returncode == 0, r.stderr
    assert torch.load(tmp_path / "x.pt")["step"] == 5


def test_refusals_exit_with_usage_and_write_nothing(make, tmp_path: Any) -> None:
    place = make("local")
    ck = place.persist_state(tmp_path, {"model": {"a.b": torch.zeros(1),
                                                  "a": {"b": torch.ones(1)}}})
    r = _run("export", ck.path, str(tmp_path / "hf"))
    assert r.returncode == 2
    assert "both map to the name 'a.b'" in r.stderr
    assert not (tmp_path / "hf").exists()
    r = _run("import", str(tmp_path / "nothing-here"))
    assert r.returncode == 1 and "does not exist" in r.stderr
    # A subtree the state lacks: the message names the flag to use here.
    r = _run("export", ck.path, str(tmp_path / "hf"), "--prefix", "optim")
    assert r.returncode == 2 and "holds no tensor under 'optim'" in r.stderr, r.stderr
    assert "--prefix" in r.stderr and not (tmp_path / "hf").exists()
