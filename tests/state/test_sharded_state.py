"""A state saved in pieces on N ranks, read back whole or in other pieces
(docs/sharded-state.md).

The format and the reads run in one process (``write_part`` for each rank,
``merge_parts`` as rank 0 does); the session path runs under torchrun with
gloo ranks and real ``DTensor``s (``_sharded_worker.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from checkpoint_store import StorageContext
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    StateMismatchError,
    TensorCorruptError,
)
from checkpoint_store.state import STATE_FILE, StateSlice, load_state, write_part
from checkpoint_store.state._box import read_box
from checkpoint_store.state._fetch import _Fetcher
from checkpoint_store.state._shards import BLOCK_BYTES, ShardIndex, merged_state_file

WORKER = os.path.join(os.path.dirname(__file__), "_sharded_worker.py")
MiB = 1 << 20


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(1037, 300, generator=g)  # 1.2 MB: split by rows among replicas
    return {
        "model": {"w": w, "tied": w, "b": torch.randn(300, generator=g),
                  "s": torch.tensor(3.5), "h": torch.randn(600, 900, generator=g).half()},
        "opt": {"state": {0: {"exp_avg": torch.randn(1037, 300, generator=g)}}, "lr": 0.1},
        "np": np.arange(12, dtype=np.int32).reshape(3, 4),
        "step": 7,
    }


def _save(tmp_path, tree: Any, world: int) -> str:
    """Every rank's part into one directory, then rank 0's state.json."""
    root = str(tmp_path / "ckpt")
    parts = [write_part(tree, root, r, world) for r in range(world)]
    raw, _ = merged_state_file(parts)
    with open(os.path.join(root, STATE_FILE), "wb") as f:
        f.write(raw)
    return root


def _index(root: str) -> dict[str, Any]:
    with open(os.path.join(root, STATE_FILE)) as f:
        return json.load(f)["tensors"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pieces_of_n_ranks_load_whole_bit_exact(tmp_path, world) -> None:
    tree = _state()
    root = _save(tmp_path, tree, world)
    index = _index(root)
    # Large replicated tensors are split among the ranks; small ones kept whole.
    assert len(index["model/w"]["shards"]) == world
    assert index["model/tied"]["alias_of"] == "model/w"
    assert "shards" not in index["model/b"] and "shards" not in index["model/s"]
    out = load_state(pafs.LocalFileSystem(), root)
    for k in ("w", "b", "s", "h"):
        assert torch.equal(out["model"][k], tree["model"][k]), k
        assert out["model"][k].dtype == tree["model"][k].dtype
    assert out["model"]["tied"] is out["model"]["w"]
    assert torch.equal(out["opt"]["state"][0]["exp_avg"], tree["opt"]["state"][0]["exp_avg"])
    assert out["opt"]["lr"] == 0.1 and out["step"] == 7
    assert np.array_equal(out["np"], tree["np"])
    part = load_state(pafs.LocalFileSystem(), root, keys="model/w")
    assert list(part["model"]) == ["w"] and torch.equal(part["model"]["w"], tree["model"]["w"])
    mapped = load_state(pafs.LocalFileSystem(), root, keys="model", mmap=True)
    assert torch.equal(mapped["model"]["h"], tree["model"]["h"])


@pytest.mark.parametrize("world", [2, 3])
def test_empty_tensors_of_any_shape_commit_and_load(tmp_path, world) -> None:
    """A replicated tensor with no elements but several dimensions is
    written by the replica its key hashes to; the others' empty pieces must
    not make the merge refuse the state (keys hashing to every rank)."""
    tree = {f"k{i}": torch.zeros(shape) for i, shape in
            enumerate([(0, 4), (5, 0), (0, 3, 2), (0,)] * 3)}
    root = _save(tmp_path, tree, world)
    out = load_state(pafs.LocalFileSystem(), root)
    assert {k: list(v.shape) for k, v in out.items()} == {
        k: list(v.shape) for k, v in tree.items()}
    into = {k: torch.ones(v.shape) for k, v in tree.items()}
    load_state(pafs.LocalFileSystem(), root, into={
        k: StateSlice(v, (0,) * v.ndim) for k, v in into.items()})


@pytest.mark.parametrize("world", [1, 2])
def test_tied_weights_load_each_into_its_own_box(tmp_path, world) -> None:
    """Keys saved as the same tensor (tied weights) asked for as different
    boxes, or one as a box and one whole, each get their own; an alias
    asked for alone as a box gets that box."""
    tree = _state()
    w = tree["model"]["w"]
    root = _save(tmp_path, tree, world)
    fs = pafs.LocalFileSystem()
    rows, whole = torch.zeros(3, 300), torch.zeros(1037, 300)
    out = load_state(fs, root, into={"model": {"w": StateSlice(rows, (4, 0)), "tied": whole}})
    assert torch.equal(rows, w[4:7]) and torch.equal(whole, w)
    assert out["model"]["w"] is rows and out["model"]["tied"] is whole
    cols = torch.zeros(1037, 2)
    load_state(fs, root, into={"model": {"tied": StateSlice(cols, (0, 298))}})
    assert torch.equal(cols, w[:, 298:])


def test_one_target_under_keys_of_different_values_is_refused(tmp_path) -> None:
    """One tensor of into under two keys the state holds different values
    for could hold only one of them: refused before it is changed. Tied
    weights saved once, or twice with the same values, load as before."""
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    root = _save(tmp_path, {"a": a, "b": b, "c": a.clone(), "t": a, "u": a}, 2)
    fs = pafs.LocalFileSystem()
    t = torch.zeros(4, 3)
    with pytest.raises(StateMismatchError, match="same tensor"):
        load_state(fs, root, into={"a": t, "b": t})
    with pytest.raises(StateMismatchError, match="same tensor"):
        load_state(fs, root, into={"a": StateSlice(t[:2], (0, 0)),
                                   "b": StateSlice(t[:2], (2, 0))})
    half = t[:2]
    with pytest.raises(StateMismatchError, match="same tensor"):
        load_state(fs, root, into={"a": StateSlice(half, (0, 0)),
                                   "c": StateSlice(half, (2, 0))})
    assert not t.any()
    out = load_state(fs, root, into={"a": t, "c": t, "t": t, "u": t})
    assert torch.equal(t, a) and all(out[k] is t for k in "actu")


def test_every_rank_writes_an_even_share(tmp_path) -> None:
    root = _save(tmp_path, _state(), 4)
    sizes = [os.path.getsize(os.path.join(root, n)) for n in sorted(os.listdir(root))
             if n.endswith(".safetensors")]
    assert len(sizes) == 4
    assert max(sizes) <= 1.1 * (sum(sizes) / 4), sizes


def _boxes(shape: tuple[int, int], rows: int, cols: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for i in range(rows):
        for j in range(cols):
            r0, r1 = shape[0] * i // rows, shape[0] * (i + 1) // rows
            c0, c1 = shape[1] * j // cols, shape[1] * (j + 1) // cols
            out.append(([r0, c0], [r1 - r0, c1 - c0]))
    return out


@pytest.mark.parametrize("grid", [(2, 1), (8, 1), (3, 1), (1, 3), (2, 2), (5, 7)])
def test_any_box_reads_the_right_slice(tmp_path, grid) -> None:
    """4 -> M both ways, uneven splits, column splits: each requested box
    equals the slice of the whole tensor (StateSlice, the DTensor-free request)."""
    tree = _state()
    root = _save(tmp_path, tree, 4)
    w = tree["model"]["w"]
    fs = pafs.LocalFileSystem()
    for offset, shape in _boxes(tuple(w.shape), *grid):
        dest = torch.full(shape, float("nan"))
        out = load_state(fs, root, into={"model": {"w": StateSlice(dest, offset)}})
        assert out["model"]["w"] is dest
        r, c = offset
        assert torch.equal(dest, w[r:r + shape[0], c:c + shape[1]]), (offset, shape)


def test_a_one_rank_checkpoint_loads_sliced(tmp_path) -> None:
    from checkpoint_store.state import write_state

    tree = _state()
    write_state(tree, tmp_path / "one")
    dest = torch.zeros(300, 150)
    load_state(pafs.LocalFileSystem(), str(tmp_path / "one"),
               into={"model": {"w": StateSlice(dest, (700, 150))}})
    assert torch.equal(dest, tree["model"]["w"][700:1000, 150:])


def test_a_row_slice_reads_about_its_bytes(tmp_path) -> None:
    """Blocks bound what a partial read costs: a box of rows of large pieces
    reads its bytes plus at most two blocks per piece it touches."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(4096, 1024, generator=g)  # 16 MiB in 4 pieces of 4 MiB
    root = _save(tmp_path, {"w": big}, 4)
    e = _index(root)["w"]
    # 4 MiB pieces: blocks of 64 KiB, the least a block holds (16 rows of 4 KiB).
    assert all(p["blocks"][0] == 16 and len(p["blocks"][1]) == 64 for p in e["shards"])
    block = 16 * 4096
    fetch = _Fetcher(pafs.LocalFileSystem(), root, {}, None, 4)
    for offset, shape in _boxes((4096, 1024), 8, 1) + _boxes((4096, 1024), 3, 1):
        dest = np.empty(shape, dtype=np.float32)
        read = read_box(fetch, root, "w", ShardIndex(e), offset, dest)
        assert np.array_equal(dest, big[offset[0]:offset[0] + shape[0]].numpy())
        pieces = len(ShardIndex(e).find(offset, [offset[0] + shape[0], 1024]))
        assert dest.nbytes <= read <= dest.nbytes + 2 * pieces * block, (offset, read)
        assert read <= 1.1 * dest.nbytes, (offset, read)


