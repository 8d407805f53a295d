"""Every reader of a committed checkpoint on files stored as chunks (format version 3).

Checkpoints are written with :mod:`checkpoint_store.testing.chunked` (no
session: the save path is not under test) on local disk, memory and S3
(moto), opened as a URI, a pyarrow filesystem and an fsspec filesystem.
"""

from __future__ import annotations

import json
import os
import posixpath
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint
from checkpoint_store._chunks.files import ChunkedFile, chunk_object_path, chunk_root_path
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import inspect_checkpoint
from checkpoint_store.errors import CheckpointCorruptError
from checkpoint_store.testing.chunked import (
    write_chunked_checkpoint,
    write_chunked_state_checkpoint,
)

FORMS = ["local-uri", "local-pyarrow", "local-fsspec", "memory-uri", "memory-fsspec",
         "s3-uri", "s3-pyarrow", pytest.param("s3-fsspec", marks=pytest.mark.slow)]
CK = "exp/t/checkpoint_000000"


@dataclass
class Place:
    """A storage root: how a Checkpoint there is opened in one form."""

    root: str
    filesystem: Any = None
    options: dict[str, Any] | None = None

    def checkpoint(self, rel: str = CK) -> Checkpoint:
        return Checkpoint(posixpath.join(self.root, rel), filesystem=self.filesystem,
                          storage_options=self.options)


def _place(form: str, request: pytest.FixtureRequest, tmp_path: Any) -> Place:
    tag = uuid.uuid4().hex[:8]
    kind, how = form.split("-")
    if kind == "local":
        root = str(tmp_path / "store")
        if how == "uri":
            return Place(root)
        if how == "pyarrow":
            return Place(root, pafs.LocalFileSystem())
        import fsspec

        return Place(root, fsspec.filesystem("file"))
    if kind == "memory":
        if how == "uri":
            return Place(f"memory://chunks-{tag}/store")
        import fsspec

        return Place(f"/chunks-{tag}/store", fsspec.filesystem("memory"))
    srv = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    if how == "uri":
        loc = request.getfixturevalue("s3_location")
        return Place(f"{loc.uri.rstrip('/')}/{tag}", None, dict(loc.storage_options))
    if how == "pyarrow":
        fs = pafs.S3FileSystem(access_key=srv.access_key_id, secret_key=srv.secret_access_key,
                               endpoint_override=srv.endpoint_url.split("://", 1)[1],
                               scheme="http", region=srv.region)
        return Place(f"{bucket}/{tag}", fs)
    s3fs = pytest.importorskip("s3fs")
    fs = s3fs.S3FileSystem(key=srv.access_key_id, secret=srv.secret_access_key,
                           client_kwargs={"endpoint_url": srv.endpoint_url,
                                          "region_name": srv.region})
    return Place(f"{bucket}/{tag}", fs)


@pytest.fixture(params=FORMS)
def place(request: pytest.FixtureRequest, tmp_path: Any) -> Place:
    return _place(request.param, request, tmp_path)


def _files() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    return {"model.bin": rng.bytes(300_000), "sub/optim.bin": rng.bytes(70_001),
            "config.json": b'{"lr": 0.1}', "empty.bin": b""}


CHUNKED = {"model.bin", "sub/optim.bin", "empty.bin"}


def _write(ck: Checkpoint, files: dict[str, bytes] | None = None) -> dict[str, Any]:
    return write_chunked_checkpoint(ck.filesystem, ck.path, files or _files(),
                                    chunked=CHUNKED, chunk_bytes=64 << 10)


