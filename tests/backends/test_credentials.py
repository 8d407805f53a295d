"""Where each plugin finds its endpoint and credentials: options, then standard variables."""

from __future__ import annotations

import datetime

import pytest

from checkpoint_store import InvalidConfigError, StorageContext
from checkpoint_store.registry import resolve


def _write_read(uri: str, options=None) -> bytes:
    ctx = StorageContext(uri, "e", "t", storage_options=options)
    ctx.write_params({"ok": True})
    return ctx.filesystem.open_input_stream(ctx.trial_path + "/params.json").read()


def test_s3_options_win_over_environment(s3_server, s3_bucket, monkeypatch):
    # Wrong values in the environment; the options are complete and must be used.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert b"ok" in _write_read(f"s3://{s3_bucket}/x", s3_server.storage_options())


def test_s3_endpoint_from_aws_endpoint_url_s3(s3_server, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")   # the S3-specific one wins
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    opts = {"access_key_id": s3_server.access_key_id,
            "secret_access_key": s3_server.secret_access_key}
    assert b"ok" in _write_read(f"s3a://{s3_bucket}/x", opts)


@pytest.mark.parametrize("alias", [{"key": "k", "secret": "s"},
                                   {"aws_access_key_id": "k", "aws_secret_access_key": "s"}])
def test_s3_option_aliases(alias, s3_server, s3_bucket):
    opts = {"endpoint_url": s3_server.endpoint_url, **alias}
    assert b"ok" in _write_read(f"s3://{s3_bucket}/x", opts)   # moto accepts any key pair


def test_s3_conflicting_aliases_are_refused():
    with pytest.raises(InvalidConfigError, match="given twice"):
        resolve("s3://b/x", storage_options={"key": "a", "access_key_id": "b", "secret": "s",
                                             "endpoint_url": "http://127.0.0.1:9"})


def test_azure_connection_string_from_environment(azure_env, azure_container):
    assert b"ok" in _write_read(f"az://{azure_container}/x")


def test_azure_sas_token(azure_server, azure_container):
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    sas = generate_container_sas(
        azure_server.account_name, azure_container, account_key=azure_server.account_key,
        permission=ContainerSasPermissions(read=True, write=True, delete=True, list=True),
        expiry=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1),
    )
    conn = (f"BlobEndpoint={azure_server.blob_endpoint};SharedAccessSignature={sas}")
    assert b"ok" in _write_read(f"az://{azure_container}/x", {"connection_string": conn})


def test_azure_connection_string_option_is_not_mixed_with_environment(
    azure_server, azure_container, monkeypatch
):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "someotheraccount")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "c29tZW90aGVya2V5")
    assert b"ok" in _write_read(f"az://{azure_container}/x", azure_server.storage_options())


def test_gcs_emulator_host_from_environment(gcs_env, gcs_bucket):
    assert b"ok" in _write_read(f"gs://{gcs_bucket}/x")


def test_gcs_rejects_a_malformed_endpoint():
    with pytest.raises(InvalidConfigError, match="not http"):
        resolve("gs://b/x", storage_options={"endpoint_url": "127.0.0.1:1"})


def test_s3_rebuild_reads_the_environment_again(s3_server, s3_bucket, monkeypatch):
    """After credentials expire the filesystem is rebuilt; it must pick up what
    the environment holds now, not what it held at first resolution."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    opts = {"access_key_id": s3_server.access_key_id,
            "secret_access_key": s3_server.secret_access_key}
    backend, path = resolve(f"s3://{s3_bucket}/x", storage_options=opts)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    fresh = backend.rebuild()
    with fresh.open_output_stream(path + "/f") as f:
        f.write(b"data")
    assert s3_server.list_keys(s3_bucket) == {"x/f": 4}


def test_azure_rebuild_reads_the_environment_again(azure_server, azure_container, monkeypatch):
    stale = azure_server.connection_string.replace(str(azure_server.port), "9")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", stale)
    backend, path = resolve(f"az://{azure_container}/x")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_server.connection_string)
    fresh = backend.rebuild()
    with fresh.open_output_stream(path + "/f") as f:
        f.write(b"data")
    assert azure_server.list_blobs(azure_container) == {"x/f": 4}