def test_a_damaged_piece_is_named_on_whole_and_partial_reads(tmp_path) -> None:
    tree = {"w": torch.randn(4096, 1024)}
    root = _save(tmp_path, tree, 4)
    piece = _index(root)["w"]["shards"][2]
    assert piece["blocks"][0] == 16
    path = os.path.join(root, piece["file"])
    block = piece["blocks"][0] * 4096
    with open(path, "r+b") as f:  # a byte in the 17th block of rank 2's piece
        f.seek(piece["offsets"][0] + 16 * block + 17)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    fs = pafs.LocalFileSystem()
    with pytest.raises(TensorCorruptError) as err:
        load_state(fs, root)
    assert err.value.tensor == "w" and err.value.file == piece["file"]
    rows, per = piece["offset"][0], piece["blocks"][0]
    dest = torch.zeros(per, 1024)  # the damaged block's rows
    with pytest.raises(TensorCorruptError):
        load_state(fs, root, into={"w": StateSlice(dest, (rows + 16 * per, 0))})
    assert not dest.any()  # nothing changed
    ok = torch.zeros(4 * per, 1024)  # other blocks of the same piece read fine
    load_state(fs, root, into={"w": StateSlice(ok, (rows + 20 * per, 0))})
    assert torch.equal(ok, tree["w"][rows + 20 * per:rows + 24 * per])


