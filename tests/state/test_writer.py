"""The writer a persist process uses: a picklable layout, raw bytes in any
order and in pieces, every byte accounted for before state.json is written,
shards at the size asked, plain safetensors files."""

from __future__ import annotations

import os
import pickle
import threading

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from checkpoint_store import Checkpoint
from checkpoint_store.errors import InvalidConfigError, UnsupportedStateError
from checkpoint_store.state import (
    STATE_FILE,
    StateWriter,
    flatten_state,
    write_buffers,
    write_state,
)
from checkpoint_store.testing import strategies as cst


def _tree():
    return {"model": {f"w{i}": torch.full((1000,), float(i)) for i in range(6)},
            "opt": {"step": 4, "m": np.arange(10, dtype=np.float64)}}


def test_the_layout_pickles_without_the_tensors() -> None:
    flat = flatten_state(_tree())
    raw = pickle.dumps(flat.layout)
    assert len(raw) < 2000
    back = pickle.loads(raw)
    assert back == flat.layout and back.nbytes == 6 * 4000 + 80


def test_pieces_in_any_order_from_threads_make_the_same_files(tmp_path) -> None:
    tree = _tree()
    flat = flatten_state(tree)
    index_one = write_state(tree, tmp_path / "one")
    pieces = []
    for key, data in flat.buffers():
        for at in range(0, len(data), 700):
            pieces.append((key, at, bytes(data[at:at + 700])))
    pieces.reverse()
    with StateWriter(tmp_path / "two", pickle.loads(pickle.dumps(flat.layout))) as w:
        threads = [threading.Thread(target=lambda p=p: w.write(p[0], p[2], offset=p[1]))
                   for p in pieces]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        index_two = w.close()
    assert index_one == index_two
    for name in os.listdir(tmp_path / "one"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert cst.same_state(Checkpoint.from_directory(tmp_path / "two").load_state(), tree)


def test_a_tensor_not_written_whole_fails_close_and_leaves_nothing(tmp_path) -> None:
    flat = flatten_state(_tree())
    w = StateWriter(tmp_path / "d", flat.layout)
    for key, data in flat.buffers():
        w.write(key, data[: len(data) - 1] if key == "model/w3" else data)
    with pytest.raises(InvalidConfigError, match="'model/w3' was not written whole"):
        w.close()
    assert os.listdir(tmp_path / "d") == []


def test_an_error_inside_the_block_removes_the_files(tmp_path) -> None:
    flat = flatten_state(_tree())
    with pytest.raises(RuntimeError), StateWriter(tmp_path / "d", flat.layout) as w:
        w.write("model/w0", flat.tensor_bytes("model/w0"))
        raise RuntimeError("persist process lost")
    assert os.listdir(tmp_path / "d") == []


def test_a_piece_past_the_tensor_end_is_refused(tmp_path) -> None:
    flat = flatten_state({"a": torch.zeros(4)})
    with StateWriter(tmp_path / "d", flat.layout) as w:
        with pytest.raises(InvalidConfigError, match="do not fit"):
            w.write("a", b"\0" * 8, offset=12)
        with pytest.raises(InvalidConfigError, match="not a tensor"):
            w.write("b", b"")
        w.abort()


@pytest.mark.parametrize("shard_bytes, files", [(1 << 30, 1), (8000, 4), (4000, 7), (1, 7)])
def test_shards_hold_at_most_shard_bytes_unless_one_tensor_is_larger(tmp_path, shard_bytes,
                                                                     files) -> None:
    tree = _tree()
    index = write_state(tree, tmp_path / "d", shard_bytes=shard_bytes)
    names = sorted(f for f in os.listdir(tmp_path / "d") if f.endswith(".safetensors"))
    assert len(names) == files
    assert names == sorted({e["file"] for e in index.values()})
    for name in names:
        data = sum(e["offsets"][1] - e["offsets"][0] for e in index.values()
                   if e["file"] == name)
        assert data <= shard_bytes or len([e for e in index.values() if e["file"] == name]) == 1
        # Every shard is a safetensors file its reader opens and checks.
        load_file(str(tmp_path / "d" / name))
    assert cst.same_state(Checkpoint.from_directory(tmp_path / "d").load_state(), tree)


def test_bad_shard_sizes_are_refused(tmp_path) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidConfigError, match="shard_bytes"):
            write_state({"a": torch.zeros(1)}, tmp_path / "d", shard_bytes=bad)
        with pytest.raises(InvalidConfigError, match="shard_bytes"):
            Checkpoint.from_state({"a": torch.zeros(1)}, tmp_path / "d", shard_bytes=bad)
    assert not (tmp_path / "d").exists() or os.listdir(tmp_path / "d") == []


