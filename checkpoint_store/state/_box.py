"""Reading one box of a logical tensor from the pieces that overlap it,
every byte checked before it is copied (docs/sharded-state.md).

:func:`read_box` plans each piece (:class:`_PieceRead`): the columns a box
needs rounded out to the piece's tiles (:mod:`._tiles`) when it has tiles
and the box leaves out some of its columns (one read per row, or one of the
covering span when the holes are small); else the rows it needs rounded out
to its blocks; else the whole piece. It fetches them all at once
(``_Fetcher.fill``: ranged reads on object stores, ``preadv`` on local
disks), checks every piece, then copies. :func:`read_whole` is the whole
tensor that way (what an export streams); :func:`dest_array` the numpy view
of a target's memory that a box is read into.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checkpoint_store._transfer.crc32c import crc32c_combine
from checkpoint_store.errors import TensorCorruptError
from checkpoint_store.state._shards import ShardIndex
from checkpoint_store.state._tiles import HOLE_FRACTION, band_crcs, unpack
from checkpoint_store.state._tree import DTYPES

__all__ = ["dest_array", "read_box", "read_whole"]


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


@dataclass
class _PieceRead:
    """What :func:`read_box` reads of one piece: its rows ``[a, b)`` and
    columns ``[ca, cb)`` (indexes of dimension 1; ``[0, 1)`` for a piece of
    fewer than 2 dimensions), each column ``col_bytes`` long.

    ``segs`` (a 2-D uint8 view, one row per row read) holds those columns'
    bytes once ``jobs`` (for :meth:`_Fetcher.fill`) are done; ``buf`` the
    memory behind it; ``nbytes`` what the jobs read. Checked by ``tiles``
    (a read of some columns), else by the ``blocks`` CRCs given (whole rows
    of some blocks), else by the piece's CRC (the whole piece).
    """

    piece: Mapping[str, Any]
    a: int
    b: int
    ca: int
    cb: int
    col_bytes: int
    buf: Any
    segs: Any
    jobs: list[tuple[str, int, memoryview]]
    nbytes: int
    tiles: bool = False
    blocks: list[Any] | None = None


def _plan(piece: Mapping[str, Any], lo: Sequence[int], hi: Sequence[int],
          size: int, span_below: int = 0) -> _PieceRead:
    """How to read the part of ``piece`` inside the box ``[lo, hi)``: the
    columns it needs rounded out to its tiles when it has tiles and that
    leaves out some columns; else the rows it needs rounded out to its
    blocks (:func:`_rows_read`). Rows narrower than ``span_below`` bytes
    are read as one span, not one read per row (:func:`_segments`)."""
    import numpy as np

    off, sh, file, start = piece["offset"], piece["shape"], piece["file"], piece["offsets"][0]
    n = sh[0] if sh else 1
    m = sh[1] if len(sh) > 1 else 1
    col_bytes = math.prod(sh[2:]) * size if len(sh) > 1 else size
    row_bytes = m * col_bytes
    r0, r1 = (max(lo[0], off[0]) - off[0], min(hi[0], off[0] + n) - off[0]) if sh else (0, 1)
    tiles = piece.get("tiles")
    if tiles is not None and len(sh) > 1:
        rows, cols = tiles[0], tiles[1]
        c0, c1 = max(lo[1], off[1]) - off[1], min(hi[1], off[1] + m) - off[1]
        ca, cb = c0 // cols * cols, min(m, -(-c1 // cols) * cols)
        if (ca, cb) != (0, m):
            a, b = r0 // rows * rows, min(n, -(-r1 // rows) * rows)
            return _segments(piece, a, b, ca, cb, col_bytes, row_bytes, span_below)
    a, b, crcs = _rows_read(piece, r0, r1)
    buf = np.empty((b - a) * row_bytes, dtype=np.uint8)
    return _PieceRead(piece, a, b, 0, m, col_bytes, buf, buf.reshape(b - a, row_bytes),
                      [(file, start + a * row_bytes, buf.data)], len(buf),
                      blocks=crcs)


def _segments(piece: Mapping[str, Any], a: int, b: int, ca: int, cb: int, col_bytes: int,
              row_bytes: int, span_below: int = 0) -> _PieceRead:
    """Columns ``[ca, cb)`` of rows ``[a, b)`` of a piece: one read per
    row, or one of their covering span when the holes between the rows'
    segments are at most 1/:data:`HOLE_FRACTION` of the segments or the
    rows are narrower than ``span_below`` bytes (an object store's
    :data:`~._tiles.REMOTE_ROW_BYTES`)."""
    import numpy as np

    seg, at = (cb - ca) * col_bytes, ca * col_bytes
    first = piece["offsets"][0] + a * row_bytes + at
    if (row_bytes - seg) * HOLE_FRACTION <= seg or row_bytes < span_below:
        buf = np.empty((b - a) * row_bytes, dtype=np.uint8)
        span = buf.data[at:at + (b - a - 1) * row_bytes + seg]
        return _PieceRead(piece, a, b, ca, cb, col_bytes, buf,
                          buf.reshape(b - a, row_bytes)[:, at:at + seg],
                          [(piece["file"], first, span)], len(span), tiles=True)
    buf = np.empty((b - a, seg), dtype=np.uint8)
    jobs = [(piece["file"], first + i * row_bytes, buf[i].data) for i in range(b - a)]
    return _PieceRead(piece, a, b, ca, cb, col_bytes, buf, buf, jobs, buf.size, tiles=True)


def _check_tiles(path: str, key: str, r: _PieceRead) -> None:
    """Check each tile ``r`` read against the piece's tile CRCs."""
    rows, cols, _ = r.piece["tiles"]
    crcs = unpack(r.piece["tiles"])
    per_row = -(-r.piece["shape"][1] // cols)
    j0 = r.ca // cols
    for top in range(r.a, r.b, rows):
        got = band_crcs(r.segs[top - r.a:top - r.a + rows], cols * r.col_bytes)
        first = top // rows * per_row + j0
        for j, (crc, want) in enumerate(zip(got, crcs[first:first + len(got)], strict=True)):
            if crc != want:
                raise _corrupt(path, key, r.piece,
                               f"tile ({top // rows}, {j0 + j}) crc32c {crc:08x}, the index "
                               f"says {want:08x}")


def read_box(fetch: Any, path: str, key: str, index: ShardIndex, lo: Sequence[int],
             dest: Any, *, verify: bool = True) -> int:
    """Fill ``dest`` (a numpy array: the box at ``lo`` of the logical tensor,
    its shape the box's) from the pieces that overlap it. Each piece is read
    as the columns the box needs rounded out to its checked tiles (a piece
    with tiles, when that leaves out some columns), else as the rows it
    needs rounded out to its checked blocks; every piece read is checked
    before any byte is copied into ``dest``. Returns the bytes read.

    Raises:
        TensorCorruptError: a piece's bytes fail their checksum (``dest``
            is unchanged).
    """
    hi = [a + n for a, n in zip(lo, dest.shape, strict=True)]
    size = DTYPES[index.entry["dtype"]][0]
    span_below = getattr(fetch, "span_below", 0)
    reads = [_plan(piece, lo, hi, size, span_below) for piece in index.find(lo, hi)]
    fetch.fill([job for r in reads for job in r.jobs])
    if verify:
        for r in reads:
            if r.tiles:
                _check_tiles(path, key, r)
            else:
                per = r.piece["blocks"][0] if r.blocks is not None else 0
                _check(path, key, r.piece, memoryview(r.buf), r.blocks,
                       (r.cb - r.ca) * r.col_bytes, per)
    dtype = _np_dtype(index.entry["dtype"])
    for r in reads:
        off, sh = r.piece["offset"], r.piece["shape"]
        if not sh:
            dest[()] = r.buf.view(dtype).reshape(())
            continue
        data = r.segs.view(dtype).reshape([r.b - r.a, *([r.cb - r.ca] if len(sh) > 1 else []),
                                          *sh[2:]])
        start = [r.a, r.ca] + [0] * (len(sh) - 2)
        src = tuple(slice(max(lo[d], off[d]) - off[d] - start[d],
                          min(hi[d], off[d] + sh[d]) - off[d] - start[d])
                    for d in range(len(sh)))
        dst = tuple(slice(max(lo[d], off[d]) - lo[d], min(hi[d], off[d] + sh[d]) - lo[d])
                    for d in range(len(sh)))
        dest[dst] = data[src]
    return sum(r.nbytes for r in reads)


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
