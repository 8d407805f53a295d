"""load_state on object stores: every location form (a URI, a pyarrow
filesystem, an fsspec filesystem) reads the same tree, and a partial load
sends requests for only the asked tensors' byte ranges plus the metadata,
counted by a relay between the client and the real server (moto, Azurite,
the GCS emulator)."""

from __future__ import annotations

import os
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store.errors import TensorCorruptError
from checkpoint_store.state import STATE_FILE, write_state
from checkpoint_store.testing import strategies as cst
from tests.backends.relay import CountingRelay

KiB, MiB = 1024, 1024 * 1024


def _s3_uri(engine: str):
    return lambda srv, url, bucket: {
        "storage_path": f"s3://{bucket}/ckpt",
        "storage_options": {**srv.storage_options(engine), "endpoint_url": url}}


def _pyarrow_s3(srv, url: str, bucket: str) -> dict[str, Any]:
    fs = pafs.S3FileSystem(access_key=srv.access_key_id, secret_key=srv.secret_access_key,
                           endpoint_override=url.split("://", 1)[1], scheme="http",
                           region=srv.region)
    return {"storage_path": f"{bucket}/ckpt", "storage_filesystem": fs}


def _s3fs(wrapped: bool):
    def build(srv, url: str, bucket: str) -> dict[str, Any]:
        import s3fs

        fs: Any = s3fs.S3FileSystem(endpoint_url=url, key=srv.access_key_id,
                                    secret=srv.secret_access_key, skip_instance_cache=True)
        if wrapped:
            fs = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
        return {"storage_path": f"{bucket}/ckpt", "storage_filesystem": fs}
    return build


def _az_uri(srv, url: str, container: str) -> dict[str, Any]:
    conn = (f"DefaultEndpointsProtocol=http;AccountName={srv.account_name};"
            f"AccountKey={srv.account_key};BlobEndpoint={url}/{srv.account_name};")
    return {"storage_path": f"az://{container}/ckpt",
            "storage_options": {"engine": "adlfs", "connection_string": conn}}


def _adlfs(srv, url: str, container: str) -> dict[str, Any]:
    import adlfs

    fs = adlfs.AzureBlobFileSystem(connection_string=_az_uri(srv, url, container)[
        "storage_options"]["connection_string"], skip_instance_cache=True)
    return {"storage_path": f"{container}/ckpt", "storage_filesystem": fs}


def _pyarrow_azure(srv, url: str, container: str) -> dict[str, Any]:
    host = url.split("://", 1)[1]
    fs = pafs.AzureFileSystem(account_name=srv.account_name, account_key=srv.account_key,
                              blob_storage_authority=host, blob_storage_scheme="http",
                              dfs_storage_authority=host, dfs_storage_scheme="http")
    return {"storage_path": f"{container}/ckpt", "storage_filesystem": fs}


def _gcsfs(srv, url: str, bucket: str) -> dict[str, Any]:
    import gcsfs

    fs = gcsfs.GCSFileSystem(endpoint_url=url, token="anon", project=srv.project,
                             skip_instance_cache=True)
    return {"storage_path": f"{bucket}/ckpt", "storage_filesystem": fs}


def _gs_uri(srv, url: str, bucket: str) -> dict[str, Any]:
    return {"storage_path": f"gs://{bucket}/ckpt",
            "storage_options": {**srv.storage_options(), "endpoint_url": url}}


FORMS = {
    "s3:// pyarrow engine": ("s3", _s3_uri("pyarrow")),
    "s3:// s3fs engine": ("s3", _s3_uri("s3fs")),
    "pyarrow S3FileSystem": ("s3", _pyarrow_s3),
    "s3fs S3FileSystem": ("s3", _s3fs(wrapped=False)),
    "s3fs in PyFileSystem": ("s3", _s3fs(wrapped=True)),
    "az:// adlfs engine": ("azure", _az_uri),
    "adlfs AzureBlobFileSystem": ("azure", _adlfs),
    "pyarrow AzureFileSystem": ("azure", _pyarrow_azure),
    "gs://": ("gcs", _gs_uri),
    "gcsfs GCSFileSystem": ("gcs", _gcsfs),
}


