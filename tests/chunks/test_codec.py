"""Chunk objects and their codecs: the format byte for byte, lossless round
trips of every dtype the state path stores (special float bit patterns,
lengths that are not a multiple of the item size), every kind of damage
refused as corrupt, the ratio on bf16 weights, and the automatic choice."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import google_crc32c
import numpy as np
import pyarrow.fs as pafs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_store._chunks.codec import (
    CODECS,
    HEAD_BYTES,
    MAGIC,
    PLANES_ZSTD,
    RAW,
    chunk_header,
    chunk_name,
    codec_for,
    decode_chunk,
    decode_into,
    decode_many,
    encode_chunk,
)
from checkpoint_store.backends.forwarding import ForwardingHandler
from checkpoint_store.errors import CheckpointCorruptError
from checkpoint_store.registry import resolve
from checkpoint_store.state._tree import DTYPES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bf16(values: np.ndarray) -> bytes:
    """float32 values rounded toward zero to bfloat16, as bytes (numpy has no bf16)."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _weights(n: int, seed: int = 0) -> np.ndarray:
    """``n`` float32 values shaped like a trained layer's weights."""
    return np.random.default_rng(seed).normal(0.0, 0.02, n).astype(np.float32)


# -- the format ----------------------------------------------------------------------------


def test_a_chunk_object_is_magic_header_length_compact_json_and_payload() -> None:
    data = b"hello, chunk"
    blob = encode_chunk(data)
    assert blob[:8] == MAGIC == b"CSCHUNK1"
    (length,) = struct.unpack_from("<I", blob, 8)
    text = blob[12:12 + length]
    assert text == b'{"codec":"raw","size":12,"crc32c":"%s","itemsize":1}' % (
        chunk_header(blob)["crc32c"].encode())
    assert json.loads(text)["crc32c"] == f"{google_crc32c.value(data):08x}"
    assert blob[12 + length:] == data
    assert chunk_header(blob[:HEAD_BYTES]) == json.loads(text)


def test_planes_hold_each_byte_of_the_elements_and_a_float_exponent_whole() -> None:
    # bf16 1.0, -1.0, -0.0 and a NaN with payload 0x41, then a last odd
    # byte (elements too few to compress: every plane is stored raw).
    data = struct.pack("<4H", 0x3F80, 0xBF80, 0x8000, 0x7FC1) + b"z"
    blob = encode_chunk(data, itemsize=2, codec=PLANES_ZSTD)
    payload = blob[12 + struct.unpack_from("<I", blob, 8)[0]:]
    assert struct.unpack_from("<BQBQ", payload) == (0, 4, 0, 4)
    low, top, tail = payload[18:22], payload[22:26], payload[26:]
    # The top plane: the 8 exponent bits (127, 127, 0, 255); below it the
    # sign bit over the mantissa's low 7 bits.
    assert list(top) == [0x7F, 0x7F, 0x00, 0xFF]
    assert list(low) == [0x00, 0x80, 0x80, 0x41]
    assert tail == b"z"
    assert bytes(decode_chunk(blob, where="c")) == data


def test_the_name_is_blake3_of_the_logical_bytes_whatever_the_codec() -> None:
    # BLAKE3's published digest of the empty input.
    assert chunk_name(b"") == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    data = _bf16(_weights(4096))
    assert chunk_name(memoryview(data)) == chunk_name(bytearray(data)) == chunk_name(data)
    raw, packed = encode_chunk(data, itemsize=2), encode_chunk(data, itemsize=2,
                                                               codec=PLANES_ZSTD)
    assert raw != packed
    assert chunk_name(decode_chunk(raw, where="r")) == chunk_name(
        decode_chunk(packed, where="p")) == chunk_name(data)


def test_the_header_counts_stored_against_logical_bytes() -> None:
    data = _bf16(_weights(1 << 18))
    blob = encode_chunk(data, itemsize=2, codec=PLANES_ZSTD)
    head = chunk_header(blob)
    assert head["codec"] == PLANES_ZSTD and head["itemsize"] == 2
    assert head["size"] == len(data) > len(blob)


# -- round trips ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=3000), itemsize=st.sampled_from([1, 2, 3, 4, 8, 16]),
       codec=st.sampled_from(CODECS))
def test_any_bytes_come_back_whole(data: bytes, itemsize: int, codec: str) -> None:
    blob = encode_chunk(data, itemsize=itemsize, codec=codec)
    assert bytes(decode_chunk(blob, where="c")) == data
    out = bytearray(len(data))
    decode_into(blob, memoryview(out), where="c")
    assert out == data


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 70_000), tail=st.integers(0, 7), seed=st.integers(0, 2**32 - 1),
       itemsize=st.sampled_from([2, 4, 8]))
