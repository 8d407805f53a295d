"""A checkpoint saved on one rank loads sharded reading only each rank's rows.

A tensor written whole gets the CRC32C of each block of its rows, taken
while its bytes are written (no second pass), so a load on M ranks reads
and checks each rank's rows (rounded out to blocks) instead of the whole
tensor on every rank. Entry points: ``write_state``, ``Checkpoint.from_state``,
``report(state=...)`` (the persist process), the torch-file import; loads by
``Checkpoint.load_state``, ``state.load_state``, on local disks, memory,
fsspec filesystems and S3; ``Checkpoint.verify`` checks the blocks too.
"""

from __future__ import annotations

import itertools
import json
import os
import random

import google_crc32c
import numpy as np
import pyarrow.fs as pafs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_store import Checkpoint, session
from checkpoint_store.errors import CheckpointCorruptError, InvalidConfigError, TensorCorruptError
from checkpoint_store.state import STATE_FILE, StateSlice, load_state, write_state
from checkpoint_store.state._box import read_box
from checkpoint_store.state._fetch import _Fetcher
from checkpoint_store.state._files import StateWriter, layout_of_buffers, rows_per_block
from checkpoint_store.state._shards import ShardIndex, block_crcs
from tests.state.test_sharded_state import assert_ranks_fetch_the_state_once


def _index(root: str) -> dict:
    with open(os.path.join(root, STATE_FILE)) as f:
        return json.load(f)["tensors"]


def _blocks_of_file(root: str, e: dict) -> list:
    with open(os.path.join(root, e["file"]), "rb") as f:
        f.seek(e["offsets"][0])
        data = f.read(e["offsets"][1] - e["offsets"][0])
    return block_crcs(data, len(data) // e["shape"][0])


def test_a_whole_tensor_gets_the_blocks_of_its_bytes(tmp_path) -> None:
    g = torch.Generator().manual_seed(1)
    tree = {"w": torch.randn(4096, 1024, generator=g),   # 16 MiB: 256 blocks of 16 rows
            "b": torch.randn(1024, generator=g),         # one block: none
            "r": torch.randn(1, 70000, generator=g),     # one row: none
            "s": torch.tensor(3.0),                      # a scalar: none
            "h": torch.randn(333, 517, generator=g).to(torch.bfloat16)}
    root = str(tmp_path / "s")
    write_state(tree, root)
    idx = _index(root)
    assert idx["w"]["blocks"] == _blocks_of_file(root, idx["w"])
    assert idx["w"]["blocks"][0] == 16 and len(idx["w"]["blocks"][1]) == 256
    assert idx["h"]["blocks"] == _blocks_of_file(root, idx["h"])  # 337 KiB: 64 KiB blocks
    assert {"b", "r", "s"}.isdisjoint(k for k, e in idx.items() if "blocks" in e)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(2, 300), cols=st.integers(1, 700), seed=st.integers(0, 2**16))
def test_blocks_do_not_depend_on_how_the_bytes_were_written(rows, cols, seed) -> None:
    """The persist process writes a tensor in pieces of any size, in any order."""
    import tempfile

    data = np.random.default_rng(seed).integers(0, 255, rows * cols * 4, dtype=np.uint8)
    layout = layout_of_buffers({"t": ("F32", [rows, cols])})
    rnd = random.Random(seed)
    cuts = sorted({0, len(data), *(rnd.randrange(len(data)) for _ in range(rnd.randrange(6)))})
    pieces = list(itertools.pairwise(cuts))
    rnd.shuffle(pieces)
    with tempfile.TemporaryDirectory() as d:
        with StateWriter(d, layout) as w:
            for a, b in pieces:
                w.write("t", memoryview(data)[a:b], offset=a)
            e = w.close()["t"]
    assert e["crc32c"] == f"{google_crc32c.value(data.tobytes()):08x}"
    per = rows_per_block(len(data), cols * 4)
    if per >= rows:
        assert "blocks" not in e
    else:
        assert e["blocks"] == block_crcs(data.tobytes(), cols * 4)


@pytest.mark.parametrize("m", [2, 3, 8])
def test_a_one_rank_checkpoint_read_by_rows_reads_about_each_slice(tmp_path, m) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4099, 1024, generator=g)
    root = str(tmp_path / "s")
    write_state({"w": w}, root)
    e = _index(root)["w"]
    fetch = _Fetcher(pafs.LocalFileSystem(), root, {}, None, 4)
    total = 0
    for r in range(m):
        a, b = 4099 * r // m, 4099 * (r + 1) // m
        dest = np.empty((b - a, 1024), dtype=np.float32)
        read = read_box(fetch, root, "w", ShardIndex(e), (a, 0), dest)
        assert np.array_equal(dest, w[a:b].numpy())
        assert read <= 1.1 * dest.nbytes, (r, read, dest.nbytes)
        total += read
    assert total <= 1.1 * w.nbytes


