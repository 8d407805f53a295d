"""CRC32C arithmetic of the transfers: extend a checksum over bytes as they
pass, and combine the checksums of a file's parts computed in parallel
(:func:`crc32c_combine`), so no checksum costs a second read of the data.
"""

from __future__ import annotations

from typing import Any

import google_crc32c

__all__ = ["_crc", "crc32c_combine"]

_POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    p = 1 << 30  # x^1
    table = [p]
    for _ in range(1, 32):
        p = _multmodp(p, p)
        table.append(p)
    return table


_X2N = _x2n_table()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc1 = crc(A)``, ``crc2 = crc(B)`` and ``len(B)``.

    Same method as zlib's ``crc32_combine`` (multiply by x^(8*len2) modulo the
    polynomial); costs microseconds, so parts of a file can be checksummed in
    parallel.
    """
    if len2 <= 0:
        return crc1
    # x^(8 * len2): walk the bits of len2, starting at x^(2^3).
    p = 1 << 31
    k = 3
    n = len2
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def _crc(crc: int, data: Any) -> int:
    # google_crc32c takes bytes or pyarrow buffers, not memoryviews.
    return google_crc32c.extend(crc, data)
