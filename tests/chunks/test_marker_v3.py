"""The version-3 marker: its chunked entries' shape, and a listing against it."""

from __future__ import annotations

import copy
import os
import re
from typing import Any

import pyarrow.fs as pafs
import pytest

from checkpoint_store._format.manifest import internal_metadata
from checkpoint_store._util.inspect import _validate_manifest, inspect_checkpoint
from checkpoint_store.testing.chunked import write_chunked_checkpoint

NAME = "ab" * 32


def _meta() -> dict[str, Any]:
    return internal_metadata({"index": 0, "chunk_root": "../../.cs_chunks"}, [
        {"path": "a.bin", "size": 5, "crc32c": "00000000",
         "chunks": [[NAME, 2, 30], [NAME, 3, 31]]},
        {"path": "b.txt", "size": 1, "crc32c": "00000000"}])


def test_internal_metadata_gives_version_3_only_with_chunks() -> None:
    assert _meta()["format_version"] == 3
    assert internal_metadata({"index": 0}, [{"path": "x", "size": 0, "crc32c": "0" * 8}]
                             )["format_version"] == 1
    assert internal_metadata({"index": 0, "tensors": {}}, [])["format_version"] == 2
    assert _validate_manifest(_meta()) is None


@pytest.mark.parametrize(("change", "why"), [
    (lambda m: m.pop("chunk_root"), "chunk_root"),
    (lambda m: m.update(chunk_root="/abs"), "chunk_root"),
    (lambda m: m.update(format_version=2, tensors={}), "format_version 2, not 3"),
    (lambda m: m["manifest"][0].update(chunks="x"), "not a list"),
    (lambda m: m["manifest"][0]["chunks"].append(["zz", 0, 0]), "invalid name"),
    (lambda m: m["manifest"][0]["chunks"].append([NAME, 0]), "not \\[name"),
    (lambda m: m["manifest"][0]["chunks"].append([NAME, -1, 0]), "invalid length"),
    (lambda m: m["manifest"][0]["chunks"].append([NAME, True, 0]), "invalid length"),
    (lambda m: m["manifest"][0].update(size=6), "5 bytes in all"),
])
def test_malformed_chunked_entries_are_refused(change: Any, why: str) -> None:
    meta = copy.deepcopy(_meta())
    change(meta)
    bad = _validate_manifest(meta)
    assert bad is not None
    assert re.search(why, bad[0]), bad[0]


def test_a_renamed_chunk_name_is_valid() -> None:
    meta = _meta()
    meta["manifest"][0]["chunks"][0][0] = NAME + ".0123abcd"
    assert _validate_manifest(meta) is None


def test_a_chunked_file_present_in_the_directory_is_invalid(tmp_path: Any) -> None:
    path = str(tmp_path / "exp" / "t" / "checkpoint_000000")
    write_chunked_checkpoint(pafs.LocalFileSystem(), path, {"m.bin": b"abc" * 10,
                                                            "c.txt": b"x"}, chunked={"m.bin"})
    assert inspect_checkpoint(pafs.LocalFileSystem(), path).state == "committed"
    with open(os.path.join(path, "m.bin"), "wb") as f:
        f.write(b"abc" * 10)
    insp = inspect_checkpoint(pafs.LocalFileSystem(), path)
    assert insp.state == "invalid" and insp.file == "m.bin"
    assert "as chunks" in (insp.reason or "")


def test_previous_checkpoint_skips_its_chunked_files(tmp_path: Any) -> None:
    from checkpoint_store._commit.trialdir import _previous_at

    trial = str(tmp_path / "exp" / "t")
    write_chunked_checkpoint(pafs.LocalFileSystem(), trial + "/checkpoint_000000",
                             {"m.bin": b"abc" * 10, "c.txt": b"x"}, chunked={"m.bin"})
    prev = _previous_at(pafs.LocalFileSystem(), trial, "checkpoint_000000", None)
    assert prev is not None and set(prev.files) == {"c.txt"}
