"""The CRC-32 fields of a ``torch.save`` archive, filled in after it is written.

torch's archive writer (``torch._C.PyTorchFileWriter``, miniz) takes the
CRC-32 of every record as it writes it at about 1.1 GB/s, slower than the
rest of an export together; with its CRC option off it writes at about
3.5 GB/s and leaves every CRC 0. The exports write with it off, take each
tensor's CRC-32 with ``zlib.crc32`` (about 4 GB/s, the GIL released) on the
thread that reads the tensor ahead, and :func:`fill_crcs` writes the CRCs
where ZIP keeps them: the local header, the data descriptor after the data
(the writer sets that flag) and the central directory. The archive is then
the one torch would have written, byte for byte (``zipfile``'s ``testzip``
and any ZIP tool check it), its serialization id included.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["fill_crcs"]

_LOCAL_SIG = 0x04034B50
_CENTRAL_SIG = 0x02014B50
_DESCRIPTOR_SIG = 0x08074B50
_EOCD_SIG = b"PK\x05\x06"
_ZIP64_LOCATOR_SIG = b"PK\x06\x07"
_ZIP64_EOCD_SIG = 0x06064B50


def _central_directory(f: Any, size: int) -> tuple[int, int]:
    """``(offset, entries)`` of the central directory, from the end records
    (ZIP64's where the archive has them)."""
    tail_len = min(size, 1 << 16)
    f.seek(size - tail_len)
    tail = f.read(tail_len)
    at = tail.rfind(_EOCD_SIG)
    if at < 0:
        raise ValueError("no end of central directory record")
    entries, _, offset = struct.unpack_from("<HIi", tail, at + 10)
    offset &= 0xFFFFFFFF
    loc = at - 20
    if loc >= 0 and tail[loc:loc + 4] == _ZIP64_LOCATOR_SIG:
        (eocd64,) = struct.unpack_from("<Q", tail, loc + 8)
        f.seek(eocd64)
        rec = f.read(56)
        sig, = struct.unpack_from("<I", rec, 0)
        if sig != _ZIP64_EOCD_SIG:
            raise ValueError("bad ZIP64 end of central directory record")
        entries, _, offset = struct.unpack_from("<QQQ", rec, 32)
    return offset, entries


def fill_crcs(path: str, crcs: Mapping[str, int]) -> None:
    """Write the CRC-32 of every record of the ZIP archive at local ``path``,
    and its ``.data/serialization_id`` as torch derives it from them.

    Args:
        path: an archive written with its CRCs left 0 (stored records, as
            torch writes them).
        crcs: CRC-32 by record name without the archive's folder
            (``"data/0"``); any record not named is read back and
            checksummed (the small ones: ``data.pkl``, ``version`` ...).

    torch's writer makes the id from a hash of the record names (kept) and
    ``c10::hash_combine`` of the records' CRCs in the order written (what
    :func:`_combine` computes), so the archive ends up byte for byte the
    one torch.save writes with its CRCs on.

    Raises:
        ValueError: ``path`` is not such an archive.
    """
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        offset, count = _central_directory(f, size)
        f.seek(offset)
        central = bytearray(f.read(size - offset))
        records = _records(f, central, offset, count)
        combined = 0
        for r in records:
            short = r.name.split("/", 1)[1] if "/" in r.name else r.name
            if short == _SERIALIZATION_ID:
                f.seek(r.data_at)
                sid = f.read(r.size)
                if len(sid) == 40 and sid.isdigit():  # torch's: two 20-digit numbers
                    sid = sid[:20] + b"%020d" % combined
                    f.seek(r.data_at)
                    f.write(sid)
                r.crc = zlib.crc32(sid)
            else:
                given = crcs.get(short)
                if given is None:
                    f.seek(r.data_at)
                    given = zlib.crc32(f.read(r.size))
                r.crc = given
            if r.flags & 0x08:  # torch combines the CRCs its data descriptors carry
                combined = _combine(combined, r.crc)
            packed = struct.pack("<I", r.crc & 0xFFFFFFFF)
            if r.flags & 0x08:
                # A data descriptor follows the data and holds the CRC; the
                # local header's stays 0, as the ZIP format says (and torch
                # writes it).
                f.seek(r.data_at + r.size)
                first = f.read(4)
                f.seek(r.data_at + r.size + (4 if first == _DESCRIPTOR else 0))
            else:
                f.seek(r.local + 14)
            f.write(packed)
            central[r.central + 16:r.central + 20] = packed
        f.seek(offset)
        f.write(central)


_SERIALIZATION_ID = ".data/serialization_id"
_DESCRIPTOR = struct.pack("<I", _DESCRIPTOR_SIG)
_U64 = (1 << 64) - 1


def _combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit ``size_t``."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _U64) + (seed >> 2)) & _U64)) & _U64


@dataclass
class _Record:
    name: str
    flags: int
    local: int  # offset of its local header
    data_at: int
    size: int
    central: int  # offset of its central directory entry, within that directory
    crc: int = 0


def _records(f: Any, central: bytes | bytearray, offset: int, count: int) -> list[_Record]:
    """The archive's records in the order written (the central directory's)."""
    out = []
    at = 0
    for _ in range(count):
        sig, = struct.unpack_from("<I", central, at)
        if sig != _CENTRAL_SIG:
            raise ValueError(f"bad central directory entry at {offset + at}")
        flags, method = struct.unpack_from("<HH", central, at + 8)
        csize, usize = struct.unpack_from("<II", central, at + 20)
        n, m, k = struct.unpack_from("<HHH", central, at + 28)
        local, = struct.unpack_from("<I", central, at + 42)
        name = bytes(central[at + 46:at + 46 + n]).decode("utf-8")
        csize, usize, local = _zip64_fields(bytes(central[at + 46 + n:at + 46 + n + m]),
                                            csize, usize, local)
        if method != 0:
            raise ValueError(f"record {name!r} is compressed")
        f.seek(local)
        head = f.read(30)
        lsig, = struct.unpack_from("<I", head, 0)
        if lsig != _LOCAL_SIG:
            raise ValueError(f"bad local header of {name!r}")
        ln, lm = struct.unpack_from("<HH", head, 26)
        out.append(_Record(name, flags, local, local + 30 + ln + lm, csize, at))
        at += 46 + n + m + k
    return out


def _zip64_fields(extra: bytes, csize: int, usize: int, local: int) -> tuple[int, int, int]:
    """Sizes and local header offset of a central directory entry, from its
    ZIP64 extra field where the 32-bit ones are saturated."""
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        if tag == 0x0001:
            body, pos = extra[at + 4:at + 4 + length], 0
            if usize == 0xFFFFFFFF:
                usize, = struct.unpack_from("<Q", body, pos)
                pos += 8
            if csize == 0xFFFFFFFF:
                csize, = struct.unpack_from("<Q", body, pos)
                pos += 8
            if local == 0xFFFFFFFF:
                local, = struct.unpack_from("<Q", body, pos)
            break
        at += 4 + length
    return csize, usize, local
