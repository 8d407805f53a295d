"""Retry policy: backoff bounds, classification, typed give-ups."""

from __future__ import annotations

import random
from typing import get_args

import pyarrow.fs as pafs
import pytest

from checkpoint_store._util.retry import RetryKind, RetryPolicy, call, classify, with_rebuild
from checkpoint_store.backends.base import LOCAL_CAPABILITIES, Backend
from checkpoint_store.errors import (
    CredentialsExpiredError,
    InvalidConfigError,
    PermanentBackendError,
    TransientBackendError,
)

FAST = RetryPolicy(attempts=4, base_delay=0.0, max_delay=0.0)


@pytest.mark.parametrize("exc,kind", [
    (ConnectionResetError("reset"), "transient"),
    (TimeoutError("timed out"), "transient"),
    (OSError("AWS Error SLOW_DOWN during PutObject: 503 Slow Down"), "transient"),
    (OSError("HTTP 500 InternalError"), "transient"),
    (OSError("Server busy: 429 Too Many Requests"), "transient"),
    (TransientBackendError("x"), "transient"),
    (FileNotFoundError("nope"), "permanent"),
    (PermissionError("AccessDenied"), "permanent"),
    (OSError("AWS Error ACCESS_DENIED: 403 Forbidden"), "permanent"),
    (OSError("[Errno 28] No space left on device"), "permanent"),
    (OSError("ExpiredToken: the provided token has expired"), "expired"),
    (OSError("invalid_grant: Token has been expired or revoked."), "expired"),
    (ConnectionRefusedError("[Errno 111] Connection refused"), "unreachable"),
    (IsADirectoryError("a directory"), "permanent"),
    (ValueError("bad"), "permanent"),
    (KeyboardInterrupt(), "permanent"),
    (RuntimeError("dictionary changed size during iteration"), "transient"),
    (RuntimeError("cannot schedule new futures after shutdown"), "permanent"),
])
def test_classify(exc, kind):
    assert kind in get_args(RetryKind)
    assert classify(exc) == kind


def _expiring_op(backend: Backend, seen: list[pafs.FileSystem]):
    def op() -> str:
        seen.append(backend.filesystem)
        backend.filesystem.get_file_info("/")
        if len(seen) == 1:
            raise CredentialsExpiredError("the storage credentials have expired")
        return "done"
    return op


def test_with_rebuild_runs_the_operation_again_on_a_fresh_filesystem(tmp_path):
    first = pafs.LocalFileSystem()
    fresh = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    backend = Backend(first, scheme="file", capabilities=LOCAL_CAPABILITIES,
                      rebuild=lambda: fresh)
    seen: list[pafs.FileSystem] = []
    assert with_rebuild(backend, _expiring_op(backend, seen), what="op") == "done"
    assert seen == [first, fresh]
    assert backend.filesystem is fresh


def test_with_rebuild_without_a_factory_raises_the_expiry():
    backend = Backend(pafs.LocalFileSystem(), scheme="file", capabilities=LOCAL_CAPABILITIES)
    seen: list[pafs.FileSystem] = []
    with pytest.raises(CredentialsExpiredError, match="expired"):
        with_rebuild(backend, _expiring_op(backend, seen), what="op")
    assert len(seen) == 1


def test_backoff_grows_and_is_capped():
    p = RetryPolicy(attempts=10, base_delay=0.1, max_delay=1.0)
    rng = random.Random(0)
    delays = [p.delay(k, rng) for k in range(8)]
    for k, d in enumerate(delays):
        cap = min(1.0, 0.1 * 2**k)
        assert cap / 2 <= d <= cap
    assert max(delays) <= 1.0


def test_transient_errors_are_retried_until_success():
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    assert call(flaky, policy=FAST) == "ok"
    assert len(calls) == 3


def test_attempts_run_out_with_a_typed_error():
    calls = []

    def down() -> None:
        calls.append(1)
        raise OSError("503 Service Unavailable")

    with pytest.raises(TransientBackendError, match="4 attempts") as err:
        call(down, policy=FAST, what="upload x")
    assert len(calls) == 4
    assert isinstance(err.value.__cause__, OSError)


@pytest.mark.parametrize("exc,typ", [
    (PermissionError("AccessDenied"), PermanentBackendError),
    (FileNotFoundError("gone"), FileNotFoundError),
    (ValueError("bad"), ValueError),
])
def test_permanent_errors_surface_at_once(exc, typ):
    calls = []

    def fail() -> None:
        calls.append(1)
        raise exc

    with pytest.raises(typ):
        call(fail, policy=FAST)
    assert len(calls) == 1


def test_policy_validation_and_environment(monkeypatch):
    with pytest.raises(InvalidConfigError):
        RetryPolicy(attempts=0)
    with pytest.raises(InvalidConfigError):
        RetryPolicy(max_delay=-1)
    assert RetryPolicy().attempts >= 3
    monkeypatch.setenv("CHECKPOINT_STORE_RETRY_ATTEMPTS", "7")
    monkeypatch.setenv("CHECKPOINT_STORE_RETRY_MAX_DELAY", "0.5")
    p = RetryPolicy.from_env()
    assert (p.attempts, p.max_delay) == (7, 0.5)
    monkeypatch.setenv("CHECKPOINT_STORE_RETRY_ATTEMPTS", "many")
    with pytest.raises(InvalidConfigError, match="CHECKPOINT_STORE_RETRY_ATTEMPTS"):
        RetryPolicy.from_env()



@pytest.mark.parametrize("listing", ["list_tree", "list_dir"])
def test_a_memory_listing_racing_a_writer_is_asked_again(monkeypatch, listing):
    """fsspec's memory filesystem lists by copying its dict; a writer in
    another thread that lands mid-copy makes the copy raise. Seen in a full
    run: two threads committing one checkpoint on ``memory://``, the loser's
    claim listing died with that RuntimeError instead of a conflict."""
    import uuid

    from fsspec.implementations.memory import MemoryFileSystem

    from checkpoint_store._util import fs as _fsutil
    from checkpoint_store.registry import resolve

    backend, root = resolve(f"memory://race-{uuid.uuid4().hex[:8]}/t")
    _fsutil.write_bytes(backend.filesystem, f"{root}/a/f.bin", b"x", backend.capabilities)
    left = [2]
    for name in ("find", "ls"):
        real = getattr(MemoryFileSystem, name)

        def raced(fs, path, *args, _real=real, **kwargs):
            if left[0]:
                left[0] -= 1
                raise RuntimeError("dictionary changed size during iteration")
            return _real(fs, path, *args, **kwargs)

        monkeypatch.setattr(MemoryFileSystem, name, raced)
    got = getattr(_fsutil, listing)(backend.filesystem, root, retry=FAST)
    assert left[0] == 0
    assert [fi.base_name for fi in got if fi.type == pafs.FileType.Directory] == ["a"]
