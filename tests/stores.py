"""Fixtures for the storage-identity tests: one storage root on every backend.

``store`` is parametrized over local disk, memory, S3 with both engines
(pyarrow, s3fs), Azure (Azurite) and GCS (the emulator); the servers come
from the shipped pytest plugin and are started once per session.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from checkpoint_store import StorageContext

ALL_BACKENDS = ["local", "memory", "s3", "s3fs", "azure", "gcs"]
# s3fs costs about 5 s a test (its client's calls against moto); S3 through
# pyarrow stays in the quick loop (-m "not slow"), s3fs runs in the full one.
_PARAMS = [pytest.param(k, marks=pytest.mark.slow) if k == "s3fs" else k for k in ALL_BACKENDS]


@dataclass
class Store:
    """A storage root for one test: its URI and the backend options it needs."""

    kind: str
    uri: str
    options: dict[str, Any] = field(default_factory=dict)

    def ctx(self, experiment: str = "exp", trial: str = "t", **kw: Any) -> StorageContext:
        return StorageContext(self.uri, experiment, trial,
                              storage_options=self.options or None, fsync=False, **kw)

    def opt_args(self) -> list[str]:
        out: list[str] = []
        for k, v in self.options.items():
            out += ["-o", f"{k}={v}"]
        return out

    def join(self, *parts: str) -> str:
        return "/".join([self.uri.rstrip("/"), *parts])


def make_store(kind: str, request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    if kind == "local":
        return Store(kind, str(tmp_path / "store"))
    if kind == "memory":
        return Store(kind, f"memory://identity-{uuid.uuid4().hex[:10]}/store")
    loc = request.getfixturevalue(f"{kind}_location")
    return Store(kind, loc.uri, dict(loc.storage_options))


def pyarrow_azure(server: Any) -> Any:
    """pyarrow's own ``AzureFileSystem`` on the Azurite ``server`` (the
    plugin's pyarrow engine, or one a user passes in)."""
    import pyarrow.fs as pafs

    host = server.endpoint_url.split("://", 1)[1]
    return pafs.AzureFileSystem(account_name=server.account_name,
                                account_key=server.account_key,
                                blob_storage_authority=host, blob_storage_scheme="http",
                                dfs_storage_authority=host, dfs_storage_scheme="http")


@pytest.fixture(params=_PARAMS)
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    """A fresh storage root on each backend."""
    return make_store(request.param, request, tmp_path)


@pytest.fixture(params=["local", "memory"])
def near_store(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    """Local disk and memory only: for cases whose refusal comes before any
    backend is reached, or that the ``store`` tests cover elsewhere."""
    return make_store(request.param, request, tmp_path)


@pytest.fixture
def make_store_for(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    """``make_store`` as a fixture: tests that pick their own backends."""
    return lambda kind: make_store(kind, request, tmp_path)
