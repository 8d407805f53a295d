"""Every transfer feature on every form a location takes: a URI (each
engine), a pyarrow filesystem passed in and an fsspec filesystem passed in
(bare, or in a ``pyarrow.fs.PyFileSystem``), on S3 (moto), Azure (Azurite)
and GCS (the emulator). docs/backends.md has the table these tests hold.

The bytes a client sends are counted by a relay between it and the real
server (tests/backends/relay.py): the second report of a checkpoint with
one file changed sends about that file, whatever the form."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store._transfer.remote import (
    AzureBlocks,
    S3Multipart,
    _client_of,
    _is_async,
    can_stream_ranges,
    part_upload_client,
)
from checkpoint_store.errors import UnsafePathError
from tests.backends.relay import CountingRelay

MiB = 1024 * 1024
#: Eight files of 4 MiB; the second report changes one (same size, new bytes).
FILES, FILE_SIZE, CHANGED = 8, 4 * MiB, "shard_3.bin"
#: Requests and their headers on top of the changed file's bytes (the copies,
#: the claim, manifest and marker): measured under 40 KiB on every form.
OVERHEAD = 512 * 1024
#: Memory budget of every transfer: files above 16 MiB go in parts.
BUDGET = 32 * MiB

#: ``form -> (store, build(server, endpoint URL, place) -> StorageContext kwargs)``.
Form = tuple[str, Callable[[Any, str, str], dict[str, Any]]]


def _s3_uri(engine: str) -> Callable[[Any, str, str], dict[str, Any]]:
    return lambda srv, url, bucket: {
        "storage_path": f"s3://{bucket}/ckpt",
        "storage_options": {**srv.storage_options(engine), "endpoint_url": url}}


def _pyarrow_s3(srv, url: str, bucket: str) -> dict[str, Any]:
    # As a Ray user builds it (allow_delayed_open False, pyarrow's defaults).
    fs = pafs.S3FileSystem(access_key=srv.access_key_id, secret_key=srv.secret_access_key,
                           endpoint_override=url.split("://", 1)[1], scheme="http",
                           region=srv.region)
    return {"storage_path": f"{bucket}/ckpt", "storage_filesystem": fs}


def _s3fs(wrapped: bool) -> Callable[[Any, str, str], dict[str, Any]]:
    def build(srv, url: str, bucket: str) -> dict[str, Any]:
        import s3fs

        fs: Any = s3fs.S3FileSystem(endpoint_url=url, key=srv.access_key_id,
                                    secret=srv.secret_access_key, skip_instance_cache=True)
        if wrapped:
            fs = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
        return {"storage_path": f"{bucket}/ckpt", "storage_filesystem": fs}
    return build


def _azure_conn(srv, url: str) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={srv.account_name};"
            f"AccountKey={srv.account_key};BlobEndpoint={url}/{srv.account_name};")


def _az_uri(engine: str) -> Callable[[Any, str, str], dict[str, Any]]:
    return lambda srv, url, container: {
        "storage_path": f"az://{container}/ckpt",
        "storage_options": {"engine": engine, "connection_string": _azure_conn(srv, url)}}


def _adlfs(srv, url: str, container: str) -> dict[str, Any]:
    import adlfs

    fs = adlfs.AzureBlobFileSystem(connection_string=_azure_conn(srv, url),
                                   skip_instance_cache=True)
    return {"storage_path": f"{container}/ckpt", "storage_filesystem": fs}


def _pyarrow_azure(srv, url: str, container: str) -> dict[str, Any]:
    host = url.split("://", 1)[1]
    # Both authorities, or pyarrow asks the real Azure host about the namespace.
    fs = pafs.AzureFileSystem(account_name=srv.account_name, account_key=srv.account_key,
                              blob_storage_authority=host, blob_storage_scheme="http",
                              dfs_storage_authority=host, dfs_storage_scheme="http")
    return {"storage_path": f"{container}/ckpt", "storage_filesystem": fs}


def _gs_uri(srv, url: str, bucket: str) -> dict[str, Any]:
    return {"storage_path": f"gs://{bucket}/ckpt",
            "storage_options": {**srv.storage_options(), "endpoint_url": url}}


def _gcsfs(srv, url: str, bucket: str) -> dict[str, Any]:
    import gcsfs

    fs = gcsfs.GCSFileSystem(endpoint_url=url, token="anon", project=srv.project,
                             skip_instance_cache=True)
    return {"storage_path": f"{bucket}/ckpt", "storage_filesystem": fs}


FORMS: dict[str, Form] = {
    "s3:// pyarrow engine": ("s3", _s3_uri("pyarrow")),
    "s3:// s3fs engine": ("s3", _s3_uri("s3fs")),
    "pyarrow S3FileSystem": ("s3", _pyarrow_s3),
    "s3fs S3FileSystem": ("s3", _s3fs(wrapped=False)),
    "s3fs in PyFileSystem": ("s3", _s3fs(wrapped=True)),
    "az:// adlfs engine": ("azure", _az_uri("adlfs")),
    "az:// pyarrow engine": ("azure", _az_uri("pyarrow")),
    "adlfs AzureBlobFileSystem": ("azure", _adlfs),
    "pyarrow AzureFileSystem": ("azure", _pyarrow_azure),
    "gs://": ("gcs", _gs_uri),
    "gcsfs GCSFileSystem": ("gcs", _gcsfs),
}

#: What each form does, as docs/backends.md tells it: (incremental uploads,
#: large uploads in parallel parts through, small files batched in one
#: concurrent call, downloads in streamed ranged GETs).
FEATURES: dict[str, tuple[bool, type | None, bool, bool]] = {
    **dict.fromkeys([f for f, (store, _) in FORMS.items() if store == "s3"],
                    (True, S3Multipart, True, True)),
    **dict.fromkeys([f for f, (store, _) in FORMS.items() if store == "azure"],
                    (True, AzureBlocks, True, False)),
    **dict.fromkeys([f for f, (store, _) in FORMS.items() if store == "gcs"],
                    (True, None, True, False)),
}


@pytest.fixture(params=list(FORMS))
def form(request) -> Iterator[tuple[str, StorageContext, CountingRelay]]:
    """``(form name, a StorageContext of that form, the relay its bytes pass)``
    on a fresh bucket or container of the form's store."""
    name = request.param
    store, build = FORMS[name]
    server = request.getfixturevalue(f"{store}_server")
    place = request.getfixturevalue("azure_container" if store == "azure"
                                    else f"{store}_bucket")
    relay = CountingRelay(server.port)
    try:
        yield name, StorageContext(experiment_name="exp", trial_name="t", memory_budget=BUDGET,
                                   **build(server, relay.url, place)), relay
    finally:
        relay.close()


