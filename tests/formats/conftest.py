"""Places to export from and to, on every kind of backend: a local path, a
``memory://`` URI, ``s3://`` on a moto server, an fsspec filesystem object
and a pyarrow ``S3FileSystem`` object against the same server."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store.state import write_state

PLACES = ["local", "memory", "s3", "fsspec", "pyarrow"]


@dataclass
class Place:
    """A root on one backend; ``at(name)`` gives the keyword arguments that
    name a location under it (``{"path", "options", "fs"}``)."""

    kind: str
    root: str
    options: dict[str, Any] = field(default_factory=dict)
    fs: Any = None

    def loc(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def ctx(self) -> StorageContext:
        if self.fs is not None:
            return StorageContext(self.root, "exp", "t", storage_filesystem=self.fs, fsync=False)
        return StorageContext(self.root, "exp", "t", storage_options=self.options or None,
                              fsync=False)

    def persist_state(self, tmp_path: Any, tree: Any, index: int = 0, **kw: Any) -> Checkpoint:
        """``tree`` saved as a committed state checkpoint of trial ``exp/t``."""
        src = tmp_path / f"src-{uuid.uuid4().hex[:6]}"
        tensors = write_state(tree, src, **kw)
        return self.ctx().persist_checkpoint(Checkpoint.from_directory(src), index,
                                             {"tensors": tensors})

    def side(self, prefix: str) -> dict[str, Any]:
        """Keyword arguments of export/import for this place's side."""
        out: dict[str, Any] = {}
        if self.fs is not None:
            out[f"{prefix}filesystem"] = self.fs
        elif self.options:
            out[f"{prefix}storage_options"] = self.options
        return out


def make_place(kind: str, request: pytest.FixtureRequest, tmp_path: Any) -> Place:
    tag = uuid.uuid4().hex[:8]
    if kind == "local":
        return Place(kind, str(tmp_path / f"store-{tag}"))
    if kind == "memory":
        return Place(kind, f"memory://fmt-{tag}/store")
    if kind == "fsspec":
        import fsspec

        return Place(kind, f"/fmt-{tag}/store", fs=fsspec.filesystem("memory"))
    loc = request.getfixturevalue("s3_location")
    if kind == "s3":
        return Place(kind, f"{loc.uri.rstrip('/')}/{tag}", dict(loc.storage_options))
    srv = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    fs = pafs.S3FileSystem(access_key=srv.access_key_id, secret_key=srv.secret_access_key,
                           endpoint_override=srv.endpoint_url.split("://", 1)[1],
                           scheme="http", region=srv.region)
    return Place(kind, f"{bucket}/{tag}", fs=fs)


@pytest.fixture(params=PLACES)
def place(request: pytest.FixtureRequest, tmp_path: Any) -> Place:
    return make_place(request.param, request, tmp_path)


@pytest.fixture
def make(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    return lambda kind: make_place(kind, request, tmp_path)
