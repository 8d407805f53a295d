"""A column slice of a sharded state reads only its columns, checked by the
pieces' tile CRCs (docs/sharded-state.md, checkpoint_store/state/_tiles.py).

States are saved in pieces as ranks do (``write_part`` per rank, the merge
rank 0 does: the helpers of test_sharded_state.py) and read back through
``load_state`` with ``StateSlice`` requests, on local disk, memory and S3
(moto, its bytes counted by a relay).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store.errors import CheckpointCorruptError, TensorCorruptError
from checkpoint_store.state import STATE_FILE, StateSlice, load_state
from checkpoint_store.state._box import read_box
from checkpoint_store.state._fetch import _Fetcher
from checkpoint_store.state._shards import ShardIndex
from checkpoint_store.state._tiles import tile_crcs, tile_shape
from tests.state.test_sharded_state import _boxes, _index, _save, on_s3_through_relay

W = (256, 4096)  # fp32, 4 MiB: two row pieces of 2 MiB on two ranks


def _wide(seed: int = 0, shape: tuple[int, ...] = W) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cols(shape: tuple[int, ...], k: int) -> list[tuple[list[int], list[int]]]:
    """k column shards of a 2-D shape, as ``(offset, shape)``."""
    return _boxes((shape[0], shape[1]), 1, k)


def _read(root: str, key: str, offset: list[int], shape: list[int],
          dtype: Any = np.float32) -> tuple[np.ndarray, int]:
    """The box through read_box on a local fetch: ``(its values, bytes read)``."""
    dest = np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 0xBEEF, dtype=dtype)
    fetch = _Fetcher(pafs.LocalFileSystem(), root, {}, None, 4)
    read = read_box(fetch, root, key, ShardIndex(_index(root)[key]), offset, dest)
    return dest, read


@pytest.mark.parametrize("k", [2, 3, 4, 8, 5, 7])
def test_column_shards_read_their_columns_bit_exact(tmp_path, k) -> None:
    """Row pieces (Shard(0) on 2) read as k column shards: each shard bit-exact,
    reading about its own bytes (at most 2 column bands more per row)."""
    w = _wide()
    root = _save(tmp_path, {"w": w}, 2)
    e = _index(root)["w"]
    assert all(p["tiles"][:2] == [64, 32] for p in e["shards"])
    for offset, shape in _cols(W, k):
        dest, read = _read(root, "w", offset, shape)
        c = offset[1]
        assert np.array_equal(dest, w[:, c:c + shape[1]].numpy()), (offset, shape)
        assert read <= dest.nbytes + 2 * 32 * 4 * W[0], (k, offset, read)
        if k in (2, 3, 4, 8):
            assert read <= 1.1 * dest.nbytes, (k, offset, read / dest.nbytes)


def test_boxes_cutting_both_dimensions_read_their_tiles(tmp_path) -> None:
    w = _wide(1)
    root = _save(tmp_path, {"w": w}, 2)
    for grid in [(2, 4), (3, 3), (4, 3), (5, 7)]:
        for offset, shape in _boxes(W, *grid):
            dest, read = _read(root, "w", offset, shape)
            r, c = offset
            assert np.array_equal(dest, w[r:r + shape[0], c:c + shape[1]].numpy()), (grid, offset)
            if grid == (2, 4):  # boxes on tile boundaries: their bytes exactly
                assert read == dest.nbytes, (offset, read)
    out = load_state(pafs.LocalFileSystem(), root)  # whole: every piece, its own CRC
    assert torch.equal(out["w"], w)


def test_a_three_dimensional_tensor_sliced_along_dim_1(tmp_path) -> None:
    """Columns of a 3-D piece are its dimension-1 indexes (each 48 floats):
    a slice along dimension 1 reads those, and a slice of dimensions 1 and 2
    reads dimension 1's (dimension 2 is within a column)."""
    t = _wide(2, (256, 96, 48))
    root = _save(tmp_path, {"t": t}, 2)
    assert _index(root)["t"]["shards"][0]["tiles"][:2] == [43, 1]
    for offset, shape in [([0, 0, 0], [256, 32, 48]), ([0, 32, 0], [256, 32, 48]),
                          ([100, 50, 0], [20, 7, 48]), ([0, 10, 8], [256, 40, 24])]:
        dest = torch.full(shape, float("nan"))
        load_state(pafs.LocalFileSystem(), root, into={"t": StateSlice(dest, tuple(offset))})
        sel = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        assert torch.equal(dest, t[sel]), offset
    _, read = _read(root, "t", [0, 32, 0], [256, 32, 48])
    assert read == 256 * 32 * 48 * 4


