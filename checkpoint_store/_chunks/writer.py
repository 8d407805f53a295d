"""The write side of chunked checkpoints: a local directory committed with its
large files stored once, as chunks in the experiment's chunk store.

:class:`ChunkedUpload` is a commit's ``write`` function
(:data:`~checkpoint_store._commit.protocols.WriteContents`): it cuts each
large file of a local source directory into chunks (a safetensors file at its
tensors' boundaries, so an unchanged tensor gives the same chunks in every
checkpoint; any other file in fixed pieces), names each by the BLAKE3 hash of
its bytes, and uploads only the chunks the store lacks, encoded with the
codec chosen for the store. The small files are copied into the checkpoint
directory as before; the manifest lists every file, a chunked one with its
chunks (docs/format.md, "Chunks"). The commit protocol around it is
unchanged: chunks first, marker last.

The writer's intent (the chunk names it will reference) is written before
any existence check and removed by :meth:`ChunkedUpload.finish` once the
marker is written or the commit failed, so a garbage collection running
beside it never frees a chunk it is about to reference.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import google_crc32c
import pyarrow.fs as pafs

from checkpoint_store._chunks.codec import PLANES_ZSTD, RAW, chunk_name, codec_for, encode_chunk
from checkpoint_store._chunks.gc import INTENT_TTL_S
from checkpoint_store._format.manifest import crc_hex
from checkpoint_store._transfer.crc32c import crc32c_combine
from checkpoint_store._transfer.trees import copy_tree, source_files
from checkpoint_store._util.fs import local_path
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend
from checkpoint_store.errors import (
    InvalidConfigError,
    SourceChangedError,
    SourceDeletedError,
    TransientBackendError,
)

__all__ = [
    "CHUNK_BYTES",
    "COMPRESSIONS",
    "MIN_CHUNKED_BYTES",
    "ChunkedEntry",
    "ChunkedUpload",
    "check_chunking",
    "cut_file",
    "resolve_codec",
]

#: The values of ``compression``: see :func:`resolve_codec`.
COMPRESSIONS = ("auto", "on", "off")

#: Largest chunk: 16 MiB of logical bytes. Small enough that a partial load
#: reads little beyond its slice and that encoding runs in parallel pieces,
#: large enough that a GiB is 64 objects, not thousands of requests.
CHUNK_BYTES = 16 << 20
#: Files smaller than this are copied into the checkpoint directory whole
#: (``state.json``, metadata, small extras): a chunk costs a request of its own.
MIN_CHUNKED_BYTES = 1 << 20

#: Bytes per element of each safetensors dtype (pieces of a tensor are cut at
#: element boundaries and the byte-plane codec splits planes by this size).
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


@dataclass(frozen=True)
class Piece:
    """One chunk of a file: ``length`` bytes at ``offset``, of elements of ``itemsize`` bytes."""

    offset: int
    length: int
    itemsize: int = 1


@dataclass(frozen=True)
class ChunkedEntry:
    """A manifest entry whose file lives as chunks: ``chunks`` is
    ``[[object name, logical bytes, stored bytes], ...]`` in file order."""

    path: str
    size: int
    crc32c: str
    chunks: list[list[Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "crc32c": self.crc32c,
                "chunks": [list(c) for c in self.chunks]}


def _pieces(offset: int, length: int, itemsize: int, limit: int) -> Iterator[Piece]:
    step = max(itemsize, limit - limit % itemsize)
    end = offset + length
    while offset < end:
        n = min(step, end - offset)
        yield Piece(offset, n, itemsize)
        offset += n


def _safetensors_pieces(fd: int, size: int, limit: int) -> list[Piece] | None:
    """A safetensors file cut at its tensors' boundaries, or None when the
    file is not one (its header does not parse or does not fit)."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, 100 << 20):
        return None
    try:
        header = json.loads(os.pread(fd, n, 8))
        spans = sorted(
            (int(v["data_offsets"][0]), int(v["data_offsets"][1]),
             _ITEMSIZE.get(str(v.get("dtype")), 1))
            for k, v in header.items() if k != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        return None
    base = 8 + n
    pieces = [Piece(0, base)]
    at = 0
    for begin, end, itemsize in spans:
        if begin < at or end < begin or base + end > size:
            return None  # overlapping or out of the file: not a layout we cut
        if begin > at:
            pieces.extend(_pieces(base + at, begin - at, 1, limit))
        pieces.extend(_pieces(base + begin, end - begin, itemsize, limit))
        at = end
    if base + at < size:
        pieces.extend(_pieces(base + at, size - base - at, 1, limit))
    return pieces


def cut_file(path: str, size: int, *, limit: int = CHUNK_BYTES) -> list[Piece]:
    """How a local file of ``size`` bytes is cut into chunks: a ``.safetensors``
    file into its header and each tensor's bytes in pieces of at most
    ``limit`` bytes (cut at element boundaries); any other file into pieces
    of ``limit`` bytes."""
    if path.endswith(".safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            cut = _safetensors_pieces(fd, size, limit)
        finally:
            os.close(fd)
        if cut is not None:
            return cut
    return list(_pieces(0, size, 1, limit))


def check_chunking(dedup: object, compression: object) -> tuple[bool, str]:
    """``(dedup, compression)`` checked.

    Raises:
        InvalidConfigError: ``dedup`` is not a bool, or ``compression`` is not
            one of :data:`COMPRESSIONS`.
    """
    if not isinstance(dedup, bool):
        raise InvalidConfigError(f"dedup must be True or False, got {dedup!r}")
    if compression not in COMPRESSIONS:
        raise InvalidConfigError(
            f"compression must be one of {', '.join(map(repr, COMPRESSIONS))}, got "
            f"{compression!r}")
    return dedup, str(compression)


def resolve_codec(compression: str, backend: Backend) -> str:
    """The codec new chunks get on ``backend``: ``"off"`` stores them raw,
    ``"on"`` with the byte-plane codec, ``"auto"`` with it where bytes are
    dear (object stores, remote filesystems) and raw where the store is
    faster than the codec (the local disk, memory)."""
    if compression == "auto":
        return codec_for(backend.filesystem)
    return PLANES_ZSTD if compression == "on" else RAW


#: What identifies one version of a source file: inode, size, mtime (ns).
_Stamp = tuple[int, int, int]


def _stamp_of(st: os.stat_result) -> _Stamp:
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class _Cut:
    rel: str
    size: int
    pieces: list[Piece]
    stamp: _Stamp = (0, 0, 0)
    names: list[str] = field(default_factory=list)
    crcs: list[int] = field(default_factory=list)


class ChunkedUpload:
    """Commit a local directory with its large files as chunks of ``store``.

    Args:
        src_fs, src_dir: the source directory (its filesystem must be the local disk).
        dest: the destination backend (for the small files' copy).
        store: the experiment's :class:`~checkpoint_store._chunks.store.ChunkStore`.
        codec: the codec new chunks are encoded with (``"raw"`` or a codec of
            :mod:`checkpoint_store._chunks.codec`).
        writer: this writer's id (names its intent).
        fsync, retry: as for the commit's copy of the small files.
        workers: threads hashing, encoding and uploading chunks.
        min_bytes, chunk_bytes: see :data:`MIN_CHUNKED_BYTES` and :data:`CHUNK_BYTES`.

    Use as ``write=upload.write`` of a commit, then call :meth:`finish`
    whatever its outcome.
    """

    def __init__(self, src_fs: pafs.FileSystem, src_dir: str, dest: Backend, store: Any, *,
                 codec: str, writer: str, fsync: bool = True, retry: RetryPolicy | None = None,
                 workers: int = 8, min_bytes: int = MIN_CHUNKED_BYTES,
                 chunk_bytes: int = CHUNK_BYTES,
                 include: Callable[[str], bool] = lambda rel: True) -> None:
        root = local_path(src_fs, src_dir)
        if root is None:
            raise ValueError("chunked uploads read their source from the local disk")
        self.src_fs, self.src_dir, self.root = src_fs, src_dir, root
        self.dest, self.store, self.codec, self.writer = dest, store, codec, writer
        self.fsync, self.retry, self.workers = fsync, retry, max(1, workers)
        self.min_bytes, self.chunk_bytes, self.include = min_bytes, chunk_bytes, include
        self._intent: Any = None
        self._lock = threading.Lock()
        #: Bytes of chunks this upload stored (encoded), and their logical bytes.
        self.uploaded_bytes = 0
        self.uploaded_logical = 0

    def _changed(self, rel: str, how: str) -> SourceChangedError:
        """The error for source file ``rel`` that changed (``how``) while its
        chunks were stored: its chunks would not hold the file its manifest
        names, and a chunk whose bytes are not those its name hashes would
        corrupt every later checkpoint that holds the genuine bytes."""
        return SourceChangedError(
            f"{os.path.join(self.root, rel)} {how} while it was being stored as chunks; "
            "nothing of the checkpoint is committed. Write the checkpoint completely before "
            "reporting it (wait for whatever writes it)", path=self.src_dir, file=rel)

    def _stamp(self, rel: str) -> _Stamp:
        try:
            return _stamp_of(os.stat(os.path.join(self.root, rel)))
        except FileNotFoundError:
            raise SourceDeletedError(
                f"{os.path.join(self.root, rel)} was deleted while the checkpoint was being "
                "stored; nothing of it is committed. Keep the directory until the report "
                "returns", path=self.src_dir, file=rel) from None

    def _read(self, cut: _Cut, piece: Piece) -> bytes:
        """``piece`` of ``cut``'s file, read while the file is still the
        version planned (same inode, size and mtime)."""
        try:
            fd = os.open(os.path.join(self.root, cut.rel), os.O_RDONLY)
        except FileNotFoundError:
            self._stamp(cut.rel)  # raises SourceDeletedError when it is gone
            raise
        try:
            data = os.pread(fd, piece.length, piece.offset)
            now = _stamp_of(os.fstat(fd))
        finally:
            os.close(fd)
        if len(data) != piece.length:
            raise self._changed(cut.rel, f"shrank (read {len(data)} bytes at offset "
                                         f"{piece.offset}, expected {piece.length})")
        if now != cut.stamp:
            raise self._changed(cut.rel, "was rewritten")
        return data

    def _hash(self, cut: _Cut, piece: Piece) -> tuple[str, int]:
        data = self._read(cut, piece)
        return chunk_name(data), google_crc32c.value(data)

    def _plan(self, files: Sequence[tuple[str, int]]) -> tuple[list[_Cut], list[tuple[str, int]]]:
        cuts, rest = [], []
        for rel, size in files:
            if size >= self.min_bytes:
                stamp = self._stamp(rel)
                if stamp[1] != size:
                    raise self._changed(rel, f"was {size} bytes when listed, {stamp[1]} now,")
                cuts.append(_Cut(rel, size, cut_file(os.path.join(self.root, rel), size,
                                                     limit=self.chunk_bytes), stamp))
            else:
                rest.append((rel, size))
        # Piece by piece, not file by file: a state is often one shard.
        jobs = [(cut, p) for cut in cuts for p in cut.pieces]
        with ThreadPoolExecutor(self.workers) as pool:
            hashed = list(pool.map(lambda job: self._hash(*job), jobs))
        for (cut, _), (name, crc) in zip(jobs, hashed, strict=True):
            cut.names.append(name)
            cut.crcs.append(crc)
        return cuts, rest

    def _check_unchanged(self, cut: _Cut) -> None:
        """Raise unless ``cut``'s file is still the version whose chunks were
        named: the chunks found present were not read again."""
        if self._stamp(cut.rel) != cut.stamp:
            raise self._changed(cut.rel, "was rewritten")

    def _upload(self, intent: Any, cuts: list[_Cut]) -> dict[str, int]:
        """Encode and store the chunks ``intent`` says are missing; returns
        every referenced object's stored size (read from the store's answer
        for the chunks already there, from the encoding for new ones)."""
        todo: dict[str, tuple[_Cut, Piece, int]] = {}
        for cut in cuts:
            for name, piece, crc in zip(cut.names, cut.pieces, cut.crcs, strict=True):
                obj = intent.object_names[name]
                if obj in intent.missing and obj not in todo:
                    todo[obj] = (cut, piece, crc)
        stored: dict[str, int] = dict(getattr(intent, "stored_sizes", {}) or {})

        def one(item: tuple[str, tuple[_Cut, Piece, int]]) -> None:
            obj, (cut, piece, crc) = item
            data = self._read(cut, piece)
            # The object is named by the bytes hashed earlier: bytes read
            # now must be those, or the name would lie to every later save.
            if google_crc32c.value(data) != crc:
                raise self._changed(cut.rel, "was rewritten")
            blob = encode_chunk(data, itemsize=piece.itemsize, codec=self.codec)
            intent.upload(obj, blob)
            with self._lock:
                stored[obj] = len(blob)
                self.uploaded_bytes += len(blob)
                self.uploaded_logical += piece.length

        with ThreadPoolExecutor(self.workers) as pool:
            list(pool.map(one, todo.items()))
        return stored

    def write(self, fs: pafs.FileSystem, target: str) -> list[Any]:
        """The commit's ``write``: chunks into the store, small files into
        ``target``; returns the manifest entries of every file."""
        files = source_files(self.src_fs, self.src_dir, include=self.include,
                             confine_links=True, retry=self.retry,
                             dest_caps=self.dest.capabilities,
                             dest_name=self.dest.name or self.dest.scheme, committing=True)
        cuts, rest = self._plan(files)
        names = [n for c in cuts for n in c.names]
        sizes = {n: p.length for c in cuts for n, p in zip(c.names, c.pieces, strict=True)}
        if self._intent is not None:  # a retry: the first intent stays ours
            self._intent.finish()
        self._intent = self.store.begin(names, writer=self.writer, sizes=sizes)
        stored = self._upload(self._intent, cuts)
        for cut in cuts:
            self._check_unchanged(cut)
        entries: list[Any] = []
        if rest:
            entries = copy_tree(self.src_fs, self.src_dir, fs, target, self.dest.capabilities,
                                files=rest, fsync=self.fsync, retry=self.retry)
        if time.time() - self._intent.created_at > INTENT_TTL_S / 2:
            # A gc counts an intent this old as a crashed writer's: the
            # chunks it found present may be gone by the time the marker is.
            raise TransientBackendError(
                f"storing the chunks of {len(cuts)} file(s) took over "
                f"{INTENT_TTL_S / 7200:g} h; not committing a checkpoint whose chunks a "
                "garbage collection may have freed meanwhile: report it again")
        for cut in cuts:
            crc = 0
            chunks: list[list[Any]] = []
            for name, piece, part in zip(cut.names, cut.pieces, cut.crcs, strict=True):
                obj = self._intent.object_names[name]
                crc = crc32c_combine(crc, part, piece.length) if chunks else part
                chunks.append([obj, piece.length, stored.get(obj, piece.length)])
            entries.append(ChunkedEntry(cut.rel, cut.size, crc_hex(crc), chunks))
        return entries

    def finish(self) -> None:
        """Remove the intent (after the marker is written, or the commit failed)."""
        if self._intent is not None:
            self._intent.finish()
