"""Shared by the chunk tests: a marker with chunk entries, a settable clock."""

from __future__ import annotations

import json
import posixpath
from typing import Any

from checkpoint_store._chunks.codec import chunk_name, encode_chunk
from checkpoint_store._chunks.store import ChunkStore
from checkpoint_store._format.layout import INTERNAL_METADATA


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def blob(i: int) -> tuple[str, bytes]:
    data = f"chunk-{i}".encode() * 3
    return chunk_name(data), encode_chunk(data)


def commit(store: ChunkStore, ckpt: str, objects: list[str], sizes: dict[str, int]) -> None:
    """Write a marker at ``ckpt`` whose one file is ``objects``."""
    entry: dict[str, Any] = {"path": "model.bin", "size": 21 * len(objects), "crc32c": "0",
                             "chunks": [[o, 21, sizes.get(o, 0)] for o in objects]}
    body = {"format_version": 3, "chunk_root": "../../.cs_chunks", "manifest": [entry]}
    store.filesystem.create_dir(ckpt, recursive=True)
    with store.filesystem.open_output_stream(posixpath.join(ckpt, INTERNAL_METADATA)) as f:
        f.write(json.dumps(body).encode())