def _tree(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/")] = f.read()
    return out


def _chunk_path(ck: Checkpoint, meta: dict[str, Any], rel: str, i: int) -> str:
    entry = next(e for e in meta["manifest"] if e["path"] == rel)
    return chunk_object_path(chunk_root_path(ck.path, meta), entry["chunks"][i][0])


# -- the marker -------------------------------------------------------------------------


def test_marker_is_version_3_and_its_chunked_files_are_not_listed(place: Place) -> None:
    ck = place.checkpoint()
    meta = _write(ck)
    assert meta["format_version"] == 3 and meta["chunk_root"] == "../../.cs_chunks"
    insp = inspect_checkpoint(ck.filesystem, ck.path)
    assert insp.state == "committed", insp.reason
    assert set(insp.files or {}) == {"config.json", ".internal_metadata.json"}
    assert ck.is_committed
    assert ck.internal_metadata["format_version"] == 3


# -- to_directory / as_directory / verify -------------------------------------------------


def test_to_directory_writes_real_files(place: Place, tmp_path: Any) -> None:
    ck = place.checkpoint()
    _write(ck)
    seen: list[tuple[int, int]] = []
    out = ck.to_directory(str(tmp_path / "out"),
                          progress=lambda d, t: seen.append((d, t)))
    assert _tree(out) == _files()
    total = sum(len(v) for v in _files().values())
    assert seen[-1] == (total, total)
    # A second call finds the same checkpoint in place: nothing moves.
    assert ck.to_directory(str(tmp_path / "out")) == out
    with ck.as_directory() as d:
        assert _tree(d) == _files()
    ck.verify()


def test_missing_chunk_is_typed_and_leaves_the_target_alone(place: Place,
                                                            tmp_path: Any) -> None:
    ck = place.checkpoint()
    meta = _write(ck)
    earlier = place.checkpoint("exp/t/checkpoint_000001")
    _write(earlier, {"model.bin": b"x" * 200_000, "sub/optim.bin": b"y" * 1000,
                     "empty.bin": b""})
    target = tmp_path / "out"
    earlier.to_directory(str(target))
    before = _tree(str(target))
    names = sorted(p.name for p in tmp_path.iterdir())
    _fsutil.delete_file(ck.filesystem, _chunk_path(ck, meta, "sub/optim.bin", 1))
    with pytest.raises(CheckpointCorruptError, match="chunk #1") as exc:
        ck.verify()
    assert exc.value.file == "sub/optim.bin"
    with pytest.raises(CheckpointCorruptError, match="is missing") as exc:
        ck.to_directory(str(target))
    assert exc.value.file == "sub/optim.bin"
    assert "no chunk store" not in str(exc.value)  # the store is there, one chunk is not
    assert _tree(str(target)) == before
    with pytest.raises(CheckpointCorruptError):
        ck.to_directory(str(tmp_path / "fresh"))
    assert not (tmp_path / "fresh").exists()
    with pytest.raises(CheckpointCorruptError):
        with ck.as_directory():
            pass
    # Nothing half-written is left beside the targets either.
    assert sorted(p.name for p in tmp_path.iterdir() if "fresh" not in p.name) == names


def test_a_trial_copied_by_hand_to_another_experiment_says_where_its_chunks_are(
        place: Place, tmp_path: Any) -> None:
    """Its chunks stay in the source experiment's store: the error says so
    and names the command that copies whole files."""
    ck = place.checkpoint()
    _write(ck)
    fs = ck.filesystem
    copy = place.checkpoint("exp2/t/checkpoint_000000")
    fs.create_dir(copy.path, recursive=True)
    for name in ("config.json", ".internal_metadata.json"):
        with fs.open_output_stream(posixpath.join(copy.path, name)) as f:
            f.write(_fsutil.read_bytes(fs, posixpath.join(ck.path, name)))
    with pytest.raises(CheckpointCorruptError, match="no chunk store") as exc:
        copy.to_directory(str(tmp_path / "out"))
    assert "checkpoint-store cp" in str(exc.value)
    assert not (tmp_path / "out").exists()


def test_corrupt_chunk_is_typed(place: Place, tmp_path: Any) -> None:
    ck = place.checkpoint()
    meta = _write(ck)
    where = _chunk_path(ck, meta, "model.bin", 2)
    blob = bytearray(_fsutil.read_bytes(ck.filesystem, where))
    blob[-1] ^= 0xFF
    with ck.filesystem.open_output_stream(where) as f:
        f.write(bytes(blob))
    with pytest.raises(CheckpointCorruptError, match="damaged") as exc:
        ck.verify()
    assert exc.value.file == "model.bin"
    with pytest.raises(CheckpointCorruptError):
        ck.to_directory(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# -- ranges ---------------------------------------------------------------------------


def test_read_range_reads_only_the_chunks_it_covers(tmp_path: Any) -> None:
    fs = pafs.LocalFileSystem()
    path = str(tmp_path / CK)
    data = _files()["model.bin"]
    meta = write_chunked_checkpoint(fs, path, {"model.bin": data}, chunked={"model.bin"},
                                    chunk_bytes=10_000)
    entry = meta["manifest"][0]
    assert len(entry["chunks"]) == 30
    # Every chunk but #3 and #4 gone: a range inside them still reads.
    root = chunk_root_path(path, meta)
    for i, (name, _, _) in enumerate(entry["chunks"]):
        if i not in (3, 4):
            os.remove(chunk_object_path(root, name))
    cf = ChunkedFile(fs, path, meta, entry)
    assert cf.read_range(35_000, 12_000) == data[35_000:47_000]
    assert cf.read_range(30_000, 0) == b""
    with pytest.raises(CheckpointCorruptError, match="chunk #5"):
        cf.read_range(49_999, 2)


# -- load_state ---------------------------------------------------------------------------


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(1)
    return {"model": {"w": rng.standard_normal((200, 130)).astype(np.float32),
                      "b": rng.standard_normal(130).astype(np.float16)},
            "optim": {"step": np.arange(5000, dtype=np.int64)}, "epoch": 3}


def test_load_state_on_chunked_shards(place: Place) -> None:
    ck = place.checkpoint()
    meta = write_chunked_state_checkpoint(ck.filesystem, ck.path, _state(), chunk_bytes=24_000,
                                          shard_bytes=60_000)
    assert meta["format_version"] == 3 and "tensors" in meta
    shards = [e for e in meta["manifest"] if "chunks" in e]
    assert len(shards) >= 2
    want = _state()
    got = ck.load_state()
    assert got["epoch"] == 3
    np.testing.assert_array_equal(got["model"]["w"], want["model"]["w"])
    np.testing.assert_array_equal(got["optim"]["step"], want["optim"]["step"])
    part = ck.load_state("model/b")
    np.testing.assert_array_equal(part["model"]["b"], want["model"]["b"])
    mapped = ck.load_state(mmap=True)  # chunked files are read into memory
    np.testing.assert_array_equal(mapped["model"]["w"], want["model"]["w"])
    into = {"model": {"w": np.zeros((200, 130), np.float32)}}
    ck.load_state(into=into)
    np.testing.assert_array_equal(into["model"]["w"], want["model"]["w"])
    ck.verify()


def test_load_state_names_a_missing_chunk(tmp_path: Any) -> None:
    ck = Checkpoint(str(tmp_path / CK))
    meta = write_chunked_state_checkpoint(ck.filesystem, ck.path, _state(), chunk_bytes=24_000)
    shard = next(e for e in meta["manifest"] if "chunks" in e)
    os.remove(_chunk_path(ck, meta, shard["path"], len(shard["chunks"]) - 1))
    with pytest.raises(CheckpointCorruptError, match="is missing") as exc:
        ck.load_state()
    assert exc.value.file == shard["path"]


def test_export_reads_a_chunked_state(tmp_path: Any) -> None:
    from safetensors.numpy import load_file

    from checkpoint_store.formats import export_checkpoint

    ck = Checkpoint(str(tmp_path / CK))
    write_chunked_state_checkpoint(ck.filesystem, ck.path, _state(), chunk_bytes=24_000)
    out = tmp_path / "hf"
    export_checkpoint(ck, str(out), format="hf")
    got: dict[str, Any] = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(str(f)))
    key = next(k for k in got if k.endswith("w"))
    np.testing.assert_array_equal(got[key], _state()["model"]["w"])


# -- CLI --------------------------------------------------------------------------------


def test_cli_ls_show_verify_download_cp(tmp_path: Any) -> None:
    from click.testing import CliRunner

    from checkpoint_store.cli import main

    root = str(tmp_path / "store")
    ck = Checkpoint(posixpath.join(root, CK))
    _write(ck)
    run = CliRunner()
    ls = run.invoke(main, ["ls", ck.path, "--json"], catch_exceptions=False)
    assert ls.exit_code == 0, ls.output
    assert {f["path"]: f["size"] for f in json.loads(ls.stdout)["files"]} == {
        k: len(v) for k, v in _files().items()}
    exp = run.invoke(main, ["ls", posixpath.join(root, "exp"), "--json"],
                     catch_exceptions=False)
    assert [t["name"] for t in json.loads(exp.stdout)["trials"]] == ["t"]
    show = run.invoke(main, ["show", ck.path, "--json"], catch_exceptions=False)
    assert show.exit_code == 0, show.output
    body = json.loads(show.stdout)
    assert body["manifest"]["bytes"] == sum(len(v) for v in _files().values())
    assert body["internal_metadata"]["format_version"] == 3
    assert run.invoke(main, ["verify", ck.path], catch_exceptions=False).exit_code == 0
    dl = run.invoke(main, ["download", ck.path, str(tmp_path / "dl")], catch_exceptions=False)
    assert dl.exit_code == 0, dl.output
    assert _tree(str(tmp_path / "dl")) == _files()
    dst = posixpath.join(str(tmp_path / "copy"), CK)
    cp = run.invoke(main, ["cp", ck.path, dst], catch_exceptions=False)
    assert cp.exit_code == 0, cp.output
    copied = Checkpoint(dst)
    copied.verify()
    assert copied.internal_metadata["format_version"] == 1
    assert _tree(dst).keys() >= {"model.bin", "sub/optim.bin"}