def _write_shards(src) -> None:
    src.mkdir(exist_ok=True)
    for i in range(FILES):
        (src / f"shard_{i}.bin").write_bytes(os.urandom(FILE_SIZE))


def test_second_report_sends_about_the_changed_file(form, tmp_path) -> None:
    name, st, relay = form
    src = tmp_path / "src"
    _write_shards(src)
    st.persist_checkpoint(Checkpoint.from_directory(str(src)), 0, {})
    first = relay.sent
    (src / CHANGED).write_bytes(os.urandom(FILE_SIZE))
    relay.reset()
    second = st.persist_checkpoint(Checkpoint.from_directory(str(src)), 1, {})
    sent = relay.sent
    assert first >= FILES * FILE_SIZE, (name, first)
    assert FILE_SIZE <= sent <= FILE_SIZE + OVERHEAD, (name, sent / MiB)
    # Every file is in the second checkpoint, its checksum verified.
    second.to_directory(str(tmp_path / "back"))
    for i in range(FILES):
        rel = f"shard_{i}.bin"
        assert (tmp_path / "back" / rel).read_bytes() == (src / rel).read_bytes(), rel


def test_every_form_of_a_store_has_its_features(form) -> None:
    name, st, _ = form
    fs = st.backend.filesystem
    client = _client_of(fs)
    uploader = part_upload_client(fs)
    got = (st.backend.capabilities.server_side_copy,
           None if uploader is None else uploader.kind,
           client is not None and _is_async(client),
           can_stream_ranges(client))
    assert got == FEATURES[name]


