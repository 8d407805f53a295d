"""``Checkpoint.verify()`` of a saved state whose shards live as chunks: a
missing or damaged chunk is named as such, not taken for a truncated shard."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from checkpoint_store import Checkpoint
from checkpoint_store._chunks.files import chunk_object_path, chunk_root_path
from checkpoint_store.errors import CheckpointCorruptError, TensorCorruptError
from checkpoint_store.testing.chunked import write_chunked_state_checkpoint

CK = "exp/t/checkpoint_000000"


def _chunk_of_first_shard(tmp_path: Any) -> tuple[Checkpoint, str, str]:
    ck = Checkpoint(str(tmp_path / CK))
    state = {"w": np.arange(40_000, dtype=np.float32), "step": 3}
    meta = write_chunked_state_checkpoint(ck.filesystem, ck.path, state, chunk_bytes=24_000)
    shard = next(e for e in meta["manifest"] if "chunks" in e)
    name = shard["chunks"][-1][0]
    return ck, shard["path"], chunk_object_path(chunk_root_path(ck.path, meta), name)


def test_verify_names_the_missing_chunk_of_a_state_shard(tmp_path: Any) -> None:
    ck, shard, chunk = _chunk_of_first_shard(tmp_path)
    os.remove(chunk)
    with pytest.raises(CheckpointCorruptError, match="is missing") as exc:
        ck.verify()
    assert not isinstance(exc.value, TensorCorruptError)
    assert "truncated" not in str(exc.value)
    assert exc.value.file == shard


def test_verify_names_the_damaged_chunk_of_a_state_shard(tmp_path: Any) -> None:
    ck, shard, chunk = _chunk_of_first_shard(tmp_path)
    with open(chunk, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(CheckpointCorruptError, match="damaged") as exc:
        ck.verify()
    assert "truncated" not in str(exc.value)
    assert exc.value.file == shard
