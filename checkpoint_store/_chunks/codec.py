"""The chunk object: a self-describing blob holding one chunk's bytes.

Layout (docs/format.md, "Chunks")::

    b"CSCHUNK1"          8 bytes of magic
    u32 little-endian    header length H
    H bytes of JSON      {"codec", "size", "crc32c", "itemsize"}
    payload              the logical bytes as the codec stored them

A chunk's name is the BLAKE3 hash of its logical bytes (:func:`chunk_name`),
so one content is stored once whatever codec wrote it.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import blake3
import google_crc32c
import pyarrow as pa

from checkpoint_store.errors import CheckpointCorruptError

__all__ = ["MAGIC", "chunk_header", "chunk_name", "decode_chunk", "encode_chunk"]

MAGIC = b"CSCHUNK1"
_LEN = struct.Struct("<I")


def chunk_name(data: Any) -> str:
    """The name of a chunk holding ``data``: 64 hex digits of BLAKE3."""
    return blake3.blake3(data).hexdigest()


def encode_chunk(data: Any, *, itemsize: int = 1, codec: str = "raw") -> bytes:
    """The chunk object of ``data`` (bytes-like) with ``codec``."""
    if codec != "raw":
        raise ValueError(f"unknown codec {codec!r}")
    mv = memoryview(data).cast("B")
    crc = f"{google_crc32c.value(pa.py_buffer(mv)):08x}"
    header = json.dumps({"codec": codec, "size": mv.nbytes, "crc32c": crc, "itemsize": itemsize},
                        separators=(",", ":")).encode()
    return b"".join((MAGIC, _LEN.pack(len(header)), header, mv))


def _split(blob: Any, where: str) -> tuple[dict[str, Any], memoryview]:
    mv = memoryview(blob).cast("B")
    if mv.nbytes < 12 or bytes(mv[:8]) != MAGIC:
        raise CheckpointCorruptError(f"chunk {where} is not a chunk object (bad magic); "
                                     "resume from an earlier checkpoint", path=where)
    (n,) = _LEN.unpack(mv[8:12])
    try:
        header = json.loads(bytes(mv[12:12 + n]))
    except ValueError:
        header = None
    if not isinstance(header, dict) or mv.nbytes < 12 + n:
        raise CheckpointCorruptError(f"chunk {where} has a damaged header; resume from an "
                                     "earlier checkpoint", path=where)
    return header, mv[12 + n:]


def chunk_header(blob: Any, *, where: str = "?") -> dict[str, Any]:
    """The header of a chunk object: ``{"codec", "size", "crc32c", "itemsize"}``."""
    return _split(blob, where)[0]


def decode_chunk(blob: Any, *, where: str) -> bytes:
    """The logical bytes of a chunk object, checked against its size and CRC32C.

    Raises:
        CheckpointCorruptError: bad magic or header, unknown codec, or the
            decoded bytes differ in size or CRC32C; names ``where``.
    """
    header, payload = _split(blob, where)
    if header.get("codec") != "raw":
        raise CheckpointCorruptError(f"chunk {where} uses codec {header.get('codec')!r}, "
                                     "unknown to this version", path=where)
    data = bytes(payload)
    crc = f"{google_crc32c.value(data):08x}"
    if len(data) != header.get("size") or crc != header.get("crc32c"):
        raise CheckpointCorruptError(f"chunk {where} does not match its header (size or "
                                     "crc32c); resume from an earlier checkpoint", path=where)
    return data