def test_pieces_that_do_not_tile_are_refused(tmp_path) -> None:
    root = _save(tmp_path, {"w": torch.randn(1037, 300)}, 4)
    with open(os.path.join(root, STATE_FILE)) as f:
        body = json.load(f)
    body["tensors"]["w"]["shards"][1]["offset"][0] += 1  # overlaps the next, gap before
    with open(os.path.join(root, STATE_FILE), "w") as f:
        json.dump(body, f)
    with pytest.raises(CheckpointCorruptError, match="do not tile|overlap|lies outside"):
        load_state(pafs.LocalFileSystem(), root)
    parts = [write_part({"w": torch.randn(8, 2)}, str(tmp_path / f"p{r}"), r, 2)
             for r in range(2)]
    parts[1]["sharding"]["w"] = {"shape": [8, 2], "offset": [0, 0]}
    parts[1]["tensors"]["w"] = parts[0]["tensors"]["w"]  # rank 1 claims rank 0's rows
    parts[0]["tensors"]["w"] = {**parts[0]["tensors"]["w"], "shape": [8, 2]}
    with pytest.raises(CheckpointConflictError):
        merged_state_file(parts)


def test_a_piece_listed_again_at_another_box_is_refused(tmp_path) -> None:
    """A piece's CRC checks its bytes, not where they go: rank 0's piece
    listed in place of rank 1's tiles the tensor and passes every CRC, yet
    would load rank 0's rows twice. Refused when the index is read."""
    w = torch.randn(1024, 300)
    root = _save(tmp_path, {"w": w}, 4)
    with open(os.path.join(root, STATE_FILE)) as f:
        body = json.load(f)
    shards = body["tensors"]["w"]["shards"]
    shards[1] = {**shards[0], "offset": shards[1]["offset"]}
    with open(os.path.join(root, STATE_FILE), "w") as f:
        json.dump(body, f)
    with pytest.raises(CheckpointCorruptError, match="same bytes"):
        load_state(pafs.LocalFileSystem(), root)