def test_narrow_rows_get_no_tiles_and_read_whole_rows(tmp_path) -> None:
    """Rows under MIN_TILED_ROW_BYTES (300 floats, 1.2 KB) are read whole,
    as before tiles; a 1-D tensor has none either."""
    w, v = _wide(3, (1037, 300)), _wide(3, (300_000,))
    root = _save(tmp_path, {"w": w, "v": v}, 2)
    index = _index(root)
    assert all("tiles" not in p for p in index["w"]["shards"] + index["v"]["shards"])
    assert tile_shape([1037, 300], 4) is None and tile_shape([300_000], 4) is None
    dest, read = _read(root, "w", [0, 100], [1037, 100])
    assert np.array_equal(dest, w[:, 100:200].numpy())
    assert read == w.nbytes  # whole rows of both pieces


def test_tiles_of_half_precision_and_odd_widths(tmp_path) -> None:
    """A bfloat16 piece (no numpy dtype: moved as uint16) whose width is no
    multiple of the band width: its last band is narrower, and a slice
    ending there reads it."""
    w = _wide(4, (128, 4100)).to(torch.bfloat16)  # 1 MiB and a bit: two pieces
    root = _save(tmp_path, {"w": w}, 2)
    pieces = _index(root)["w"]["shards"]
    assert [p["tiles"][:2] for p in pieces] == [[64, 32], [64, 32]]
    assert all(len(base64.b64decode(p["tiles"][2])) == 4 * 129 for p in pieces)  # 4100 / 32
    for offset, shape in [((0, 2700), (128, 1400)), ((30, 0), (60, 33)), ((0, 4099), (128, 1))]:
        one = StateSlice(torch.zeros(shape, dtype=torch.bfloat16), offset)
        load_state(pafs.LocalFileSystem(), root, into={"w": one})
        assert torch.equal(one.tensor, w[offset[0]:offset[0] + shape[0],
                                         offset[1]:offset[1] + shape[1]]), offset
    _, read = _read(root, "w", [0, 2700], [128, 1400], np.uint16)
    assert read == 128 * (4100 - 2688) * 2  # from band 84 (column 2688) to the end
    raw = w[:64].view(torch.int16).numpy().tobytes()
    assert tile_crcs(raw, [64, 4100], 2) == pieces[0]["tiles"]


def _flip(root: str, piece: dict[str, Any], at: int) -> None:
    path = os.path.join(root, piece["file"])
    with open(path, "r+b") as f:
        f.seek(piece["offsets"][0] + at)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_flipped_byte_in_a_requested_tile_is_caught_one_outside_is_not_read(
        tmp_path) -> None:
    w = _wide(5)
    root = _save(tmp_path, {"w": w}, 2)
    piece = _index(root)["w"]["shards"][1]  # rows 128-255
    row_bytes = W[1] * 4
    _flip(root, piece, 70 * row_bytes + 3000 * 4 + 1)  # row 198, column 3000
    fs = pafs.LocalFileSystem()
    hit = torch.zeros(256, 1365)  # the third of three column shards holds column 3000
    with pytest.raises(TensorCorruptError, match="tile") as err:
        load_state(fs, root, into={"w": StateSlice(hit, (0, 2731))})
    assert err.value.file == piece["file"] and err.value.tensor == "w"
    assert not hit.any()  # checked before any byte is copied
    for offset in [(0, 0), (0, 1365)]:  # the same rows, other columns: not read
        ok = torch.zeros(256, 1365)
        load_state(fs, root, into={"w": StateSlice(ok, offset)})
        assert torch.equal(ok, w[:, offset[1]:offset[1] + 1365])
    rows = torch.zeros(64, 4096)  # other rows of the piece, all columns: its blocks
    load_state(fs, root, into={"w": StateSlice(rows, (128, 0))})
    assert torch.equal(rows, w[128:192])
    with pytest.raises(TensorCorruptError):
        load_state(fs, root)