@pytest.mark.parametrize("form", ["uri", "pyarrow", "fsspec"])
def test_each_location_form_loads_a_one_rank_state_by_rows(tmp_path, form) -> None:
    import fsspec

    g = torch.Generator().manual_seed(3)
    tree = {"model": {"w": torch.randn(2048, 512, generator=g), "b": torch.randn(512)}}
    src = Checkpoint.from_state(tree)
    uri = f"memory://one-rank-blocks-{form}-{os.getpid()}"
    storage = {"uri": dict(storage_path=uri),
               "pyarrow": dict(storage_path=str(tmp_path / "store"),
                               storage_filesystem=pafs.LocalFileSystem()),
               "fsspec": dict(storage_path=str(tmp_path / "store2"),
                              storage_filesystem=fsspec.filesystem("file"))}[form]
    with session.start(experiment_name="e", trial_name="t", **storage):
        session.report({"x": 1}, checkpoint=src)
    with session.start(experiment_name="e", trial_name="t", **storage) as s:
        ck = s.get_checkpoint()
        for r in range(4):
            dest = torch.empty(512, 512)
            ck.load_state(into={"model": {"w": StateSlice(dest, (512 * r, 0))}})
            assert torch.equal(dest, tree["model"]["w"][512 * r:512 * (r + 1)])
        ck.verify()


def test_a_report_of_a_state_records_blocks_taken_by_the_persist_process(tmp_path) -> None:
    g = torch.Generator().manual_seed(4)
    tree = {"w": torch.randn(3000, 700, generator=g), "v": torch.randn(50, 7, generator=g)}
    where = dict(storage_path=str(tmp_path / "store"), experiment_name="e", trial_name="t")
    with session.start(**where):
        session.report({"x": 1}, state=tree)
    with session.start(**where) as s:
        ck = s.get_checkpoint()
    with ck.as_directory() as d:
        idx = _index(d)
        assert idx["w"]["blocks"] == _blocks_of_file(d, idx["w"])
        assert "blocks" not in idx["v"]
    dest = torch.empty(1000, 700)
    ck.load_state(into={"w": StateSlice(dest, (1000, 0))})
    assert torch.equal(dest, tree["w"][1000:2000])


def test_a_flipped_byte_is_caught_in_its_block_and_only_there(tmp_path) -> None:
    w = torch.randn(4096, 1024)
    root = str(tmp_path / "s")
    write_state({"w": w}, root)
    e = _index(root)["w"]
    per = e["blocks"][0]
    with open(os.path.join(root, e["file"]), "r+b") as f:  # a byte of block 10
        f.seek(e["offsets"][0] + 10 * per * 4096 + 5)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x08]))
    fs = pafs.LocalFileSystem()
    dest = torch.zeros(per, 1024)
    with pytest.raises(TensorCorruptError) as err:
        load_state(fs, root, into={"w": StateSlice(dest, (10 * per, 0))})
    assert err.value.tensor == "w"
    assert not dest.any()  # nothing copied
    ok = torch.zeros(3 * per, 1024)
    load_state(fs, root, into={"w": StateSlice(ok, (20 * per, 0))})
    assert torch.equal(ok, w[20 * per:23 * per])
    with pytest.raises(TensorCorruptError):
        load_state(fs, root)


def test_verify_tensors_checks_each_block_checksum(tmp_path) -> None:
    """A block CRC that does not match its bytes (the whole tensor's does)
    would fail a partial read on some rank: verify_tensors names it first."""
    from checkpoint_store.state import verify_tensors

    w = torch.randn(2048, 256)
    root = str(tmp_path / "s")
    index = write_state({"w": w}, root)
    fs = pafs.LocalFileSystem()
    verify_tensors(fs, root, index)
    crcs = index["w"]["blocks"][1]
    crcs[7] = f"{int(crcs[7], 16) ^ 1:08x}"
    with pytest.raises(TensorCorruptError, match="block 7") as err:
        verify_tensors(fs, root, index)
    assert err.value.tensor == "w"


@pytest.mark.parametrize("bad", [
    "x", [0, []], [True, ["00000000"]], [64, "00"], [64, [1, 2]], [64, ["0"] * 3], [64],
    [64, ["zz"] * 64], [64, ["0000000G"] * 64], [64, ["0000000A"] * 64],
])
def test_bad_blocks_on_a_whole_tensor_are_refused(tmp_path, bad) -> None:
    root = str(tmp_path / "s")
    write_state({"w": torch.randn(4096, 256)}, root)
    path = os.path.join(root, STATE_FILE)
    with open(path) as f:
        body = json.load(f)
    body["tensors"]["w"]["blocks"] = bad
    with open(path, "w") as f:
        json.dump(body, f)
    with pytest.raises(CheckpointCorruptError, match="bad blocks"):
        load_state(pafs.LocalFileSystem(), root)


