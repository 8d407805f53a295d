"""Where tensors come from: one small reader per format, all behind :class:`Source`.

A :class:`Source` describes a checkpoint's tensors without their bytes
(:class:`Entry`: flattened state key, safetensors dtype, shape, alias) and
hands each tensor's bytes as a stream of chunks of at most
:data:`CHUNK_BYTES`, so a writer holds one chunk (and one read ahead) at a
time whatever the checkpoint's size. Readers:

* :class:`StateSource`: a state saved by ``report(state=...)`` /
  ``Checkpoint.from_state`` (``state.json`` + safetensors shards): ranged
  reads, each tensor's CRC32C checked against the index as it streams.
* :class:`SafetensorsSource`: one ``.safetensors`` file or a folder of them
  (a Hugging Face model folder, with or without its
  ``model.safetensors.index.json``: the names come from the shards' own
  headers, and the index, when there, must agree).
* :class:`TorchSaveSource` (``torch.save`` files) and :class:`DCPSource`
  (torch.distributed.checkpoint directories) live in :mod:`._torch`, as they
  need torch.

Flattened keys are the state's (docs/state.md): components joined with
``/``, ``~`` and ``/`` inside a component escaped as ``~0`` and ``~1``.
"""

from __future__ import annotations

import abc
import json
import math
import os
import posixpath
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import google_crc32c
import pyarrow as pa
import pyarrow.fs as pafs

from checkpoint_store._util import fs as _fsutil
from checkpoint_store.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    TensorCorruptError,
)
from checkpoint_store.state import DTYPES, read_state_index
from checkpoint_store.state._tree import iter_leaves

__all__ = ["CHUNK_BYTES", "Entry", "crc_extend", "SafetensorsSource", "Source", "StateSource",
           "read_safetensors_header"]

#: Largest piece of a tensor read or written at once (bytes). A writer holds
#: one piece and reads the next ahead: 2 x this bounds the bytes in flight.
CHUNK_BYTES = 16 << 20

#: Largest safetensors header read (bytes); safetensors itself refuses > 100 MB.
_MAX_HEADER = 100_000_000

HF_INDEX = "model.safetensors.index.json"
_HF_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<k>\d{5})-of-(?P<n>\d{5})\.safetensors$")


def crc_extend(crc: int, data: Any) -> int:
    """CRC32C of ``data`` (bytes, memoryview, a buffer), extended from ``crc``."""
    if not isinstance(data, bytes):
        data = pa.py_buffer(memoryview(data).cast("B"))
    return int(google_crc32c.extend(crc, data))


@dataclass(frozen=True)
class Entry:
    """One tensor of a source, without its bytes.

    Attributes:
        key: its flattened state key (``model/layer.0.weight``).
        dtype: safetensors dtype name (:data:`checkpoint_store.state.DTYPES`).
        shape: elements per dimension.
        alias_of: the key of the tensor it is the very same view of (tied
            weights; its bytes are that tensor's), or None.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    alias_of: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of its data."""
        return math.prod(self.shape) * DTYPES[self.dtype][0]


class Source(abc.ABC):
    """The tensors (and JSON values) of one checkpoint, read tensor by tensor.

    Attributes:
        kind: ``"state"``, ``"safetensors"``, ``"torch_save"`` or ``"dcp"``.
        where: the location, for messages.
        entries: flattened key -> :class:`Entry`, in the checkpoint's order.
        values: flattened key -> JSON value (non-tensor leaves); only a
            state, a ``torch.save`` file or a DCP directory has any.
        skeleton: the state tree's skeleton (``state.json``'s ``tree``) when
            the source is a tree, else None (a flat set of named tensors).
    """

    kind: str = ""
    where: str = ""
    entries: dict[str, Entry]
    values: dict[str, Any]
    skeleton: Any = None

    @abc.abstractmethod
    def chunks(self, key: str) -> Iterator[Any]:
        """The bytes of tensor ``key`` (an alias: its target's) in order, as
        bytes-like pieces of at most :data:`CHUNK_BYTES`, C order,
        little-endian.

        Raises:
            TensorCorruptError: the bytes fail the checksum the source keeps
                (raised after the last piece).
        """

    def read_into(self, key: str, out: memoryview) -> None:
        """The bytes of tensor ``key`` into ``out`` (writable, exactly its
        size), checked as :meth:`chunks` checks them. A source that can read
        straight into ``out`` does (no copy of each piece in between).

        Raises:
            TensorCorruptError: as :meth:`chunks`; ``out`` then holds garbage.
        """
        at = 0
        for piece in self.chunks(key):
            n = len(piece)
            out[at:at + n] = memoryview(piece).cast("B")
            at += n


