"""A chunk object's bytes: its format, its name, and the lossless codecs that
encode it.

A chunk object is self-describing (docs/format.md)::

    b"CSCHUNK1"          8 bytes, the magic
    u32 little-endian    H, the header's length
    H bytes              compact JSON: {"codec": name, "size": logical bytes,
                         "crc32c": 8 hex of the logical bytes, "itemsize": n}
    payload              the logical bytes as the codec encoded them

Its name (:func:`chunk_name`) is the BLAKE3 digest of the logical bytes, so
one content is one name whichever codec wrote it. :func:`decode_chunk`
checks everything a reader can check (magic, header, each length, the
decoded size and the CRC32C of the decoded bytes) and raises
:class:`~checkpoint_store.errors.CheckpointCorruptError` on any mismatch.

Codecs, by name (:data:`CODECS`):

* ``"raw"``: the payload is the logical bytes.
* ``"planes-zstd"``: the bytes of ``size // itemsize`` elements are split
  into ``itemsize`` byte planes (plane ``k`` holds byte ``k`` of every
  element; of elements of 2 bytes or more, the sign bit is moved so that a
  bf16 or fp32 exponent sits whole in the top plane:
  :mod:`~checkpoint_store._chunks.planes`), each compressed with zstandard
  on its own; a plane that does not shrink by :data:`MIN_SAVING` is stored
  raw. Exponents repeat a few values and shrink; mantissa bytes are noise
  and stay raw, costing no decode time. Payload::

      itemsize x (u8 mode, u64 LE stored length)   mode 0: raw, 1: zstd frame
      the planes' stored bytes, in order
      the last size % itemsize bytes, raw

  Lossless on any bytes: the codec never reads them as numbers, so NaN
  payloads, -0.0 and denormals come back bit for bit.

Threads: encoding and decoding one chunk release the GIL for their heavy
parts (zstandard, numpy's copies, CRC32C, BLAKE3), so a thread pool decodes
chunks in parallel (:func:`decode_many` is one). The byte planes are cut
and put back by numpy when it is installed (about 3x faster) and by the
standard library otherwise; both write the same bytes.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypedDict

import blake3
import pyarrow as pa
import pyarrow.fs as pafs
import zstandard

from checkpoint_store._chunks import planes
from checkpoint_store._chunks.planes import Buffer
from checkpoint_store._transfer.crc32c import _crc
from checkpoint_store.backends.forwarding import ForwardingHandler
from checkpoint_store.errors import CheckpointCorruptError

__all__ = [
    "CODECS",
    "HEAD_BYTES",
    "MAGIC",
    "MIN_SAVING",
    "PLANES_ZSTD",
    "RAW",
    "ZSTD_PARAMETERS",
    "Buffer",
    "ChunkHeader",
    "chunk_header",
    "chunk_name",
    "codec_for",
    "decode_chunk",
    "decode_into",
    "decode_many",
    "encode_chunk",
    "min_object_size",
    "object_size",
]

MAGIC = b"CSCHUNK1"
_PREFIX = struct.Struct("<8sI")  # magic, header length
#: The longest header a reader accepts (a real one is under 120 bytes).
_MAX_HEADER = 1024
#: The first ``HEAD_BYTES`` bytes of a chunk object always hold its whole
#: header: what :func:`chunk_header` needs (a ranged read is enough).
HEAD_BYTES = _PREFIX.size + _MAX_HEADER

RAW = "raw"
PLANES_ZSTD = "planes-zstd"
#: Every codec this version writes and reads.
CODECS = (RAW, PLANES_ZSTD)

#: zstandard parameters of the byte planes, chosen on a trained model's
#: bf16 weights and fp32 AdamW moments (benchmarks/bench_codec.py): the fast
#: strategy with the longest minimum match (7) and the smallest hash table
#: (64 entries). An exponent plane is a few symbols: its bytes are best sent
#: as Huffman-coded literals, and every short match found costs time to find
#: and to decode for little gain. Against level 1 on bf16 exponents: 2.93x
#: instead of 2.71x, compression about 2x and decompression 1.5-2x faster;
#: on fp32 exponents 2-4 % smaller at about the same speed. Negative levels
#: and the fast strategy's acceleration store literals uncoded (1.0x).
ZSTD_PARAMETERS: dict[str, int] = {
    "window_log": 17, "hash_log": 6, "chain_log": 6, "search_log": 1, "min_match": 7,
    "target_length": 0, "strategy": zstandard.STRATEGY_FAST,
}
#: A plane is stored compressed only when that saves this share of its bytes;
#: below it, decoding would spend time for next to nothing.
MIN_SAVING = 0.03
_MAX_ITEMSIZE = 255
_PLANE_ENTRY = struct.Struct("<BQ")  # mode, stored length
_MODE_RAW, _MODE_ZSTD = 0, 1
# Planes longer than this are probed on a sample before the whole is compressed.
_PROBE_PIECES, _PROBE_PIECE = 4, 16 * 1024


class ChunkHeader(TypedDict):
    """A chunk object's header. ``size``: logical bytes; ``crc32c``: 8 hex
    of the logical bytes; ``itemsize``: bytes per element of the data."""

    codec: str
    size: int
    crc32c: str
    itemsize: int


# -- names and the automatic choice ---------------------------------------------------


def chunk_name(data: Buffer) -> str:
    """The chunk name of ``data``'s logical bytes: BLAKE3, 64 lowercase hex."""
    return blake3.blake3(data).hexdigest()


