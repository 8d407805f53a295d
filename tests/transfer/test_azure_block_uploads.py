"""Large files uploaded to Azure Blob in parallel staged blocks (issue 17),
the Azure side of tests/transfer/test_part_uploads.py: each part is staged
as a block (Put Block) from any worker, and one Put Block List commits
them in order, against the real Azurite server. Checked for the blocks
the blob is made of, correct bytes, checksums, commits and no blob left
behind by a failed upload (not for speed)."""

from __future__ import annotations

import errno
import threading

import adlfs
import pyarrow.fs as pafs
import pytest
from azure.storage.blob import BlobServiceClient

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store._transfer.remote import AzureBlocks, PartUploader, part_upload_client
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

HOWS = ["adlfs engine", "pyarrow engine", "adlfs filesystem passed",
        "pyarrow filesystem passed"]
PREFIX = "ckpt/exp/t/checkpoint_000000/"


def _adlfs(azure_server) -> adlfs.AzureBlobFileSystem:
    return adlfs.AzureBlobFileSystem(connection_string=azure_server.connection_string,
                                     skip_instance_cache=True)


def _pyarrow_azure(azure_server) -> pafs.AzureFileSystem:
    """What a user passes in: pyarrow's client on the account and its key."""
    host = azure_server.endpoint_url.split("://", 1)[1]
    return pafs.AzureFileSystem(
        account_name=azure_server.account_name, account_key=azure_server.account_key,
        blob_storage_authority=host, blob_storage_scheme="http",
        dfs_storage_authority=host, dfs_storage_scheme="http")


def _storage(how: str, azure_server, container: str, **kw) -> StorageContext:
    if how.endswith("filesystem passed"):
        fs = _adlfs(azure_server) if how.startswith("adlfs") else _pyarrow_azure(azure_server)
        return StorageContext(f"{container}/ckpt", "exp", "t", memory_budget=BUDGET,
                              storage_filesystem=fs, **kw)
    engine = how.split()[0]
    return StorageContext(f"az://{container}/ckpt", "exp", "t", memory_budget=BUDGET,
                          storage_options=azure_server.storage_options(engine), **kw)


def _committed_blocks(azure_server, container: str, blob: str) -> list[int]:
    """Sizes of the committed blocks the blob is made of, in order."""
    with BlobServiceClient.from_connection_string(azure_server.connection_string) as svc:
        committed, _ = svc.get_blob_client(container, blob).get_block_list("committed")
    return [b.size for b in committed]


class _PartSpy:
    """Records ``(blob basename, part number, size)`` of every block staged (they still go)."""

    def __init__(self, monkeypatch) -> None:
        self.parts: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()
        real = AzureBlocks.put_part

        def spy(upload: AzureBlocks, number: int, data) -> None:
            real(upload, number, data)
            with self._lock:
                self.parts.append((upload._blob.rsplit("/", 1)[-1], number, len(data)))

        monkeypatch.setattr(AzureBlocks, "put_part", spy)


@pytest.mark.parametrize("how", HOWS)
def test_every_engine_picks_staged_blocks(azure_server, azure_container, how) -> None:
    st = _storage(how, azure_server, azure_container)
    uploader = part_upload_client(st.backend.filesystem)
    assert isinstance(uploader, PartUploader) and uploader.kind is AzureBlocks


@pytest.mark.parametrize("how, blob", [
    ("adlfs engine", "x/a b?"),  # the engine refuses such names; pyarrow writes its bytes
    ("pyarrow engine", "x/a b?"),
    ("adlfs filesystem passed", "x/a b"),  # as adlfs's own writes and reads spell it
    ("pyarrow filesystem passed", "x/a b?"),
])
def test_blocks_name_the_blob_as_the_backends_writer_does(
        azure_server, azure_container, how, blob) -> None:
    st = _storage(how, azure_server, azure_container)
    uploader = part_upload_client(st.backend.filesystem)
    assert uploader is not None
    up = uploader.open(f"{azure_container}/x/a b?")
    assert (up._container, up._blob) == (azure_container, blob)


