"""The index of a saved state: ``state.json`` read and checked, no tensor byte.

:func:`read_state_index` is the first step of every read of a state
(:func:`~checkpoint_store.state._read.load_state`, ``Checkpoint.verify``);
:func:`local_state_index` lets a commit record the index of a state written
into a local directory.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import pyarrow.fs as pafs

from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import inspect_checkpoint, read_checked
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.errors import CheckpointCorruptError, CheckpointNotFoundError
from checkpoint_store.state._files import (
    SHARDED_FORMAT_VERSION,
    STATE_FILE,
    STATE_FORMAT_VERSION,
)
from checkpoint_store.state._tree import DTYPES

__all__ = ["SavedState", "local_state_index", "read_state_index"]


@dataclass(frozen=True)
class SavedState:
    """What a checkpoint says about its state, read without any tensor byte.

    Attributes:
        skeleton: the tree of containers and JSON leaves (``state.json``'s ``tree``).
        tensors: the tensor index: key -> ``{file, dtype, shape, offsets,
            crc32c, framework}`` (aliases carry ``alias_of``).
        sizes: ``{relative path: bytes}`` of the checkpoint's files as listed.
        committed: the directory carries a valid commit marker.
        chunked: ``{relative path: ChunkedFile}`` of the files whose bytes
            live as chunks (format version 3; their sizes are in ``sizes``).
    """

    skeleton: Any
    tensors: dict[str, Any]
    sizes: dict[str, int]
    committed: bool
    chunked: dict[str, Any] = field(default_factory=dict)


def _where(fs: pafs.FileSystem, path: str) -> str:
    return f"{fs.type_name}:{path}"


def read_state_index(fs: pafs.FileSystem, path: str, *,
                     retry: RetryPolicy | None = None) -> SavedState:
    """The skeleton and tensor index of the state saved at ``path``.

    A committed checkpoint (one listing and one marker read) has its
    ``state.json`` checked against the manifest (size and CRC32C) as it is
    read; a local directory not committed yet (``Checkpoint.from_state``)
    is read as it is. The marker's ``"tensors"`` (format version 2) must
    agree with ``state.json``'s.

    Raises:
        CheckpointNotFoundError: nothing at ``path``, or it holds no saved
            state (no ``state.json``: it was saved from a directory; use
            ``to_directory()``).
        CheckpointCorruptError: the marker or ``state.json`` is damaged, or
            the two indexes disagree.
    """
    insp = inspect_checkpoint(fs, path, retry=retry)
    where = _where(fs, path)
    if insp.state == "missing":
        raise CheckpointNotFoundError(f"checkpoint {where} does not exist")
    if insp.state == "invalid":
        raise CheckpointCorruptError(f"checkpoint {where} is corrupt: {insp.reason}",
                                     path=path, file=insp.file)
    sizes = dict(insp.files or {})
    chunked: dict[str, Any] = {}
    if insp.meta is not None:
        from checkpoint_store._chunks.files import ChunkedFile, chunked_entries

        for e in chunked_entries(insp.meta):
            chunked[e["path"]] = ChunkedFile(fs, path, insp.meta, e, retry=retry)
            sizes[e["path"]] = e["size"]
    if STATE_FILE not in sizes:
        raise CheckpointNotFoundError(
            f"checkpoint {where} holds no saved state (no {STATE_FILE}): it was saved from "
            "a directory, not a state; read its files with to_directory() or as_directory()"
        )
    meta = insp.meta
    if meta is not None:
        entry = next((e for e in meta["manifest"] if e["path"] == STATE_FILE), None)
        if entry is None:  # listed but not in the manifest: inspect would say invalid
            raise CheckpointCorruptError(f"{STATE_FILE} of {where} is not in its manifest",
                                         path=path, file=STATE_FILE)
        if STATE_FILE in chunked:
            raw = chunked[STATE_FILE].read_all()
        else:
            raw = read_checked(fs, path, entry, retry=retry)
    else:
        raw = _fsutil.read_bytes(fs, posixpath.join(path, STATE_FILE), retry=retry)
    try:
        body = json.loads(raw)
        ok = (isinstance(body, dict) and body.get("kind") == "checkpoint_store_state"
              and isinstance(body.get("tensors"), dict) and isinstance(body.get("tree"), dict))
    except (ValueError, UnicodeDecodeError):
        ok, body = False, None
    if not ok:
        raise CheckpointCorruptError(f"{STATE_FILE} of {where} is not a saved state's index",
                                     path=path, file=STATE_FILE)
    assert isinstance(body, dict)
    version = body.get("format_version")
    if version not in (STATE_FORMAT_VERSION, SHARDED_FORMAT_VERSION):
        raise CheckpointCorruptError(
            f"{STATE_FILE} of {where} has format_version {version!r}; this checkpoint-store "
            f"reads {STATE_FORMAT_VERSION} and {SHARDED_FORMAT_VERSION} (upgrade "
            "checkpoint-store)", path=path, file=STATE_FILE)
    tensors = body["tensors"]
    if meta is not None and "tensors" in meta and meta["tensors"] != tensors:
        raise CheckpointCorruptError(
            f"the tensor index in the commit marker of {where} differs from {STATE_FILE}'s",
            path=path, file=STATE_FILE)
    for key, e in tensors.items():
        why = _bad_entry(e, sizes)
        if why:
            raise CheckpointCorruptError(f"tensor {key!r} of {where}: {why}", path=path,
                                         file=e.get("file") if isinstance(e, dict) else None)
    return SavedState(body["tree"], tensors, sizes, meta is not None, chunked)


def _is_shape(shape: Any) -> TypeGuard[list[int]]:
    return isinstance(shape, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)


def _bad_entry(e: Any, sizes: Mapping[str, int]) -> str | None:
    if not isinstance(e, dict):
        return "its index entry is not an object"
    dtype, shape, off = e.get("dtype"), e.get("shape"), e.get("offsets")
    if dtype not in DTYPES:
        return f"unknown dtype {dtype!r}"
    if not _is_shape(shape):
        return f"bad shape {shape!r}"
    if "shards" in e:
        return _bad_sharded(e, sizes)
    if not (isinstance(off, list) and len(off) == 2 and all(isinstance(n, int) for n in off)
            and 0 <= off[0] <= off[1]):
        return f"bad offsets {off!r}"
    if off[1] - off[0] != math.prod(shape) * DTYPES[dtype][0]:
        return f"offsets {off} do not hold {dtype} {shape}"
    if e.get("file") not in sizes:
        return f"its file {e.get('file')!r} is missing"
    if off[1] > sizes[e["file"]]:
        return f"offsets {off} run past the end of {e['file']!r} ({sizes[e['file']]} bytes)"
    if e.get("framework") not in ("torch", "numpy"):
        return f"unknown framework {e.get('framework')!r}"
    return _bad_checks(e)


def _bad_sharded(e: dict[str, Any], sizes: Mapping[str, int]) -> str | None:
    """Why a tensor stored in pieces (docs/sharded-state.md) cannot be read."""
    from checkpoint_store.state._shards import ShardIndex

    shards = e["shards"]
    stored: dict[tuple[str, int], Any] = {}
    if e.get("framework") not in ("torch", "numpy"):
        return f"unknown framework {e.get('framework')!r}"
    if not isinstance(shards, list):
        return "its pieces are not a list"
    for p in shards:
        if not isinstance(p, dict):
            return "a piece is not an object"
        sub = {"dtype": e["dtype"], "shape": p.get("shape"), "offsets": p.get("offsets"),
               "file": p.get("file"), "framework": e["framework"]}
        why = _bad_entry(sub, sizes)
        if why:
            return f"piece at {p.get('offset')!r}: {why}"
        off = p.get("offset")
        if not (_is_shape(off) and len(off) == len(e["shape"])):
            return f"bad piece offset {off!r}"
        if not isinstance(p.get("crc32c"), str):
            return f"piece at {off} has no crc32c"
        why = _bad_checks(p)
        if why:
            return f"piece at {off} has {why}"
        # A piece's CRC checks its bytes, not its box: one piece's bytes
        # listed again at another box would pass it. Pieces never share bytes.
        at = (p["file"], p["offsets"][0])
        if p["offsets"][1] > p["offsets"][0]:
            if at in stored:
                return f"pieces at {stored[at]} and {off} are the same bytes of {p['file']!r}"
            stored[at] = off
    return ShardIndex.why_not_tiling(e)


#: A CRC32C as the index writes it: 8 lowercase hex digits.
_CRC_HEX = re.compile(r"[0-9a-f]{8}")


def _bad_checks(p: Mapping[str, Any]) -> str | None:
    """Why a piece's (or a whole tensor's) partial-read checksums
    (``blocks``, ``tiles``) cannot be used; None when absent or sound."""
    from checkpoint_store.state._tiles import bad_tiles

    blocks = p.get("blocks")
    if blocks is not None and not (
            isinstance(blocks, list) and len(blocks) == 2 and isinstance(blocks[0], int)
            and not isinstance(blocks[0], bool) and blocks[0] > 0
            and isinstance(blocks[1], list)
            and all(isinstance(c, str) and _CRC_HEX.fullmatch(c) for c in blocks[1])
            and len(blocks[1]) == -(-(p["shape"][0] if p["shape"] else 1) // blocks[0])):
        return "bad blocks"
    tiles = p.get("tiles")
    why = bad_tiles(tiles, p["shape"]) if tiles is not None else None
    return f"bad tiles: {why}" if why else None


def local_state_index(fs: pafs.FileSystem, path: str) -> dict[str, Any] | None:
    """The tensor index of a state written into the local directory ``path``
    (``Checkpoint.from_state``), for a commit to record in its marker; None
    when ``path`` is not on a local disk or holds no ``state.json`` of ours
    (a directory of files, or one whose ``state.json`` is another tool's).
    One stat and, for a state, one read of a small local file."""
    local = _fsutil.local_path(fs, path)
    if local is None:
        return None
    try:
        with open(os.path.join(local, STATE_FILE), "rb") as f:
            body = json.loads(f.read())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not (isinstance(body, dict) and body.get("kind") == "checkpoint_store_state"
            and body.get("format_version") in (STATE_FORMAT_VERSION, SHARDED_FORMAT_VERSION)
            and isinstance(body.get("tensors"), dict)):
        return None
    tensors: dict[str, Any] = body["tensors"]
    return tensors
