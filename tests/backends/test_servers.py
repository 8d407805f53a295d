"""The server fixtures themselves: loopback only, fresh buckets, stopped at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pyarrow.fs as pafs
import pytest

from checkpoint_store import StorageContext
from checkpoint_store.testing.servers import S3Server


def _roundtrip(uri: str, options: dict) -> int:
    """Write params.json through the backend; return its size read back."""
    ctx = StorageContext(uri, "exp", "trial", storage_options=options)
    ctx.write_params({"lr": 0.1})
    raw = ctx.filesystem.open_input_stream(ctx.trial_path + "/params.json").read()
    assert b"0.1" in raw
    return len(raw)


def test_s3_server_on_loopback_and_fresh_bucket(s3_server, s3_bucket, s3_location):
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")
    assert s3_location.uri == f"s3://{s3_bucket}/ckpt"
    assert s3_server.list_keys(s3_bucket) == {}
    size = _roundtrip(s3_location.uri, s3_location.storage_options)
    assert s3_server.list_keys(s3_bucket) == {"ckpt/exp/trial/params.json": size}


def test_each_test_gets_its_own_bucket(s3_bucket, s3_server):
    # The previous test wrote into its bucket; this one is empty.
    assert s3_server.list_keys(s3_bucket) == {}


def test_s3_env_fixture_sets_standard_variables(s3_env, s3_bucket):
    assert os.environ["AWS_ENDPOINT_URL"] == s3_env["AWS_ENDPOINT_URL"]
    # No storage_options: everything comes from the AWS_* variables.
    _roundtrip(f"s3://{s3_bucket}/from-env", {})


def test_s3_env_reaches_a_child_process(s3_location, s3_bucket, s3_server):
    code = textwrap.dedent(
        f"""
        from checkpoint_store import StorageContext
        ctx = StorageContext("s3://{s3_bucket}/child", "e", "t")
        ctx.write_params({{"from": "child"}})
        """
    )
    env = {**os.environ, **s3_location.env}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert "child/e/t/params.json" in s3_server.list_keys(s3_bucket)


def test_server_stops_and_frees_its_port():
    server = S3Server.start()
    port, proc = server.port, server.process
    assert proc is not None and proc.poll() is None
    server.stop()
    assert proc.poll() is not None
    # Nothing answers on the port any more.
    fs = pafs.S3FileSystem(
        endpoint_override=f"127.0.0.1:{port}", scheme="http", access_key="a", secret_key="b",
        region="us-east-1", connect_timeout=0.5, request_timeout=0.5,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
    )
    try:
        fs.get_file_info("bucket/x")
    except OSError:
        pass
    else:
        raise AssertionError("the stopped server still answered")


def test_azure_fixture(azure_server, azure_container, azure_location):
    assert azure_server.endpoint_url.startswith("http://127.0.0.1:")
    assert azure_location.uri == f"az://{azure_container}/ckpt"
    size = _roundtrip(azure_location.uri, azure_location.storage_options)
    assert azure_server.list_blobs(azure_container) == {"ckpt/exp/trial/params.json": size}


def test_gcs_fixture(gcs_server, gcs_bucket, gcs_location):
    assert gcs_server.endpoint_url.startswith("http://127.0.0.1:")
    size = _roundtrip(gcs_location.uri, gcs_location.storage_options)
    assert gcs_server.list_objects(gcs_bucket) == {"ckpt/exp/trial/params.json": size}


def _run_pytest_with(tmp_path, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    (tmp_path / "test_needs_azure.py").write_text(
        "def test_uses_azure(azure_server):\n    pass\n", encoding="utf-8"
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         str(tmp_path / "test_needs_azure.py")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )


@pytest.mark.slow  # two pytest subprocesses
def test_missing_server_skips_outside_ci_and_fails_in_ci(tmp_path):
    missing = {"AZURITE_BLOB": str(tmp_path / "no-such-azurite-blob")}
    local = _run_pytest_with(tmp_path, missing)
    assert local.returncode == 0, local.stdout[-2000:]
    assert "1 skipped" in local.stdout and "could not start" in local.stdout
    ci = _run_pytest_with(tmp_path, {**missing, "CI": "true"})
    assert ci.returncode == 1, ci.stdout[-2000:]
    assert "1 error" in ci.stdout and "CI=true" in ci.stdout


@pytest.mark.parametrize("eol", [b"\r\n", b"\n"], ids=["crlf", "lf"])
@pytest.mark.parametrize("data", [b"", b"x", b"x\r", b"\r\n", b"x\n", b"\r\r", b"--b\r"],
                         ids=repr)
def test_the_gcs_emulator_reads_a_multipart_upload_byte_exact(eol, data):
    # Google's clients frame a multipart upload with CRLF (RFC 2046), gcsfs
    # with a bare LF; the object's bytes are the second part's, whatever they end in.
    from checkpoint_store.testing.gcs_emulator import split_related

    b = b"--==0=="
    body = (b + eol + b"Content-Type: application/json" + eol + eol + b'{"name": "o"}'
            + eol + b + eol + b"Content-Type: application/x-bytes" + eol + eol + data
            + eol + b + b"--")
    (meta_headers, meta), (headers, content) = split_related(
        body, 'multipart/related; boundary="==0=="')
    assert meta == b'{"name": "o"}' and meta_headers == {"content-type": "application/json"}
    assert headers == {"content-type": "application/x-bytes"}
    assert content == data


def test_the_gcs_emulator_refuses_a_body_without_its_boundary():
    from checkpoint_store.testing.gcs_emulator import split_related

    with pytest.raises(ValueError, match="boundary"):
        split_related(b"--x\ndata", "multipart/related")
    with pytest.raises(ValueError, match="closing"):
        split_related(b"--x\nContent-Type: a\n\ndata", "multipart/related; boundary=x")


def test_gcs_fixture_keeps_an_object_ending_in_cr(gcs_server, gcs_bucket):
    # Through gcsfs, which frames its simple uploads with a bare LF.
    import gcsfs

    fs = gcsfs.GCSFileSystem(**gcs_server.storage_options())
    fs.pipe_file(f"{gcs_bucket}/cr", b"x" * 10 + b"\r")
    assert fs.cat_file(f"{gcs_bucket}/cr") == b"x" * 10 + b"\r"
    assert gcs_server.list_objects(gcs_bucket) == {"cr": 11}
