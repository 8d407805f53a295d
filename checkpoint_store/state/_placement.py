"""Where each rank's piece of a sharded state lies in its logical tensor
(docs/sharded-state.md): the geometry of saves and loads.

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

:func:`write_part` is a rank's whole save in one call. Loading,
:func:`box_of_target` gives the box a target asks for (a
DTensor's local shard, a :class:`StateSlice`'s box, else the whole tensor)
and :func:`why_not_servable` why one cannot be served. The index the
pieces make is :mod:`._shards`'s; reading a box, :mod:`._box`'s.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import zlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checkpoint_store.errors import UnsupportedStateError
from checkpoint_store.state._sharing import tie_key
from checkpoint_store.state._tree import escape_key, join_key

__all__ = [
    "RankLocal",
    "SPLIT_BYTES",
    "StateSlice",
    "box_of_target",
    "local_whole",
    "localize",
    "why_not_servable",
    "write_part",
]

#: A replicated tensor of at least this many bytes is split by rows among
#: its replicas (each writes an even share); a smaller one is written whole
#: by one replica.
SPLIT_BYTES = 1 << 20


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

    from checkpoint_store.state._shards import ShardIndex

    boxes = set()
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        sh, off = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord),
                                                         placements)
        if math.prod(sh):
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


def write_part(tree: Any, directory: str, rank: int, world_size: int, *,
               shard_bytes: int | None = None) -> dict[str, Any]:
    """Write ``rank``'s part of a state saved on ``world_size`` ranks into
    the local ``directory`` (its own safetensors files) and return it for
    :func:`~checkpoint_store.state._shards.merge_parts`
    (:func:`~checkpoint_store.state._shards.finish_part`). The one-call form of what a
    session's persist process does."""
    import dataclasses

    from checkpoint_store.state._files import DEFAULT_SHARD_BYTES, StateWriter
    from checkpoint_store.state._shards import finish_part, rank_stem
    from checkpoint_store.state._tree import flatten_state

    local, sharding = localize(tree, rank, world_size)

    flat = flatten_state(local)
    flat.layout = dataclasses.replace(flat.layout, file_stem=rank_stem(rank))
    with StateWriter(directory, flat.layout,
                     shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES) as writer:
        for key, data in flat.buffers():
            writer.write(key, data)
        tensors = writer.close()
    return finish_part(directory, tensors, sharding)


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


def why_not_servable(target: Any, shape: Sequence[int]) -> str | None:
    """Why a boxed load target (a DTensor, a :class:`StateSlice`) cannot be
    served from a saved tensor of logical ``shape`` (None: it can): a box
    outside the tensor or of other dimensions than it, a slice of something
    that is no tensor or array, a placement a load cannot fill."""
    if isinstance(target, StateSlice):
        np = sys.modules.get("numpy")
        torch = sys.modules.get("torch")
        if not ((torch is not None and isinstance(target.tensor, torch.Tensor))
                or (np is not None and isinstance(target.tensor, np.ndarray))):
            return (f"a StateSlice holds {type(target.tensor).__name__}, not a torch tensor "
                    "or numpy array to fill")
        off, sh = list(target.offset), list(target.shape)
        if len(off) != len(shape) or any(
                isinstance(o, bool) or not isinstance(o, int) for o in off):
            return f"offset {tuple(target.offset)} is not {len(shape)} ints"
        if len(sh) != len(shape):
            # A box has the tensor's dimensions: no squeezing or unsqueezing.
            return (f"the slice's tensor has {len(sh)} dimension(s) {tuple(sh)}, the saved "
                    f"tensor {len(shape)} ({list(shape)})")
        if any(o < 0 or o + n > m for o, n, m in zip(off, sh, shape, strict=True)):
            return (f"the slice at {tuple(off)} of shape {tuple(sh)} lies outside the saved "
                    f"tensor's {list(shape)}")
        return None
    # A mesh dimension with more ranks than the tensor dimension it shards
    # has rows leaves some ranks an empty shard, as FSDP2 makes for small
    # tensors: served (those ranks read nothing).
    return _why_not_placed(target.shape, target.device_mesh.shape, target.placements)
