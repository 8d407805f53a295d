"""Helpers of the local tier tests: the persistent tier in every location form,
a gate that holds its checkpoint writes, checkpoint directories."""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store.backends.base import Backend
from checkpoint_store.backends.forwarding import ForwardingHandler
from checkpoint_store.registry import resolve

#: The checkout under test, first on the path of the processes tests start.
REPO = str(Path(__file__).resolve().parents[2])


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process that imports this checkout."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


# Where the persistent tier lives, in each form the project supports: a path,
# URIs, and filesystem objects passed in (pyarrow, fsspec).
DURABLE_FORMS = ["local", "memory", "s3-uri", "s3-pyarrow", "s3-fsspec"]


@dataclass
class Durable:
    """The persistent tier: what ``session.start`` gets, and a reader of it."""

    kind: str
    storage_path: str
    storage_options: dict[str, Any] | None = None
    storage_filesystem: Any = None
    env: dict[str, str] = field(default_factory=dict)

    def start_kwargs(self) -> dict[str, Any]:
        return {"storage_path": self.storage_path, "storage_options": self.storage_options,
                "storage_filesystem": self.storage_filesystem}

    def ctx(self, experiment: str = "e", trial: str = "t") -> StorageContext:
        return StorageContext(self.storage_path, experiment, trial,
                              storage_options=self.storage_options,
                              storage_filesystem=self.storage_filesystem)

    def committed(self, experiment: str = "e", trial: str = "t") -> list[int]:
        """Indexes committed on the persistent tier."""
        return [meta["index"] for _, meta in self.ctx(experiment, trial).committed_checkpoints()]


def make_durable(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Durable:
    if kind == "local":
        return Durable(kind, str(tmp_path / "durable"))
    if kind == "memory":
        return Durable(kind, f"memory://tiers-{uuid.uuid4().hex}")
    if kind == "s3-uri":
        loc = request.getfixturevalue("s3_location")
        return Durable(kind, loc.uri, dict(loc.storage_options))
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    if kind == "s3-pyarrow":
        fs = pafs.S3FileSystem(access_key=server.access_key_id,
                               secret_key=server.secret_access_key, region="us-east-1",
                               scheme="http", endpoint_override=f"127.0.0.1:{server.port}")
        return Durable(kind, f"{bucket}/runs", storage_filesystem=fs)
    assert kind == "s3-fsspec"
    import s3fs

    fs = s3fs.S3FileSystem(key=server.access_key_id, secret=server.secret_access_key,
                           endpoint_url=server.endpoint_url, skip_instance_cache=True,
                           use_listings_cache=False)
    return Durable(kind, f"{bucket}/runs", storage_filesystem=fs)


def make_checkpoint(root: Path, name: str, files: dict[str, bytes]) -> Checkpoint:
    d = root / "src" / name
    d.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return Checkpoint.from_directory(d)


def read_files(path: str) -> dict[str, bytes]:
    """The user files of a local checkpoint directory (ours left out)."""
    out = {}
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), path)
            if name.startswith(".cs_") or rel == ".internal_metadata.json":
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                out[rel] = f.read()
    return out


class GateHandler(ForwardingHandler):
    """Forwards to ``inner``; writes and moves of checkpoint directories wait
    while ``gate`` is clear (a persistent tier that is slow or down)."""

    def __init__(self, inner: pafs.FileSystem, gate: threading.Event):
        super().__init__(inner)
        self.gate = gate
        self.held = 0

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def _hold(self, path: str) -> None:
        if "checkpoint_0" in path and not self.gate.is_set():
            self.held += 1
            assert self.gate.wait(120), "the gate was never opened"

    def open_output_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        self._hold(path)
        return super().open_output_stream(path, metadata)

    def move(self, src: str, dest: str) -> None:
        self._hold(dest)
        super().move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self._hold(dest)
        super().copy_file(src, dest)


def gated_storage(location: str, gate: threading.Event, experiment: str = "e",
                  trial: str = "t", **options: Any) -> tuple[StorageContext, GateHandler]:
    """A StorageContext on ``location`` whose checkpoint writes wait for ``gate``."""
    backend, path = resolve(location, storage_options=options or None)
    handler = GateHandler(backend.filesystem, gate)
    gated = Backend(pafs.PyFileSystem(handler), scheme=backend.scheme,
                    capabilities=backend.capabilities, name="gated")
    return StorageContext.from_backend(gated, path, experiment, trial), handler


def tiered_rank(store: str | Path, rank: int, world_size: int, tier: str | Path, *,
                refused: str | None = None, sync_timeout_s: float = 30) -> Any:
    """Rank ``rank`` of ``world_size`` (attempt ``a1``) of trial ``e/t`` on the
    local directory ``store``, with a local tier at ``tier``; where ``refused``
    is given, every write to a path holding it is refused (access denied)."""
    from checkpoint_store import LocalTier
    from checkpoint_store.session import Session
    from checkpoint_store.testing.faults import faulty_backend

    backend, path = resolve(str(store))
    if refused is not None:
        backend = faulty_backend(backend, permanent={"write": "access_denied"},
                                 path_contains=refused)
    ctx = StorageContext.from_backend(backend, path, "e", "t")
    return Session(ctx, world_rank=rank, world_size=world_size, attempt_id="a1",
                   sync_timeout_s=sync_timeout_s, local_tier=LocalTier(tier))
