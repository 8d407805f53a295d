"""Fixtures for the command-line tests: one trial layout on every backend.

``store`` is parametrized over local disk, memory, S3 (moto) and Azure
(Azurite); the servers come from the shipped pytest plugin
(``checkpoint_store.testing``) and are started once per session.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from cli_helpers import Store


@pytest.fixture(params=["local", "memory", "s3", "azure"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    """A fresh storage root on each backend the CLI must serve."""
    return _store_of(request, tmp_path)


def _store_of(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    """A fresh storage root on the backend ``request.param`` names."""
    kind = request.param
    if kind == "local":
        return Store(str(tmp_path / "store"))
    if kind == "memory":
        return Store(f"memory://cli-{uuid.uuid4().hex[:10]}/store")
    loc = request.getfixturevalue(f"{kind}_location")
    return Store(loc.uri, dict(loc.storage_options))


@pytest.fixture(params=["s3", "azure"])
def remote_store(request: pytest.FixtureRequest) -> Store:
    loc = request.getfixturevalue(f"{request.param}_location")
    return Store(loc.uri, dict(loc.storage_options))


@pytest.fixture(params=["local", "memory"])
def near_store(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    """Local disk and memory only: for edge cases whose backend-specific part the
    ``store`` tests already cover on S3 and Azure."""
    if request.param == "local":
        return Store(str(tmp_path / "store"))
    return Store(f"memory://cli-{uuid.uuid4().hex[:10]}/store")


@pytest.fixture(params=["local", "memory", "s3", "s3fs", "azure", "gcs"])
def every_store(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    """Every backend, S3 with both engines and GCS included."""
    return _store_of(request, tmp_path)
