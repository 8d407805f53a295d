"""A store slow to answer CompleteMultipartUpload: the upload completes once.

moto, like S3, assembles a multipart object before it answers
CompleteMultipartUpload, and sends nothing meanwhile (4 x 256 MiB took
longer than 3 s under load). A client that gives up on the silence sends
the request again while the first still runs; moto then answers 500
(INTERNAL_FAILURE: the first request closed the parts the second reads) or
NoSuchUpload, and the checkpoint upload failed (the s3-link benchmark row).
Here a proxy in front of the real moto server holds every
CompleteMultipartUpload answer longer than the engines' default patience
(pyarrow's AWS SDK: 3 s without a byte; s3fs: 15 s) and counts the requests.

The same proxy, holding nothing, counts the requests a small file costs
when the user passes a pyarrow ``S3FileSystem`` made without
``allow_delayed_open``: one PutObject, not a multipart upload of three;
and the requests a small file's download costs with the pyarrow engine:
one GET, no HEAD before it.
"""

from __future__ import annotations

import os

import pytest

from checkpoint_store import Checkpoint, StorageContext
from tests.backends.relay import CountingRelay

MiB = 1024 * 1024


@pytest.fixture
def big_checkpoint(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    # Above the 16 MiB a 32 MiB budget sends in one PUT: a multipart upload.
    (src / "model.bin").write_bytes(os.urandom(24 * MiB))
    (src / "meta.json").write_bytes(b"{}")
    return src


def _upload_through(proxy: CountingRelay, s3_server, s3_bucket: str, engine: str,
                    src) -> Checkpoint:
    options = {**s3_server.storage_options(engine), "endpoint_url": proxy.url}
    st = StorageContext(f"s3://{s3_bucket}/slow", "exp", "t", storage_options=options,
                        memory_budget=32 * MiB)
    return st.persist_checkpoint(Checkpoint.from_directory(str(src)), 0, {"metrics": {}})


@pytest.mark.parametrize("engine,hold_s", [
    pytest.param("pyarrow", 4.0, id="pyarrow"),
    # Past s3fs's own 15 s without a byte, inside the backend's 20 s request_timeout.
    pytest.param("s3fs", 17.0, id="s3fs", marks=pytest.mark.slow),
])
def test_slow_complete_is_sent_once_and_the_checkpoint_verifies(
        s3_server, s3_bucket, big_checkpoint, tmp_path, engine, hold_s):
    proxy = CountingRelay(s3_server.port, hold_s)
    dst = tmp_path / "back"
    try:
        ckpt = _upload_through(proxy, s3_server, s3_bucket, engine, big_checkpoint)
        # One upload, one CompleteMultipartUpload: not sent again while the
        # store was still assembling the object.
        assert len(proxy.completes) == 1, proxy.completes
        ckpt.to_directory(str(dst))  # verifies every checksum
    finally:
        proxy.close()
    keys = s3_server.list_keys(s3_bucket)
    assert keys["slow/exp/t/checkpoint_000000/model.bin"] == 24 * MiB
    assert (dst / "model.bin").read_bytes() == (big_checkpoint / "model.bin").read_bytes()


def test_small_files_are_one_put_each_through_a_pyarrow_filesystem_passed_in(
        s3_server, s3_bucket, tmp_path):
    import pyarrow.fs as pafs

    src = tmp_path / "ckpt"
    src.mkdir()
    for i in range(12):
        (src / f"shard_{i:02d}.bin").write_bytes(os.urandom(1000 + i))
    proxy = CountingRelay(s3_server.port, 0.0)
    try:
        # As a Ray user builds it: allow_delayed_open is False by default.
        user_fs = pafs.S3FileSystem(
            endpoint_override=proxy.url.split("://", 1)[1], scheme="http",
            access_key=s3_server.access_key_id, secret_key=s3_server.secret_access_key,
            region="us-east-1")
        st = StorageContext(f"{s3_bucket}/passed", "exp", "t", storage_filesystem=user_fs)
        ckpt = st.persist_checkpoint(Checkpoint.from_directory(str(src)), 0, {"metrics": {}})
        shard_requests = [line for line in proxy.requests if b"/shard_" in line]
        assert sorted(line.split(b" ")[0] for line in shard_requests) == [b"PUT"] * 12, (
            shard_requests)
        # Nor does any metadata file of the commit (claim, manifest) start a
        # multipart upload.
        assert [line for line in proxy.requests if b"?uploads" in line] == []
        # The user's filesystem is the checkpoint's, as given.
        assert ckpt.filesystem is user_fs or ckpt.filesystem.equals(user_fs)
        ckpt.to_directory(str(tmp_path / "back"))  # verifies every checksum
    finally:
        proxy.close()
    for i in range(12):
        got = (tmp_path / "back" / f"shard_{i:02d}.bin").read_bytes()
        assert got == (src / f"shard_{i:02d}.bin").read_bytes()


@pytest.mark.parametrize("engine", ["pyarrow", "s3fs"])
def test_small_files_download_with_one_get_each(s3_server, s3_bucket, tmp_path, engine):
    # pyarrow's Python API asks an object's size (HEAD) before every read;
    # the listing already gave it. Both engines read small files through
    # their s3fs client: one ranged GET per file.
    src = tmp_path / "ckpt"
    src.mkdir()
    for i in range(12):
        (src / f"shard_{i:02d}.bin").write_bytes(os.urandom(1000 + i))
    (src / "empty.bin").write_bytes(b"")
    st = StorageContext(f"s3://{s3_bucket}/dl", "exp", "t",
                        storage_options=s3_server.storage_options(engine))
    st.persist_checkpoint(Checkpoint.from_directory(str(src)), 0, {"metrics": {}})
    proxy = CountingRelay(s3_server.port, 0.0)
    try:
        options = {**s3_server.storage_options(engine), "endpoint_url": proxy.url}
        ckpt = Checkpoint(f"s3://{s3_bucket}/dl/exp/t/checkpoint_000000",
                          storage_options=options)
        ckpt.to_directory(str(tmp_path / "back"))  # verifies every checksum
        shard_requests = [line for line in proxy.requests if b"/shard_" in line]
        assert sorted(line.split(b" ")[0] for line in shard_requests) == [b"GET"] * 12, (
            shard_requests)
    finally:
        proxy.close()
    for i in range(12):
        got = (tmp_path / "back" / f"shard_{i:02d}.bin").read_bytes()
        assert got == (src / f"shard_{i:02d}.bin").read_bytes()
    assert (tmp_path / "back" / "empty.bin").read_bytes() == b""
