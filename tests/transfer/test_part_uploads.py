"""Large files uploaded to S3 through s3fs in parallel multipart parts
(issue 17): against the real moto server, which checks at completion that
the parts are numbered from 1 without a gap and that every part but the
last has at least 5 MiB. Checked for correct bytes, checksums, commits and
no multipart upload left behind (not for speed)."""

from __future__ import annotations

import errno
import threading

import pyarrow.fs as pafs
import pytest
import s3fs

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store._transfer import tasks as _tasks
from checkpoint_store._transfer.remote import S3Multipart
from tests.transfer.part_upload_cases import (
    BUDGET,
    DENIED,
    SIZES,
    MiB,
    assert_each_upload_completes_after_its_last_part,
    fail_parts_after,
    record_part_events,
    rewrite_between_parts,
)
from tests.transfer.part_upload_cases import make_tree as _tree

HOWS = ["pyarrow engine", "s3fs engine", "s3fs filesystem passed", "pyarrow filesystem passed"]


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
    if how == "pyarrow filesystem passed":
        return StorageContext(f"{bucket}/ckpt", "exp", "t", memory_budget=BUDGET,
                              storage_filesystem=_raw_pyarrow(s3_server))
    return StorageContext(f"{bucket}/ckpt", "exp", "t", memory_budget=BUDGET,
                          storage_filesystem=_raw_s3fs(s3_server))


def _raw_pyarrow(s3_server, **kw) -> pafs.S3FileSystem:
    """What a Ray user passes as storage_filesystem (pyarrow's defaults)."""
    scheme, _, netloc = s3_server.endpoint_url.partition("://")
    return pafs.S3FileSystem(access_key=s3_server.access_key_id,
                             secret_key=s3_server.secret_access_key,
                             endpoint_override=netloc, scheme=scheme,
                             region=s3_server.region, **kw)


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


@pytest.mark.parametrize("how", HOWS)
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


@pytest.mark.parametrize("how", HOWS)
def test_a_part_failing_aborts_every_upload_and_commits_nothing(
        tmp_path, monkeypatch, s3_server, s3_bucket, how) -> None:
    _tree(tmp_path / "src", SIZES)
    # Some parts of both files are in, then a permanent error.
    fail_parts_after(monkeypatch, 3, DENIED)
    st = _storage(how, s3_server, s3_bucket)
    with pytest.raises(OSError, match="injected"):
        st.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    assert st.committed_checkpoints() == []
    assert _open_uploads(s3_server, s3_bucket) == []
    assert not [k for k in s3_server.list_keys(s3_bucket) if k.endswith(".bin")]


def test_a_source_changing_during_a_part_upload_fails_it(
        tmp_path, monkeypatch, s3_server, s3_bucket) -> None:
    src = tmp_path / "src"
    _tree(src, SIZES)
    done = rewrite_between_parts(src, monkeypatch)
    st = _storage("s3fs engine", s3_server, s3_bucket)
    with pytest.raises(OSError, match="changed while it was being"):
        st.persist_checkpoint(Checkpoint.from_directory(str(src)), 0, {})
    assert done.is_set()
    assert st.committed_checkpoints() == []
    assert _open_uploads(s3_server, s3_bucket) == []


def test_an_abort_the_store_refuses_once_is_retried(
        tmp_path, monkeypatch, s3_server, s3_bucket) -> None:
    # The outage that failed the upload often fails its abort too; S3 keeps
    # the parts of an upload never aborted (billed, not listed as objects).
    _tree(tmp_path / "src", SIZES)
    fail_parts_after(monkeypatch, 3, DENIED)
    real_abort = S3Multipart.abort
    refused = []

    def abort_once_refused(upload: S3Multipart) -> None:
        if not refused:
            refused.append(upload.upload_id)
            raise ConnectionResetError(errno.ECONNRESET, "injected: connection reset")
        real_abort(upload)

    monkeypatch.setattr(S3Multipart, "abort", abort_once_refused)
    st = _storage("s3fs engine", s3_server, s3_bucket)
    with pytest.raises(OSError, match="injected failure"):
        st.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    assert refused
    assert _open_uploads(s3_server, s3_bucket) == []


def test_an_abort_that_keeps_failing_names_the_upload_and_raises_the_first_error(
        tmp_path, monkeypatch, s3_server, s3_bucket, caplog) -> None:
    _tree(tmp_path / "src", SIZES)
    fail_parts_after(monkeypatch, 3, DENIED)

    def abort_refused(upload: S3Multipart) -> None:
        raise PermissionError(errno.EACCES, "injected: abort denied")

    monkeypatch.setattr(S3Multipart, "abort", abort_refused)
    st = _storage("s3fs engine", s3_server, s3_bucket)
    with caplog.at_level("WARNING", logger="checkpoint_store._transfer.tasks"), \
            pytest.raises(OSError, match="injected failure"):
        st.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    left = _open_uploads(s3_server, s3_bucket)
    assert left  # the store kept them: the log is all that names them
    warned = " ".join(r.getMessage() for r in caplog.records)
    for key in left:
        assert key in warned
    assert "upload id" in warned and "lifecycle rule" in warned
    assert s3_server.secret_access_key not in warned
    assert st.committed_checkpoints() == []


