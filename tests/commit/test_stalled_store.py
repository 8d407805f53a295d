"""A store that stops answering: reports and the end of a session fail in bounded time."""

from __future__ import annotations

import time

import pytest
from _commit_helpers import make_source

from checkpoint_store import Checkpoint, CheckpointConfig, session
from checkpoint_store._util import retry as _retry
from checkpoint_store.errors import InvalidConfigError, TransientBackendError
from checkpoint_store.registry import resolve
from checkpoint_store.retention import lease
from checkpoint_store.testing.relay import FaultRelay


@pytest.fixture(autouse=True)
def _close_breaker():
    yield
    _retry._breaker.close()  # a stall opened it for the calls after it


def test_the_default_timeouts_are_the_documented_ones():
    import checkpoint_store_s3 as s3

    assert (s3.REQUEST_TIMEOUT_S, s3.CONNECT_TIMEOUT_S, s3.ENGINE_ATTEMPTS) == (20.0, 10.0, 3)
    assert _retry.RetryPolicy().max_elapsed == 60.0
    # Worst case for one call against a silent store: engine tries of the
    # read timeout each, then no retry past max_elapsed: about two minutes.
    assert s3.ENGINE_ATTEMPTS * s3.REQUEST_TIMEOUT_S + _retry.RetryPolicy().max_elapsed <= 120