def codec_for(filesystem: Any) -> str:
    """The codec to write chunks with on ``filesystem`` (a ``pyarrow.fs``
    filesystem, or an fsspec one): ``"raw"`` where storage is faster than the
    codec (a local disk, the local tier, memory), ``"planes-zstd"`` where
    bytes are dear (object stores, any remote fsspec filesystem).

    Wrappers are looked through: a sub-tree (pyarrow's, or fsspec's
    ``DirFileSystem``), a forwarding handler (the command line's, the fault
    kit's), an fsspec handler.
    """
    fs = filesystem
    for _ in range(16):  # wrappers nest a few deep, never in a circle
        if isinstance(fs, pafs.LocalFileSystem):
            return RAW
        if isinstance(fs, pafs.SubTreeFileSystem):
            fs = fs.base_fs
            continue
        if isinstance(fs, pafs.PyFileSystem):
            handler = fs.handler
            backend = getattr(handler, "checkpoint_store_backend", None)
            if backend is not None:
                fs = backend.filesystem
            elif isinstance(handler, ForwardingHandler):
                fs = handler.inner
            elif isinstance(handler, pafs.FSSpecHandler):
                fs = handler.fs
            else:
                return RAW if fs.type_name in ("local", "memory", "mock") else PLANES_ZSTD
            continue
        if isinstance(fs, pafs.FileSystem):
            return RAW if fs.type_name in ("local", "mock") else PLANES_ZSTD
        protocol = getattr(fs, "protocol", None)  # an fsspec filesystem
        names = (protocol,) if isinstance(protocol, str) else tuple(protocol or ())
        if "dir" in names and getattr(fs, "fs", None) is not None:
            fs = fs.fs  # a DirFileSystem: a sub-tree of the filesystem it wraps
            continue
        return RAW if {"file", "local", "memory"} & set(names) else PLANES_ZSTD
    return PLANES_ZSTD


# -- the object -------------------------------------------------------------------------


def encode_chunk(data: Buffer, *, itemsize: int = 1, codec: str = RAW) -> bytes:
    """The chunk object of ``data`` (its logical bytes), encoded with ``codec``.

    Args:
        data: the logical bytes (any C-contiguous buffer).
        itemsize: bytes per element (a tensor's dtype size, 1 for bytes
            without elements); ``"planes-zstd"`` splits by it. A length that
            is not a multiple keeps its last bytes raw.
        codec: one of :data:`CODECS`.

    Raises:
        ValueError: an unknown codec, or an itemsize outside 1..255.
    """
    if codec not in _CODECS:
        raise ValueError(f"unknown chunk codec {codec!r}; choose one of {', '.join(CODECS)}")
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or not (
            1 <= itemsize <= _MAX_ITEMSIZE):
        raise ValueError(f"itemsize must be an int in 1..{_MAX_ITEMSIZE}, got {itemsize!r}")
    view = _byte_view(data)
    header = {"codec": codec, "size": len(view), "crc32c": f"{_crc32c(view):08x}",
              "itemsize": itemsize}
    text = json.dumps(header, separators=(",", ":")).encode()
    parts = _CODECS[codec].encode(view, itemsize)
    return b"".join([_PREFIX.pack(MAGIC, len(text)), text, *parts])