@pytest.mark.parametrize("how", HOWS)
def test_large_files_go_up_in_parallel_blocks_and_verify(
        tmp_path, monkeypatch, azure_server, azure_container, how) -> None:
    want = _tree(tmp_path / "src", SIZES)
    spy = _PartSpy(monkeypatch)
    st = _storage(how, azure_server, azure_container)
    ckpt = st.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    # Both large files in 5 MiB blocks numbered from 1; the small file in one PUT.
    for name in ("model.bin", "optim.bin"):
        sizes = sorted((n, size) for key, n, size in spy.parts if key == name)
        assert [n for n, _ in sizes] == list(range(1, len(sizes) + 1)), name
        assert sum(size for _, size in sizes) == SIZES[name]
        assert all(size == 5 * MiB for _, size in sizes[:-1])
        # The blob is exactly those blocks, in part order.
        assert _committed_blocks(azure_server, azure_container, PREFIX + name) == [
            size for _, size in sizes]
    assert not [p for p in spy.parts if p[0] == "meta.json"]
    ckpt.to_directory(str(tmp_path / "back"))  # verifies every checksum
    for rel, data in want.items():
        assert (tmp_path / "back" / rel).read_bytes() == data, rel


#: Large files whose names adlfs's URL parsing could change; each engine
#: stores its own set (see _UNSUPPORTED_NAME_CHARACTERS of the backend).
NAMES = {
    "adlfs engine": ["big file ü.bin", "sub dir/a+b%20c;d=e&f.bin"],
    "pyarrow engine": ["big file ü.bin", "sub dir/a+b%20c.bin", "ends in?"],
    "adlfs filesystem passed": ["big file ü.bin", "sub dir/a+b%20c;d=e&f.bin"],
    "pyarrow filesystem passed": ["big file ü.bin", "sub dir/a+b%20c;d=e&f.bin", "ends in?",
                                  "ends in#"],
}


@pytest.mark.parametrize("how", HOWS)
def test_names_with_spaces_and_url_characters_land_where_the_backend_reads(
        tmp_path, monkeypatch, azure_server, azure_container, how) -> None:
    sizes = {name: 17 * MiB + i for i, name in enumerate(NAMES[how])}
    want = _tree(tmp_path / "src", sizes)
    spy = _PartSpy(monkeypatch)
    st = _storage(how, azure_server, azure_container)
    ckpt = st.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    assert {key for key, _, _ in spy.parts} == {n.rsplit("/", 1)[-1] for n in sizes}
    blobs = azure_server.list_blobs(azure_container)
    for name, size in sizes.items():
        assert blobs.get(PREFIX + name) == size, (name, sorted(blobs))
    ckpt.to_directory(str(tmp_path / "back"))
    for rel, data in want.items():
        assert (tmp_path / "back" / rel).read_bytes() == data, rel


@pytest.mark.parametrize("how", HOWS)
def test_a_block_failing_commits_nothing_and_leaves_no_blob(
        tmp_path, monkeypatch, azure_server, azure_container, how) -> None:
    _tree(tmp_path / "src", SIZES)
    # Some blocks of both files are staged, then a permanent error.
    fail_parts_after(monkeypatch, 3, DENIED)
    spy = _PartSpy(monkeypatch)
    st = _storage(how, azure_server, azure_container)
    with pytest.raises(OSError, match="injected"):
        st.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    assert len(spy.parts) == 3
    assert st.committed_checkpoints() == []
    # Staged blocks are not a blob: nothing of the large files is listed or found.
    assert not [k for k in azure_server.list_blobs(azure_container) if k.endswith(".bin")]
    with BlobServiceClient.from_connection_string(azure_server.connection_string) as svc:
        staged = [b.name for b in svc.get_container_client(azure_container).list_blobs(
            include=["uncommittedblobs"]) if b.name.endswith(".bin")]
    assert staged  # blocks went up ...
    fss = _adlfs(azure_server)
    assert not [name for name in staged if fss.exists(f"{azure_container}/{name}")]  # ... no blob