@pytest.mark.parametrize("name", ["request_timeout", "connect_timeout"])
# A string is what `-o KEY=VALUE` gives: converted when it is a number (docs/backends.md).
@pytest.mark.parametrize("value", [-1, 0, "-5", "abc", float("nan"), True])
@pytest.mark.parametrize("engine", ["pyarrow", "s3fs"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(name, value, engine):
    t0 = time.monotonic()
    with pytest.raises(InvalidConfigError, match=name):
        resolve("s3://bucket/x", storage_options={
            "engine": engine, "endpoint_url": "http://127.0.0.1:9", name: value,
            "access_key_id": "a", "secret_access_key": "b"})
    assert time.monotonic() - t0 < 5


def test_a_max_elapsed_that_is_not_positive_is_refused():
    with pytest.raises(InvalidConfigError, match="max_elapsed"):
        _retry.RetryPolicy(max_elapsed=0)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["pyarrow", "s3fs"])
def test_a_store_that_stops_answering_fails_the_report_and_the_end_in_bounded_time(
        s3_server, s3_bucket, tmp_path, monkeypatch, engine):
    # The relay accepts connections, then stops answering mid-report. With a
    # 1 s read timeout the bounds scale down: max_elapsed 3 s stands for the
    # default 60 s (report ~2 min, session end within the same bound); s3fs
    # (aiobotocore) can wait for "100 Continue" past its timeouts, so the end
    # of the session gives a renewal of the lease in flight 3 s
    # (_stall_report_and_end sets both).
    with FaultRelay(s3_server.endpoint_url, lifetime_s=120) as relay:
        opts = {**s3_server.storage_options(engine), "endpoint_url": relay.endpoint_url,
                "request_timeout": 1, "connect_timeout": 1}
        report_s, end_s = _stall_report_and_end(f"s3://{s3_bucket}/runs", opts, relay,
                                                tmp_path, monkeypatch)
    # One stalled call: 3 engine tries of 1 s, then no retry past 3 s.
    assert report_s < 12, report_s
    assert end_s < 12, end_s


def test_a_stalled_store_fails_fast_only_for_itself():
    """The breaker a stalled store opens is that store's: calls to another store in
    the same process (a local disk, another bucket) still run."""
    import pyarrow.fs as pafs

    stalled, healthy = pafs.LocalFileSystem(), pafs.LocalFileSystem()
    policy = _retry.RetryPolicy(attempts=1000, base_delay=0.01, max_delay=0.01, max_elapsed=0.2)
    tries = []

    def silent() -> None:
        tries.append(1)
        raise TimeoutError("the store stopped answering")

    with pytest.raises(TransientBackendError, match="still failing after"):
        _retry.call(silent, policy=policy, store=stalled)
    n = len(tries)
    with pytest.raises(TransientBackendError, match="not tried"):
        _retry.call(silent, policy=policy, store=stalled)
    assert len(tries) == n  # failed at once, nothing sent
    assert _retry.call(lambda: "ok", policy=policy, store=healthy) == "ok"
    assert _retry.call(lambda: "ok", policy=policy) == "ok"  # no store named: no breaker


def _plugins():
    import checkpoint_store_azure as azure
    import checkpoint_store_gcs as gcs

    return azure, gcs


def test_the_azure_and_gcs_defaults_are_the_documented_ones():
    for plugin in _plugins():
        assert (plugin.REQUEST_TIMEOUT_S, plugin.CONNECT_TIMEOUT_S,
                plugin.ENGINE_ATTEMPTS) == (20.0, 10.0, 3)
        assert (plugin.ENGINE_ATTEMPTS * plugin.REQUEST_TIMEOUT_S
                + _retry.RetryPolicy().max_elapsed <= 120)


def _fsspec_of(resolved):
    handler = resolved[0].filesystem.handler
    return getattr(handler, "deleter", None) or handler.fs


@pytest.mark.parametrize("engine", ["adlfs", "pyarrow"])
def test_azure_clients_use_the_timeouts_and_tries(azure_server, azure_container, engine):
    opts = {**azure_server.storage_options(engine), "request_timeout": "3",
            "connection_timeout": 2}
    fs = _fsspec_of(resolve(f"az://{azure_container}/x", storage_options=opts))
    clients = [fs.service_client]
    with fs.open(f"{azure_container}/x/probe", "wb") as f:
        f.write(b"1")
        clients.append(f.container_client)
    for client in clients:
        policy = client._config.retry_policy
        assert policy.total_retries == 2  # ENGINE_ATTEMPTS tries
        transport = client._pipeline._transport
        config = getattr(transport, "_transport", transport).connection_config
        assert (config.timeout, config.read_timeout) == (2.0, 3.0)
    default = resolve(f"az://{azure_container}/x",
                      storage_options=azure_server.storage_options(engine))
    config = _fsspec_of(default).service_client._pipeline._transport.connection_config
    assert (config.timeout, config.read_timeout) == (10.0, 20.0)


def test_an_azure_timeout_sends_every_byte_through_adlfs(azure_server, azure_container):
    """pyarrow's AzureFileSystem takes no timeout: with one set, the adlfs engine
    moves file bytes through adlfs too, so that every call honours it."""
    uri, opts = f"az://{azure_container}/x", azure_server.storage_options("adlfs")
    assert resolve(uri, storage_options=opts)[0].filesystem.handler.native is not None
    timed = resolve(uri, storage_options={**opts, "request_timeout": 5})[0]
    assert getattr(timed.filesystem.handler, "native", None) is None


def test_gcs_client_uses_the_timeouts_and_tries(gcs_server, gcs_bucket):
    fs = _fsspec_of(resolve(f"gs://{gcs_bucket}/x", storage_options={
        **gcs_server.storage_options(), "request_timeout": "3", "connect_timeout": 2}))
    timeout = fs.requests_timeout
    assert (timeout.total, timeout.sock_connect, timeout.sock_read) == (None, 2.0, 3.0)
    default = _fsspec_of(resolve(f"gs://{gcs_bucket}/x",
                                 storage_options=gcs_server.storage_options()))
    assert (default.requests_timeout.sock_connect, default.requests_timeout.sock_read) == (
        10.0, 20.0)


@pytest.mark.parametrize("name", ["request_timeout", "connect_timeout", "read_timeout",
                                  "connection_timeout"])
@pytest.mark.parametrize("value", [-1, 0, "-5", "abc", float("nan"), float("inf"), True])
@pytest.mark.parametrize("engine", ["adlfs", "pyarrow"])
def test_a_bad_azure_timeout_is_refused(name, value, engine):
    secret = "c2VjcmV0LWtleQ=="
    with pytest.raises(InvalidConfigError, match=name) as info:
        resolve("az://container/x", storage_options={
            "engine": engine, "account_name": "acct", "account_key": secret, name: value})
    assert secret not in str(info.value)


@pytest.mark.parametrize("name", ["request_timeout", "connect_timeout"])
@pytest.mark.parametrize("value", [-1, 0, "-5", "abc", float("nan"), float("inf"), True])
def test_a_bad_gcs_timeout_is_refused(name, value):
    with pytest.raises(InvalidConfigError, match=name):
        resolve("gs://bucket/x", storage_options={
            "endpoint_url": "http://127.0.0.1:9", "token": "anon", name: value})


def _stall_report_and_end(uri, opts, relay, tmp_path, monkeypatch):
    """(seconds the report that meets the stall took to fail, seconds the end took)."""
    monkeypatch.setattr(_retry, "_DEFAULT", _retry.RetryPolicy(max_elapsed=3.0))
    monkeypatch.setattr(lease, "RELEASE_WAIT_S", 3.0)
    src = make_source(tmp_path / "s", 0, files=3, size=1024)
    ctx = session.start(storage_path=uri, storage_options=opts, experiment_name="exp",
                        trial_name="trial", checkpoint_config=CheckpointConfig(num_to_keep=2))
    ctx.__enter__()
    session.report({"i": 0}, checkpoint=Checkpoint.from_directory(src))
    relay.stall()
    t0 = time.monotonic()
    with pytest.raises(TransientBackendError):
        session.report({"i": 1}, checkpoint=Checkpoint.from_directory(src))
    report_s = time.monotonic() - t0
    t1 = time.monotonic()
    try:
        ctx.__exit__(None, None, None)
    except TransientBackendError:
        pass
    return report_s, time.monotonic() - t1


@pytest.mark.slow
def test_a_stalled_azure_store_fails_the_report_and_the_end_in_bounded_time(
        azure_server, azure_container, tmp_path, monkeypatch):
    # The adlfs engine: pyarrow's AzureFileSystem takes no timeout (one listing
    # against this relay held 302 s), docs/backends.md says so.
    with FaultRelay(azure_server.endpoint_url, lifetime_s=120) as relay:
        conn = azure_server.connection_string.replace(
            azure_server.endpoint_url, relay.endpoint_url)
        opts = {"engine": "adlfs", "connection_string": conn, "request_timeout": 1,
                "connect_timeout": 1}
        report_s, end_s = _stall_report_and_end(
            f"az://{azure_container}/runs", opts, relay, tmp_path, monkeypatch)
    # One stalled call: 3 engine tries of 1 s (1 s and 3 s apart), then no retry
    # past 3 s. adlfs's find is two requests, each bounded so: its isfile probe
    # swallows any error (a bare except) and the listing then times out too.
    assert report_s < 25, report_s
    assert end_s < 25, end_s


@pytest.mark.slow
def test_a_stalled_gcs_store_fails_the_report_and_the_end_in_bounded_time(
        gcs_server, gcs_bucket, tmp_path, monkeypatch):
    with FaultRelay(gcs_server.endpoint_url, lifetime_s=120) as relay:
        opts = {**gcs_server.storage_options(), "endpoint_url": relay.endpoint_url,
                "request_timeout": 1, "connect_timeout": 1}
        report_s, end_s = _stall_report_and_end(
            f"gs://{gcs_bucket}/runs", opts, relay, tmp_path, monkeypatch)
    assert report_s < 15, report_s
    assert end_s < 15, end_s


def test_the_bounded_clients_survive_a_pickle_into_another_process(tmp_path):
    """Checkpoints travel pickled (Ray workers): the bounded filesystem classes are
    found in a process that has not made them yet, with their settings."""
    import os
    import pickle
    import subprocess
    import sys

    gcs, _ = resolve("gs://bucket/x", storage_options={
        "endpoint_url": "http://127.0.0.1:9", "token": "anon", "request_timeout": 3})
    azure, _ = resolve("az://container/x", storage_options={
        "account_name": "acct", "account_key": "c2VjcmV0", "request_timeout": 4})
    (tmp_path / "b.pkl").write_bytes(pickle.dumps((gcs, azure)))
    probe = (
        "import pickle, sys\n"
        "g, a = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "g, a = g.filesystem.handler.fs, a.filesystem.handler.fs\n"
        "print(type(g).__name__, g.requests_timeout.sock_read, type(a).__name__,\n"
        "      a.service_client._pipeline._transport.connection_config.read_timeout)\n")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "b.pkl")],
                         capture_output=True, text=True, env=os.environ, check=True).stdout
    assert out.split() == ["_BoundedGCSFileSystem", "3.0", "_BoundedBlobFileSystem", "4.0"]