def test_small_files_download_with_one_request_each(form, tmp_path) -> None:
    # pyarrow's Python API asks an object's size (HEAD, Get Blob Properties)
    # before it reads; the listing already said it. Through an async fsspec
    # client (the one behind the handler, or the twin of a pyarrow
    # filesystem passed in) each small file is one GET, all in flight at once.
    name, st, relay = form
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"small_{i:02d}.bin").write_bytes(os.urandom(1000 + i))
    # small_01 ends in \r: the GCS emulator's own multipart reading kept it
    # one byte short (tests/commit/test_stored_sizes.py).
    (src / "small_01.bin").write_bytes(os.urandom(1000) + b"\r")
    ckpt = st.persist_checkpoint(Checkpoint.from_directory(str(src)), 0, {})
    relay.reset()
    ckpt.to_directory(str(tmp_path / "back"))  # verifies every checksum
    for i in range(12):
        rel = f"small_{i:02d}.bin"
        assert (tmp_path / "back" / rel).read_bytes() == (src / rel).read_bytes(), rel
    per_file = [line for line in relay.requests if b"small_" in line]
    assert FEATURES[name][2]
    # One GET per file and nothing else (a GET the client sent again after
    # a slow answer is the same request line).
    assert all(line.startswith(b"GET ") for line in per_file), per_file
    assert len(set(per_file)) == 12, per_file


def test_small_files_keep_a_question_mark_ending_their_name(form, tmp_path) -> None:
    # adlfs parses a path as a URL: in a batch it wrote "opt?" as "opt" (the
    # Azure pyarrow engine, which stores '?', batched its small files
    # through the adlfs client it deletes with). Where the form's client
    # cannot keep the name at all, it is refused before anything is written.
    name, st, _ = form
    src = tmp_path / "src"
    src.mkdir()
    want = {"opt?": b"question", "opt": b"plain", "a?b.bin": b"inside"}
    for rel, data in want.items():
        (src / rel).write_bytes(data)
    if "?" in st.backend.capabilities.unsupported_name_characters:
        with pytest.raises(UnsafePathError, match=r"holds '\?'"):
            st.persist_checkpoint(Checkpoint.from_directory(str(src)), 0, {})
        assert st.committed_checkpoints() == []
        return
    ckpt = st.persist_checkpoint(Checkpoint.from_directory(str(src)), 0, {})
    ckpt.to_directory(str(tmp_path / "back"))  # verifies every checksum
    for rel, data in want.items():
        assert (tmp_path / "back" / rel).read_bytes() == data, rel


@pytest.mark.parametrize("options", [
    {"account_name": "acct"},  # Azure's default credential chain: pyarrow's alone
    {"account_name": "acct", "client_id": "app", "tenant_id": "t", "client_secret": "s"},
])
def test_a_pyarrow_azure_filesystem_without_a_key_keeps_its_own_client(options) -> None:
    # An adlfs client would authenticate another way than the user's.
    fs = pafs.AzureFileSystem(**options)
    assert _client_of(fs) is None
    assert part_upload_client(fs) is None


def test_a_large_file_downloads_as_the_form_reads_ranges(form, tmp_path) -> None:
    # s3fs streams one ranged GET piece by piece (the pyarrow S3 client
    # passed in, through its s3fs twin, too); adlfs, gcsfs and pyarrow's
    # clients read a range whole, so the file comes in several ranged reads.
    name, st, relay = form
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(24 * MiB + 5)
    (src / "large.bin").write_bytes(data)
    ckpt = st.persist_checkpoint(Checkpoint.from_directory(str(src)), 0, {})
    relay.reset()
    ckpt.to_directory(str(tmp_path / "back"))  # verifies the checksum
    assert (tmp_path / "back" / "large.bin").read_bytes() == data
    gets = [line for line in relay.requests if b"large.bin" in line and b"GET " in line]
    streams = FEATURES[name][3]
    assert (len(gets) == 1) if streams else (len(gets) > 1), gets
