"""Sharded states: one logical tensor written in pieces by many ranks, read
back in any other pieces (docs/sharded-state.md).

Saving on N ranks, every rank calls :func:`localize` on its own state: each
tensor leaf becomes the **piece** this rank writes, with the piece's place
in the logical tensor recorded by flattened key (``sharding``):

* a ``DTensor`` (``torch.distributed.tensor``) contributes its local shard,
  at the global offset its placements give it
  (``compute_local_shape_and_global_offset``, as DCP does);
* a shard held by R ranks (a ``Replicate`` placement; any plain tensor or
  numpy array, which every rank holds, as in DDP) is written once: split by
  rows into R pieces, one per replica, when it is at least
  :data:`SPLIT_BYTES` and has R rows; else whole by the one replica its key
  hashes to. No rank talks to another to decide: every rank computes the
  same split.

The ranks' pieces are ordinary safetensors files (each rank its own file
names); rank 0 merges the ranks' indexes (:func:`merge_parts`) into one
tensor index of the whole logical state. A tensor written whole by one rank
keeps the one-rank entry (``file``, ``offsets``, ``crc32c``); a tensor in
pieces gets ``"shards"``: ``[{file, offsets, crc32c, offset, shape,
blocks}]``, ``offset``/``shape`` the piece's box in the logical tensor and
``blocks`` the CRC32C of every run of ``rows`` rows, so a reader that needs
part of a piece reads and checks only the blocks that hold it. The pieces
must tile the logical tensor exactly (no gap, no overlap): the merge and
every read check it, so a wrong reassembly cannot pass.

Reading on M ranks, :class:`ShardIndex` finds the pieces a requested box
overlaps in O(pieces) to build and O(log + overlaps) per request (a grid of
the pieces' boundaries, not the product of saved and requested pieces);
:func:`read_box` reads them (only the byte ranges, rounded out to checked
blocks) into the box's memory.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import sys
import zlib
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checkpoint_store._transfer.crc32c import crc32c_combine
from checkpoint_store.errors import (
    CheckpointConflictError,
    TensorCorruptError,
    UnsupportedStateError,
)
from checkpoint_store.state._sharing import tie_key
from checkpoint_store.state._tree import DTYPES, escape_key, join_key

__all__ = [
    "BLOCK_BYTES",
    "RankLocal",
    "StateSlice",
    "SPLIT_BYTES",
    "ShardIndex",
    "block_crcs",
    "box_of_target",
    "localize",
    "merge_parts",
    "read_box",
    "shards_of",
    "stored_bytes",
]

#: A replicated tensor of at least this many bytes is split by rows among
#: its replicas (each writes an even share); a smaller one is written whole
#: by one replica.
SPLIT_BYTES = 1 << 20
#: Most bytes of rows per checksummed block of a piece: a partial read reads
#: and checks whole blocks, so it reads at most two blocks more than it
#: needs. A piece has about :data:`BLOCKS_PER_PIECE` blocks (at least
#: :data:`MIN_BLOCK_BYTES` each), so that excess stays a few percent of a
#: piece whatever its size.
BLOCK_BYTES = 1 << 20
MIN_BLOCK_BYTES = 64 << 10
BLOCKS_PER_PIECE = 64


@dataclass(frozen=True)
class StateSlice:
    """A request for part of a saved tensor, as a leaf of ``load_state(into=...)``:
    ``tensor`` (a writable torch tensor or numpy array) is filled with the
    box of the logical tensor that starts at ``offset`` and has
    ``tensor``'s shape. What a ``DTensor`` target asks for implicitly, for
    callers that shard without ``torch.distributed.tensor``.

    Attributes:
        tensor: the destination; its dtype must be the saved one.
        offset: elements per dimension from the logical tensor's start
            (``len(offset) == tensor.ndim``).
    """

    tensor: Any
    offset: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "offset", tuple(self.offset))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


@dataclass(frozen=True)
class RankLocal:
    """An entry of a state that differs by rank (its RNG state, its data
    loader's position), as a value of ``report(state=...)`` on several
    ranks: each rank's value is saved whole, and the checkpoint holds
    ``{"0": rank 0's value, "1": rank 1's, ...}`` at that key (a one-rank
    session saves ``{"0": value}``). Without it every tensor is taken to be
    the same on every rank and every JSON value is rank 0's.

    Attributes:
        value: any state value (a tensor, a tree, a JSON value).
    """

    value: Any


# -- save: every rank's piece ----------------------------------------------------


def _is_dtensor(value: Any) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(value, cls)


def _is_array(value: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, (np.ndarray, np.generic))


def _why_not_placed(shape: Sequence[int], mesh_shape: Sequence[int],
                    placements: Sequence[Any]) -> str | None:
    """Why a DTensor of ``shape`` with ``placements`` on a mesh of
    ``mesh_shape`` cannot be saved or loaded as one box per rank (None: it
    can): a ``Partial`` placement, or strided shards (``_StridedShard``, which
    FSDP2 makes over a tensor-parallel shard of the same dimension) whose
    ranks' boxes do not tile the tensor.

    Strided shards are taken, as DCP takes them, at the box that
    ``compute_local_shape_and_global_offset`` gives (shape and first
    offset); every coordinate's box is computed and the distinct boxes must
    tile the tensor exactly. Each rank's rows are then that very box: the
    ranks' index sets partition each dimension, and a set with the box's
    first index and size that tiles with the others holds exactly the box's
    indexes (by induction from the last box). Otherwise the save would
    interleave rows, and it is refused before anything is written.
    """
    from torch.distributed.tensor import Replicate, Shard

    strided = False
    for p in placements:
        if type(p) is Shard or isinstance(p, Replicate):
            continue
        if type(p).__name__ != "_StridedShard":
            return (f"placement {p!r} cannot be saved or loaded; a sharded state takes "
                    "Shard(dim), Replicate() and FSDP2's strided shards (reduce a Partial "
                    "one first, e.g. dt.redistribute(placements=[Replicate()]), or save "
                    ".full_tensor())")
        strided = True
    if not strided:
        return None
    return _strided_tiling(tuple(shape), tuple(mesh_shape), tuple(placements))


@functools.lru_cache(maxsize=256)
def _strided_tiling(shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                    placements: tuple[Any, ...]) -> str | None:
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    boxes = set()
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        sh, off = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord),
                                                         placements)
        if _volume(sh):
            boxes.add((tuple(int(o) for o in off), tuple(int(n) for n in sh)))
    entry = {"shape": list(shape), "shards": [
        {"file": "", "offsets": [0, 0], "offset": list(o), "shape": list(n)}
        for o, n in sorted(boxes)]}
    why = ShardIndex.why_not_tiling(entry) if boxes else None
    if why is None:
        return None
    return (f"strided shards {list(placements)} on a mesh of {list(mesh_shape)} do not "
            f"give each rank one block ({why}); save .full_tensor() or redistribute it to "
            "Shard/Replicate placements first")


def _dtensor_geometry(value: Any, key: str) -> tuple[Any, list[int], list[int], int, int]:
    """``(local tensor, global shape, global offset, replicas, replica index)``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = value.device_mesh, value.placements
    why = _why_not_placed(value.shape, mesh.shape, placements)
    if why is not None:
        raise UnsupportedStateError(f"tensor {key!r} is a DTensor whose {why}", key=key)
    local = value.to_local()
    coord = mesh.get_coordinate()
    if coord is None:  # this rank holds nothing of it
        return local, list(value.shape), [0] * value.ndim, 1, 1
    shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, placements)
    if tuple(local.shape) != tuple(shape):
        raise UnsupportedStateError(
            f"tensor {key!r}: the DTensor's local tensor has shape {list(local.shape)}, its "
            f"placements give {list(shape)}; save it through DTensor's own API "
            "(to_local() of a padded shard is not supported)", key=key)
    replicas, index = _outer_copies(mesh, key)
    for dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            n = mesh.size(dim)
            replicas, index = replicas * n, index * n + coord[dim]
    return local, list(value.shape), list(offset), replicas, index