def chunk_header(blob: Buffer, *, where: str = "chunk") -> ChunkHeader:
    """The header of the chunk object ``blob`` (its first :data:`HEAD_BYTES`
    bytes are enough), checked: ``du`` reads logical sizes from it.

    Raises:
        CheckpointCorruptError: not a chunk object, or a malformed header.
    """
    return _parse(_byte_view(blob), where)[0]


def min_object_size(logical: int) -> int:
    """The fewest bytes a whole chunk object of ``logical`` logical bytes
    has, whatever its codec: a shorter object was cut short (a writer
    killed in the middle of an in-place write, a blob created empty)."""
    header = {"codec": RAW, "size": logical, "crc32c": "0" * 8, "itemsize": 1}
    return _PREFIX.size + len(json.dumps(header, separators=(",", ":")))


#: Bytes of the start of a chunk object that :func:`object_size` may need.
SIZE_HEAD_BYTES = HEAD_BYTES + _PLANE_ENTRY.size * _MAX_ITEMSIZE


def object_size(head: Buffer, *, where: str) -> int:
    """The whole size in bytes of the chunk object whose first bytes are
    ``head`` (its first :data:`SIZE_HEAD_BYTES`, or all of it when shorter),
    from its header and plane table: an object of another size is torn.

    Raises:
        CheckpointCorruptError: ``head`` is not the start of a chunk object,
            or ends inside its header or plane table.
    """
    view = _byte_view(head)
    header, start = _parse(view, where)
    size, itemsize = header["size"], header["itemsize"]
    if header["codec"] == RAW:
        return start + size
    table = _PLANE_ENTRY.size * itemsize
    if len(view) < start + table:
        raise _corrupt(where, f"it ends at byte {len(view)}, inside its plane table")
    stored = sum(_PLANE_ENTRY.unpack_from(view, start + k * _PLANE_ENTRY.size)[1]
                 for k in range(itemsize))
    return start + table + stored + size % itemsize


def decode_chunk(blob: Buffer, *, where: str) -> memoryview:
    """The logical bytes of the chunk object ``blob``, checked.

    Returns a view: of ``blob`` itself for a ``"raw"`` chunk (no copy), of a
    new buffer otherwise.

    Args:
        blob: the whole object.
        where: what the object is, for messages (its path, the checkpoint
            and file that need it).

    Raises:
        CheckpointCorruptError: a wrong magic, a malformed or truncated
            header or payload, an unknown codec, a decoded size or CRC32C
            that differs from the header's.
    """
    view = _byte_view(blob)
    header, start = _parse(view, where)
    if header["codec"] == RAW:
        payload = view[start:]
        _check_raw_length(payload, header, where)
        _check_crc(payload, header, where)
        return payload
    out = memoryview(bytearray(header["size"]))
    _decode_checked(view[start:], out, header, where)
    return out


def decode_into(blob: Buffer, out: memoryview, *, where: str) -> None:
    """Decode the chunk object ``blob`` straight into ``out`` (writable, C
    contiguous, exactly the chunk's logical size): a loader fills a tensor's
    buffer without a copy in between. On an error ``out`` holds garbage.

    Raises:
        CheckpointCorruptError: as :func:`decode_chunk`.
        ValueError: ``out`` is read-only or not the chunk's logical size.
    """
    view = _byte_view(blob)
    header, start = _parse(view, where)
    target = _byte_view(out)
    if target.readonly:
        raise ValueError("decode_into needs a writable buffer")
    if len(target) != header["size"]:
        raise ValueError(f"{where} holds {header['size']} bytes; the buffer given has "
                         f"{len(target)}")
    _decode_checked(view[start:], target, header, where)


def decode_many(blobs: Sequence[Buffer], *, wheres: Sequence[str],
                workers: int = 4) -> list[memoryview]:
    """:func:`decode_chunk` of each blob, ``workers`` at a time on threads
    (decoding releases the GIL), in the order given.

    Raises:
        CheckpointCorruptError: the first corrupt blob in order.
        ValueError: ``wheres`` is not as long as ``blobs``.
    """
    if len(wheres) != len(blobs):
        raise ValueError(f"{len(blobs)} blobs but {len(wheres)} wheres")
    if workers <= 1 or len(blobs) <= 1:
        return [decode_chunk(b, where=w) for b, w in zip(blobs, wheres, strict=True)]
    with ThreadPoolExecutor(max_workers=min(workers, len(blobs)),
                            thread_name_prefix="cs-decode") as pool:
        return list(pool.map(lambda bw: decode_chunk(bw[0], where=bw[1]),
                             zip(blobs, wheres, strict=True)))