def test_an_index_without_tiles_loads_as_before(tmp_path) -> None:
    """A checkpoint written before tiles: a column slice reads whole rows
    (blocks) and loads the same."""
    w = _wide(6)
    root = _save(tmp_path, {"w": w}, 2)
    with open(os.path.join(root, STATE_FILE)) as f:
        body = json.load(f)
    for p in body["tensors"]["w"]["shards"]:
        del p["tiles"]
    with open(os.path.join(root, STATE_FILE), "w") as f:
        json.dump(body, f)
    dest, read = _read(root, "w", [0, 1365], [256, 1366])
    assert np.array_equal(dest, w[:, 1365:2731].numpy())
    assert read == w.nbytes
    out = torch.zeros(256, 1366)
    load_state(pafs.LocalFileSystem(), root, into={"w": StateSlice(out, (0, 1365))})
    assert torch.equal(out, w[:, 1365:2731])


@pytest.mark.parametrize("bad, match", [
    (lambda t: t[:2], "not \\[rows"),
    (lambda t: [True, t[1], t[2]], "not \\[rows"),
    (lambda t: [0, t[1], t[2]], "not \\[rows"),
    (lambda t: [t[0], t[1], t[2] + "!"], "not base64"),
    (lambda t: [t[0], t[1], base64.b64encode(base64.b64decode(t[2])[:-4]).decode()],
     "tile CRCs for its"),
    (lambda t: [t[0] // 2, t[1], t[2]], "tile CRCs for its"),
])
def test_a_bad_tile_list_is_refused(tmp_path, bad, match) -> None:
    root = _save(tmp_path, {"w": _wide(7)}, 2)
    with open(os.path.join(root, STATE_FILE)) as f:
        body = json.load(f)
    piece = body["tensors"]["w"]["shards"][0]
    piece["tiles"] = bad(piece["tiles"])
    with open(os.path.join(root, STATE_FILE), "w") as f:
        json.dump(body, f)
    with pytest.raises(CheckpointCorruptError, match=f"bad tiles: .*{match}"):
        load_state(pafs.LocalFileSystem(), root, into={
            "w": StateSlice(torch.zeros(256, 100), (0, 0))})


def test_a_one_dimensional_piece_with_tiles_is_refused(tmp_path) -> None:
    root = _save(tmp_path, {"v": _wide(8, (600_000,))}, 2)
    with open(os.path.join(root, STATE_FILE)) as f:
        body = json.load(f)
    body["tensors"]["v"]["shards"][0]["tiles"] = [1, 1, "AAAAAA=="]
    with open(os.path.join(root, STATE_FILE), "w") as f:
        json.dump(body, f)
    with pytest.raises(CheckpointCorruptError, match="1 dimension"):
        load_state(pafs.LocalFileSystem(), root)


def test_column_slices_on_memory_and_fsspec_stores(tmp_path) -> None:
    """The same reads through a committed checkpoint on memory:// (pyarrow's
    handler over fsspec), an fsspec memory filesystem, and a local path
    through fsspec; a damaged tile is named on each."""
    import fsspec

    w = _wide(9)
    root = _save(tmp_path, {"w": w}, 2)
    stores = [StorageContext("memory://cols-readers", "exp", "t"),
              StorageContext("mem-cols/ckpt", "exp", "t",
                             storage_filesystem=fsspec.filesystem("memory")),
              StorageContext(str(tmp_path / "store"), "exp", "t",
                             storage_filesystem=fsspec.filesystem("file"))]
    for ctx in stores:
        ck = ctx.persist_checkpoint(Checkpoint.from_directory(root), 0, {})
        for offset, shape in _cols(W, 3):
            dest = torch.zeros(shape)
            ck.load_state(into={"w": StateSlice(dest, tuple(offset))})
            assert torch.equal(dest, w[:, offset[1]:offset[1] + shape[1]])
    piece = _index(root)["w"]["shards"][0]
    _flip(root, piece, 5 * W[1] * 4 + 10 * 4)  # row 5, column 10
    ctx = StorageContext("memory://cols-damaged", "exp", "t")
    ck = ctx.persist_checkpoint(Checkpoint.from_directory(root), 0, {})
    with pytest.raises(TensorCorruptError, match="tile"):
        ck.load_state(into={"w": StateSlice(torch.zeros(256, 100), (0, 0))})
    ok = torch.zeros(256, 100)
    ck.load_state(into={"w": StateSlice(ok, (0, 200))})
    assert torch.equal(ok, w[:, 200:300])


def test_column_shards_fetch_about_their_slice_from_s3(tmp_path, s3_server, s3_bucket) -> None:
    """Row pieces of 2 ranks on S3 (moto), read as 3 column shards: the bytes
    the server sends, counted by a relay, are each rank's slice (and all
    ranks together the state) within 1.1x, besides each load's metadata."""
    g = torch.Generator().manual_seed(11)
    shape = (128, 16384)  # 8 MiB each; 64 KiB rows: a shard's row is 21 KiB
    tree = {"model": {f"l{i}": torch.randn(*shape, generator=g) for i in range(2)}}
    root = _save(tmp_path, tree, 2)
    with on_s3_through_relay(root, s3_server, s3_bucket, "ckpt") as (ck, relay):
        state_bytes = sum(t.nbytes for t in tree["model"].values())
        relay.reset()
        ck.load_state(keys="model/l0")  # one load's metadata, measured
        metadata = relay.received - tree["model"]["l0"].nbytes
        total, requests = 0, 0
        for offset, box in _cols(shape, 3):
            relay.reset()
            into = {k: StateSlice(torch.empty(box), tuple(offset)) for k in tree["model"]}
            ck.load_state(into={"model": into})
            for key, sl in into.items():
                c = offset[1]
                assert torch.equal(sl.tensor, tree["model"][key][:, c:c + box[1]])
            slice_bytes = sum(sl.tensor.nbytes for sl in into.values())
            assert relay.received - metadata <= 1.1 * slice_bytes, (
                relay.received, metadata, slice_bytes)
            total += relay.received
            requests += len(relay.requests)
    assert state_bytes <= total <= 1.1 * state_bytes + 3 * metadata, (total, state_bytes)
    # One ranged GET per row of each piece and tensor, besides the metadata's.
    assert requests <= 3 * (2 * shape[0] + 10), requests


def test_narrow_rows_on_s3_are_read_as_spans_not_a_get_per_row(
        tmp_path, s3_server, s3_bucket) -> None:
    """Rows narrower than REMOTE_ROW_BYTES on an object store: a column
    read fetches the covering span (a few GETs per piece, its tiles still
    checked) instead of one GET per row, which would cost each GET's
    latency for a few KiB; the same read from a local file stays per row."""
    from checkpoint_store.state._tiles import REMOTE_ROW_BYTES

    shape = (512, 4096)  # 16 KiB rows, tiled; a third of a row is 5.3 KiB
    assert shape[1] * 4 < REMOTE_ROW_BYTES
    w = _wide(12, shape)
    root = _save(tmp_path, {"w": w}, 2)
    with on_s3_through_relay(root, s3_server, s3_bucket, "narrow") as (ck, relay):
        for offset, box in _cols(shape, 3):
            relay.reset()
            dest = torch.empty(box)
            ck.load_state(into={"w": StateSlice(dest, tuple(offset))})
            assert torch.equal(dest, w[:, offset[1]:offset[1] + box[1]])
            # Spans: the rows of both pieces (about the whole tensor), in a
            # handful of requests besides the metadata's, not 512.
            assert relay.received >= 0.9 * w.nbytes, relay.received
            assert len(relay.requests) <= 24, len(relay.requests)
    # A local file: one preadv per row, the slice's bytes.
    for offset, box in _cols(shape, 3):
        got, read = _read(root, "w", offset, box)
        assert np.array_equal(got, w[:, offset[1]:offset[1] + box[1]].numpy())
        assert read <= 1.1 * got.nbytes, read / got.nbytes