def _outer_copies(mesh: Any, key: str) -> tuple[int, int]:
    """``(copies, this one)`` of a DTensor's mesh when it is sliced from a
    larger mesh (``fully_shard(mesh=mesh["dp"])`` of a module that tensor
    parallelism left whole): every slice along the root mesh's other
    dimensions holds the same shards, so they share writing them as
    ``Replicate`` dimensions do. ``(1, 0)`` for a root mesh.

    Raises:
        UnsupportedStateError: a mesh whose ranks do not fill whole
            dimensions of its root mesh.
    """
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = get_root() if get_root is not None else None
    if root is None or root is mesh or root.size() == mesh.size():
        return 1, 0
    got = _slice_copies(tuple(root.mesh.shape), tuple(int(r) for r in root.mesh.flatten()),
                        tuple(int(r) for r in mesh.mesh.flatten()), int(root.get_rank()))
    if got is None:
        raise UnsupportedStateError(
            f"tensor {key!r} is a DTensor on a mesh of ranks {mesh.mesh.flatten().tolist()} that "
            f"is not a slice of whole dimensions of its root mesh {root.mesh.tolist()}; save "
            ".full_tensor() or place it on the root mesh", key=key)
    return got


@functools.lru_cache(maxsize=64)
def _slice_copies(shape: tuple[int, ...], root: tuple[int, ...], ranks: tuple[int, ...],
                  me: int) -> tuple[int, int] | None:
    """:func:`_outer_copies` for a root mesh of ``shape`` (ranks ``root`` in
    C order) and a slice holding ``ranks``, seen from rank ``me``; None when
    the slice does not fill whole dimensions. Once per mesh, not per tensor."""
    where = {r: i for i, r in enumerate(root)}
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    coords = [tuple((where[r] // strides[d]) % shape[d] for d in range(len(shape)))
              for r in ranks]
    mine = coords[ranks.index(me)]
    fixed = [d for d in range(len(shape)) if len({c[d] for c in coords}) == 1]
    copies = math.prod(shape[d] for d in fixed)
    if copies * len(ranks) != len(root):
        return None
    index = 0
    for d in fixed:
        index = index * shape[d] + mine[d]
    return copies, index


def _owner(key: str, replicas: int) -> int:
    """The replica that writes a small replicated tensor: by its key's hash,
    the same on every rank and spread over the replicas."""
    return zlib.crc32(key.encode("utf-8")) % replicas


def _empty_like(value: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return torch.empty((0,), dtype=value.dtype)
    import numpy as np

    return np.empty((0,), dtype=np.asarray(value).dtype)


def _piece(value: Any, key: str, rank: int, world_size: int) -> tuple[Any, dict[str, Any]]:
    """This rank's piece of one tensor leaf and its box in the logical tensor."""
    if _is_dtensor(value):
        local, shape, offset, replicas, index = _dtensor_geometry(value, key)
    else:
        local, shape = value, list(getattr(value, "shape", ()))
        offset, replicas, index = [0] * len(shape), world_size, rank
    if replicas == 1:
        return local, {"shape": shape, "offset": offset}
    nbytes = math.prod(local.shape) * local.dtype.itemsize if len(local.shape) else 0
    rows = local.shape[0] if len(local.shape) else 0
    if nbytes >= SPLIT_BYTES and rows >= replicas:
        a, b = rows * index // replicas, rows * (index + 1) // replicas
        at = list(offset)
        at[0] += a
        return local[a:b], {"shape": shape, "offset": at}
    if _owner(key, replicas) == index:
        return local, {"shape": shape, "offset": offset}
    return _empty_like(local), {"shape": shape, "offset": offset}


def localize(tree: Any, rank: int, world_size: int) -> tuple[Any, dict[str, dict[str, Any]]]:
    """This rank's part of a state saved on ``world_size`` ranks.

    Args:
        tree: this rank's state (what ``report(state=...)`` takes): DTensors,
            tensors and arrays (replicated: every rank holds the same), JSON
            values.
        rank, world_size: this rank among the ranks that save together.

    Returns:
        ``(tree of pieces, sharding)``: the same tree with each tensor leaf
        replaced by the piece this rank writes (an empty tensor when it
        writes none of it), and flattened key -> ``{"shape": the logical
        shape, "offset": the piece's offset in it}`` (``"alias_of"`` for a
        tensor that is the very same view as an earlier one: tied weights);
        a :class:`RankLocal` entry becomes ``{str(rank): its value}``, its
        key marked ``{"rank_local": True}``.

    Raises:
        UnsupportedStateError: a DTensor placement that cannot be saved
            (``Partial``, strided shards that do not give each rank one
            block); ``.key`` names it.
    """
    sharding: dict[str, dict[str, Any]] = {}
    seen: dict[Hashable, tuple[str, Any]] = {}

    def walk(value: Any, key: str, root: bool, local: bool) -> Any:
        if isinstance(value, RankLocal):
            if local or root:
                raise UnsupportedStateError(
                    f"RankLocal at {key or 'the root'!r}: a rank-local value must be an entry "
                    "of the state, not its root nor inside another RankLocal", key=key)
            sharding[key] = {"rank_local": True}
            return walk({str(rank): value.value}, key, root, True)
        if _is_dtensor(value) or _is_array(value):
            tie = id(value) if _is_dtensor(value) else tie_key(value)
            first = seen.get(tie)
            if first is not None:
                sharding[key] = {**sharding[first[0]], "alias_of": first[0]}
                return first[1]
            if local:  # this rank's own: whole, written by this rank
                piece = value.to_local() if _is_dtensor(value) else value
                shape = list(getattr(piece, "shape", ()))
                box = {"shape": shape, "offset": [0] * len(shape)}
            else:
                piece, box = _piece(value, key, rank, world_size)
            sharding[key] = box
            seen[tie] = (key, piece)
            return piece
        if isinstance(value, Mapping):
            return {k: walk(v, join_key(key, escape_key(k), root=root), False, local)
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [walk(v, join_key(key, str(i), root=root), False, local)
                     for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    return walk(tree, "", True, False), sharding


def local_whole(tree: Any) -> Any:
    """``tree`` for a one-rank save: each DTensor replaced by its local
    tensor when that is the whole tensor (a one-rank mesh, or replicated),
    each :class:`RankLocal` by ``{"0": its value}``; the tree itself when it
    holds neither.

    Raises:
        UnsupportedStateError: a DTensor sharded over several ranks: start
            the session with every rank (``world_size``), or save
            ``.full_tensor()``.
    """
    found = False

    def walk(value: Any, key: str, root: bool) -> Any:
        nonlocal found
        if isinstance(value, RankLocal):
            found = True
            return {"0": walk(value.value, key, False)}
        if _is_dtensor(value):
            found = True
            local = value.to_local()
            if tuple(local.shape) != tuple(value.shape):
                raise UnsupportedStateError(
                    f"tensor {key!r} is a DTensor sharded over several ranks ({list(local.shape)} "
                    f"of {list(value.shape)} here) but the session has one rank: start it "
                    "on every rank (world_size, as torchrun sets it), or save .full_tensor()",
                    key=key)
            return local
        if isinstance(value, Mapping):
            return {k: walk(v, join_key(key, escape_key(k), root=root), False)
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [walk(v, join_key(key, str(i), root=root), False)
                     for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    out = walk(tree, "", True)
    return out if found else tree


def block_crcs(data: Any, row_bytes: int) -> list[Any]:
    """``[rows per block, [CRC32C hex of each block]]`` of a piece's bytes
    (``data``: bytes-like, C order), blocks of whole rows: about 1/64 of the
    piece, between :data:`MIN_BLOCK_BYTES` and :data:`BLOCK_BYTES`."""
    import google_crc32c

    view = memoryview(data).cast("B")
    target = max(MIN_BLOCK_BYTES, min(BLOCK_BYTES, len(view) // BLOCKS_PER_PIECE))
    rows = max(1, target // max(1, row_bytes))
    step = rows * row_bytes
    crcs = [f"{google_crc32c.value(bytes(view[a:a + step])):08x}"
            for a in range(0, len(view), step)] if step else []
    return [rows, crcs]


# -- rank 0: one index of the logical state ---------------------------------------


def _volume(shape: Sequence[int]) -> int:
    return math.prod(shape)


def merge_parts(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Rank 0: the tensor index of the whole logical state, from every
    rank's part ``{"tensors": its index, "sharding": localize's}`` (rank by
    rank; file names already distinct per rank).

    Raises:
        CheckpointConflictError: the ranks saved different states (other
            keys, shapes or dtypes), or the pieces of a tensor do not tile
            it exactly (a gap or an overlap: a placement this module
            mis-read); nothing should be committed.
    """
    local = sorted(k for k, box in parts[0]["sharding"].items() if box.get("rank_local"))

    def shared_keys(part: Mapping[str, Any]) -> list[str]:
        return [k for k, box in part["sharding"].items() if not box.get("rank_local")
                and not any(k.startswith(p + "/") for p in local)]

    keys = shared_keys(parts[0])
    for r, part in enumerate(parts):
        mine = sorted(k for k, box in part["sharding"].items() if box.get("rank_local"))
        if shared_keys(part) != keys or mine != local:
            extra = sorted(set(shared_keys(part)) ^ set(keys))[:3] or sorted(
                set(mine) ^ set(local))[:3]
            raise CheckpointConflictError(
                f"rank {r} saved a state with other tensors than rank 0 ({extra} differ); "
                "every rank must report a state of the same keys")
    out: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for part in parts:  # rank-local entries: each rank's own, whole
        for key, box in part["sharding"].items():
            if box.get("rank_local") or not any(key.startswith(p + "/") for p in local):
                continue
            if "alias_of" in box:
                aliases[key] = box["alias_of"]
            else:
                out[key] = {k: v for k, v in part["tensors"][key].items() if k != "blocks"}
    for key in keys:
        alias = parts[0]["sharding"][key].get("alias_of")
        if alias is not None:
            aliases[key] = alias
            continue
        shape = parts[0]["sharding"][key]["shape"]
        pieces: list[tuple[int, Mapping[str, Any], Mapping[str, Any]]] = []
        for r, part in enumerate(parts):
            box = part["sharding"][key]
            if box["shape"] != shape:
                raise CheckpointConflictError(
                    f"tensor {key!r} is {shape} on rank 0 and {box['shape']} on rank {r}; "
                    "every rank must report the same logical state")
            e = part["tensors"][key]
            if _volume(e["shape"]) or not _volume(shape) and r == 0:
                pieces.append((r, e, box))
        # Every rank's, even one that writes none of it (its empty piece
        # keeps its dtype): a rank that disagrees is refused, not outvoted.
        dtypes = {(part["tensors"][key]["dtype"], part["tensors"][key]["framework"])
                  for part in parts}
        if len(dtypes) > 1:
            raise CheckpointConflictError(
                f"tensor {key!r} was saved with different dtypes on different ranks "
                f"({sorted(dtypes)}); every rank must report the same logical state")
        first = pieces[0][1]
        if not _volume(shape):
            # No bytes to place: one entry of the logical shape (a rank that
            # writes none of it saved an empty 1-D piece, not of that shape).
            out[key] = {**{k: v for k, v in first.items() if k != "blocks"},
                        "shape": list(shape)}
            continue
        if (len(pieces) == 1 and list(first["shape"]) == list(shape)
                and not any(pieces[0][2]["offset"])):
            out[key] = {k: v for k, v in first.items() if k != "blocks"}
            continue
        entry: dict[str, Any] = {"dtype": first["dtype"], "shape": list(shape),
                                 "framework": first["framework"]}
        entry["shards"] = [
            {"file": e["file"], "offsets": list(e["offsets"]), "crc32c": e["crc32c"],
             "offset": list(box["offset"]), "shape": list(e["shape"]),
             **({"blocks": e["blocks"]} if "blocks" in e else {})}
            for _, e, box in pieces]
        why = ShardIndex.why_not_tiling(entry)
        if why:
            raise CheckpointConflictError(
                f"the ranks' pieces of tensor {key!r} {shape} do not tile it: {why}; "
                "nothing was committed")
        out[key] = entry
    for key, target in aliases.items():
        out[key] = {**out[target], "alias_of": target}
    return out


# -- read: which pieces hold a box -----------------------------------------------


def shards_of(e: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An index entry's pieces; a one-piece entry is its own piece at 0."""
    if "shards" in e:
        return list(e["shards"])
    return [{"file": e["file"], "offsets": e["offsets"], "crc32c": e["crc32c"],
             "offset": [0] * len(e["shape"]), "shape": list(e["shape"])}]


class ShardIndex:
    """The pieces of one logical tensor, indexed by the grid of their
    boundaries: building it costs O(pieces x cells each spans) (one cell
    each for the grids every sharding makes), finding the pieces a box
    overlaps O(dims x log(pieces) + cells in the box)."""

    #: Beyond this many cells per piece on average, lookups scan the pieces.
    MAX_CELLS_PER_PIECE = 64

    def __init__(self, entry: Mapping[str, Any]):
        self.entry = entry
        self.shape = list(entry["shape"])
        self.pieces = [p for p in shards_of(entry) if _volume(p["shape"])]
        nd = len(self.shape)
        self.bounds = [sorted({0, self.shape[d]}
                              | {p["offset"][d] for p in self.pieces}
                              | {p["offset"][d] + p["shape"][d] for p in self.pieces})
                       for d in range(nd)]
        self.cells: dict[tuple[int, ...], int] | None = {}
        self.overlap: tuple[int, int] | None = None
        budget = self.MAX_CELLS_PER_PIECE * (len(self.pieces) + 1)
        for i, p in enumerate(self.pieces):
            ranges = [range(bisect.bisect_left(self.bounds[d], p["offset"][d]),
                            bisect.bisect_left(self.bounds[d], p["offset"][d] + p["shape"][d]))
                      for d in range(nd)]
            n = math.prod(len(r) for r in ranges)
            if self.cells is not None and len(self.cells) + n > budget:
                self.cells = None  # an irregular tiling: lookups scan
            if self.cells is None:
                continue
            for cell in itertools.product(*ranges):
                if cell in self.cells and self.overlap is None:
                    self.overlap = (self.cells[cell], i)
                self.cells[cell] = i

    @classmethod
    def why_not_tiling(cls, entry: Mapping[str, Any]) -> str | None:
        """Why the pieces of ``entry`` do not cover its shape exactly once
        (None: they do)."""
        shape = list(entry["shape"])
        for p in shards_of(entry):
            off, sh = p["offset"], p["shape"]
            if (len(off) != len(shape) or len(sh) != len(shape)
                    or any(o < 0 or o + s > n for o, s, n in zip(off, sh, shape, strict=True))):
                return f"piece at {off} of shape {sh} lies outside it"
        idx = cls(entry)
        total = sum(_volume(p["shape"]) for p in idx.pieces)
        if idx.overlap is not None:
            a, b = idx.overlap
            return (f"pieces at {idx.pieces[a]['offset']} and {idx.pieces[b]['offset']} "
                    "overlap")
        if total != _volume(shape):
            return f"its pieces hold {total} of its {_volume(shape)} elements"
        return None

    def find(self, lo: Sequence[int], hi: Sequence[int]) -> list[dict[str, Any]]:
        """The pieces overlapping the box ``[lo, hi)``, in storage order."""
        if any(a >= b for a, b in zip(lo, hi, strict=True)):
            return []
        if self.cells is None:
            found = [p for p in self.pieces
                     if all(p["offset"][d] < hi[d] and lo[d] < p["offset"][d] + p["shape"][d]
                            for d in range(len(lo)))]
        else:
            ranges = [range(bisect.bisect_right(self.bounds[d], lo[d]) - 1,
                            bisect.bisect_left(self.bounds[d], hi[d]))
                      for d in range(len(lo))]
            hits = {self.cells[c] for c in itertools.product(*ranges) if c in self.cells}
            found = [self.pieces[i] for i in sorted(hits)]
        return sorted(found, key=lambda p: (p["file"], p["offsets"][0]))


def box_of_target(target: Any) -> tuple[list[int], list[int], Any]:
    """``(offset, shape, local tensor)`` of a load target: a DTensor's local
    shard where its placements put it, a :class:`StateSlice`'s box, else
    the whole tensor at 0."""
    if isinstance(target, StateSlice):
        return list(target.offset), list(target.shape), target.tensor
    if _is_dtensor(target):
        local, _shape, offset, _r, _i = _dtensor_geometry(target, "")
        return list(offset), list(local.shape), local
    return [0] * len(target.shape), list(target.shape), target


def _rows_read(piece: Mapping[str, Any], r0: int, r1: int) -> tuple[int, int, list[Any] | None]:
    """Rows ``[r0, r1)`` of a piece rounded out to what can be checked:
    whole blocks, or the whole piece when it has none. Returns the rows to
    read and the block CRCs they cover (None: check the piece's CRC)."""
    n = piece["shape"][0] if piece["shape"] else 1
    blocks = piece.get("blocks")
    if (r0, r1) == (0, n) or not blocks:
        return 0, n, None
    per, crcs = blocks
    b0, b1 = r0 // per, -(-r1 // per)
    return b0 * per, min(n, b1 * per), crcs[b0:b1]


def _corrupt(path: str, key: str, piece: Mapping[str, Any], what: str) -> TensorCorruptError:
    return TensorCorruptError(
        f"tensor {key!r}: its piece at {piece['offset']} ({piece['file']!r}) of checkpoint "
        f"{path!r} does not match its checksum ({what}); the checkpoint is damaged: resume "
        "from an earlier one", path=path, file=piece["file"], tensor=key)


def _check(path: str, key: str, piece: Mapping[str, Any], data: memoryview,
           crcs: list[Any] | None, row_bytes: int, per: int) -> None:
    import google_crc32c

    if crcs is None:
        crc = 0
        step = 64 << 20
        for a in range(0, len(data), step):
            part = data[a:a + step]
            c = google_crc32c.value(bytes(part))
            crc = crc32c_combine(crc, c, len(part)) if a else c
        if f"{crc:08x}" != piece["crc32c"]:
            raise _corrupt(path, key, piece, f"crc32c {crc:08x}, the index says "
                                             f"{piece['crc32c']}")
        return
    step = per * row_bytes
    for i, want in enumerate(crcs):
        got = f"{google_crc32c.value(bytes(data[i * step:(i + 1) * step])):08x}"
        if got != want:
            raise _corrupt(path, key, piece, f"block {i} crc32c {got}, the index says {want}")


def read_box(fetch: Any, path: str, key: str, index: ShardIndex, lo: Sequence[int],
             dest: Any, *, verify: bool = True) -> int:
    """Fill ``dest`` (a numpy array: the box at ``lo`` of the logical tensor,
    its shape the box's) from the pieces that overlap it. Each piece is read
    as the rows the box needs, rounded out to its checked blocks, and
    checked before its bytes are copied. Returns the bytes read.

    Raises:
        TensorCorruptError: a piece's bytes fail their checksum.
    """
    import numpy as np

    hi = [a + n for a, n in zip(lo, dest.shape, strict=True)]
    size = DTYPES[index.entry["dtype"]][0]
    read = 0
    jobs: list[tuple[dict[str, Any], int, int, list[Any] | None, Any]] = []
    for piece in index.find(lo, hi):
        off, sh = piece["offset"], piece["shape"]
        row_bytes = math.prod(sh[1:]) * size if sh else size
        if sh:
            r0, r1 = max(lo[0], off[0]) - off[0], min(hi[0], off[0] + sh[0]) - off[0]
        else:
            r0, r1 = 0, 1
        a, b, crcs = _rows_read(piece, r0, r1)
        buf = np.empty((b - a) * row_bytes, dtype=np.uint8)
        jobs.append((piece, a, b, crcs, buf))
    fetch.fill([(p["file"], p["offsets"][0] + a * (len(buf) // max(1, b - a)), memoryview(buf))
                for p, a, b, _, buf in jobs])
    dtype = _np_dtype(index.entry["dtype"])
    for piece, a, b, crcs, buf in jobs:
        off, sh = piece["offset"], piece["shape"]
        row_bytes = len(buf) // max(1, b - a)
        read += len(buf)
        if verify:
            per = piece["blocks"][0] if crcs is not None else 0
            _check(path, key, piece, memoryview(buf), crcs, row_bytes, per)
        if not sh:
            dest[()] = buf.view(dtype).reshape(())
            continue
        rows = buf.view(dtype).reshape([b - a, *sh[1:]])
        src = tuple(slice(max(lo[d], off[d]) - off[d] - (a if d == 0 else 0),
                          min(hi[d], off[d] + sh[d]) - off[d] - (a if d == 0 else 0))
                    for d in range(len(sh)))
        dst = tuple(slice(max(lo[d], off[d]) - lo[d], min(hi[d], off[d] + sh[d]) - lo[d])
                    for d in range(len(sh)))
        dest[dst] = rows[src]
    return read


def _np_dtype(name: str) -> Any:
    """A numpy dtype of the same width for moving a safetensors dtype's
    bytes (bfloat16 and float8 have no numpy dtype: moved as raw ints)."""
    import numpy as np

    size, np_name, _ = DTYPES[name]
    if np_name is not None:
        return np.dtype(np_name)
    return np.dtype({1: "u1", 2: "u2", 4: "u4", 8: "u8"}[size])


def dest_array(tensor: Any) -> Any:
    """A numpy view of a contiguous CPU tensor's (or array's) memory, in
    :func:`_np_dtype`'s dtype, for :func:`read_box` to fill."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(tensor, numpy.ndarray):
        return tensor
    import ctypes

    import numpy as np

    from checkpoint_store.state._tree import _BY_TORCH

    name = _BY_TORCH[str(tensor.dtype).removeprefix("torch.")]
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return np.empty(tuple(tensor.shape), dtype=_np_dtype(name))
    buf = (ctypes.c_char * n).from_address(tensor.data_ptr())
    arr = np.frombuffer(buf, dtype=_np_dtype(name)).reshape(tuple(tensor.shape))
    return arr


def pieces_bytes(tensors: Mapping[str, Any]) -> Iterable[tuple[str, Mapping[str, Any]]]:
    """Every stored piece of an index as ``(key, piece)``: the entries
    themselves, or their shards (aliases skipped)."""
    for key, e in tensors.items():
        if not isinstance(e, Mapping) or "alias_of" in e:
            continue
        if "shards" in e:
            shards = e["shards"] if isinstance(e["shards"], list) else []
            for p in shards:
                if isinstance(p, Mapping):
                    yield key, {**p, "dtype": e.get("dtype"), "framework": e.get("framework")}
        else:
            yield key, e


# -- a rank's part on its local disk ------------------------------------------------


def rank_stem(rank: int) -> str:
    """The file stem of ``rank``'s safetensors files (``tensors-rank00003``)."""
    return f"tensors-rank{rank:05d}"


def finish_part(directory: str, tensors: Mapping[str, Any],
                sharding: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A rank whose piece files are written into the local ``directory``:
    its part for rank 0's merge, ``{"tree", "tensors", "sharding"}``, each
    piece of a split tensor given its block CRCs (read back from the files,
    in the page cache). The rank's own ``state.json`` is removed: only rank
    0's merged one is committed."""
    import json
    import os

    from checkpoint_store.state._files import STATE_FILE

    state_path = os.path.join(directory, STATE_FILE)
    with open(state_path, "rb") as f:
        tree = json.loads(f.read())["tree"]
    os.unlink(state_path)
    out: dict[str, Any] = {}
    for key, e in tensors.items():
        box = sharding.get(key)
        whole = (box is not None and list(e["shape"]) == list(box["shape"])
                 and not any(box["offset"]))
        if "alias_of" in e or whole or not _volume(e["shape"]) or not e["shape"]:
            out[key] = dict(e)
            continue
        begin, end = e["offsets"]
        row_bytes = (end - begin) // e["shape"][0] if e["shape"][0] else 0
        with open(os.path.join(directory, e["file"]), "rb") as f:
            data = os.pread(f.fileno(), end - begin, begin)
        out[key] = {**e, "blocks": block_crcs(data, row_bytes)}
    return {"tree": tree, "tensors": out, "sharding": dict(sharding)}


def write_part(tree: Any, directory: str, rank: int, world_size: int, *,
               shard_bytes: int | None = None) -> dict[str, Any]:
    """Write ``rank``'s part of a state saved on ``world_size`` ranks into
    the local ``directory`` (its own safetensors files) and return it for
    :func:`merge_parts` (:func:`finish_part`). The one-call form of what a
    session's persist process does."""
    from checkpoint_store.state._files import DEFAULT_SHARD_BYTES, StateWriter
    from checkpoint_store.state._tree import flatten_state

    local, sharding = localize(tree, rank, world_size)
    import dataclasses

    flat = flatten_state(local)
    flat.layout = dataclasses.replace(flat.layout, file_stem=rank_stem(rank))
    with StateWriter(directory, flat.layout,
                     shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES) as writer:
        for key, data in flat.buffers():
            writer.write(key, data)
        tensors = writer.close()
    return finish_part(directory, tensors, sharding)


def merged_state_file(parts: Sequence[Mapping[str, Any]]) -> tuple[bytes, dict[str, Any]]:
    """Rank 0: ``(state.json's bytes, the tensor index)`` of the whole
    logical state from every rank's part (:func:`merge_parts`; the tree of
    rank 0's part)."""
    import json

    from checkpoint_store.state._files import (
        SHARDED_FORMAT_VERSION,
        STATE_FORMAT_VERSION,
    )

    tensors = merge_parts(parts)
    version = (SHARDED_FORMAT_VERSION if any("shards" in e for e in tensors.values())
               else STATE_FORMAT_VERSION)
    tree = parts[0]["tree"]
    for key in sorted(k for k, box in parts[0]["sharding"].items() if box.get("rank_local")):
        # Every rank's own subtree under the key: {"0": ..., "1": ..., ...}.
        merged = {"dict": [item for part in parts for item in _node_at(part["tree"], key)["dict"]]}
        tree = _replace_at(tree, key, merged)
    body = {"kind": "checkpoint_store_state", "format_version": version,
            "tree": tree, "tensors": tensors}
    raw = json.dumps(body, ensure_ascii=False, allow_nan=True,
                     separators=(",", ":")).encode("utf-8")
    return raw, tensors


def read_whole(fs: Any, path: str, sizes: Mapping[str, int], key: str,
               e: Mapping[str, Any], *, concurrency: int = 8,
               chunked: Mapping[str, Any] | None = None) -> Any:
    """The whole logical tensor ``key`` (index entry ``e``) of the state at
    ``path`` as a numpy array of its bytes' width (:func:`_np_dtype`), every
    piece checked: what an export streams, one tensor at a time."""
    import numpy as np

    from checkpoint_store.state._fetch import _Fetcher

    out = np.empty(tuple(e["shape"]), dtype=_np_dtype(e["dtype"]))
    fetch = _Fetcher(fs, path, sizes, None, concurrency, chunked=chunked)
    read_box(fetch, path, key, ShardIndex(e),
             [0] * len(e["shape"]), out)
    return out


def stored_bytes(tensors: Mapping[str, Any]) -> int:
    """Bytes of tensor data an index stores (pieces summed, aliases once)."""
    total = 0
    for _, e in pieces_bytes(tensors):
        off = e.get("offsets")
        if isinstance(off, list) and len(off) == 2 and all(isinstance(n, int) for n in off):
            total += max(0, off[1] - off[0])
    return total


def why_not_servable(target: Any, shape: Sequence[int]) -> str | None:
    """Why a boxed load target (a DTensor, a :class:`StateSlice`) cannot be
    served from a saved tensor of logical ``shape`` (None: it can): a box
    outside the tensor, a placement a load cannot fill."""
    if isinstance(target, StateSlice):
        off, sh = list(target.offset), list(target.shape)
        if len(off) != len(shape) or any(
                isinstance(o, bool) or not isinstance(o, int) for o in off):
            return f"offset {tuple(target.offset)} is not {len(shape)} ints"
        if any(o < 0 or o + n > m for o, n, m in zip(off, sh, shape, strict=True)):
            return (f"the slice at {tuple(off)} of shape {tuple(sh)} lies outside the saved "
                    f"tensor's {list(shape)}")
        return None
    # A mesh dimension with more ranks than the tensor dimension it shards
    # has rows leaves some ranks an empty shard, as FSDP2 makes for small
    # tensors: served (those ranks read nothing).
    return _why_not_placed(target.shape, target.device_mesh.shape, target.placements)


def _components(key: str) -> list[str]:
    return key.split("/") if key else []


def _child(node: Mapping[str, Any], comp: str) -> tuple[str, int]:
    """Where the component ``comp`` (escaped) of a flattened key is in a
    skeleton node: ``(kind, position)``."""
    for kind in ("dict", "list", "tuple"):
        if kind in node:
            items = node[kind]
            for i, item in enumerate(items):
                name = escape_key(item[0]) if kind == "dict" else str(i)
                if name == comp:
                    return kind, i
    raise KeyError(comp)


def _node_at(tree: Mapping[str, Any], key: str) -> Any:
    node: Any = tree
    for comp in _components(key):
        kind, i = _child(node, comp)
        node = node[kind][i][1] if kind == "dict" else node[kind][i]
    return node


def _replace_at(tree: Any, key: str, new: Any) -> Any:
    comps = _components(key)
    if not comps:
        return new
    kind, i = _child(tree, comps[0])
    items = list(tree[kind])
    rest = "/".join(comps[1:])
    if kind == "dict":
        items[i] = [items[i][0], _replace_at(items[i][1], rest, new)]
    else:
        items[i] = _replace_at(items[i], rest, new)
    return {**tree, kind: items}
