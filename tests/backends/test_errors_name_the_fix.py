"""Errors that name the thing and the fix: a bucket or container that does not
exist, an endpoint where nothing listens, on every cloud backend (real local
servers: moto, Azurite, the GCS emulator)."""

from __future__ import annotations

import socket
import tempfile
import time

import pytest

from checkpoint_store import Checkpoint, StorageContext, session
from checkpoint_store._util import retry
from checkpoint_store.errors import (
    CheckpointNotFoundError,
    PermanentBackendError,
    StorageUnreachableError,
    TransientBackendError,
)
from tests.cli.cli_helpers import invoke


def _closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _report_one(storage_path: str, options: dict) -> None:
    with session.start(storage_path=storage_path, experiment_name="e", trial_name="t",
                       storage_options=options):
        with tempfile.TemporaryDirectory() as tmp:
            with open(f"{tmp}/model.bin", "wb") as f:
                f.write(b"w")
            session.report({"loss": 1.0}, checkpoint=Checkpoint.from_directory(tmp))


def _options(backend: str, request: pytest.FixtureRequest) -> dict:
    return request.getfixturevalue(f"{backend}_server").storage_options()


_SCHEME = {"s3": "s3", "azure": "az", "gcs": "gs"}
_WORD = {"s3": "bucket", "azure": "container", "gcs": "bucket"}


@pytest.mark.parametrize("backend", ["s3", "azure", "gcs"])
def test_a_missing_bucket_is_named_with_how_to_create_it(backend, request, tmp_path) -> None:
    options = _options(backend, request)
    uri = f"{_SCHEME[backend]}://nosuchbucket/runs"
    # A session start writes nothing and names the bucket, not a key in it.
    with pytest.raises(PermanentBackendError) as err:
        _report_one(uri, options)
    message = str(err.value)
    assert f"the {_WORD[backend]} 'nosuchbucket' of {uri} does not exist" in message
    assert "create it" in message
    # The command line says the same of a read.
    args = ["ls", f"{uri}/e/t"] + [a for k, v in options.items() for a in ("-o", f"{k}={v}")]
    res = invoke(args)
    assert res.exit_code != 0
    assert f"the {_WORD[backend]} 'nosuchbucket' of {uri}/e/t does not exist" in res.stderr
    assert "create it" in res.stderr


def test_a_missing_path_in_a_bucket_that_exists_stays_nothing_exists(s3_location) -> None:
    res = invoke(["ls", f"{s3_location.uri}/no/such/trial"]
                 + [a for k, v in s3_location.storage_options.items()
                    for a in ("-o", f"{k}={v}")])
    assert res.exit_code != 0
    assert "nothing exists at" in res.stderr and "does not exist" not in res.stderr


def _dead_endpoint_options(backend: str, port: int) -> dict:
    if backend == "s3":
        return {"endpoint_url": f"http://127.0.0.1:{port}", "access_key_id": "x",
                "secret_access_key": "y", "region": "us-east-1"}
    if backend == "azure":
        from checkpoint_store.testing.servers import AZURITE_ACCOUNT, AZURITE_KEY

        return {"connection_string": (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};")}
    return {"endpoint_url": f"http://127.0.0.1:{port}", "token": "anon"}


@pytest.mark.parametrize("backend", ["s3", "azure", "gcs"])
def test_a_closed_port_fails_fast_as_cannot_connect(backend) -> None:
    port = _closed_port()
    options = _dead_endpoint_options(backend, port)
    started = time.monotonic()
    with pytest.raises(StorageUnreachableError) as err:
        _report_one(f"{_SCHEME[backend]}://b/runs", options)
    took = time.monotonic() - started
    assert str(err.value).startswith(f"cannot connect to 127.0.0.1:{port}"), str(err.value)
    assert err.value.endpoint == f"127.0.0.1:{port}"
    assert "throttl" not in str(err.value)
    # It is still a TransientBackendError for callers that catch those.
    assert isinstance(err.value, TransientBackendError)
    # Seconds, not minutes: two quick tries (the engines' own connect retries aside).
    assert took < 10, took
    # A read through another StorageContext: the same typed error.
    started = time.monotonic()
    with pytest.raises(StorageUnreachableError, match=f"cannot connect to 127.0.0.1:{port}"):
        StorageContext(f"{_SCHEME[backend]}://b/runs", "e", "t",
                       storage_options=options).committed_checkpoints()
    assert time.monotonic() - started < 10


def test_a_refused_connection_is_tried_twice_then_the_store_fails_at_once() -> None:
    calls = []
    store = object.__new__(type("Store", (), {}))

    def refuse() -> None:
        calls.append(time.monotonic())
        raise ConnectionRefusedError(111, "Connection refused")

    policy = retry.RetryPolicy(attempts=5)
    with pytest.raises(StorageUnreachableError, match="cannot connect to the storage endpoint"):
        retry.call(refuse, policy=policy, store=store, what="probe")
    assert len(calls) == 2 and calls[1] - calls[0] < 1
    # The next call to that store is not tried at all, and says why.
    with pytest.raises(StorageUnreachableError, match="cannot connect"):
        retry.call(refuse, policy=policy, store=store, what="probe again")
    assert len(calls) == 2
    retry._breaker.close(store)


@pytest.mark.parametrize(("message", "kind", "endpoint"), [
    ("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 7, Could not "
     "connect to server; Details: Failed to connect to minio.local port 9000 after 3 ms",
     "unreachable", "minio.local:9000"),
    ('Could not connect to the endpoint URL: "http://127.0.0.1:9/b?list-type=2"',
     "unreachable", "http://127.0.0.1:9"),
    ("Cannot connect to host storage.example:443 ssl:default [Name or service not known]",
     "unreachable", "storage.example:443"),
    ("curlCode: 6, Could not resolve host: s3.us-eest-1.amazonaws.com", "unreachable",
     "s3.us-eest-1.amazonaws.com"),
    ("Connection reset by peer", "transient", None),
    ("503 Slow Down", "transient", None),
])
def test_refused_and_unresolved_are_told_apart_from_throttling(message, kind,
                                                               endpoint) -> None:
    exc = ConnectionError(message)
    assert retry.classify(exc) == kind
    if endpoint is not None:
        assert retry.unreachable_endpoint(exc) == endpoint


def test_a_write_into_a_missing_bucket_names_it() -> None:
    raw = OSError("When uploading object with key 'x/m' in bucket 'gone': AWS Error "
                  "NO_SUCH_BUCKET during PutObject operation: The specified bucket does not "
                  "exist")
    typed = retry.typed_permanent(raw, "upload s3://gone/x/m")
    assert isinstance(typed, PermanentBackendError)
    assert "the bucket 'gone' does not exist" in str(typed) and "Create it" in str(typed)


def test_checkpoint_not_found_is_still_raised_for_local_paths(tmp_path) -> None:
    res = invoke(["ls", str(tmp_path / "absent")])
    assert res.exit_code != 0 and "nothing exists at" in res.stderr
    assert not issubclass(CheckpointNotFoundError, PermanentBackendError)
