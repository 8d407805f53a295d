"""One place, one spelling: a storage path is normalised once, where it enters.

Ray users hand in their own filesystem (``RunConfig(storage_filesystem=...)``)
with a path spelled as they like; the filesystem's listings spell it their own
way. Every report must still commit and be found again (issue 11, kind 1).
The conformance suite (``BackendTests``) checks the same on every backend.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import fsspec
import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint, StorageContext, session
from checkpoint_store.backends.base import LOCAL_CAPABILITIES
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.registry import resolve
from checkpoint_store.testing.conformance import read_tree


def _report_once(tmp_path: Path, storage_path: str, fs: object) -> Checkpoint:
    src = tmp_path / f"src-{uuid.uuid4().hex[:6]}"
    src.mkdir()
    (src / "model.bin").write_bytes(b"weights")
    with session.start(storage_path=storage_path, experiment_name="e", trial_name="t",
                       storage_filesystem=fs):
        session.report({"a": 1}, checkpoint=Checkpoint.from_directory(src))
        got = session.get_checkpoint()
    assert got is not None
    return got


@pytest.mark.parametrize("spelling", ["bucket/runs", "bucket/runs/", "/bucket/runs"])
def test_memory_pyfilesystem_commits_whatever_the_spelling(tmp_path, spelling):
    # fsspec's memory store is shared by all its instances: a fresh bucket per test.
    bucket = f"bucket-{uuid.uuid4().hex[:8]}"
    spelled = spelling.replace("bucket", bucket)
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory",
                                                                 skip_instance_cache=True)))
    got = _report_once(tmp_path, spelled, fs)
    assert got.path == f"/{bucket}/runs/e/t/checkpoint_000000"
    assert got.internal_metadata["index"] == 0
    assert got.internal_metadata["metrics"]["a"] == 1
    assert read_tree(got.to_directory(str(tmp_path / "out"))) == {"model.bin": b"weights"}


def test_the_three_memory_spellings_are_one_trial(tmp_path):
    bucket = f"bucket-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory", skip_instance_cache=True)
    paths = {StorageContext(s, "e", "t", storage_filesystem=fs).trial_path
             for s in (f"{bucket}/runs", f"{bucket}/runs/", f"/{bucket}/runs",
                       f"memory://{bucket}/runs")}
    assert paths == {f"/{bucket}/runs/e/t"}
    assert resolve(f"memory://{bucket}/runs/")[1] == f"/{bucket}/runs"


@pytest.mark.parametrize("wrap", ["pyfilesystem", "bare"])
def test_fsspec_local_filesystem_is_the_local_disk(tmp_path, wrap):
    inner = fsspec.filesystem("file")
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(inner)) if wrap == "pyfilesystem" else inner
    root = tmp_path / "store"
    ctx = StorageContext(str(root), "e", "t", storage_filesystem=fs)
    assert isinstance(ctx.filesystem, pafs.LocalFileSystem)
    assert ctx.backend.capabilities == LOCAL_CAPABILITIES
    got = _report_once(tmp_path, str(root), fs)
    assert got.is_local
    assert (root / "e" / "t" / "checkpoint_000000" / "model.bin").read_bytes() == b"weights"
    assert not (root / "e" / "t" / ".cs_manager_lease.json").exists()  # released at the end


def test_fsspec_local_filesystem_takes_relative_and_uri_spellings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("file")))
    got = _report_once(tmp_path, "runs/", fs)
    assert got.path == os.path.join(str(tmp_path), "runs", "e", "t", "checkpoint_000000")
    ctx = StorageContext(f"file://{tmp_path}/runs", "e", "t", storage_filesystem=fs)
    assert [c.path for c, _ in ctx.committed_checkpoints()] == [got.path]


def test_pyarrow_local_filesystem_refuses_a_uri_as_path(tmp_path):
    with pytest.raises(InvalidConfigError, match="is a URI"):
        StorageContext(f"file://{tmp_path}", "e", "t", storage_filesystem=pafs.LocalFileSystem())


def test_own_pyarrow_s3_filesystem_with_a_scheme_in_its_endpoint_commits(tmp_path, s3_server,
                                                                          s3_bucket):
    """pyarrow takes ``endpoint_override="http://host:port"`` as well as
    ``"host:port"`` plus ``scheme``: the client built beside it for parallel parts
    and batches must reach the same endpoint (it read "http://http:/...")."""
    fs = pafs.S3FileSystem(
        endpoint_override=s3_server.endpoint_url, scheme="http",
        access_key=s3_server.access_key_id, secret_key=s3_server.secret_access_key,
        region=s3_server.region,
    )
    got = _report_once(tmp_path, f"{s3_bucket}/runs", fs)
    assert read_tree(got.to_directory(str(tmp_path / "out"))) == {"model.bin": b"weights"}


@pytest.mark.parametrize("engine", ["pyarrow", "s3fs"])
@pytest.mark.parametrize("spelling", ["{b}/runs", "/{b}/runs/"])
def test_own_s3_filesystem_with_any_spelling_commits(tmp_path, s3_server, s3_bucket, engine,
                                                     spelling):
    """The Ray way on S3: the user builds the client, the path carries the bucket."""
    if engine == "pyarrow":
        fs: object = pafs.S3FileSystem(
            endpoint_override=s3_server.endpoint_url.split("://", 1)[1], scheme="http",
            access_key=s3_server.access_key_id, secret_key=s3_server.secret_access_key,
            region=s3_server.region,
        )
    else:
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=s3_server.endpoint_url, key=s3_server.access_key_id,
                               secret=s3_server.secret_access_key, skip_instance_cache=True,
                               use_listings_cache=False)
    got = _report_once(tmp_path, spelling.format(b=s3_bucket), fs)
    assert got.path == f"{s3_bucket}/runs/e/t/checkpoint_000000"
    assert read_tree(got.to_directory(str(tmp_path / "out"))) == {"model.bin": b"weights"}


def test_s3_uri_with_an_empty_host_is_the_same_place(s3_location):
    opts = dict(s3_location.storage_options)
    bucket_path = s3_location.uri.split("://", 1)[1]
    assert resolve(f"s3:///{bucket_path}/", storage_options=opts)[1] == bucket_path
