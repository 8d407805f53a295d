"""Fixtures for the retention tests: the same trial on local disk, memory and S3."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from checkpoint_store import StorageContext
from checkpoint_store._util.fs import delete_dir
from tests.stores import store  # noqa: F401  (fixtures: a storage root on each backend)

StorageFactory = Callable[..., StorageContext]


@pytest.fixture(params=["local", "memory", "s3"])
def backend_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_storage(backend_name: str, request: pytest.FixtureRequest, tmp_path) -> Iterator[
    StorageFactory
]:
    """``make_storage(trial="t", experiment="exp")`` -> a StorageContext on one root
    (each call a fresh context, as a new process would build)."""
    if backend_name == "local":
        root, opts = str(tmp_path / "runs"), None
    elif backend_name == "memory":
        root, opts = f"memory://retention-{uuid.uuid4().hex}", None
    else:
        loc = request.getfixturevalue("s3_location")
        root, opts = loc.uri, dict(loc.storage_options)

    made: list[StorageContext] = []

    def factory(trial: str = "t", experiment: str = "exp") -> StorageContext:
        ctx = StorageContext(root, experiment, trial, storage_options=opts, fsync=False)
        made.append(ctx)
        return ctx

    yield factory
    if backend_name == "memory" and made:
        delete_dir(made[0].filesystem, made[0].storage_path)


@pytest.fixture
def source_dir(tmp_path) -> str:
    """A small local checkpoint directory to report."""
    d = tmp_path / "src"
    d.mkdir()
    (d / "model.bin").write_bytes(b"weights" * 4)
    return str(d)
