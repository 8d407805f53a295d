"""Safetensors shards written to any filesystem, streamed, with their checksums.

:func:`plan_shards` cuts a list of named tensors into files of at most
``max_bytes`` of tensor data (a larger tensor gets a file of its own) and
builds each file's header; :func:`write_shard` streams one file to a
``pyarrow.fs`` output stream from a :class:`~._sources.Source`, a reader
thread fetching the next piece while the current one is written (reads and
writes overlap; at most two pieces of :data:`~._sources.CHUNK_BYTES` are in
memory). It returns the file's size and CRC32C and each tensor's offsets and
CRC32C (and, for a tensor of two or more blocks of rows, its block CRCs, as
a state's writer takes them), so a commit needs no second read.

The files are plain safetensors (8-byte little-endian header length, JSON
header padded with spaces to a multiple of 8, then the data with no gaps),
widest elements first so every tensor is aligned to its element size.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import google_crc32c
import pyarrow.fs as pafs

from checkpoint_store._transfer.crc32c import crc32c_combine, crc32c_concat
from checkpoint_store.errors import CheckpointCorruptError
from checkpoint_store.formats._sources import CHUNK_BYTES, Entry, Source, crc_extend
from checkpoint_store.state import DTYPES, encode_header
from checkpoint_store.state._files import block_bytes

__all__ = ["Planned", "Written", "ahead", "copy_file", "plan_shards", "write_shard"]


@dataclass(frozen=True)
class Planned:
    """One file to write.

    Attributes:
        name: the file's name (relative to the target folder).
        header: the header bytes (length prefix included).
        items: ``(name in the file, source entry)`` in file order.
        size: the whole file in bytes.
    """

    name: str
    header: bytes
    items: tuple[tuple[str, Entry], ...]
    size: int


@dataclass(frozen=True)
class Written:
    """A file written: its size, CRC32C (8 hex digits), and per tensor
    (name in the file) ``(begin, end, crc32c hex)``, offsets from the file
    start; ``blocks``: the index's ``[rows per block, [CRC32C hex]]`` of each
    tensor of two or more blocks of rows (docs/sharded-state.md)."""

    name: str
    size: int
    crc32c: str
    tensors: dict[str, tuple[int, int, str]]
    blocks: dict[str, list[Any]] = field(default_factory=dict)


class _TensorCrc:
    """The CRC32C of one tensor's bytes fed in order, and of each block of
    ``step`` bytes (None: the tensor is one block) from the same pass."""

    def __init__(self, step: int | None):
        self.step, self.crc, self.fill = step, 0, 0
        self.parts: list[list[int]] = []  # [crc, length] of each block so far

    def add(self, data: Any) -> None:
        """Feed the tensor's next bytes (bytes-like)."""
        if self.step is None:
            self.crc = crc_extend(self.crc, data)
            return
        view = memoryview(data).cast("B")
        at = 0
        while at < len(view):
            if self.fill == 0:
                self.parts.append([0, 0])
            n = min(self.step - self.fill, len(view) - at)
            part = self.parts[-1]
            part[0], part[1] = crc_extend(part[0], view[at:at + n]), part[1] + n
            self.fill, at = (self.fill + n) % self.step, at + n

    def value(self) -> int:
        """The CRC32C of every byte fed (combined from the blocks' when split)."""
        return self.crc if self.step is None else crc32c_concat(self.parts)

    def blocks(self, shape: Sequence[int], nbytes: int) -> list[Any] | None:
        """The index's ``blocks`` of the tensor of ``shape`` and ``nbytes``
        fed whole; None when it is one block."""
        if self.step is None:
            return None
        return [self.step // (nbytes // shape[0]), [f"{c:08x}" for c, _ in self.parts]]


def plan_shards(items: Sequence[tuple[str, Entry]], max_bytes: int,
                name_for: Callable[[int, int], str],
                metadata: Mapping[str, str] | None = None) -> list[Planned]:
    """Group ``(name, entry)`` pairs, in order, into files of at most
    ``max_bytes`` of data; ``name_for(k, n)`` names file ``k`` (from 1) of ``n``."""
    groups: list[list[tuple[str, Entry]]] = []
    filled = 0
    for name, e in items:
        if not groups or (filled + e.nbytes > max_bytes and filled > 0):
            groups.append([])
            filled = 0
        groups[-1].append((name, e))
        filled += e.nbytes
    if not groups:
        groups = [[]]
    out = []
    for k, group in enumerate(groups, 1):
        group.sort(key=lambda ne: -DTYPES[ne[1].dtype][0])  # stable: keeps order per width
        head: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        at = 0
        for name, e in group:
            head[name] = {"dtype": e.dtype, "shape": list(e.shape),
                          "data_offsets": [at, at + e.nbytes]}
            at += e.nbytes
        header = encode_header(head)
        out.append(Planned(name_for(k, len(groups)), header, tuple(group), len(header) + at))
    return out


_END = object()


def ahead(it: Iterator[Any]) -> Iterator[Any]:
    """``it``'s items, the next one fetched in a thread while the caller
    handles the current one (one item read ahead at most)."""
    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-store-format-read") as pool:
        fut = pool.submit(next, it, _END)
        while True:
            item = fut.result()
            if item is _END:
                return
            fut = pool.submit(next, it, _END)
            yield item


def _pieces(source: Source, plan: Planned, crcs: bool
            ) -> Iterator[tuple[str, Any, _TensorCrc | None]]:
    """``(name, piece, the tensor's CRCs so far or None)`` over the file's tensors."""
    for name, e in plan.items:
        crc, n = (_TensorCrc(block_bytes(e.shape, e.nbytes)) if crcs else None), 0
        for piece in source.chunks(e.key):
            if crc is not None:
                crc.add(piece)
            n += len(piece)
            yield name, piece, crc
        if n != e.nbytes:
            raise CheckpointCorruptError(
                f"tensor {e.key!r} of {source.where} gave {n} bytes, {e.nbytes} expected")
        if n == 0:
            yield name, b"", crc


def write_shard(fs: pafs.FileSystem, path: str, plan: Planned, source: Source, *,
                crcs: bool = True) -> Written:
    """Write ``plan`` to ``path`` (one output stream), its bytes from ``source``.

    ``crcs=False`` skips the CRC32C of what is written (the returned ones
    are then 0): a Hugging Face folder records none, and the source checks
    its own as it reads.

    Raises:
        TensorCorruptError: a source tensor failed its checksum (the file is
            left incomplete: the caller removes it).
        OSError and backend errors: the write failed.
    """
    file_crc = google_crc32c.value(plan.header)
    tensor_crc: dict[str, _TensorCrc | None] = {}
    with fs.open_output_stream(path) as out:
        out.write(plan.header)
        for name, piece, crc in ahead(_pieces(source, plan, crcs)):
            if len(piece):
                out.write(piece)
            tensor_crc[name] = crc
    at = len(plan.header)
    spans: dict[str, tuple[int, int, str]] = {}
    blocks: dict[str, list[Any]] = {}
    for name, e in plan.items:
        tc = tensor_crc.get(name)
        crc = tc.value() if tc is not None else 0
        spans[name] = (at, at + e.nbytes, f"{crc:08x}")
        if tc is not None and (b := tc.blocks(e.shape, e.nbytes)) is not None:
            blocks[name] = b
        file_crc = crc32c_combine(file_crc, crc, e.nbytes) if e.nbytes else file_crc
        at += e.nbytes
    return Written(plan.name, plan.size, f"{file_crc:08x}", spans, blocks)


def copy_file(fs_in: pafs.FileSystem, src: str, fs_out: pafs.FileSystem | None, dst: str | None,
              spans: Mapping[str, tuple[int, int]], size: int,
              shapes: Mapping[str, Sequence[int]] | None = None) -> Written:
    """Read ``src`` once, front to back, in pieces (writing each to ``dst``
    on ``fs_out`` unless that is None); return its CRC32C and the CRC32C of
    each named byte span ``[begin, end)`` (spans must not overlap), and the
    block CRCs of each span that ``shapes`` gives a tensor's shape of two or
    more blocks of rows.

    Raises:
        CheckpointCorruptError: ``src`` is shorter than ``size``.
    """
    order = sorted(spans.items(), key=lambda kv: kv[1])
    ends = [e for _, (_b, e) in order]
    crcs = {name: _TensorCrc(block_bytes(shapes[name], e - b)
                             if shapes is not None and name in shapes else None)
            for name, (b, e) in spans.items()}

    def pieces() -> Iterator[tuple[int, bytes]]:
        with fs_in.open_input_file(src) as f:
            at = 0
            while at < size:
                piece = f.read_at(min(CHUNK_BYTES, size - at), at)
                if not piece:
                    raise CheckpointCorruptError(f"{fs_in.type_name}:{src} ends at byte {at}, "
                                                 f"before its listed size {size}", path=src)
                yield at, piece
                at += len(piece)

    file_crc = 0
    out = fs_out.open_output_stream(dst) if fs_out is not None and dst is not None else None
    try:
        for at, piece in ahead(pieces()):
            if out is not None:
                out.write(piece)
            file_crc = crc_extend(file_crc, piece)
            end = at + len(piece)
            # Spans are sorted and disjoint: start at the first ending after `at`.
            i = bisect.bisect_right(ends, at)
            while i < len(order) and order[i][1][0] < end:
                name, (b, e) = order[i]
                lo, hi = max(b, at) - at, min(e, end) - at
                if hi > lo:
                    crcs[name].add(memoryview(piece)[lo:hi])
                i += 1
    finally:
        if out is not None:
            out.close()
    blocks = {name: got for name, (b, e) in spans.items()
              if shapes is not None and name in shapes
              and (got := crcs[name].blocks(shapes[name], e - b)) is not None}
    return Written(src.rstrip("/").rsplit("/", 1)[-1], size, f"{file_crc:08x}",
                   {name: (b, e, f"{crcs[name].value():08x}") for name, (b, e) in spans.items()},
                   blocks)

