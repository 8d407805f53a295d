"""A chunk object left torn under its own name (a writer killed while writing
it in place, a blob created empty on open) is not trusted by the next save
that needs its chunk: a fresh copy is uploaded under a new name, and the
checkpoint committed reads back whole."""

from __future__ import annotations

import os
import posixpath
import uuid
from typing import Any

import fsspec
import pytest
from fsspec.implementations.dirfs import DirFileSystem

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store._chunks.codec import (
    PLANES_ZSTD,
    RAW,
    SIZE_HEAD_BYTES,
    chunk_name,
    encode_chunk,
    object_size,
)
from checkpoint_store.errors import CheckpointCorruptError
from tests.stores import make_store

MiB = 1 << 20


def _ctx(kind: str, tmp_path: Any, request: Any = None) -> tuple[StorageContext, Any]:
    """A dedup context and a function writing raw bytes at a store path."""
    if kind == "s3":
        ctx = make_store(kind, request, tmp_path).ctx(dedup=True)
    elif kind == "dirfs":
        (tmp_path / "root").mkdir()
        fs = DirFileSystem(path=str(tmp_path / "root"), fs=fsspec.filesystem("file"))
        ctx = StorageContext("store", "exp", "t", storage_filesystem=fs, dedup=True,
                             fsync=False)
    elif kind == "local":
        ctx = StorageContext(str(tmp_path / "store"), "exp", "t", dedup=True, fsync=False)
    else:
        ctx = StorageContext(f"memory://torn-{uuid.uuid4().hex[:8]}/store", "exp", "t",
                             dedup=True, fsync=False)

    def put(path: str, data: bytes) -> None:
        ctx.filesystem.create_dir(posixpath.dirname(path), recursive=True)
        with ctx.filesystem.open_output_stream(path) as f:
            f.write(data)

    return ctx, put


def _save(ctx: StorageContext, tmp_path: Any, data: bytes, index: int) -> Checkpoint:
    src = tmp_path / f"src{index}"
    src.mkdir()
    (src / "model.bin").write_bytes(data)
    return ctx.persist_checkpoint(Checkpoint.from_directory(str(src)), index, {})


def _object_path(ctx: StorageContext, name: str) -> str:
    return posixpath.join(ctx.experiment_path, ".cs_chunks", name[:2], name)


@pytest.mark.parametrize("kind", ["dirfs", "local", "memory", "s3"])
def test_an_empty_object_under_a_chunks_name_is_not_trusted(kind, request, tmp_path) -> None:
    ctx, put = _ctx(kind, tmp_path, request)
    data = os.urandom(2 * MiB)  # one chunk
    put(_object_path(ctx, chunk_name(data)), b"")  # a blob created empty, its writer gone
    ckpt = _save(ctx, tmp_path, data, 0)
    ckpt.verify()
    with ckpt.as_directory() as d:
        assert open(os.path.join(d, "model.bin"), "rb").read() == data
    [entry] = [e for e in ckpt.internal_metadata["manifest"] if "chunks" in e]
    [[obj, _, _]] = entry["chunks"]
    assert obj.startswith(chunk_name(data) + ".")  # a fresh copy


@pytest.mark.parametrize("codec", [RAW, PLANES_ZSTD])
@pytest.mark.parametrize("cut", [0.5, 0.999])
def test_an_object_cut_short_by_an_in_place_writer_is_not_trusted(codec, cut, tmp_path) -> None:
    ctx, put = _ctx("dirfs", tmp_path)
    data = bytes(range(256)) * (2 * MiB // 256)
    whole = encode_chunk(data, itemsize=4, codec=codec)
    put(_object_path(ctx, chunk_name(data)), whole[:int(len(whole) * cut)])
    for index in (0, 1):  # until a gc frees the torn object, each save skips it
        ckpt = _save(ctx, tmp_path, data, index)
        ckpt.verify()
        [entry] = [e for e in ckpt.internal_metadata["manifest"] if "chunks" in e]
        assert entry["chunks"][0][0].startswith(chunk_name(data) + ".")


def test_a_whole_object_found_present_is_trusted_without_a_new_copy(tmp_path) -> None:
    ctx, _ = _ctx("dirfs", tmp_path)
    data = bytes(range(256)) * (2 * MiB // 256)
    first = _save(ctx, tmp_path, data, 0)
    again = _save(ctx, tmp_path, data, 1)
    again.verify()
    assert [e.get("chunks") for e in again.internal_metadata["manifest"]] == \
        [e.get("chunks") for e in first.internal_metadata["manifest"]]
    [chunks] = [e["chunks"] for e in again.internal_metadata["manifest"] if "chunks" in e]
    assert [c[0] for c in chunks] == [chunk_name(data)]


@pytest.mark.parametrize("codec", [RAW, PLANES_ZSTD])
@pytest.mark.parametrize("itemsize", [1, 2, 8])
def test_object_size_is_the_whole_size_and_a_cut_head_is_corrupt(codec, itemsize) -> None:
    data = bytes(range(256)) * 1000 + b"xyz"
    blob = encode_chunk(data, itemsize=itemsize, codec=codec)
    assert object_size(blob[:SIZE_HEAD_BYTES], where="x") == len(blob)
    with pytest.raises(CheckpointCorruptError):
        object_size(blob[:20], where="x")