@pytest.mark.parametrize("m", [2, 4])
def test_ranks_fetch_about_a_one_rank_state_once_from_s3(tmp_path, s3_server, s3_bucket,
                                                         m) -> None:
    """The issue's S3 target for a one-rank checkpoint loaded on M ranks:
    every rank's rows of every tensor, counted by a relay."""
    g = torch.Generator().manual_seed(5)
    tree = {"model": {f"l{i}": torch.randn(1031, 1024, generator=g) for i in range(4)}}
    root = str(tmp_path / "s")
    write_state(tree, root)
    assert_ranks_fetch_the_state_once(root, tree, s3_server, s3_bucket, m)


@pytest.mark.parametrize("shape", [(), (0, 5), (1, 3)])
def test_verify_tensors_reads_blocks_on_a_tensor_of_one_or_no_rows(tmp_path, shape) -> None:
    """Blocks the index validation lets through on a scalar (one block: the
    reader takes it as one row) or on no rows (no block) are checked as the
    reader checks them: a bad CRC is a TensorCorruptError, never an
    IndexError or a ZeroDivisionError out of Checkpoint.verify."""
    from checkpoint_store.state import verify_tensors

    root = str(tmp_path / "s")
    index = write_state({"t": torch.ones(shape)}, root)
    e = index["t"]
    n = shape[0] if shape else 1
    e["blocks"] = [1, [e["crc32c"]] * n]
    fs = pafs.LocalFileSystem()
    verify_tensors(fs, root, index)
    if n:
        e["blocks"][1][0] = f"{int(e['crc32c'], 16) ^ 1:08x}"
        with pytest.raises(TensorCorruptError, match="block 0"):
            verify_tensors(fs, root, index)


@pytest.mark.parametrize("how", ["torch_save", "hf_copy", "hf_in_place", "dcp"])
def test_an_imported_checkpoint_gets_blocks_and_loads_by_rows(tmp_path, how) -> None:
    """An import is a one-rank save too: each tensor of two or more blocks
    gets the blocks of its bytes, so M ranks read about the state once."""
    from safetensors.torch import save_file

    from checkpoint_store.formats import import_checkpoint

    g = torch.Generator().manual_seed(6)
    tree = {"w": torch.randn(4096, 256, generator=g), "b": torch.randn(10, generator=g),
            "h": torch.randn(3000, 70, generator=g).to(torch.bfloat16)}
    src = tmp_path / "src"
    if how == "torch_save":
        src = tmp_path / "m.pt"
        torch.save(tree, src)
    elif how == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(tree, checkpoint_id=str(src))
    else:
        src.mkdir()
        save_file(tree, str(src / "model.safetensors"))
    dest = None if how == "hf_in_place" else str(tmp_path / "imp")
    ck = import_checkpoint(str(src), dest, prefix="")
    root = str(src) if dest is None else dest
    idx = _index(root)
    assert idx["w"]["blocks"] == _blocks_of_file(root, idx["w"])
    assert idx["h"]["blocks"] == _blocks_of_file(root, idx["h"])
    assert "blocks" not in idx["b"]
    ck.verify()
    per = idx["w"]["blocks"][0]
    dest_t = torch.empty(per, 256)
    ck.load_state(into={"w": StateSlice(dest_t, (3 * per, 0))})
    assert torch.equal(dest_t, tree["w"][3 * per:4 * per])


@pytest.mark.parametrize("rewrite", [(1199000, 1200000), (0, 1200000), (5000, 70000)])
def test_bytes_written_again_leave_the_blocks_of_the_first_write(tmp_path, rewrite) -> None:
    """A piece written again (the same bytes) once its range is covered, as
    StateWriter always took it: the tensor's CRC comes from the first
    cover, and so must its blocks (a block's CRC combined with the repeat
    made a partial load of those rows fail on sound bytes)."""
    data = np.arange(300000, dtype=np.float32).view(np.uint8)
    layout = layout_of_buffers({"t": ("F32", [3000, 100])})
    a, b = rewrite
    with StateWriter(str(tmp_path), layout) as w:
        w.write("t", memoryview(data), offset=0)
        w.write("t", memoryview(data)[a:b], offset=a)
        e = w.close()["t"]
    assert e["crc32c"] == f"{google_crc32c.value(data.tobytes()):08x}"
    assert e["blocks"] == block_crcs(data.tobytes(), 400)


def test_overlapping_pieces_give_the_index_of_their_bytes_and_a_gap_is_refused(
        tmp_path) -> None:
    data = np.arange(300000, dtype=np.float32).view(np.uint8)
    layout = layout_of_buffers({"t": ("F32", [3000, 100])})
    with StateWriter(str(tmp_path / "a"), layout) as w:
        w.write("t", memoryview(data)[:700000], offset=0)
        w.write("t", memoryview(data)[600000:], offset=600000)
        e = w.close()["t"]
    assert e["crc32c"] == f"{google_crc32c.value(data.tobytes()):08x}"
    assert e["blocks"] == block_crcs(data.tobytes(), 400)
    with pytest.raises(InvalidConfigError, match="not written whole"):
        with StateWriter(str(tmp_path / "b"), layout) as w:
            w.write("t", memoryview(data)[:600000], offset=0)
            w.write("t", memoryview(data)[600004:], offset=600004)
            w.close()