def test_a_block_failing_once_is_staged_again_and_the_blob_verifies(
        tmp_path, monkeypatch, azure_server, azure_container) -> None:
    want = _tree(tmp_path / "src", SIZES)
    reset = ConnectionResetError(errno.ECONNRESET, "injected: connection reset")
    calls = fail_parts_after(monkeypatch, 2, reset)
    st = _storage("adlfs engine", azure_server, azure_container)
    ckpt = st.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    parts = sum(-(-size // (5 * MiB)) for size in SIZES.values() if size > 5 * MiB)
    assert calls[0] == 2 * parts - 2  # every part after the second was sent twice
    ckpt.to_directory(str(tmp_path / "back"))
    for rel, data in want.items():
        assert (tmp_path / "back" / rel).read_bytes() == data, rel


def test_a_source_changing_between_blocks_fails_the_upload(
        tmp_path, monkeypatch, azure_server, azure_container) -> None:
    src = tmp_path / "src"
    _tree(src, SIZES)
    done = rewrite_between_parts(src, monkeypatch)
    st = _storage("pyarrow engine", azure_server, azure_container)
    with pytest.raises(OSError, match="changed while it was being"):
        st.persist_checkpoint(Checkpoint.from_directory(str(src)), 0, {})
    assert done.is_set()
    assert st.committed_checkpoints() == []
    assert not [k for k in azure_server.list_blobs(azure_container) if k.endswith(".bin")]


def test_two_writers_of_one_blob_never_mix_their_blocks(azure_server, azure_container) -> None:
    # Azure keeps a blob's uncommitted blocks by id, whoever staged them: ids
    # from the part number alone would let the second writer's part 1 into
    # the first writer's blob.
    fss = _adlfs(azure_server)
    path = f"{azure_container}/x/blob.bin"
    a, b = AzureBlocks(fss, path), AzureBlocks(fss, path)
    a.start()
    b.start()
    a.put_part(1, b"a1" * 1000)
    b.put_part(1, b"b1" * 1000)
    a.put_part(2, b"a2")
    b.put_part(2, b"b2")
    a.complete(2)
    assert fss.cat_file(path) == b"a1" * 1000 + b"a2"
    # The commit dropped the other writer's staged blocks (Azure and Azurite alike).
    with BlobServiceClient.from_connection_string(azure_server.connection_string) as svc:
        committed, uncommitted = svc.get_blob_client(azure_container,
                                                     "x/blob.bin").get_block_list("all")
    assert [blk.size for blk in committed] == [2000, 2] and uncommitted == []


def test_a_missing_container_is_file_not_found(azure_server) -> None:
    up = AzureBlocks(_adlfs(azure_server), "no-such-container/x.bin")
    up.start()
    with pytest.raises(FileNotFoundError, match="az://no-such-container/x.bin"):
        up.put_part(1, b"x")
    with pytest.raises(OSError, match=r"parts \[1\] were not staged"):
        up.complete(1)


@pytest.mark.parametrize("status, kind, retry", [
    (503, ConnectionError, "transient"), (429, ConnectionError, "transient"),
    (403, PermissionError, "permanent"), (400, OSError, "permanent")])
def test_azure_errors_become_oserrors_the_retry_policy_tells_apart(status, kind, retry) -> None:
    from azure.core.exceptions import HttpResponseError

    from checkpoint_store._transfer.remote import _azure_os_error
    from checkpoint_store._util.retry import classify

    exc = HttpResponseError(message="The server said no.\nRequestId:abc")
    exc.status_code = status
    got = _azure_os_error(exc, "az://c/b")
    assert type(got) is kind
    assert "az://c/b: HttpResponseError: The server said no." in str(got)
    assert f"HTTP {status}" in str(got) and "RequestId" not in str(got)
    assert classify(got) == retry


def test_each_blob_is_committed_as_its_last_block_is_in(
        tmp_path, monkeypatch, azure_server, azure_container) -> None:
    want = _tree(tmp_path / "src", SIZES)
    events = record_part_events(monkeypatch, AzureBlocks)
    st = _storage("adlfs engine", azure_server, azure_container, max_concurrency=1)
    ckpt = st.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    assert_each_upload_completes_after_its_last_part(events)
    ckpt.to_directory(str(tmp_path / "back"))
    for rel, data in want.items():
        assert (tmp_path / "back" / rel).read_bytes() == data, rel