def test_ctrl_c_while_parts_upload_starts_no_other_part_and_aborts(
        tmp_path, monkeypatch, s3_server, s3_bucket) -> None:
    from checkpoint_store._transfer import plan as _plan

    _tree(tmp_path / "src", SIZES)
    sent = []
    real = _tasks.TransferTasks._upload_part

    def count(self, rel, offset, length):
        sent.append((rel, offset))
        return real(self, rel, offset, length)

    def interrupted_wait(futs, return_when):
        while not any(f.done() for f in futs):  # a part or two is in
            threading.Event().wait(0.01)
        raise KeyboardInterrupt

    monkeypatch.setattr(_tasks.TransferTasks, "_upload_part", count)
    monkeypatch.setattr(_plan, "wait", interrupted_wait)
    st = StorageContext(f"s3://{s3_bucket}/ckpt", "exp", "t", memory_budget=BUDGET,
                        max_concurrency=2, storage_options=s3_server.storage_options("s3fs"))
    with pytest.raises(KeyboardInterrupt):
        st.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    total = sum(-(-size // (5 * MiB)) for size in SIZES.values() if size > 5 * MiB)
    assert len(sent) < total  # the queued parts were never sent
    assert _open_uploads(s3_server, s3_bucket) == []
    assert st.committed_checkpoints() == []


def test_default_metadata_reaches_large_files_too(tmp_path, s3_server, s3_bucket) -> None:
    # pyarrow's default_metadata (an ACL a cross-account bucket needs, a
    # content type) is pyarrow's alone: objects written by the s3fs client
    # (a large file's parallel parts) would lack it.
    _tree(tmp_path / "src", SIZES)
    opts = {**s3_server.storage_options("pyarrow"),
            "default_metadata": {"Content-Type": "application/x-checkpoint"}}
    st = StorageContext(f"s3://{s3_bucket}/ckpt", "exp", "t", memory_budget=BUDGET,
                        storage_options=opts)
    ckpt = st.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    raw = _raw_s3fs(s3_server)
    for rel in SIZES:
        key = f"ckpt/exp/t/checkpoint_000000/{rel}"
        head = raw.call_s3("head_object", Bucket=s3_bucket, Key=key)
        assert head["ContentType"] == "application/x-checkpoint", rel
    ckpt.to_directory(str(tmp_path / "back"))


def test_a_pyarrow_filesystem_passed_in_gets_an_s3fs_client_only_where_it_writes_alike(
        s3_server) -> None:
    # pyarrow cannot send one object's parts from several threads; s3fs can,
    # when it reaches the same store as the same user.
    from checkpoint_store._transfer.remote import part_upload_client
    from checkpoint_store.backends.clients import _s3fs_twin_of

    fs = _raw_pyarrow(s3_server, request_timeout=7)
    uploader = part_upload_client(fs)
    assert uploader is not None and uploader.kind is S3Multipart
    twin = uploader.fss
    assert _s3fs_twin_of(fs) is twin  # made once per filesystem
    assert twin.endpoint_url == s3_server.endpoint_url and twin.key == s3_server.access_key_id
    assert twin.config_kwargs["read_timeout"] == 7
    # Anything s3fs would not do the same way keeps pyarrow's stream: the
    # default credential chain, virtual addressing, metadata on every object,
    # a proxy.
    scheme, _, netloc = s3_server.endpoint_url.partition("://")
    for other in (pafs.S3FileSystem(endpoint_override=netloc, scheme=scheme),
                  _raw_pyarrow(s3_server, force_virtual_addressing=True),
                  _raw_pyarrow(s3_server, default_metadata={"Content-Type": "x/y"}),
                  _raw_pyarrow(s3_server, proxy_options="http://127.0.0.1:1")):
        assert part_upload_client(other) is None, other.__reduce__()[1][0]


def test_each_upload_completes_as_its_last_part_is_in(
        tmp_path, monkeypatch, s3_server, s3_bucket) -> None:
    # The store assembles an object at CompleteMultipartUpload (seconds for a
    # large one, answering nothing meanwhile): done while the next file's
    # parts go, not after the last byte of all of them.
    want = _tree(tmp_path / "src", SIZES)
    events = record_part_events(monkeypatch, S3Multipart)
    st = StorageContext(f"s3://{s3_bucket}/ckpt", "exp", "t", memory_budget=BUDGET,
                        max_concurrency=1, storage_options=s3_server.storage_options("s3fs"))
    ckpt = st.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    assert_each_upload_completes_after_its_last_part(events)
    ckpt.to_directory(str(tmp_path / "back"))
    for rel, data in want.items():
        assert (tmp_path / "back" / rel).read_bytes() == data, rel
