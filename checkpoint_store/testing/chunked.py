"""Chunked checkpoints (format version 3) written directly, for readers' tests.

A reader of checkpoints (a backend plugin, an integration, our own tests)
must handle a manifest entry whose bytes live as chunks in the experiment's
chunk store (docs/format.md, "Chunks"). These helpers write such a
checkpoint without a session: the chunk objects (raw codec) first, then the
plain files, then the marker last, as a commit does::

    from checkpoint_store.testing.chunked import write_chunked_checkpoint

    meta = write_chunked_checkpoint(
        fs, "bucket/root/exp/trial/checkpoint_000000",
        {"model.bin": data, "config.json": b"{}"}, chunked={"model.bin"})

The checkpoint path must be laid out ``<root>/<experiment>/<trial>/checkpoint_NNNNNN``:
chunks go to ``<root>/<experiment>/.cs_chunks/<name[:2]>/<name>``.
"""

from __future__ import annotations

import os
import posixpath
import shutil
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import google_crc32c
import pyarrow.fs as pafs

from checkpoint_store._chunks.codec import chunk_name, encode_chunk
from checkpoint_store._chunks.files import chunk_object_path, chunk_root_path
from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import CHUNK_ROOT, INTERNAL_METADATA, parse_checkpoint_dir_name
from checkpoint_store._format.manifest import crc_hex, internal_metadata
from checkpoint_store._util import fs as _fsutil

__all__ = ["safetensors_cuts", "write_chunked_checkpoint", "write_chunked_state_checkpoint"]


def _as_pyarrow(filesystem: Any) -> pafs.FileSystem:
    if isinstance(filesystem, pafs.FileSystem):
        return filesystem
    return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))


def _mkdir(fs: pafs.FileSystem, path: str) -> None:
    """A directory where the store has real ones (local disk); object stores need none."""
    local = _fsutil.local_path(fs, path)
    if local is not None:
        os.makedirs(local, exist_ok=True)


def _fixed_cuts(size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk_bytes, size)) for a in range(0, size, chunk_bytes)]


def safetensors_cuts(data: bytes, tensors: Mapping[str, Mapping[str, Any]], file: str,
                     chunk_bytes: int) -> list[tuple[int, int]]:
    """``[(begin, end), ...]`` covering a safetensors shard ``data`` as the
    design cuts it: the header (8-byte length + JSON) as one piece, then each
    tensor's bytes in pieces of at most ``chunk_bytes`` cut at element
    boundaries (``tensors``: the state's index; only entries in ``file`` count).
    """
    from checkpoint_store.state._tree import DTYPES

    header_end = 8 + int.from_bytes(data[:8], "little")
    cuts = [(0, header_end)]
    spans = sorted((e["offsets"][0], e["offsets"][1], DTYPES[e["dtype"]][0])
                   for e in tensors.values()
                   if e.get("file") == file and "offsets" in e and "alias_of" not in e)
    at = header_end
    for begin, end, itemsize in spans:
        if begin > at:  # padding between tensors: a piece of its own
            cuts.append((at, begin))
        step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
        cuts.extend((a, min(a + step, end)) for a in range(begin, end, step))
        at = max(at, end)
    if at < len(data):
        cuts.append((at, len(data)))
    return [(a, b) for a, b in cuts if b > a]


def _store_chunks(fs: pafs.FileSystem, root: str, data: bytes,
                  cuts: list[tuple[int, int]]) -> list[list[Any]]:
    out: list[list[Any]] = []
    for a, b in cuts:
        piece = data[a:b]
        name = chunk_name(piece)
        blob = encode_chunk(piece)
        where = chunk_object_path(root, name)
        if not _fsutil.exists(fs, where):
            _mkdir(fs, posixpath.dirname(where))
            with fs.open_output_stream(where) as f:
                f.write(blob)
        out.append([name, b - a, len(blob)])
    return out