class _Ring:
    """Three reusable piece buffers for local reads: no fresh allocation (and
    page faults) per piece. A piece stays valid until two more are read,
    which covers a writer holding one while :func:`~._shards.ahead` reads the
    next."""

    def __init__(self) -> None:
        self._bufs: list[bytearray] = []
        self._next = 0

    def take(self, n: int) -> memoryview:
        if len(self._bufs) < 3:
            self._bufs.append(bytearray(CHUNK_BYTES))
            buf = self._bufs[-1]
        else:
            buf = self._bufs[self._next % 3]
            self._next += 1
        if len(buf) < n:
            buf.extend(bytes(n - len(buf)))
        return memoryview(buf)[:n]


def _ranged(fs: pafs.FileSystem, path: str, begin: int, end: int,
            ring: _Ring | None = None) -> Iterator[Any]:
    """Bytes ``[begin, end)`` of file ``path``, in pieces of :data:`CHUNK_BYTES`
    (on a local disk read with ``preadv`` into ``ring``'s buffers when given)."""
    if end <= begin:
        return
    local = _fsutil.local_path(fs, path) if ring is not None else None
    if local is not None and ring is not None:
        fd = os.open(local, os.O_RDONLY)
        try:
            at = begin
            while at < end:
                view = ring.take(min(CHUNK_BYTES, end - at))
                got = 0
                while got < len(view):
                    k = os.preadv(fd, [view[got:]], at + got)
                    if k == 0:
                        raise CheckpointCorruptError(
                            f"{path} ends at byte {at + got}, before byte {end} its index "
                            "names; the file is truncated", path=path)
                    got += k
                yield view
                at += len(view)
        finally:
            os.close(fd)
        return
    with fs.open_input_file(path) as f:
        at = begin
        while at < end:
            n = min(CHUNK_BYTES, end - at)
            piece = f.read_at(n, at)
            if len(piece) != n:
                raise CheckpointCorruptError(
                    f"{fs.type_name}:{path} ends at byte {at + len(piece)}, before byte {end} "
                    "its index names; the file is truncated", path=path)
            yield piece
            at += n


