"""Fixtures for the commit-protocol tests: one trial on local disk, memory or S3."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest

from checkpoint_store import StorageContext
from checkpoint_store.backends.base import Backend
from checkpoint_store.registry import resolve
from tests.stores import make_store_for, store  # noqa: F401  (fixtures: a storage root on each backend)


@dataclass
class Trial:
    """A trial location: the URI a user passes, its backend and path."""

    uri: str
    backend: Backend
    root: str
    storage_options: dict

    def storage(self, **kwargs) -> StorageContext:
        return StorageContext.from_backend(self.backend, self.root, "exp", "trial", **kwargs)

    def session_kwargs(self) -> dict:
        return {"storage_path": self.uri, "storage_options": self.storage_options or None,
                "experiment_name": "exp", "trial_name": "trial"}


def _trial(kind: str, tmp_path, request) -> Trial:
    if kind == "local":
        uri = str(tmp_path / "store")
        opts: dict = {}
    elif kind == "memory":
        uri = f"memory://cs-commit-{uuid.uuid4().hex}"
        opts = {}
    else:
        loc = request.getfixturevalue("s3_location")
        uri, opts = loc.uri, dict(loc.storage_options)
    backend, root = resolve(uri, storage_options=opts or None)
    return Trial(uri, backend, root, opts)


@pytest.fixture(params=["local", "memory"])
def trial(request, tmp_path) -> Trial:
    """Local disk (rename commit) and memory (marker-last commit)."""
    return _trial(request.param, tmp_path, request)


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.slow)])
def any_trial(request, tmp_path) -> Trial:
    """Also S3 on a moto server (marker-last against a real object store API)."""
    return _trial(request.param, tmp_path, request)


@pytest.fixture
def memory_trial(request, tmp_path) -> Trial:
    return _trial("memory", tmp_path, request)