def test_numbers_with_few_exponents_and_a_ragged_end_come_back_whole(
        n: int, tail: int, seed: int, itemsize: int) -> None:
    rng = np.random.default_rng(seed)
    body = rng.normal(0, 0.02, n).astype({2: np.float16, 4: np.float32, 8: np.float64}[itemsize])
    data = body.tobytes() + rng.bytes(tail % itemsize)
    blob = encode_chunk(data, itemsize=itemsize, codec=PLANES_ZSTD)
    assert bytes(decode_chunk(blob, where="c")) == data
    if n >= 20_000:  # the exponent planes compressed: the zstd path ran
        assert len(blob) < len(data)


def _special_bits(dtype: str) -> np.ndarray:
    """Every bit pattern class a float can hold: signed zeros, the smallest and
    largest denormals and normals, infinities, quiet and signalling NaNs with
    payloads and with the sign set (all 256 values for 1-byte types)."""
    size = DTYPES[dtype][0]
    if size == 1:
        return np.arange(256, dtype=np.uint8)
    bits = {2: 16, 4: 32, 8: 64}[size]
    exp_bits = {"F16": 5, "BF16": 8, "F32": 8, "F64": 11}.get(dtype)
    kind = {2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
    if exp_bits is None:  # integers, complex64 (two f32): extremes and a ramp
        top = (1 << bits) - 1
        return np.array([0, 1, top, top >> 1, (top >> 1) + 1, 12345], dtype=kind)
    mant = bits - 1 - exp_bits
    sign = 1 << (bits - 1)
    exp_all = ((1 << exp_bits) - 1) << mant
    patterns = [0, 1, (1 << mant) - 1, 1 << mant, exp_all - 1, exp_all,
                exp_all | 1, exp_all | (1 << (mant - 1)), exp_all | ((1 << mant) - 1),
                exp_all | 0x5]
    return np.array(patterns + [p | sign for p in patterns], dtype=kind)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("codec", CODECS)
def test_every_dtype_of_the_state_path_comes_back_bit_for_bit(dtype: str, codec: str) -> None:
    size = DTYPES[dtype][0]
    special = _special_bits(dtype)
    if size == 1:
        filler = np.random.default_rng(1).integers(0, 256, 300_000, dtype=np.uint8)
    elif dtype == "BF16":
        filler = np.frombuffer(_bf16(_weights(300_000)), np.uint16)
    else:
        kind = {2: np.float16, 4: np.float32, 8: np.float64}[size]
        filler = _weights(300_000).astype(kind).view(special.dtype)
    # Special values among many ordinary ones (the planes compress and a
    # long plane is probed), and the specials alone, ragged at the end.
    for data in (np.concatenate([filler, special, filler[:7]]).tobytes(),
                 special.tobytes() + b"\x7f\xc0\x01"[: size - 1]):
        blob = encode_chunk(data, itemsize=size, codec=codec)
        assert bytes(decode_chunk(blob, where="c")) == data
        # Each float comes back as the same bits (NaN != NaN, so compare bits).
        assert np.array_equal(np.frombuffer(decode_chunk(blob, where="c")[: len(data) // size
                                                                          * size],
                                            special.dtype),
                              np.frombuffer(data[: len(data) // size * size], special.dtype))


def test_any_buffer_goes_in_and_decode_into_fills_a_numpy_array() -> None:
    values = _weights(50_000)
    blob = encode_chunk(values, itemsize=4, codec=PLANES_ZSTD)  # a numpy array as input
    target = np.empty_like(values)
    decode_into(blob, memoryview(target), where="c")  # a float32 buffer as output
    assert np.array_equal(target.view(np.uint32), values.view(np.uint32))
    assert bytes(decode_chunk(memoryview(blob), where="c")) == values.tobytes()


def test_without_numpy_the_codec_writes_the_same_bytes_and_reads_numpys() -> None:
    data = _bf16(_weights(200_001)) + b"\x01"
    blob = encode_chunk(data, itemsize=4, codec=PLANES_ZSTD)
    script = (
        "import sys; sys.modules['numpy'] = None\n"
        "from checkpoint_store._chunks.codec import decode_chunk, encode_chunk\n"
        "data, blob = open(sys.argv[1], 'rb').read(), open(sys.argv[2], 'rb').read()\n"
        "assert bytes(decode_chunk(blob, where='c')) == data\n"
        "assert encode_chunk(data, itemsize=4, codec='planes-zstd') == blob\n"
        "assert 'numpy' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}\n"
        "print('ok')\n")
    tmp = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"codec-{os.getpid()}")
    with open(tmp + ".data", "wb") as f:
        f.write(data)
    with open(tmp + ".blob", "wb") as f:
        f.write(blob)
    try:
        run = subprocess.run([sys.executable, "-c", script, tmp + ".data", tmp + ".blob"],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": ROOT})
    finally:
        os.remove(tmp + ".data")
        os.remove(tmp + ".blob")
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_decode_many_decodes_in_order_on_threads() -> None:
    datas = [_bf16(_weights(100_000, seed=i)) for i in range(6)]
    blobs = [encode_chunk(d, itemsize=2, codec=c) for d, c in zip(datas, CODECS * 3, strict=True)]
    got = decode_many(blobs, wheres=[f"chunk {i}" for i in range(6)], workers=3)
    assert [bytes(g) for g in got] == datas
    broken = list(blobs)
    broken[4] = broken[4][:-1]
    with pytest.raises(CheckpointCorruptError, match="chunk 4"):
        decode_many(broken, wheres=[f"chunk {i}" for i in range(6)], workers=3)


# -- compression -----------------------------------------------------------------------------


def test_bf16_weights_shrink_by_more_than_a_fifth() -> None:
    data = _bf16(_weights(1 << 21))  # 4 MiB
    blob = encode_chunk(data, itemsize=2, codec=PLANES_ZSTD)
    assert len(data) / len(blob) > 1.2
    # Split by the wrong item size (or not at all), the same bytes shrink less.
    assert len(encode_chunk(data, itemsize=1, codec=PLANES_ZSTD)) > len(blob)


def test_noise_is_stored_raw_and_costs_only_the_plane_table() -> None:
    data = os.urandom(4 << 20)  # planes long enough to be probed first
    blob = encode_chunk(data, itemsize=4, codec=PLANES_ZSTD)
    assert len(blob) - len(data) < 150


# -- damage ---------------------------------------------------------------------------------


def _sample_blobs() -> list[bytes]:
    data = _bf16(_weights(3000)) + b"\x05"
    return [encode_chunk(data, itemsize=2, codec=c) for c in CODECS]


@pytest.mark.parametrize("blob", _sample_blobs(), ids=CODECS)
def test_every_truncation_is_corrupt(blob: bytes) -> None:
    for end in list(range(0, 80)) + list(range(len(blob) - 40, len(blob))):
        with pytest.raises(CheckpointCorruptError, match="chunk ab/abcd of checkpoint_000003"):
            decode_chunk(blob[:end], where="chunk ab/abcd of checkpoint_000003")


@pytest.mark.parametrize("blob", _sample_blobs(), ids=CODECS)
def test_a_flipped_byte_is_corrupt_or_changes_nothing(blob: bytes) -> None:
    data = bytes(decode_chunk(blob, where="c"))
    refused = 0
    for at in range(0, len(blob), max(1, len(blob) // 700)):
        damaged = bytearray(blob)
        damaged[at] ^= 0x41
        try:
            got = decode_chunk(bytes(damaged), where="c")
        except CheckpointCorruptError:
            refused += 1
        else:  # e.g. a zstd frame header field the decoder does not need
            assert bytes(got) == data
    assert refused >= 0.95 * len(range(0, len(blob), max(1, len(blob) // 700)))


def test_a_longer_payload_is_corrupt() -> None:
    for blob in _sample_blobs():
        with pytest.raises(CheckpointCorruptError, match="bytes"):
            decode_chunk(blob + b"\0", where="c")


def _with_header(header: object, payload: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(text)) + text + payload


@pytest.mark.parametrize("blob,reason", [
    (b"CSCHUNK2" + bytes(8), "starts with"),
    (MAGIC + struct.pack("<I", 1 << 30), "header length"),
    (MAGIC + struct.pack("<I", 3) + b"{no", "not JSON"),
    (_with_header([1, 2]), "not a chunk header"),
    (_with_header({"codec": "raw", "size": 1, "crc32c": "00000000"}), "not a chunk header"),
    (_with_header({"codec": "raw", "size": -1, "crc32c": "00000000", "itemsize": 1}), "size"),
    (_with_header({"codec": "raw", "size": 0, "crc32c": "0000000", "itemsize": 1}), "crc32c"),
    (_with_header({"codec": "raw", "size": 0, "crc32c": "00000000", "itemsize": 0}),
     "itemsize"),
    (_with_header({"codec": "raw", "size": 1, "crc32c": "00000000", "itemsize": 1}, b"x"),
     "CRC32C"),
])
def test_a_malformed_header_is_corrupt_and_says_why(blob: bytes, reason: str) -> None:
    with pytest.raises(CheckpointCorruptError, match=reason) as info:
        decode_chunk(blob, where="chunk 12/1234")
    assert "chunk 12/1234" in str(info.value)
    assert "load a checkpoint that does not use this chunk" in str(info.value)


def test_an_unknown_codec_is_corrupt_and_suggests_an_upgrade() -> None:
    blob = _with_header({"codec": "planes-lz4", "size": 0, "crc32c": "00000000",
                         "itemsize": 1})
    with pytest.raises(CheckpointCorruptError, match="'planes-lz4' is not one this version "
                                                     "reads.*upgrade"):
        decode_chunk(blob, where="c")
    with pytest.raises(CheckpointCorruptError):
        chunk_header(blob)


def test_a_plane_table_that_lies_is_corrupt() -> None:
    data = _bf16(_weights(50_000))
    blob = bytearray(encode_chunk(data, itemsize=2, codec=PLANES_ZSTD))
    start = 12 + struct.unpack_from("<I", blob, 8)[0]
    mode, stored = struct.unpack_from("<BQ", blob, start + 9)  # plane 1: the exponents
    assert mode == 1
    for entry, reason in (((7, stored), "mode 7"), ((0, stored), "mode 0"),
                          ((1, stored + 1), "past the end"), ((1, stored - 1), "not a valid|more")):
        damaged = bytearray(blob)
        struct.pack_into("<BQ", damaged, start + 9, *entry)
        with pytest.raises(CheckpointCorruptError, match=reason):
            decode_chunk(bytes(damaged), where="c")


def test_bad_arguments_are_refused_before_anything_is_encoded() -> None:
    with pytest.raises(ValueError, match="unknown chunk codec 'gzip'"):
        encode_chunk(b"x", codec="gzip")
    for itemsize in (0, 256, True, 2.0):
        with pytest.raises(ValueError, match="itemsize"):
            encode_chunk(b"x", itemsize=itemsize)  # type: ignore[arg-type]
    blob = encode_chunk(b"abcd")
    with pytest.raises(ValueError, match="holds 4 bytes"):
        decode_into(blob, memoryview(bytearray(3)), where="c")
    with pytest.raises(ValueError, match="writable"):
        decode_into(blob, memoryview(b"abcd"), where="c")


# -- the automatic choice ---------------------------------------------------------------------


def test_local_disks_and_memory_get_raw_object_stores_get_planes(tmp_path) -> None:
    import s3fs

    local = pafs.LocalFileSystem()
    assert codec_for(local) == RAW
    assert codec_for(pafs.SubTreeFileSystem(str(tmp_path), local)) == RAW
    assert codec_for(pafs.PyFileSystem(ForwardingHandler(local))) == RAW
    assert codec_for(resolve(str(tmp_path))[0].filesystem) == RAW
    assert codec_for(resolve("memory://codec-choice")[0].filesystem) == RAW
    import fsspec

    assert codec_for(fsspec.filesystem("memory")) == RAW
    s3 = pafs.S3FileSystem(anonymous=True, region="us-east-1")
    assert codec_for(s3) == PLANES_ZSTD
    assert codec_for(pafs.SubTreeFileSystem("bucket/runs", s3)) == PLANES_ZSTD
    assert codec_for(pafs.PyFileSystem(ForwardingHandler(s3))) == PLANES_ZSTD
    remote = s3fs.S3FileSystem(anon=True)
    assert codec_for(remote) == PLANES_ZSTD
    assert codec_for(pafs.PyFileSystem(pafs.FSSpecHandler(remote))) == PLANES_ZSTD


def test_a_dir_filesystem_gets_the_codec_of_the_filesystem_it_wraps(tmp_path) -> None:
    import fsspec
    import s3fs
    from fsspec.implementations.dirfs import DirFileSystem

    local = DirFileSystem(path=str(tmp_path), fs=fsspec.filesystem("file"))
    assert codec_for(local) == RAW
    assert codec_for(pafs.PyFileSystem(pafs.FSSpecHandler(local))) == RAW
    assert codec_for(DirFileSystem(path="/runs", fs=fsspec.filesystem("memory"))) == RAW
    remote = DirFileSystem(path="bucket/runs", fs=s3fs.S3FileSystem(anon=True))
    assert codec_for(remote) == PLANES_ZSTD
    assert codec_for(pafs.PyFileSystem(pafs.FSSpecHandler(remote))) == PLANES_ZSTD


def test_compression_auto_through_a_dir_filesystem_on_a_local_disk_stores_raw(
        tmp_path) -> None:
    import fsspec
    from fsspec.implementations.dirfs import DirFileSystem

    from checkpoint_store import Checkpoint, StorageContext
    from checkpoint_store._chunks.codec import chunk_header

    (tmp_path / "root").mkdir()
    fs = DirFileSystem(path=str(tmp_path / "root"), fs=fsspec.filesystem("file"))
    ctx = StorageContext("store", "exp", "t", storage_filesystem=fs, dedup=True, fsync=False)
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(np.arange(1 << 19, dtype=np.float32).tobytes())
    ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(str(src)), 0, {})
    [[obj, _, _]] = [e["chunks"] for e in ckpt.internal_metadata["manifest"] if "chunks" in e][0]
    blob = (tmp_path / "root/store/exp/.cs_chunks" / obj[:2] / obj).read_bytes()
    assert chunk_header(blob)["codec"] == RAW