# -- checks -------------------------------------------------------------------------------


def _corrupt(where: str, reason: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{where} is corrupt: {reason}. Its bytes cannot be trusted: load a checkpoint "
        "that does not use this chunk, or put the object back from a copy of the storage")


def _byte_view(data: Any) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise ValueError("chunk data must be a C-contiguous buffer")
        view = view.cast("B")
    return view


def _crc32c(view: memoryview) -> int:
    # google_crc32c takes bytes or pyarrow buffers, not memoryviews.
    return _crc(0, pa.py_buffer(view))


def _parse(view: memoryview, where: str) -> tuple[ChunkHeader, int]:
    """The checked header of a chunk object and where its payload starts."""
    if len(view) < _PREFIX.size:
        raise _corrupt(where, f"it has {len(view)} bytes, fewer than a chunk's "
                              f"{_PREFIX.size}-byte prefix")
    magic, length = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise _corrupt(where, f"it starts with {bytes(magic)!r}, not {MAGIC!r}")
    if length > _MAX_HEADER:
        raise _corrupt(where, f"its header length {length} exceeds {_MAX_HEADER}")
    start = _PREFIX.size + length
    if len(view) < start:
        raise _corrupt(where, f"it ends at byte {len(view)}, inside its {length}-byte header")
    try:
        header = json.loads(bytes(view[_PREFIX.size:start]).decode("utf-8"))
    except ValueError as exc:
        raise _corrupt(where, f"its header is not JSON ({exc})") from None
    return _checked_header(header, where), start


def _checked_header(header: Any, where: str) -> ChunkHeader:
    if not isinstance(header, dict) or set(header) != {"codec", "size", "crc32c", "itemsize"}:
        raise _corrupt(where, f"its header is not a chunk header: {str(header)[:200]}")
    codec, size, crc, itemsize = (header["codec"], header["size"], header["crc32c"],
                                  header["itemsize"])
    if not isinstance(codec, str):
        raise _corrupt(where, f"its codec {codec!r} is not a name")
    if codec not in _CODECS:
        raise _corrupt(where, f"its codec {codec!r} is not one this version reads "
                              f"({', '.join(CODECS)}); if a newer checkpoint-store wrote it, "
                              "upgrade")
    for name, value, low, high in (("size", size, 0, None),
                                   ("itemsize", itemsize, 1, _MAX_ITEMSIZE)):
        if (isinstance(value, bool) or not isinstance(value, int) or value < low
                or (high is not None and value > high)):
            raise _corrupt(where, f"its header's {name} {value!r} is out of range")
    if (not isinstance(crc, str) or len(crc) != 8
            or any(c not in "0123456789abcdef" for c in crc)):
        raise _corrupt(where, f"its header's crc32c {crc!r} is not 8 lowercase hex digits")
    return ChunkHeader(codec=codec, size=size, crc32c=crc, itemsize=itemsize)


def _check_raw_length(payload: memoryview, header: ChunkHeader, where: str) -> None:
    if len(payload) != header["size"]:
        raise _corrupt(where, f"its raw payload has {len(payload)} bytes, its header says "
                              f"{header['size']}")


def _check_crc(data: memoryview, header: ChunkHeader, where: str) -> None:
    got = f"{_crc32c(data):08x}"
    if got != header["crc32c"]:
        raise _corrupt(where, f"its decoded bytes have CRC32C {got}, its header says "
                              f"{header['crc32c']}")


def _decode_checked(payload: memoryview, out: memoryview, header: ChunkHeader,
                    where: str) -> None:
    _CODECS[header["codec"]].decode_into(payload, out, header, where)
    _check_crc(out, header, where)


# -- codecs -------------------------------------------------------------------------------


class _Codec(Protocol):
    def encode(self, data: memoryview, itemsize: int) -> list[Buffer]:
        """The payload of ``data``, as pieces to concatenate."""

    def decode_into(self, payload: memoryview, out: memoryview, header: ChunkHeader,
                    where: str) -> None:
        """Fill ``out`` (``header["size"]`` bytes) from ``payload``; the caller
        checks the CRC32C. Raises CheckpointCorruptError on a malformed payload."""


