"""A source is never unpickled in a way that runs its code: a ``torch.save``
file and every pickle of a DCP directory (its ``.metadata``, its pickled
values) are read with ``weights_only`` rules, and what they refuse is a
typed error through every entry point, with nothing written."""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from checkpoint_store.cli import main
from checkpoint_store.errors import CheckpointCorruptError, FormatConversionError
from checkpoint_store.formats import export_checkpoint, import_checkpoint


class _Runs:
    """Unpickled unsafely, creates the file ``path`` (``open(path, "w")``)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def _dcp(path: Any, tree: Any) -> str:
    import torch.distributed.checkpoint as dcp

    dcp.save(tree, checkpoint_id=str(path), no_dist=True)
    return str(path)


def _refused_everywhere(src: str, tmp_path: Any, error: type[Exception], match: str) -> None:
    """Import (in place and copied), each export and the CLI refuse ``src``
    with ``error``; nothing is written anywhere, ``src`` is unchanged."""
    before = sorted(os.listdir(src))
    with pytest.raises(error, match=match):
        import_checkpoint(src)
    with pytest.raises(error, match=match):
        import_checkpoint(src, str(tmp_path / "ck"))
    for fmt in ("hf", "torch_save", "dcp"):
        with pytest.raises(error, match=match):
            export_checkpoint(src, str(tmp_path / f"out-{fmt}"), format=fmt, prefix="")
    res = CliRunner().invoke(main, ["import", src, str(tmp_path / "ck")])
    assert res.exit_code == (2 if issubclass(error, ValueError) else 1), res.output
    assert "Traceback" not in res.output and "unexpected" not in res.output, res.output
    assert sorted(os.listdir(src)) == before
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(("ck", "out-"))]
    assert leftovers == []


def test_a_dcp_metadata_pickling_code_is_refused_unrun(tmp_path: Any) -> None:
    """DCP's own reader loads ``.metadata`` with ``pickle.load``: a folder
    from elsewhere ran any code it names when it was imported."""
    ran = str(tmp_path / "ran")
    src = _dcp(tmp_path / "dcp", {"w": torch.ones(3)})
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(_Runs(ran), f)
    _refused_everywhere(src, tmp_path, CheckpointCorruptError, "not a DCP metadata file")
    assert not os.path.exists(ran)


def test_a_damaged_dcp_metadata_is_a_corrupt_checkpoint(tmp_path: Any) -> None:
    src = _dcp(tmp_path / "dcp", {"w": torch.ones(3)})
    with open(os.path.join(src, ".metadata"), "r+b") as f:
        f.truncate(40)
    _refused_everywhere(src, tmp_path, CheckpointCorruptError, "not a DCP metadata file")


def test_a_dcp_value_pickling_code_is_refused_unrun(tmp_path: Any) -> None:
    """DCP loads each pickled value with ``torch.load(weights_only=False)``."""
    ran = str(tmp_path / "ran")
    src = _dcp(tmp_path / "dcp", {"w": torch.ones(3), "cfg": _Runs(ran)})
    assert not os.path.exists(ran)
    _refused_everywhere(src, tmp_path, FormatConversionError, "weights_only=True")
    assert not os.path.exists(ran)


def test_plain_dcp_values_still_come_back(tmp_path: Any) -> None:
    tree = {"w": torch.ones(3), "pair": (torch.arange(2), 2.5), "name": "x",
            "groups": [{"lr": 0.1, "params": [0, 1], "nesterov": None}]}
    src = _dcp(tmp_path / "dcp", tree)
    got = import_checkpoint(src, str(tmp_path / "ck")).load_state()
    assert got["name"] == "x" and got["groups"] == tree["groups"]
    assert torch.equal(got["pair"][0], tree["pair"][0]) and got["pair"][1] == 2.5


def test_a_legacy_torch_save_file_is_imported_and_exported(tmp_path: Any) -> None:
    """Found by a new user's try: a file of torch.save's legacy format
    (``_use_new_zipfile_serialization=False``, as older checkpoints are)
    was refused as 'not a torch.save file', with torch's advice to save it
    again for mmap."""
    tree = {"w": torch.randn(3, 2).to(torch.bfloat16), "n": torch.arange(4), "step": 7}
    src = str(tmp_path / "old.pt")
    torch.save(tree, src, _use_new_zipfile_serialization=False)
    got = import_checkpoint(src, str(tmp_path / "ck")).load_state()
    assert got["step"] == 7
    assert all(torch.equal(got[k], tree[k]) for k in ("w", "n"))
    export_checkpoint(src, str(tmp_path / "new.pt"), format="torch_save")
    assert torch.equal(torch.load(tmp_path / "new.pt", weights_only=True)["w"], tree["w"])
    res = CliRunner().invoke(main, ["import", src, str(tmp_path / "ck2")])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("content", [b"", b"not a checkpoint" * 8])
def test_a_file_that_is_no_torch_save_is_a_corrupt_source(content: bytes,
                                                           tmp_path: Any) -> None:
    src = tmp_path / "x.pt"
    src.write_bytes(content)
    with pytest.raises(CheckpointCorruptError, match="not a torch.save file") as err:
        import_checkpoint(str(src), str(tmp_path / "ck"))
    assert "mmap" not in str(err.value)
    assert not (tmp_path / "ck").exists()


def test_a_legacy_torch_save_pickling_code_is_refused_unrun(tmp_path: Any) -> None:
    ran = str(tmp_path / "ran")
    src = str(tmp_path / "old.pt")
    torch.save({"w": torch.ones(2), "cfg": _Runs(ran)}, src,
               _use_new_zipfile_serialization=False)
    with pytest.raises(FormatConversionError, match="weights_only=True"):
        import_checkpoint(src, str(tmp_path / "ck"))
    assert not os.path.exists(ran) and not (tmp_path / "ck").exists()
