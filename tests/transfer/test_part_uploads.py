"""Large files uploaded to S3 through s3fs in parallel multipart parts
(issue 17): against the real moto server, which checks at completion that
the parts are numbered from 1 without a gap and that every part but the
last has at least 5 MiB. Checked for correct bytes, checksums, commits and
no multipart upload left behind (not for speed)."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import s3fs

from checkpoint_store import Checkpoint, StorageContext, _tasks
from checkpoint_store._remote import S3Multipart

MiB = 1024 * 1024
#: With this budget the parts are S3's smallest (5 MiB): several per file.
BUDGET = 32 * MiB
SIZES = {"model.bin": 23 * MiB + 7, "optim.bin": 17 * MiB + 3, "meta.json": 100}


def _tree(root, sizes: dict[str, int]) -> dict[str, bytes]:
    root.mkdir()
    out = {}
    for rel, size in sizes.items():
        out[rel] = os.urandom(size)
        (root / rel).write_bytes(out[rel])
    return out


def _raw_s3fs(s3_server) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(endpoint_url=s3_server.endpoint_url, key=s3_server.access_key_id,
                             secret=s3_server.secret_access_key, skip_instance_cache=True)


def _open_uploads(s3_server, bucket: str) -> list[str]:
    resp = _raw_s3fs(s3_server).call_s3("list_multipart_uploads", Bucket=bucket)
    return [u["Key"] for u in resp.get("Uploads", [])]


def _storage(how: str, s3_server, bucket: str) -> StorageContext:
    if how == "pyarrow engine":
        return StorageContext(f"s3://{bucket}/ckpt", "exp", "t", memory_budget=BUDGET,
                              storage_options=s3_server.storage_options("pyarrow"))
    if how == "s3fs engine":
        return StorageContext(f"s3://{bucket}/ckpt", "exp", "t", memory_budget=BUDGET,
                              storage_options=s3_server.storage_options("s3fs"))
    return StorageContext(f"{bucket}/ckpt", "exp", "t", memory_budget=BUDGET,
                          storage_filesystem=_raw_s3fs(s3_server))


class _PartSpy:
    """Records ``(key, part number, size)`` of every part sent (they still go)."""

    def __init__(self, monkeypatch) -> None:
        self.parts: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()
        real = S3Multipart.put_part

        def spy(upload: S3Multipart, number: int, data) -> None:
            real(upload, number, data)
            with self._lock:
                self.parts.append((upload._key.rsplit("/", 1)[-1], number, len(data)))

        monkeypatch.setattr(S3Multipart, "put_part", spy)


@pytest.mark.parametrize("how", ["pyarrow engine", "s3fs engine", "s3fs filesystem passed"])
def test_large_files_go_up_in_parallel_parts_and_verify(
        tmp_path, monkeypatch, s3_server, s3_bucket, how) -> None:
    want = _tree(tmp_path / "src", SIZES)
    spy = _PartSpy(monkeypatch)
    st = _storage(how, s3_server, s3_bucket)
    ckpt = st.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    # Both large files in 5 MiB parts numbered from 1; the small file in one PUT.
    for name in ("model.bin", "optim.bin"):
        sizes = sorted((n, size) for key, n, size in spy.parts if key == name)
        assert [n for n, _ in sizes] == list(range(1, len(sizes) + 1)), name
        assert sum(size for _, size in sizes) == SIZES[name]
        assert all(size == 5 * MiB for _, size in sizes[:-1])
    assert not [p for p in spy.parts if p[0] == "meta.json"]
    assert _open_uploads(s3_server, s3_bucket) == []
    ckpt.to_directory(str(tmp_path / "back"))  # verifies every checksum
    for rel, data in want.items():
        assert (tmp_path / "back" / rel).read_bytes() == data, rel


@pytest.mark.parametrize("how", ["pyarrow engine", "s3fs engine", "s3fs filesystem passed"])
def test_a_part_failing_aborts_every_upload_and_commits_nothing(
        tmp_path, monkeypatch, s3_server, s3_bucket, how) -> None:
    _tree(tmp_path / "src", SIZES)
    real = _tasks._Runner._upload_part
    calls = [0]
    lock = threading.Lock()

    def flaky(self, rel, offset, length):
        with lock:
            calls[0] += 1
            n = calls[0]
        if n > 3:  # some parts of both files are in, then a permanent error
            raise PermissionError(errno.EACCES, "injected failure half-way")
        return real(self, rel, offset, length)

    monkeypatch.setattr(_tasks._Runner, "_upload_part", flaky)
    st = _storage(how, s3_server, s3_bucket)
    with pytest.raises(OSError, match="injected"):
        st.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    assert st.committed_checkpoints() == []
    assert _open_uploads(s3_server, s3_bucket) == []
    assert not [k for k in s3_server.list_keys(s3_bucket) if k.endswith(".bin")]


def test_a_source_changing_during_a_part_upload_fails_it(
        tmp_path, monkeypatch, s3_server, s3_bucket) -> None:
    # Each part is read on its own: a file rewritten between two parts would
    # be stored as a mix of both versions under a checksum of neither.
    src = tmp_path / "src"
    _tree(src, SIZES)
    real = _tasks._Runner._upload_part
    done = threading.Event()

    def write_first(self, rel, offset, length):
        if rel == "model.bin" and offset and not done.is_set():
            done.set()
            with open(src / rel, "ab") as f:
                f.write(b"late")
        return real(self, rel, offset, length)

    monkeypatch.setattr(_tasks._Runner, "_upload_part", write_first)
    st = _storage("s3fs engine", s3_server, s3_bucket)
    with pytest.raises(OSError, match="changed while it was being"):
        st.persist_checkpoint(Checkpoint.from_directory(str(src)), 0, {})
    assert st.committed_checkpoints() == []
    assert _open_uploads(s3_server, s3_bucket) == []