def test_an_overlap_and_a_gap_are_refused_in_an_irregular_tiling(tmp_path) -> None:
    """Row bands cut at a different column each make a grid too fine to
    build (the index scans its pieces instead); a piece moved onto its
    neighbour, leaving as many elements uncovered as it covers twice, must
    still be refused when the index is read, not loaded with a hole of
    uninitialized memory."""
    from checkpoint_store.state import write_state

    rows, cols = 200, 300
    full = torch.randn(rows, cols)
    cuts = [1 + i for i in range(rows)]
    pieces = {f"p{i}_{j}": (full[i:i + 1, :c] if j == 0 else full[i:i + 1, c:]).clone()
              for i, c in enumerate(cuts) for j in (0, 1)}
    root = str(tmp_path / "ckpt")
    write_state({"w": torch.zeros(1), **pieces}, root)
    with open(os.path.join(root, STATE_FILE)) as f:
        body = json.load(f)
    stored = body["tensors"]

    def shard(i: int, j: int, at: int) -> dict[str, Any]:
        e = stored[f"p{i}_{j}"]
        return {"file": e["file"], "offsets": e["offsets"], "crc32c": e["crc32c"],
                "offset": [i, at], "shape": e["shape"]}

    shards = [shard(i, j, 0 if j == 0 else c) for i, c in enumerate(cuts) for j in (0, 1)]
    entry = {"dtype": "F32", "shape": [rows, cols], "framework": "torch", "shards": shards}
    assert ShardIndex(entry).cells is None and ShardIndex.why_not_tiling(entry) is None
    shards[-1] = {**shards[-1], "offset": [rows - 1, cuts[-1] - 1]}  # one column left
    assert "overlap" in (ShardIndex.why_not_tiling(entry) or "")
    body["tensors"]["w"] = entry
    with open(os.path.join(root, STATE_FILE), "w") as f:
        json.dump(body, f)
    with pytest.raises(CheckpointCorruptError, match="overlap"):
        load_state(pafs.LocalFileSystem(), root, keys="w")


def test_ranks_with_different_states_are_refused(tmp_path) -> None:
    a = write_part({"w": torch.zeros(4)}, str(tmp_path / "a"), 0, 2)
    b = write_part({"v": torch.zeros(4)}, str(tmp_path / "b"), 1, 2)
    with pytest.raises(CheckpointConflictError, match="rank 1"):
        merged_state_file([a, b])
    # The same keys in another order (a state built from a set, whose order
    # differs by process): said as such, not as "[] differ".
    x = torch.zeros(4)
    ab = write_part({"w": x, "v": torch.ones(4), "t": x}, str(tmp_path / "ab"), 0, 2)
    ba = write_part({"v": torch.ones(4), "t": x, "w": x}, str(tmp_path / "ba"), 1, 2)
    with pytest.raises(CheckpointConflictError, match="same keys as rank 0 in another order"):
        merged_state_file([ab, ba])
    c = write_part({"w": torch.zeros(5)}, str(tmp_path / "c"), 1, 2)
    with pytest.raises(CheckpointConflictError, match="rank 1"):
        merged_state_file([a, c])
    # A small tensor is written by one rank only; another rank's other
    # dtype (or framework) is refused all the same, whichever writes it.
    for key in ("w", "v", "x", "y"):
        parts = [write_part({key: torch.zeros(4, dtype=dtype)}, str(tmp_path / f"{key}{r}"),
                            r, 2) for r, dtype in enumerate((torch.float32, torch.float64))]
        with pytest.raises(CheckpointConflictError, match="different dtypes"):
            merged_state_file(parts)
        parts[1] = write_part({key: np.zeros(4, np.float32)}, str(tmp_path / f"{key}n"), 1, 2)
        with pytest.raises(CheckpointConflictError, match="different dtypes"):
            merged_state_file(parts)