class StateSource(Source):
    """The tensors of a saved state (``state.json`` and its shards).

    Raises (at construction):
        CheckpointNotFoundError: no state there.
        CheckpointCorruptError: ``state.json`` or the marker is damaged.
    """

    kind = "state"

    def __init__(self, fs: pafs.FileSystem, path: str):
        saved = read_state_index(fs, path)
        self.fs, self.path = fs, path
        self._ring = _Ring()
        self.where = f"{fs.type_name}:{path}"
        self.committed = saved.committed
        self.skeleton = saved.skeleton
        self._index = saved.tensors
        self._sizes = saved.sizes
        self._chunked = saved.chunked  # files read through their chunks
        self.entries = {k: Entry(k, e["dtype"], tuple(e["shape"]), e.get("alias_of"))
                        for k, e in saved.tensors.items()}
        self.values = {k: node["value"] for k, node in iter_leaves(saved.skeleton)
                       if "value" in node}

    def chunks(self, key: str) -> Iterator[Any]:
        e = self._index[self._index[key].get("alias_of", key)]
        if "shards" in e:  # pieces of many ranks: assembled, each piece checked
            from checkpoint_store.state._box import read_whole

            yield memoryview(read_whole(self.fs, self.path, self._sizes, key, e,
                                        chunked=self._chunked)).cast("B")
            return
        crc = 0
        begin, end = e["offsets"]
        chunked = self._chunked.get(e["file"])
        pieces = (_ranged(self.fs, posixpath.join(self.path, e["file"]), begin, end, self._ring)
                  if chunked is None else
                  (chunked.read_range(a, min(CHUNK_BYTES, end - a))
                   for a in range(begin, end, CHUNK_BYTES)))
        for piece in pieces:
            crc = crc_extend(crc, piece)
            yield piece
        self._check(key, e, crc)

    def _check(self, key: str, e: Mapping[str, Any], crc: int) -> None:
        if f"{crc:08x}" != e["crc32c"]:
            raise TensorCorruptError(
                f"tensor {key!r} of {self.where} does not match its CRC32C (read "
                f"{crc:08x}, index {e['crc32c']}); the checkpoint is corrupt",
                path=self.path, file=e["file"], tensor=key)

    def read_into(self, key: str, out: memoryview) -> None:
        e = self._index[self._index[key].get("alias_of", key)]
        local = (None if "shards" in e or e["file"] in self._chunked else
                 _fsutil.local_path(self.fs, posixpath.join(self.path, e["file"])))
        if local is None:
            super().read_into(key, out)
            return
        begin, end = e["offsets"]
        if len(out) != end - begin:
            raise ValueError(f"tensor {key!r} has {end - begin} bytes; the buffer {len(out)}")
        crc = 0
        fd = os.open(local, os.O_RDONLY)
        try:
            for at in range(0, end - begin, CHUNK_BYTES):  # the CRC of a piece still in cache
                view = out[at:min(end - begin, at + CHUNK_BYTES)]
                got = 0
                while got < len(view):
                    k = os.preadv(fd, [view[got:]], begin + at + got)
                    if k == 0:
                        raise CheckpointCorruptError(
                            f"{local} ends at byte {begin + at + got}, before byte {end} its "
                            "index names; the file is truncated", path=self.path)
                    got += k
                crc = crc_extend(crc, view)
        finally:
            os.close(fd)
        self._check(key, e, crc)


@dataclass(frozen=True)
class Header:
    """A safetensors file's header: ``name -> (dtype, shape, begin, end)``
    with offsets from the start of the file, and its ``__metadata__``."""

    tensors: dict[str, tuple[str, tuple[int, ...], int, int]]
    metadata: dict[str, str]
    size: int


def read_safetensors_header(fs: pafs.FileSystem, path: str, size: int | None = None) -> Header:
    """Parse the header of the safetensors file ``path`` (two small reads).

    Raises:
        CheckpointCorruptError: not a safetensors file, an unknown dtype, or
            offsets that do not fit the dtype, the shape or the file.
    """
    where = f"{fs.type_name}:{path}"
    with fs.open_input_file(path) as f:
        total = f.size() if size is None else size
        head = f.read_at(8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or n > _MAX_HEADER or 8 + n > total:
            raise CheckpointCorruptError(f"{where} is not a safetensors file (header length "
                                         f"{n}, file {total} bytes)", path=path)
        raw = f.read_at(n, 8)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"{where}: its safetensors header is not JSON",
                                     path=path) from exc
    if not isinstance(body, dict):
        raise CheckpointCorruptError(f"{where}: its safetensors header is not an object",
                                     path=path)
    base = 8 + n
    meta = body.pop("__metadata__", None) or {}
    out: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for name, e in body.items():
        dtype, shape, off = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        ok = (dtype in DTYPES and isinstance(shape, list)
              and all(isinstance(d, int) and d >= 0 for d in shape)
              and isinstance(off, list) and len(off) == 2
              and all(isinstance(o, int) for o in off) and 0 <= off[0] <= off[1]
              and off[1] - off[0] == math.prod(shape) * DTYPES[dtype][0]
              and base + off[1] <= total)
        if not ok:
            raise CheckpointCorruptError(
                f"{where}: tensor {name!r} has a bad entry {e!r} (dtype, shape and offsets "
                f"must agree and fit the file's {total} bytes)", path=path)
        out[name] = (dtype, tuple(shape), base + off[0], base + off[1])
    return Header(out, {str(k): str(v) for k, v in meta.items()}, total)


