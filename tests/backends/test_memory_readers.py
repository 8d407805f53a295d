"""Concurrent readers of the built-in memory backend each get their own view
(issue 12, kind 5). fsspec's memory filesystem hands every reader of a path
the same file object, so four threads moved each other's position: "not valid
JSON", a CRC mismatch, or ``{}`` for a committed checkpoint. The conformance
suite (``BackendTests``) runs the same shape on every backend."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store.testing.conformance import make_tree, read_tree


@pytest.fixture
def committed(tmp_path) -> Checkpoint:
    src = tmp_path / "src"
    make_tree(src, {"model.pt": 200_000, "optimizer.pt": 50_000, "cfg/a.json": 40})
    ctx = StorageContext(f"memory://readers-{uuid.uuid4().hex[:8]}/r", "e", "t")
    ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {"loss": 0.5}})
    return Checkpoint(ckpt.uri)  # as a reader would: from the URI alone


def test_four_threads_download_into_one_directory(committed, tmp_path):
    expected = read_tree(tmp_path / "src")
    target = str(tmp_path / "same_dir")
    barrier = threading.Barrier(4)

    def download(_: int) -> dict[str, bytes]:
        barrier.wait()
        return read_tree(committed.to_directory(target))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(download, range(4)))
    assert results == [expected] * 4


def test_four_threads_read_the_internal_metadata(committed):
    barrier = threading.Barrier(4)

    def meta(_: int) -> list[dict]:
        barrier.wait()
        return [Checkpoint(committed.uri).internal_metadata for _ in range(50)]

    with ThreadPoolExecutor(4) as pool:
        seen = [m for batch in pool.map(meta, range(4)) for m in batch]
    assert len(seen) == 200
    assert all(m["index"] == 0 and m["metrics"] == {"loss": 0.5} for m in seen)
    assert all(m == seen[0] for m in seen)