@pytest.mark.parametrize("offset, shape, match", [
    ((1000, 0), (100, 300), "outside"),
    ((-1, 0), (10, 300), "outside"),
    ((0,), (10, 300), "ints"),
    ((0, 0), (10,), "1 dimension"),
    ((0, 0), (1, 10, 300), "3 dimension"),
    ((0, 0), None, "holds list"),
])
def test_a_bad_slice_is_refused_before_any_read(tmp_path, offset, shape, match) -> None:
    """Each a StateMismatchError naming the key, whatever the request is
    (a tensor of other dimensions than the saved one, something that is
    no tensor), before anything is read or filled."""
    root = _save(tmp_path, {"w": torch.randn(1037, 300), "v": torch.ones(4)}, 2)
    dest = torch.zeros(shape) if shape is not None else [0.0] * 10
    other = torch.zeros(4)
    with pytest.raises(StateMismatchError, match=match) as err:
        load_state(pafs.LocalFileSystem(), root,
                   into={"v": other, "w": StateSlice(dest, offset)})
    assert err.value.key == "w" and not other.any()


def test_planning_finds_overlaps_without_the_product(tmp_path) -> None:
    """2,000 saved pieces x 2,000 requested boxes: every lookup visits only
    the grid cells of its box (counted), never every piece."""
    rows = 4000
    saved = {"dtype": "F32", "shape": [rows, 8], "framework": "torch",
             "shards": [{"file": "f", "offsets": [0, 0], "crc32c": "0", "offset": [2 * i, 0],
                         "shape": [2, 8]} for i in range(rows // 2)]}
    index = ShardIndex(saved)
    assert index.cells is not None and len(index.cells) == rows // 2
    hits = [index.find([2 * i + 1, 0], [2 * i + 3, 8]) for i in range(rows // 2 - 1)]
    assert all(len(h) == 2 for h in hits)
    assert [p["offset"][0] for p in hits[10]] == [20, 22]


# -- through the session, on real ranks ---------------------------------------------


def _torchrun(n: int, *args: str, cwd) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(
               os.path.dirname(os.path.abspath(__file__)))), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(n), WORKER, *args], env=env, capture_output=True, text=True, timeout=600,
        cwd=str(cwd))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _results(out, mode: str, n: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"{mode}-{r}.json").read_text()) for r in range(n)]


@pytest.fixture(scope="module")
def saved_on_four(tmp_path_factory):
    """A trial whose state was reported on 4 gloo ranks (DTensor rows, a
    replicated tensor, a Replicate DTensor), then a report rank 1 could not save."""
    base = tmp_path_factory.mktemp("four")
    store, out = base / "store", base / "out"
    out.mkdir()
    _torchrun(4, "save", str(store), str(out), cwd=base)
    return store, _results(out, "save", 4)


def test_four_ranks_commit_one_state_and_abort_together(saved_on_four) -> None:
    store, ranks = saved_on_four
    assert ranks[1]["error"][0] == "UnsupportedStateError"
    assert all(r["error"][0] == "CheckpointAbortedError" and "rank 1" in r["error"][1]
               for r in ranks if r["rank"] != 1)
    ctx = StorageContext(str(store), "exp", "t")
    committed = ctx.committed_checkpoints()
    assert [m["index"] for _, m in committed] == [0, 1]
    assert {r["latest"] for r in ranks} == {ctx.checkpoint_path(1)}
    ck, meta = committed[-1]
    files = sorted(e["path"] for e in meta["manifest"])
    assert files == [STATE_FILE] + [f"tensors-rank{r:05d}-00001-of-00001.safetensors"
                                    for r in range(4)]
    assert meta["world_size"] == 4 and len(meta["tensors"]["model/w"]["shards"]) == 4
    ck.verify()
    # One process reads it whole (consolidation), bit-exact.
    sys.path.insert(0, os.path.dirname(__file__))
    try:
        from _sharded_worker import full_state
    finally:
        sys.path.pop(0)
    full = full_state(2)
    out = ck.load_state()
    for k in ("w", "emb", "bias", "wide"):
        assert torch.equal(out["model"][k], full["model"][k]), k
    assert out["step"] == 2