class _Raw:
    def encode(self, data: memoryview, itemsize: int) -> list[Buffer]:
        return [data]

    def decode_into(self, payload: memoryview, out: memoryview, header: ChunkHeader,
                    where: str) -> None:
        _check_raw_length(payload, header, where)
        out[:] = payload


class _PlanesZstd:
    def encode(self, data: memoryview, itemsize: int) -> list[Buffer]:
        n = len(data) // itemsize
        body = n * itemsize
        table: list[int] = []
        parts: list[Buffer] = []
        for plane in planes.split(data[:body], itemsize):
            packed = _compress(plane)
            if packed is None:
                table += [_MODE_RAW, n]
                parts.append(plane)
            else:
                table += [_MODE_ZSTD, len(packed)]
                parts.append(packed)
        entries = struct.pack("<" + "BQ" * itemsize, *table)
        return [entries, *parts, data[body:]]

    def decode_into(self, payload: memoryview, out: memoryview, header: ChunkHeader,
                    where: str) -> None:
        size, itemsize = header["size"], header["itemsize"]
        n = size // itemsize
        body = n * itemsize
        pieces = _plane_pieces(payload, n, itemsize, size - body, where)
        decoded: list[Buffer] = [_decompress(piece, n, where, k) if mode == _MODE_ZSTD
                                 else piece for k, (mode, piece) in enumerate(pieces)]
        planes.merge_into(out[:body], decoded, itemsize)
        out[body:] = payload[len(payload) - (size - body):]


def _plane_pieces(payload: memoryview, n: int, itemsize: int, tail: int,
                  where: str) -> list[tuple[int, memoryview]]:
    """Each plane's (mode, stored bytes), every length checked against the payload."""
    table = _PLANE_ENTRY.size * itemsize
    if len(payload) < table + tail:
        raise _corrupt(where, f"its payload has {len(payload)} bytes, fewer than its plane "
                              f"table and last bytes ({table + tail})")
    pieces = []
    at = table
    for k in range(itemsize):
        mode, stored = _PLANE_ENTRY.unpack_from(payload, k * _PLANE_ENTRY.size)
        if mode not in (_MODE_RAW, _MODE_ZSTD) or (mode == _MODE_RAW and stored != n):
            raise _corrupt(where, f"plane {k} has mode {mode} and {stored} stored bytes, "
                                  f"for {n} elements")
        if at + stored > len(payload) - tail:
            raise _corrupt(where, f"plane {k} runs past the end of the payload")
        pieces.append((mode, payload[at:at + stored]))
        at += stored
    if at + tail != len(payload):
        raise _corrupt(where, f"its payload has {len(payload) - at - tail} bytes more than "
                              "its planes and last bytes")
    return pieces


class _Local(threading.local):
    """One zstandard context per thread (a context serves one call at a time)."""

    def __init__(self) -> None:
        self.compressor = zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters(**ZSTD_PARAMETERS))
        self.decompressor = zstandard.ZstdDecompressor()


_local = _Local()


def _compress(plane: Buffer) -> bytes | None:
    """``plane`` as a zstandard frame, or None where that saves under
    :data:`MIN_SAVING` (a sample of a long plane decides first: a plane of
    mantissa noise costs a few small compressions, not a whole one)."""
    n = len(plane)
    keep = 1.0 - MIN_SAVING
    compressor = _local.compressor
    if n > 4 * _PROBE_PIECES * _PROBE_PIECE:
        view = memoryview(plane)
        step = n // _PROBE_PIECES
        sample = b"".join(view[i * step:i * step + _PROBE_PIECE] for i in range(_PROBE_PIECES))
        if len(compressor.compress(sample)) > keep * len(sample):
            return None
    packed = compressor.compress(plane)
    return packed if len(packed) <= keep * n else None


def _decompress(frame: memoryview, n: int, where: str, k: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(frame)
        if declared != n:
            raise _corrupt(where, f"plane {k}'s frame declares {declared} bytes, not {n}")
        plane = _local.decompressor.decompress(frame)
    except zstandard.ZstdError as exc:
        raise _corrupt(where, f"plane {k} is not a valid zstandard frame ({exc})") from None
    if len(plane) != n:
        raise _corrupt(where, f"plane {k} decodes to {len(plane)} bytes, not {n}")
    return plane


_CODECS: dict[str, _Codec] = {RAW: _Raw(), PLANES_ZSTD: _PlanesZstd()}
