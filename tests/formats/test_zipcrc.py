"""fill_crcs on archive shapes torch's writer makes rarely: ZIP64 records."""

from __future__ import annotations

import struct
import zipfile
import zlib
from typing import Any

import pytest

from checkpoint_store.formats._zipcrc import fill_crcs


def _zero_crcs(path: Any) -> None:
    """Every CRC field of the stored archive at ``path`` set to 0 (local
    headers and central directory), as a writer with its CRCs off leaves
    them."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        start = z.start_dir
    for info in infos:
        raw[info.header_offset + 14:info.header_offset + 18] = b"\0" * 4
    at = start
    for _ in infos:
        assert struct.unpack_from("<I", raw, at)[0] == 0x02014B50
        raw[at + 16:at + 20] = b"\0" * 4
        n, m, k = struct.unpack_from("<HHH", raw, at + 28)
        at += 46 + n + m + k
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("zip64", [False, True])
def test_crcs_filled_in_check_with_zipfile(tmp_path, zip64) -> None:
    path = tmp_path / "a.zip"
    blobs = {"archive/data.pkl": b"pickle", "archive/data/0": bytes(range(256)) * 300,
             "archive/empty": b""}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, blob in blobs.items():
            with z.open(name, "w", force_zip64=zip64) as f:
                f.write(blob)
    _zero_crcs(path)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is not None  # the damage is real
    fill_crcs(str(path), {"data/0": zlib.crc32(blobs["archive/data/0"])})
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
        assert {i.filename: i.CRC for i in z.infolist()} == {
            k: zlib.crc32(v) for k, v in blobs.items()}


def test_not_an_archive_is_refused(tmp_path) -> None:
    path = tmp_path / "x.zip"
    path.write_bytes(b"not a zip at all" * 10)
    with pytest.raises(ValueError, match="end of central directory"):
        fill_crcs(str(path), {})