@pytest.mark.parametrize("n, placement", [(2, "rows"), (3, "cols")])
def test_a_four_rank_state_loads_on_other_rank_counts(saved_on_four, tmp_path, n,
                                                      placement) -> None:
    store, _ = saved_on_four
    out = tmp_path / "out"
    out.mkdir()
    _torchrun(n, "load", str(store), str(out), placement, cwd=tmp_path)
    ranks = _results(out, "load", n)
    for r in ranks:
        assert all(r["ok"].values()), r
    for r in ranks:
        if placement == "rows":  # each rank read about its own rows, not the whole state
            assert sum(r["read"].values()) <= 1.1 * sum(r["local"].values()) + 4 * BLOCK_BYTES, r
        # Row pieces (Shard(0) on 4) read as rows or as column shards (Shard(1)
        # on 3): rows 16 KiB wide are read as the columns asked for (tiles).
        assert r["read"]["model/wide"] <= 1.1 * r["local"]["wide"], r


@pytest.mark.slow  # two torchrun launches: about 35 s
def test_a_state_saved_with_a_local_tier_per_rank_loads_on_two_ranks(tmp_path) -> None:
    """The same four-rank save with a local tier on every rank (each rank's
    part committed there first, the durable copies meeting through storage):
    the same outcome on the storage_path, and two ranks load it."""
    store, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    _torchrun(4, "save", str(store), str(out), "tier", cwd=tmp_path)
    ranks = _results(out, "save", 4)
    assert ranks[1]["error"][0] == "UnsupportedStateError"
    assert all(r["error"][0] == "CheckpointAbortedError" for r in ranks if r["rank"] != 1)
    ctx = StorageContext(str(store), "exp", "t")
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0, 1]
    assert {r["latest"] for r in ranks} == {ctx.checkpoint_path(1)}
    for r in range(4):  # each rank's part of checkpoint 1 on its own tier
        local = out / f"fast{r}" / "exp" / "t" / f"rank_{r}" / "checkpoint_000001"
        assert sorted(p.name for p in local.iterdir() if p.suffix == ".safetensors") == [
            f"tensors-rank{r:05d}-00001-of-00001.safetensors"]
    loaded = tmp_path / "loaded"
    loaded.mkdir()
    _torchrun(2, "load", str(store), str(loaded), "rows", cwd=tmp_path)
    for r in _results(loaded, "load", 2):
        assert all(r["ok"].values()), r