def write_chunked_checkpoint(
    filesystem: Any,
    checkpoint_path: str,
    files: Mapping[str, bytes],
    *,
    chunked: Collection[str],
    chunk_bytes: int = 1 << 20,
    internal: Mapping[str, Any] | None = None,
    cuts: Mapping[str, list[tuple[int, int]]] | None = None,
) -> dict[str, Any]:
    """Write a committed checkpoint whose ``chunked`` files live as chunks.

    Args:
        filesystem: a ``pyarrow.fs.FileSystem`` or fsspec filesystem.
        checkpoint_path: ``<root>/<experiment>/<trial>/checkpoint_NNNNNN`` in it.
        files: relative path -> bytes of every user file.
        chunked: which of ``files`` are stored as chunks (raw codec), cut in
            pieces of ``chunk_bytes`` (or as ``cuts[path]`` says:
            ``[(begin, end), ...]`` covering the file in order).
        internal: extra marker fields (``"index"`` defaults to the directory's).

    Returns:
        The marker written (``.internal_metadata.json``, format version 3
        when anything is chunked).
    """
    fs = _as_pyarrow(filesystem)
    unknown = set(chunked) - set(files)
    if unknown:
        raise ValueError(f"chunked names files not given: {sorted(unknown)}")
    index = parse_checkpoint_dir_name(posixpath.basename(checkpoint_path.rstrip("/")))
    extra: dict[str, Any] = {"index": index if index is not None else 0}
    if chunked:
        extra["chunk_root"] = CHUNK_ROOT
    extra.update(internal or {})
    root = chunk_root_path(checkpoint_path, extra) if chunked else ""
    entries: list[dict[str, Any]] = []
    for rel in sorted(files):
        data = bytes(files[rel])
        entry: dict[str, Any] = {"path": rel, "size": len(data),
                                 "crc32c": crc_hex(google_crc32c.value(data))}
        if rel in chunked:
            pieces = (cuts or {}).get(rel) or _fixed_cuts(len(data), chunk_bytes)
            entry["chunks"] = _store_chunks(fs, root, data, pieces)
        else:
            _mkdir(fs, posixpath.dirname(posixpath.join(checkpoint_path, rel)))
            with fs.open_output_stream(posixpath.join(checkpoint_path, rel)) as f:
                f.write(data)
        entries.append(entry)
    meta = internal_metadata(extra, entries)
    _mkdir(fs, checkpoint_path)
    with fs.open_output_stream(posixpath.join(checkpoint_path, INTERNAL_METADATA)) as f:
        f.write(_json.dumps(meta))
    return meta


def _read_tree(local: str) -> Iterator[tuple[str, bytes]]:
    for dirpath, _, names in os.walk(local):
        for n in names:
            full = os.path.join(dirpath, n)
            with open(full, "rb") as f:
                yield os.path.relpath(full, local).replace(os.sep, "/"), f.read()


def write_chunked_state_checkpoint(
    filesystem: Any,
    checkpoint_path: str,
    state: Any,
    *,
    chunk_bytes: int = 1 << 20,
    shard_bytes: int | None = None,
    internal: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A checkpoint of ``state`` (``Checkpoint.from_state``) whose safetensors
    shards live as chunks cut at tensor boundaries (:func:`safetensors_cuts`);
    ``state.json`` stays a plain file. Returns the marker written."""
    import json
    import tempfile

    from checkpoint_store.checkpoint import Checkpoint

    tmp = tempfile.mkdtemp()
    try:
        ck = Checkpoint.from_state(state, os.path.join(tmp, "s"), shard_bytes=shard_bytes)
        files = dict(_read_tree(ck.path))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tensors = json.loads(files["state.json"])["tensors"]
    shards = [rel for rel in files if rel.endswith(".safetensors")]
    cuts = {rel: safetensors_cuts(files[rel], tensors, rel, chunk_bytes) for rel in shards}
    extra = {"tensors": tensors, **(internal or {})}
    return write_chunked_checkpoint(filesystem, checkpoint_path, files, chunked=shards,
                                    chunk_bytes=chunk_bytes, internal=extra, cuts=cuts)