class SafetensorsSource(Source):
    """Named tensors of safetensors files: one file, or every
    ``*.safetensors`` file at the top of a folder (a Hugging Face model
    folder). Each tensor's key is ``key_of(name)``.

    Where ``model.safetensors.index.json`` is there, its ``weight_map`` must
    name exactly the tensors the headers hold, each in its file; where it is
    missing, the index is what the headers say (a sharded set
    ``stem-0000k-of-0000n`` must then be complete).

    Raises (at construction):
        CheckpointNotFoundError: no safetensors file there.
        CheckpointCorruptError: a bad header, an index that disagrees with the
            headers, a shard of a numbered set missing, or a name in two files.
    """

    kind = "safetensors"

    def __init__(self, fs: pafs.FileSystem, path: str, files: Mapping[str, int],
                 key_of: Any = None):
        """``files``: relative name -> size of the safetensors files (and
        the index, if any) under the folder ``path``; ``{"": size}`` when
        ``path`` is one file."""
        self.fs, self.path = fs, path
        self._ring = _Ring()
        self.where = f"{fs.type_name}:{path}"
        names = sorted(r for r in files if r == "" or r.endswith(".safetensors"))
        if not names:
            raise CheckpointNotFoundError(f"{self.where} holds no .safetensors file")
        self._check_numbered(names)
        self._at: dict[str, tuple[str, int, int]] = {}
        self.entries, self.values = {}, {}
        self.headers: dict[str, Header] = {}
        owner: dict[str, str] = {}
        for rel in names:
            full = posixpath.join(path, rel) if rel else path
            header = read_safetensors_header(fs, full, files[rel])
            self.headers[rel] = header
            for name, (dtype, shape, begin, end) in header.tensors.items():
                if name in owner:
                    raise CheckpointCorruptError(
                        f"{self.where}: tensor {name!r} is in both {owner[name]!r} and "
                        f"{rel!r}", path=path, file=rel)
                owner[name] = rel
                key = key_of(name) if key_of else name
                self.entries[key] = Entry(key, dtype, shape)
                self._at[key] = (full, begin, end)
        if HF_INDEX in files:
            self._check_index(owner)

    def _check_numbered(self, names: list[str]) -> None:
        sets: dict[tuple[str, str], set[int]] = {}
        for rel in names:
            m = _HF_SHARD_RE.match(posixpath.basename(rel))
            if m:
                sets.setdefault((m["stem"], m["n"]), set()).add(int(m["k"]))
        for (stem, n), have in sets.items():
            missing = sorted(set(range(1, int(n) + 1)) - have)
            if missing:
                raise CheckpointCorruptError(
                    f"{self.where}: shard {missing[0]} of {int(n)} of {stem!r} is missing "
                    f"({stem}-{missing[0]:05d}-of-{n}.safetensors); copy it there first",
                    path=self.path, file=f"{stem}-{missing[0]:05d}-of-{n}.safetensors")

    def _check_index(self, owner: Mapping[str, str]) -> None:
        raw = _fsutil.read_bytes(self.fs, posixpath.join(self.path, HF_INDEX))
        try:
            wmap = json.loads(raw)["weight_map"]
            assert isinstance(wmap, dict)
        except (ValueError, KeyError, TypeError, AssertionError) as exc:
            raise CheckpointCorruptError(f"{self.where}/{HF_INDEX} has no weight_map object",
                                         path=self.path, file=HF_INDEX) from exc
        for name, rel in owner.items():
            if wmap.get(name) != rel:
                raise CheckpointCorruptError(
                    f"{self.where}/{HF_INDEX} puts {name!r} in {wmap.get(name)!r}, its "
                    f"header in {rel!r}; delete the index to rebuild it from the headers",
                    path=self.path, file=HF_INDEX)
        extra = sorted(set(wmap) - set(owner))
        if extra:
            raise CheckpointCorruptError(
                f"{self.where}/{HF_INDEX} names {extra[0]!r}, which no shard holds; a shard "
                "is missing or the index is stale", path=self.path, file=HF_INDEX)

    def file_of(self, key: str) -> tuple[str, int, int]:
        """``(file path, begin, end)`` of tensor ``key``'s bytes."""
        return self._at[key]

    def chunks(self, key: str) -> Iterator[Any]:
        full, begin, end = self._at[key]
        yield from _ranged(self.fs, full, begin, end, self._ring)