@pytest.fixture(params=list(FORMS))
def form(request):
    name = request.param
    store, build = FORMS[name]
    server = request.getfixturevalue(f"{store}_server")
    place = request.getfixturevalue("azure_container" if store == "azure"
                                    else f"{store}_bucket")
    relay = CountingRelay(server.port)
    try:
        yield name, StorageContext(experiment_name="exp", trial_name="t",
                                   **build(server, relay.url, place)), relay
    finally:
        relay.close()


def _state(n: int = 20, numel: int = 64 * KiB) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {"model": {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)},
            "step": 11, "note": "ok"}


def _persist(ctx, tmp_path, tree, **kw):
    src = tmp_path / "src"
    tensors = write_state(tree, src, **kw)
    return ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {"tensors": tensors})


def test_every_location_form_loads_the_state_and_ranges_only(form, tmp_path) -> None:
    name, ctx, relay = form
    # 20 tensors of 256 KiB in two shards; ask for 2 of them (10 %).
    tree = _state()
    ck = _persist(ctx, tmp_path, tree, shard_bytes=3 * MiB)
    assert cst.same_state(ck.load_state(), tree), name
    asked = ["model/layer3.weight", "model/layer16.weight"]
    asked_bytes = sum(tree["model"][k.split("/")[1]].nbytes for k in asked)
    metadata = (os.path.getsize(tmp_path / "src" / STATE_FILE)
                + len(ctx.filesystem.open_input_file(
                    f"{ck.path}/.internal_metadata.json").readall()))
    relay.reset()
    part = ck.load_state(asked)
    got = relay.received
    assert list(part["model"]) == ["layer3.weight", "layer16.weight"]
    for k in part["model"]:
        assert cst.same_state(part["model"][k], tree["model"][k])
    # Headers and the listing on top: a few KiB per request, far below 10 %.
    assert got <= 1.1 * asked_bytes + metadata + 64 * KiB, (name, got, asked_bytes)
    assert got >= asked_bytes, (name, got)


def test_a_damaged_tensor_on_s3_is_named(s3_location, tmp_path) -> None:
    ctx = StorageContext(s3_location.uri, "exp", "t", storage_options=s3_location.storage_options)
    tree = {"a": torch.zeros(1000), "b": torch.ones(1000)}
    ck = _persist(ctx, tmp_path, tree)
    e = ck.internal_metadata["tensors"]["b"]
    fs = ctx.filesystem
    path = f"{ck.path}/{e['file']}"
    raw = bytearray(fs.open_input_file(path).readall())
    raw[e["offsets"][0] + 5] ^= 1
    with fs.open_output_stream(path) as f:
        f.write(bytes(raw))
    with pytest.raises(TensorCorruptError) as err:
        ck.load_state()
    assert err.value.tensor == "b"
    with pytest.raises(TensorCorruptError) as err2:
        ck.verify()
    assert err2.value.tensor == "b"
    assert torch.equal(ck.load_state("a")["a"], tree["a"])


def test_large_tensors_are_read_in_parallel_parts(s3_location, tmp_path, monkeypatch) -> None:
    from checkpoint_store.state import _fetch

    monkeypatch.setattr(_fetch, "PART_BYTES", 1 * MiB)
    ctx = StorageContext(s3_location.uri, "exp", "t", storage_options=s3_location.storage_options)
    tree = {"big": torch.randn(5 * MiB // 4 + 3), "small": torch.arange(3)}
    ck = _persist(ctx, tmp_path, tree)
    assert cst.same_state(ck.load_state(), tree)


def test_memory_store_and_into(tmp_path) -> None:
    ctx = StorageContext("memory://state-remote", "exp", "t")
    tree = _state(4, 1000)
    ck = _persist(ctx, tmp_path, tree)
    target = {f"layer{i}.weight": torch.zeros(1000) for i in range(4)}
    ck.load_state(into={"model": target})
    for k, v in target.items():
        assert torch.equal(v, tree["model"][k])
