"""Checked tiles of a piece: the CRC32C of row bands x column bands, so a
read of some columns of a piece reads and checks only those columns
(docs/sharded-state.md).

A piece of a sharded state is stored C-order: row ``r`` (index ``r`` of
dimension 0) is ``row_bytes`` contiguous bytes, made of its ``m`` columns
(indexes of dimension 1), ``col_bytes`` each (the product of the dimensions
after 1 times the item size). Its index entry's ``blocks`` check whole
runs of rows; ``tiles`` (:func:`tile_crcs`) checks the grid of ``rows``
rows x ``cols`` columns: ``[rows, cols, base64 of the big-endian CRC32C of
every tile]``, tile ``(i, j)`` at ``i * ceil(m / cols) + j``, a tile's CRC
being that of its row segments concatenated in row order. The CRCs are
packed (4 bytes each, base64) rather than listed as hex: a piece has
thousands of tiles, and the index is read whole by every reader.

A read of columns ``[c0, c1)`` rounds them out to column bands and reads,
in each row, only that segment: one ranged read per row of the box per
piece (``_segments`` in :mod:`._box`), unless the holes between the segments are at
most :data:`HOLE_FRACTION` of them, when one read of the covering span is
cheaper and costs at most that fraction more bytes, or the rows are
narrower than :data:`REMOTE_ROW_BYTES` on an object store, where a request
costs more than the holes' bytes.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from collections.abc import Sequence
from typing import Any

__all__ = [
    "COL_BANDS",
    "HOLE_FRACTION",
    "REMOTE_ROW_BYTES",
    "MIN_TILED_ROW_BYTES",
    "MIN_TILE_BYTES",
    "band_crcs",
    "bad_tiles",
    "tile_crcs",
    "tile_shape",
    "unpack",
]

#: About this many column bands per row (the largest power of two of
#: columns at most ``m / COL_BANDS``): a column slice of 1/k of a row reads
#: at most 2 * k / COL_BANDS more than it asks for (6% for 4 column
#: shards), and nothing more when the slice's bounds fall on band
#: boundaries (k a power of two dividing ``m``).
COL_BANDS = 128
#: Fewest bytes of a tile (rows are added until it holds this many): bounds
#: the index at 4 bytes of CRC per 8 KiB of data (0.05 %) and the CPU a
#: save spends per tile.
MIN_TILE_BYTES = 8 << 10
#: A piece whose rows are narrower than this gets no tiles: a read of part
#: of such a row reads the whole row, as before tiles.
MIN_TILED_ROW_BYTES = 4 << 10
#: A column read's row segments are read as one covering span when the
#: holes between them are at most 1/HOLE_FRACTION of the segments' bytes.
HOLE_FRACTION = 16
#: On an object store, a column read of rows narrower than this reads the
#: covering span (whole rows of the band) instead of one ranged GET per
#: row: a GET costs its latency (tens of ms on S3), about what 64 KiB-1 MiB
#: of bandwidth costs at the requests in flight, so for narrower rows the
#: extra bytes take less time than the extra requests. Local files (one
#: ``preadv`` per row) and memory read per row whatever the width.
REMOTE_ROW_BYTES = 64 << 10


def tile_shape(shape: Sequence[int], itemsize: int) -> tuple[int, int] | None:
    """``(rows, columns)`` of each tile of a piece of ``shape`` (items of
    ``itemsize`` bytes); None when it gets no tiles (fewer than 2
    dimensions or 2 columns, no elements, rows under
    :data:`MIN_TILED_ROW_BYTES`)."""
    if len(shape) < 2 or not math.prod(shape) or shape[1] < 2:
        return None
    col_bytes = math.prod(shape[2:]) * itemsize
    if shape[1] * col_bytes < MIN_TILED_ROW_BYTES:
        return None
    cols = 1 << max(0, (shape[1] // COL_BANDS).bit_length() - 1)
    rows = min(shape[0], max(1, -(-MIN_TILE_BYTES // (cols * col_bytes))))
    return rows, cols


def band_crcs(band: Any, width: int) -> list[int]:
    """CRC32C of each tile of one row band: ``band`` a 2-D uint8 numpy array
    (rows x bytes; its rows may be apart in memory, its bytes within a row
    not), cut into tiles of ``width`` bytes (the last one shorter). Each
    tile's row segments are gathered by one copy (``tobytes`` of a strided
    view), then checksummed."""
    import google_crc32c

    rows, nbytes = band.shape
    full = nbytes // width
    out: list[int] = []
    if full:
        tiles = band[:, :full * width].reshape(rows, full, width).transpose(1, 0, 2)
        out = [google_crc32c.value(tiles[k].tobytes()) for k in range(full)]
    if full * width < nbytes:
        out.append(google_crc32c.value(band[:, full * width:].tobytes()))
    return out


def tile_crcs(data: Any, shape: Sequence[int], itemsize: int) -> list[Any] | None:
    """The ``tiles`` field of a piece of ``shape`` whose bytes are ``data``
    (bytes-like, C order): ``[rows, cols, base64 CRCs]``; None when it gets
    no tiles (:func:`tile_shape`)."""
    import numpy as np

    ts = tile_shape(shape, itemsize)
    if ts is None:
        return None
    rows, cols = ts
    n, m = shape[0], shape[1]
    col_bytes = math.prod(shape[2:]) * itemsize
    arr = np.frombuffer(data, dtype=np.uint8).reshape(n, m * col_bytes)
    crcs: list[int] = []
    for r in range(0, n, rows):
        crcs += band_crcs(arr[r:r + rows], cols * col_bytes)
    packed = struct.pack(f">{len(crcs)}I", *crcs)
    return [rows, cols, base64.b64encode(packed).decode("ascii")]


def unpack(tiles: Sequence[Any]) -> tuple[int, ...]:
    """The tile CRCs of a ``tiles`` field, in tile order."""
    raw = base64.b64decode(tiles[2])
    return struct.unpack(f">{len(raw) // 4}I", raw)


def bad_tiles(tiles: Any, shape: Sequence[int]) -> str | None:
    """Why ``tiles`` is not a valid ``tiles`` field of a piece of ``shape``
    (None: it is): three fields, positive whole counts, a base64 string of
    exactly one CRC per tile."""
    if not (isinstance(tiles, list) and len(tiles) == 3
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                    for n in tiles[:2]) and isinstance(tiles[2], str)):
        return "its tiles are not [rows, columns, CRCs]"
    if len(shape) < 2:
        return f"a piece of {len(shape)} dimension(s) has tiles"
    try:
        raw = base64.b64decode(tiles[2], validate=True)
    except (binascii.Error, ValueError):
        return "its tile CRCs are not base64"
    want = -(-shape[0] // tiles[0]) * -(-shape[1] // tiles[1])
    if len(raw) != 4 * want:
        return f"it has {len(raw) / 4:g} tile CRCs for its {want} tiles"
    return None