def test_every_reader_of_a_checkpoint_handles_pieces(tmp_path) -> None:
    """The entry points that read a state's index: a commit of it on memory
    and S3-like stores (URI and fsspec forms), verify(), the CLI's show, the
    page's tensor table, an export to Hugging Face safetensors."""
    import fsspec
    from safetensors.numpy import load_file

    from checkpoint_store import Checkpoint
    from checkpoint_store._browse.output import fmt_size
    from checkpoint_store.formats import export_checkpoint
    from checkpoint_store.ui._rows import _tensor_rows
    from tests.cli.cli_helpers import invoke

    tree = _state()
    root = _save(tmp_path, tree, 3)
    committed = []
    for ctx in (StorageContext("memory://sharded-readers", "exp", "t"),
                StorageContext("mem-sharded/ckpt", "exp", "t",
                               storage_filesystem=fsspec.filesystem("memory"))):
        ck = ctx.persist_checkpoint(Checkpoint.from_directory(root), 0, {})
        assert len(ck.internal_metadata["tensors"]["model/w"]["shards"]) == 3
        ck.verify()
        dest = torch.zeros(100, 300)
        ck.load_state(into={"model": {"w": StateSlice(dest, (400, 0))}})
        assert torch.equal(dest, tree["model"]["w"][400:500])
        committed.append(ck)
    local = Checkpoint.from_directory(root)
    out = invoke(["show", committed[0].uri]).output
    w_bytes = tree["model"]["w"].nbytes
    data = sum(t.nbytes for t in (tree["model"]["w"], tree["model"]["b"], tree["model"]["s"],
                                  tree["model"]["h"], tree["opt"]["state"][0]["exp_avg"],
                                  tree["np"]))
    line = next(ln for ln in out.splitlines() if ln.startswith("tensors"))
    assert line.split(None, 1)[1] == f"{len(_index(root))} ({fmt_size(data)})", line
    rows = {r["name"]: r for r in _tensor_rows({"tensors": _index(root)})}
    assert rows["model/w"]["size"] == w_bytes
    assert rows["model/w"]["file"] == "3 pieces in 3 files"
    export_checkpoint(local, tmp_path / "hf", format="hf", shared="drop")
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert np.array_equal(exported["w"], tree["model"]["w"].numpy())
    assert np.array_equal(exported["h"].view(np.uint16),
                          tree["model"]["h"].view(torch.int16).numpy().view(np.uint16))


@contextmanager
def on_s3_through_relay(root: str, s3_server: Any, bucket: str,
                        prefix: str) -> Iterator[tuple[Any, Any]]:
    """The state directory ``root`` committed to S3 (moto) under ``prefix``,
    reached through a byte-counting relay: ``(checkpoint, relay)``."""
    from checkpoint_store import Checkpoint
    from tests.backends.relay import CountingRelay

    relay = CountingRelay(s3_server.port)
    try:
        ctx = StorageContext(f"s3://{bucket}/{prefix}", "exp", "t", storage_options={
            **s3_server.storage_options("pyarrow"), "endpoint_url": relay.url})
        yield ctx.persist_checkpoint(Checkpoint.from_directory(root), 0, {}), relay
    finally:
        relay.close()


@pytest.mark.parametrize("m", [2, 8])
def test_all_ranks_together_fetch_about_the_state_from_s3(tmp_path, s3_server, s3_bucket,
                                                          m) -> None:
    """A 4-rank state on S3 (moto), loaded by M ranks each asking for its rows
    of every tensor: the bytes the server sends, counted by a relay, are the
    state's once plus each load's metadata (marker, state.json, listing)."""
    g = torch.Generator().manual_seed(5)
    tree = {"model": {f"l{i}": torch.randn(1031, 1024, generator=g) for i in range(4)}}
    assert_ranks_fetch_the_state_once(_save(tmp_path, tree, 4), tree, s3_server, s3_bucket, m)


def assert_ranks_fetch_the_state_once(root: str, tree: Any, s3_server: Any, bucket: str,
                                      m: int) -> None:
    """The state directory ``root`` (of ``tree``: ``{"model": {key: 2-D tensor}}``)
    committed to S3 and loaded by ``m`` ranks, each asking for its rows of
    every tensor: the bytes the server sends, counted by a relay, are the
    state's once (within 10 %) plus each load's metadata."""
    with on_s3_through_relay(root, s3_server, bucket, f"ckpt-{m}") as (ck, relay):
        state_bytes = sum(t.nbytes for t in tree["model"].values())
        relay.reset()
        ck.load_state(keys="model/l0")  # one load's metadata, measured
        metadata = relay.received - tree["model"]["l0"].nbytes
        relay.reset()
        for r in range(m):
            into = {}
            for key, t in tree["model"].items():
                n = t.shape[0]
                a, b = n * r // m, n * (r + 1) // m
                into[key] = StateSlice(torch.empty(b - a, *t.shape[1:]), (a, 0))
            ck.load_state(into={"model": into})
            for key, sl in into.items():
                assert torch.equal(sl.tensor, tree["model"][key][sl.offset[0]:][:len(sl.tensor)])
        got = relay.received
    assert state_bytes <= got <= 1.1 * state_bytes + m * (metadata + 64 * 1024), (
        got, state_bytes, metadata)