def test_a_directory_that_is_a_file_is_refused_with_a_typed_error(tmp_path) -> None:
    blocker = tmp_path / "f"
    blocker.write_bytes(b"keep")
    for target in (blocker, blocker / "below"):
        with pytest.raises(InvalidConfigError, match="is not a directory"):
            Checkpoint.from_state({"a": torch.zeros(1)}, target)
        with pytest.raises(InvalidConfigError, match="is not a directory"):
            write_state({"a": torch.zeros(1)}, target)
    assert blocker.read_bytes() == b"keep"


def test_safetensors_reads_the_same_values_and_shapes(tmp_path) -> None:
    tree = {"a": torch.randn(3, 5), "b": torch.arange(4, dtype=torch.int8),
            "c": torch.tensor(2.5, dtype=torch.bfloat16), "z": torch.zeros(0, 2)}
    write_state(tree, tmp_path / "d")
    (name,) = [f for f in os.listdir(tmp_path / "d") if f.endswith(".safetensors")]
    with safe_open(str(tmp_path / "d" / name), "pt") as f:
        assert sorted(f.keys()) == ["a", "b", "c", "z"]
        for k in f.keys():
            assert cst.same_state(f.get_tensor(k), tree[k])


@pytest.mark.parametrize("buffers, match", [
    ({"a": ("F33", (1,), b"1234")}, "dtype 'F33'"),
    ({"a": ("F32", (2,), b"1234")}, "holds 4 bytes; F32 \\[2\\] takes 8"),
    ({"a": ("F32", (-1,), b"")}, "shape"),
    ({"a": ("F32", (1,), b"1234"), "a/b": ("F32", (1,), b"1234")}, "both a tensor and"),
])
def test_bad_raw_buffers_are_refused_before_any_write(tmp_path, buffers, match) -> None:
    with pytest.raises(UnsupportedStateError, match=match):
        write_buffers(buffers, tmp_path / "d")
    assert not (tmp_path / "d").exists() or os.listdir(tmp_path / "d") == []


def test_raw_buffers_against_a_layout_must_match_it(tmp_path) -> None:
    flat = flatten_state({"a": torch.zeros(2), "n": 3})
    with pytest.raises(UnsupportedStateError, match="'a' is missing"):
        write_buffers({}, tmp_path / "d", layout=flat.layout)
    with pytest.raises(UnsupportedStateError, match="the layout says F32 \\[2\\]"):
        write_buffers({"a": ("F32", (1, 2), b"\0" * 8)}, tmp_path / "d", layout=flat.layout)
    write_buffers({"a": ("F32", (2,), memoryview(b"\0" * 8))}, tmp_path / "d",
                  layout=flat.layout)
    back = Checkpoint.from_directory(tmp_path / "d").load_state()
    assert cst.same_state(back, {"a": torch.zeros(2), "n": 3})
    assert (tmp_path / "d" / STATE_FILE).exists()


def test_shared_memory_views_are_written_without_torch_in_the_writer(tmp_path) -> None:
    from multiprocessing import shared_memory

    flat = flatten_state({"w": torch.arange(256, dtype=torch.float32)})
    shm = shared_memory.SharedMemory(create=True, size=flat.nbytes)
    try:
        shm.buf[: flat.nbytes] = flat.tensor_bytes("w")
        index = write_buffers({"w": ("F32", (256,), shm.buf[: flat.nbytes])}, tmp_path / "d",
                              layout=flat.layout)
    finally:
        shm.close()
        shm.unlink()
    assert index["w"]["offsets"][1] - index["w"]["offsets"][0] == 1024
    back = Checkpoint.from_directory(tmp_path / "d").load_state()
    assert torch.equal(back["w"], torch.arange(256, dtype=torch.float32))
