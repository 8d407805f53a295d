"""A store that stops answering: reports and the end of a session fail in bounded time."""

from __future__ import annotations

import time

import pytest
from _commit_helpers import make_source

from checkpoint_store import Checkpoint, CheckpointConfig, _retry, session
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
    # 1 s read timeout the bounds scale down: max_elapsed 3 s here stands for
    # the default 60 s (report ~2 min, session end within the same bound).
    monkeypatch.setattr(_retry, "_DEFAULT", _retry.RetryPolicy(max_elapsed=3.0))
    # s3fs (aiobotocore) can wait for "100 Continue" past its timeouts: the
    # end of the session gives a renewal of the lease in flight this long.
    monkeypatch.setattr(lease, "RELEASE_WAIT_S", 3.0)
    src = make_source(tmp_path / "s", 0, files=3, size=1024)
    with FaultRelay(s3_server.endpoint_url, lifetime_s=120) as relay:
        opts = {**s3_server.storage_options(engine), "endpoint_url": relay.endpoint_url,
                "request_timeout": 1, "connect_timeout": 1}
        ctx = session.start(storage_path=f"s3://{s3_bucket}/runs", storage_options=opts,
                            experiment_name="exp", trial_name="trial",
                            checkpoint_config=CheckpointConfig(num_to_keep=2))
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
        end_s = time.monotonic() - t1
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
