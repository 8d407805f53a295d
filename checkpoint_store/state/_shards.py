"""Sharded states: one logical tensor written in pieces by many ranks, read
back in any other pieces (docs/sharded-state.md).

Saving on N ranks, every rank writes its **pieces** (what
:func:`~checkpoint_store.state._placement.localize` makes of its state:
:mod:`._placement`) into its own files, and :func:`finish_part` gives each
piece its checksums.

The ranks' pieces are ordinary safetensors files (each rank its own file
names); rank 0 merges the ranks' indexes (:func:`merge_parts`) into one
tensor index of the whole logical state. A tensor written whole by one rank
keeps the one-rank entry (``file``, ``offsets``, ``crc32c``); a tensor in
pieces gets ``"shards"``: ``[{file, offsets, crc32c, offset, shape,
blocks, tiles}]``, ``offset``/``shape`` the piece's box in the logical
tensor, ``blocks`` (``[rows, [CRC32C hex]]``) the CRC32C of every run of
``rows`` rows, so a reader that needs some rows of a piece reads and checks
only the blocks that hold them, and ``tiles`` (``[rows, columns, base64
CRC32Cs]``, pieces with rows of 4 KiB or more: :mod:`._tiles`) the CRC32C
of every tile of ``rows`` rows x ``columns`` indexes of dimension 1, so a
reader that needs some columns reads and checks only those. The pieces
must tile the logical tensor exactly (no gap, no overlap): the merge and
every read check it, so a wrong reassembly cannot pass.

Reading on M ranks, :class:`ShardIndex` finds the pieces a requested box
overlaps in O(pieces) to build and O(log + overlaps) per request (a grid of
the pieces' boundaries, not the product of saved and requested pieces);
:func:`~checkpoint_store.state._box.read_box` (:mod:`._box`) reads them
(only the byte ranges, rounded out to checked blocks or tiles) into the
box's memory.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from checkpoint_store.errors import CheckpointConflictError
from checkpoint_store.state._files import BLOCK_BYTES, rows_per_block
from checkpoint_store.state._tiles import tile_crcs, tile_shape
from checkpoint_store.state._tree import DTYPES, escape_key

__all__ = [
    "BLOCK_BYTES",
    "ShardIndex",
    "block_crcs",
    "finish_part",
    "merge_parts",
    "merged_state_file",
    "pieces_bytes",
    "rank_stem",
    "shards_of",
    "stored_bytes",
]

def block_crcs(data: Any, row_bytes: int) -> list[Any]:
    """``[rows per block, [CRC32C hex of each block]]`` of a piece's bytes
    (``data``: bytes-like, C order), blocks of whole rows
    (:func:`~checkpoint_store.state._files.rows_per_block`)."""
    import google_crc32c

    view = memoryview(data).cast("B")
    rows = rows_per_block(len(view), row_bytes)
    step = rows * row_bytes
    crcs = [f"{google_crc32c.value(bytes(view[a:a + step])):08x}"
            for a in range(0, len(view), step)] if step else []
    return [rows, crcs]


# -- rank 0: one index of the logical state ---------------------------------------

#: A piece's partial-read checksums (a whole tensor's too, where it has them).
_CHECKS = ("blocks", "tiles")


def _whole(e: Mapping[str, Any]) -> dict[str, Any]:
    """A one-rank entry from a piece that is its whole tensor (its blocks
    kept: a load on several ranks reads only each rank's rows)."""
    return dict(e)


def _volume(shape: Sequence[int]) -> int:
    return math.prod(shape)


def merge_parts(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Rank 0: the tensor index of the whole logical state, from every
    rank's part ``{"tensors": its index, "sharding": localize's}`` (rank by
    rank; file names already distinct per rank).

    Raises:
        CheckpointConflictError: the ranks saved different states (other
            keys, the same keys in another order, shapes or dtypes), or the
            pieces of a tensor do not tile it exactly (a gap or an overlap:
            a placement this module mis-read); nothing should be committed.
    """
    local = sorted(k for k, box in parts[0]["sharding"].items() if box.get("rank_local"))

    def shared_keys(part: Mapping[str, Any]) -> list[str]:
        return [k for k, box in part["sharding"].items() if not box.get("rank_local")
                and not any(k.startswith(p + "/") for p in local)]

    keys = shared_keys(parts[0])
    for r, part in enumerate(parts):
        mine = sorted(k for k, box in part["sharding"].items() if box.get("rank_local"))
        theirs = shared_keys(part)
        if theirs != keys and mine == local and sorted(theirs) == sorted(keys):
            at = next(i for i, (a, b) in enumerate(zip(theirs, keys, strict=True)) if a != b)
            raise CheckpointConflictError(
                f"rank {r} reported the same keys as rank 0 in another order ({theirs[at]!r} "
                f"where rank 0 has {keys[at]!r}); every rank must build its state in the same "
                "order (tied tensors are saved under the first of their keys): build it "
                "from a list or the model's own order, not from a set")
        if theirs != keys or mine != local:
            extra = sorted(set(theirs) ^ set(keys))[:3] or sorted(set(mine) ^ set(local))[:3]
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
                out[key] = _whole(part["tensors"][key])
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
            out[key] = {**_whole(first), "shape": list(shape)}
            continue
        if (len(pieces) == 1 and list(first["shape"]) == list(shape)
                and not any(pieces[0][2]["offset"])):
            out[key] = _whole(first)
            continue
        entry: dict[str, Any] = {"dtype": first["dtype"], "shape": list(shape),
                                 "framework": first["framework"]}
        entry["shards"] = [
            {"file": e["file"], "offsets": list(e["offsets"]), "crc32c": e["crc32c"],
             "offset": list(box["offset"]), "shape": list(e["shape"]),
             **{k: e[k] for k in _CHECKS if k in e}}
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
             "offset": [0] * len(e["shape"]), "shape": list(e["shape"]),
             **{k: e[k] for k in _CHECKS if k in e}}]


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
        if self.cells is None:
            # The grid was given up part-way: the pieces not put in it were
            # never compared. A sweep compares every pair that overlaps.
            self.overlap = _first_overlap(self.pieces, self.shape)

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


def _first_overlap(pieces: Sequence[Mapping[str, Any]],
                   shape: Sequence[int]) -> tuple[int, int] | None:
    """Two pieces (by position) that share an element, or None: a sweep
    along the dimension the pieces span least of (each piece compared with
    those it meets along it), so row bands cut at different columns cost
    O(pieces x log), not every pair."""
    if not shape:  # a 0-d tensor: every piece is all of it
        return (0, 1) if len(pieces) > 1 else None
    nd = len(shape)
    dim = min(range(nd), key=lambda d: sum(p["shape"][d] for p in pieces) / max(1, shape[d]))
    order = sorted(range(len(pieces)), key=lambda i: pieces[i]["offset"][dim])
    active: list[int] = []
    for i in order:
        p = pieces[i]
        start = p["offset"][dim]
        active = [j for j in active if pieces[j]["offset"][dim] + pieces[j]["shape"][dim] > start]
        for j in active:
            q = pieces[j]
            if all(q["offset"][d] < p["offset"][d] + p["shape"][d]
                   and p["offset"][d] < q["offset"][d] + q["shape"][d] for d in range(nd)):
                return j, i
        active.append(i)
    return None


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
    piece of a split tensor keeping the block CRCs its writer took and, when
    its rows are wide, given its tile CRCs
    (:func:`~checkpoint_store.state._tiles.tile_crcs`; read back from the
    files, in the page cache, on the thread that commits). The rank's own
    ``state.json`` is removed: only rank 0's merged one is committed."""
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
        if tile_shape(e["shape"], DTYPES[e["dtype"]][0]) is None:
            # Its blocks were taken as it was written (none: it is one block).
            out[key] = dict(e)
            continue
        begin, end = e["offsets"]
        with open(os.path.join(directory, e["file"]), "rb") as f:
            data = os.pread(f.fileno(), end - begin, begin)
        out[key] = {**e, "tiles": tile_crcs(data, e["shape"], DTYPES[e["dtype"]][0])}
    return {"tree": tree, "tensors": out, "sharding": dict(sharding)}


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


def stored_bytes(tensors: Mapping[str, Any]) -> int:
    """Bytes of tensor data an index stores (pieces summed, aliases once)."""
    total = 0
    for _, e in pieces_bytes(tensors):
        off = e.get("offsets")
        if isinstance(off, list) and len(off) == 2 and all(isinstance(n, int) for n in off):
            total += max(0, off[1] - off[0])
    return total


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
