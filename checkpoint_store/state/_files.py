"""The files of a state: safetensors shards and ``state.json`` (docs/state.md).

:class:`StateWriter` writes a :class:`~checkpoint_store.state._tree.StateLayout`'s
files into a local directory from raw bytes, in any order and in pieces
(``os.pwrite`` at planned offsets), so a persist process can write tensors
from shared memory as they arrive without torch or numpy. :func:`write_state`
(a tree) and :func:`write_buffers` (``name -> (dtype, shape, bytes)``) are
the one-call forms. Each returns the **tensor index**: flattened key ->
``{"file", "dtype", "shape", "offsets": [begin, end), "crc32c", "framework"}``,
the offsets in bytes from the start of the file, which a commit records in the
checkpoint's internal metadata as ``"tensors"``. A tensor of at least two
checked blocks of whole rows (:func:`rows_per_block`) also gets
``"blocks": [rows, [CRC32C hex of each block]]``, taken on the way from the
same bytes as its ``crc32c`` (no second pass), so that a sharded load of a
one-rank checkpoint reads and checks only the rows each rank needs
(docs/sharded-state.md).

The shards are plain safetensors files (8-byte little-endian header length,
JSON header padded with spaces to a multiple of 8 bytes, then the data,
tensors in key order of the plan with no gaps), readable by
``safetensors.safe_open`` and every other safetensors reader. A tensor's name
in a header is its flattened key, except for the one name the safetensors
format reserves (``__metadata__``, the header's own metadata entry), which
:func:`header_name` escapes so the header stays valid; the index (and so
every load) keeps the flattened key itself.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checkpoint_store._transfer.crc32c import crc32c_combine, crc32c_concat, crc32c_extend
from checkpoint_store.errors import InvalidConfigError, UnsupportedStateError
from checkpoint_store.state._tree import (
    DTYPES,
    StateLayout,
    TensorSpec,
    escape_key,
    flatten_state,
    split_key,
)

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "STATE_FILE",
    "STATE_FORMAT_VERSION",
    "StateWriter",
    "header_name",
    "key_of_header_name",
    "layout_of_buffers",
    "shard_name",
    "write_buffers",
    "write_state",
]

#: The JSON file of a state: the tree's skeleton, its JSON leaves and the index.
STATE_FILE = "state.json"
#: ``state.json``'s own ``format_version``: 1 for a state written whole by
#: one rank, 2 once some tensor is stored in pieces (``"shards"``), so a
#: reader that predates pieces refuses it instead of misreading it.
STATE_FORMAT_VERSION = 1
SHARDED_FORMAT_VERSION = 2
#: Default largest shard: 1 GiB of tensor data per safetensors file (a
#: tensor larger than that gets a file of its own). Large enough that a
#: model is a few files, small enough that one file is a reasonable unit of
#: upload retry and of parallel download.
DEFAULT_SHARD_BYTES = 1 << 30

_SHARD_RE = re.compile(r"^tensors(-rank\d{5,})?-(\d{5,})-of-(\d{5,})\.safetensors$")
#: Bytes hashed per call (google-crc32c holds the GIL per call).
_CRC_CHUNK = 64 << 20

#: Most bytes of rows per checksummed block of a tensor or piece: a partial
#: read reads and checks whole blocks, so it reads at most two blocks more
#: than it needs. A tensor has about :data:`BLOCKS_PER_PIECE` blocks (at
#: least :data:`MIN_BLOCK_BYTES` each), so that excess stays a few percent
#: of a 1/16 slice whatever its size (11 bytes of index per block: 11 KiB
#: per GiB of tensors of 256 MiB and more, up to 0.03% of smaller ones).
BLOCK_BYTES = 1 << 20
MIN_BLOCK_BYTES = 64 << 10
BLOCKS_PER_PIECE = 256


def rows_per_block(nbytes: int, row_bytes: int) -> int:
    """Rows per checked block of ``nbytes`` of rows ``row_bytes`` long:
    about 1/256 of them, between :data:`MIN_BLOCK_BYTES` and
    :data:`BLOCK_BYTES` of rows (at least one row)."""
    target = max(MIN_BLOCK_BYTES, min(BLOCK_BYTES, nbytes // BLOCKS_PER_PIECE))
    return max(1, target // max(1, row_bytes))


def block_bytes(shape: Sequence[int], nbytes: int) -> int | None:
    """Bytes per checked block of a whole tensor; None when it would be one
    block (a scalar, one row, or rows that fit in one block)."""
    if not shape or shape[0] < 2 or not nbytes:
        return None
    row_bytes = nbytes // shape[0]
    rows = rows_per_block(nbytes, row_bytes)
    return rows * row_bytes if rows < shape[0] else None


#: The key of a safetensors header that is not a tensor: the header's own
#: metadata (``{"format": "pt"}``). A tensor of that flattened key would
#: replace it, and no safetensors reader would open the file.
SAFETENSORS_METADATA = "__metadata__"
#: How :data:`SAFETENSORS_METADATA` is written as a tensor name: ``~2`` never
#: occurs in a flattened key (``~`` is always escaped as ``~0`` there), so the
#: escaped name is no other tensor's.
_ESCAPED_METADATA = "~2" + SAFETENSORS_METADATA


def encode_header(header: Mapping[str, Any]) -> bytes:
    """A safetensors header as it starts a file: its length (8 bytes,
    little-endian u64), then compact UTF-8 JSON padded with spaces to a
    multiple of 8 bytes (the tensors' data then starts aligned)."""
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def header_name(key: str) -> str:
    """The name tensor ``key`` (a flattened key) has in its shard's
    safetensors header: ``key`` itself, but ``"__metadata__"`` (the name
    safetensors reserves for the header's metadata) is ``"~2__metadata__"``."""
    return _ESCAPED_METADATA if key == SAFETENSORS_METADATA else key


def key_of_header_name(name: str) -> str:
    """The flattened key of a tensor named ``name`` in a shard's header
    (inverse of :func:`header_name`)."""
    return SAFETENSORS_METADATA if name == _ESCAPED_METADATA else name


def shard_name(number: int, count: int, stem: str = "tensors") -> str:
    """``tensors-00001-of-00003.safetensors``: shard ``number`` (from 1) of
    ``count``; ``stem`` ``tensors-rank00002`` for rank 2's files of a
    sharded state."""
    return f"{stem}-{number:05d}-of-{count:05d}.safetensors"


def is_shard_name(name: str) -> bool:
    return _SHARD_RE.match(name) is not None


def crc32c_of(data: Any, crc: int = 0) -> int:
    """CRC32C of a bytes-like object (memoryview included), extended from ``crc``."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _CRC_CHUNK):
        crc = crc32c_extend(crc, view[start:start + _CRC_CHUNK])
    return crc


@dataclass(frozen=True)
class _Shard:
    name: str
    header: bytes
    size: int  # the whole file, header included
    keys: tuple[str, ...]


def _plan(layout: StateLayout,
          shard_bytes: int) -> tuple[list[_Shard], dict[str, tuple[int, int, str]]]:
    """Shards in tree order, a new one when the next tensor would take the
    current one past ``shard_bytes``; ``key -> (begin, end, file)``."""
    groups: list[list[str]] = []
    filled = 0
    for key, spec in layout.tensors.items():
        n = spec.nbytes
        if not groups or (filled + n > shard_bytes and filled > 0):
            groups.append([])
            filled = 0
        groups[-1].append(key)
        filled += n
    shards: list[_Shard] = []
    where: dict[str, tuple[int, int, str]] = {}
    for number, group in enumerate(groups, 1):
        # Widest elements first: every tensor then starts at a multiple of its
        # element size (the data starts at a multiple of 8), so a memory map
        # hands out aligned tensors, and safetensors wants no gaps.
        keys = sorted(group, key=lambda k: -DTYPES[layout.tensors[k].dtype][0])
        file_name = shard_name(number, len(groups), layout.file_stem)
        header_obj: dict[str, Any] = {}
        frameworks = {layout.tensors[k].framework for k in keys}
        header_obj[SAFETENSORS_METADATA] = {"format": "pt" if "torch" in frameworks else "np"}
        offset = 0
        for key in keys:
            spec = layout.tensors[key]
            name = header_name(key)
            if name in header_obj:  # a hand-made layout with a key that is not canonical
                raise UnsupportedStateError(
                    f"tensor keys {key!r} and {key_of_header_name(name)!r} take the same name "
                    f"{name!r} in a safetensors header; use flattened keys (escape_key: "
                    "'~' is written '~0', '/' inside a name '~1')", key=key)
            header_obj[name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                                "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        header = encode_header(header_obj)
        base = len(header)
        for key in keys:
            begin, end = header_obj[header_name(key)]["data_offsets"]
            where[key] = (base + begin, base + end, file_name)
        shards.append(_Shard(file_name, header, base + offset, tuple(keys)))
    return shards, where


class StateWriter:
    """Writes one state's files into a local directory from raw bytes.

    Usage::

        with StateWriter(directory, flat.layout) as w:
            for key, data in flat.buffers():   # any order; pieces allowed
                w.write(key, data)
            index = w.close()

    Args:
        directory: a local directory (created if missing). The files it
            writes must not exist there yet.
        layout: what to write (:func:`~checkpoint_store.state.flatten_state`'s
            ``.layout``, or one sent from another process: it pickles).
        shard_bytes: largest tensor data per safetensors file, in bytes
            (default :data:`DEFAULT_SHARD_BYTES`, 1 GiB); > 0.
        create: make ``directory`` if it is missing (default). False: it
            must exist, else ``FileNotFoundError`` and nothing is written;
            the persist process writes so, into the directory the training
            process made, and never makes again one removed meanwhile (a
            report that failed drops its directory while the persist process
            may still be on its way to it).

    Thread use: :meth:`write` may be called from several threads at once
    (each piece is one ``pwrite`` at its own offset); :meth:`close` once,
    after every write returned.

    Raises:
        InvalidConfigError: ``shard_bytes`` <= 0, a file it would write
            exists already, or ``directory`` (or one above it) is a file;
            nothing written.
    """

    def __init__(self, directory: str | os.PathLike[str], layout: StateLayout, *,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, create: bool = True):
        if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes <= 0:
            raise InvalidConfigError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.layout = layout
        self._shards, self._where = _plan(layout, shard_bytes)
        self._parts: dict[str, list[tuple[int, int, int]]] = {k: [] for k in layout.tensors}
        # Bytes per checked block, for the tensors split into blocks.
        self._blocks = {k: b for k, spec in layout.tensors.items()
                        if (b := block_bytes(spec.shape, spec.nbytes)) is not None}
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._closed = False
        try:
            if create:
                os.makedirs(self.directory, exist_ok=True)
            elif not os.path.isdir(self.directory):
                if os.path.lexists(self.directory):
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory", self.directory)
                # Checked here for a clear message; a removal after this check
                # still fails the O_EXCL opens below (no makedirs anywhere).
                raise FileNotFoundError(
                    errno.ENOENT, "the directory to write the state into is gone",
                    self.directory)
        except (FileExistsError, NotADirectoryError) as exc:  # a file on the way
            raise InvalidConfigError(
                f"cannot write a state into {self.directory!r}: it, or a directory above it, "
                "exists and is not a directory; give a new or empty directory") from exc
        names = [s.name for s in self._shards] + [STATE_FILE]
        for name in names:
            if os.path.lexists(os.path.join(self.directory, name)):
                raise InvalidConfigError(
                    f"cannot write a state into {self.directory!r}: {name!r} exists there "
                    "already; write each state into a new or empty directory"
                )
        try:
            for shard in self._shards:
                fd = os.open(os.path.join(self.directory, shard.name),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                             0o644)
                self._fds[shard.name] = fd
                _pwrite_all(fd, shard.header, 0)
                os.ftruncate(fd, shard.size)
        except BaseException:
            self.abort()
            raise

    @property
    def files(self) -> list[str]:
        """The names of the files it writes (shards, then ``state.json``)."""
        return [s.name for s in self._shards] + [STATE_FILE]

    def offsets(self, key: str) -> tuple[str, int, int]:
        """``(file, begin, end)`` planned for tensor ``key`` (bytes from the file start)."""
        begin, end, name = self._where[key]
        return name, begin, end

    def write(self, key: str, data: Any, *, offset: int = 0) -> None:
        """Write ``data`` (bytes-like: bytes, memoryview, a shared-memory
        buffer) as the bytes of tensor ``key`` from byte ``offset`` of that
        tensor on; its CRC32C is taken on the way.

        Raises:
            InvalidConfigError: ``key`` is not a tensor of the layout, or the
                piece runs past the tensor's end.
        """
        if key not in self._where:
            raise InvalidConfigError(f"{key!r} is not a tensor of this state's layout")
        begin, end, name = self._where[key]
        view = data if isinstance(data, bytes) else memoryview(data).cast("B")
        n = len(view)
        if offset < 0 or begin + offset + n > end:
            raise InvalidConfigError(
                f"bytes [{offset}, {offset + n}) do not fit tensor {key!r} of {end - begin} "
                "bytes"
            )
        if n:
            _pwrite_all(self._fds[name], view, begin + offset)
        step = self._blocks.get(key)
        if step is None:
            parts = [(offset, n, crc32c_of(view))]
        else:  # one CRC per block's share: the blocks' CRCs and the whole's
            cuts = [offset, *range((offset // step + 1) * step, offset + n, step), offset + n]
            parts = [(a, b - a, crc32c_of(view[a - offset:b - offset]))
                     for a, b in itertools.pairwise(cuts) if b > a or n == 0]
        with self._lock:
            self._parts[key].extend(parts)

    def _crc(self, key: str) -> str:
        begin, end, _ = self._where[key]
        want = end - begin
        at = 0
        run: list[tuple[int, int, int]] = []  # (offset, length, crc) kept
        for offset, n, part in sorted(self._parts[key], key=lambda p: (p[0], -p[1])):
            if offset + n <= at and (n or offset < at):
                continue
            if offset != at:
                break
            run.append((offset, n, part))
            at += n
        if at != want:
            raise InvalidConfigError(
                f"tensor {key!r} was not written whole ({at} of {want} bytes contiguous "
                "from its start); write every byte of every tensor once before close()"
            )
        self._parts[key] = run  # longest first at an offset; bytes written again left out
        return f"{crc32c_concat((part, n) for _, n, part in run):08x}"

    def _block_crcs(self, key: str) -> list[Any]:
        """``[rows per block, [CRC32C hex]]`` of a tensor, from the parts :meth:`_crc` kept."""
        step = self._blocks[key]
        crcs: list[int] = []
        for offset, n, part in sorted(self._parts[key]):
            if not n:
                continue
            if offset % step == 0:  # a block's first part
                crcs.append(part)
            else:
                crcs[-1] = crc32c_combine(crcs[-1], part, n)
        spec = self.layout.tensors[key]
        return [step // (spec.nbytes // spec.shape[0]), [f"{c:08x}" for c in crcs]]

    def index(self) -> dict[str, Any]:
        """The tensor index (module docstring), aliases included; needs every
        tensor written."""
        out: dict[str, Any] = {}
        for key, spec in self.layout.tensors.items():
            name, begin, end = self.offsets(key)
            entry: dict[str, Any] = {"file": name, "dtype": spec.dtype,
                                     "shape": list(spec.shape), "offsets": [begin, end],
                                     "crc32c": self._crc(key), "framework": spec.framework}
            if key in self._blocks:
                entry["blocks"] = self._block_crcs(key)
            if spec.scalar:
                entry["scalar"] = True
            out[key] = entry
        for key, target in self.layout.aliases.items():
            out[key] = {**out[target], "alias_of": target}
        return out

    def close(self, *, fsync: bool = False) -> dict[str, Any]:
        """Finish: check every tensor was written whole, write ``state.json``
        (skeleton, JSON leaves, index), close the files.

        Args:
            fsync: flush the files and the directory to disk first (not
                needed when a commit copies them afterwards; it does its own).

        Returns:
            The tensor index (what ``internal["tensors"]`` records).

        Raises:
            InvalidConfigError: a tensor was not written whole; the files are
                removed.
        """
        try:
            index = self.index()
            body = {"kind": "checkpoint_store_state", "format_version": STATE_FORMAT_VERSION,
                    "tree": self.layout.skeleton, "tensors": index}
            raw = json.dumps(body, ensure_ascii=False, allow_nan=True,
                             separators=(",", ":")).encode("utf-8")
            path = os.path.join(self.directory, STATE_FILE)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            self._fds[STATE_FILE] = fd
            _pwrite_all(fd, raw, 0)
            for fd in self._fds.values():
                if fsync:
                    os.fsync(fd)
            self._close_fds()
            if fsync:
                dfd = os.open(self.directory, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return index

    def _close_fds(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def abort(self) -> None:
        """Close and remove every file written so far (idempotent)."""
        if self._closed:
            return
        self._close_fds()
        for name in [s.name for s in self._shards] + [STATE_FILE]:
            try:
                os.unlink(os.path.join(self.directory, name))
            except OSError:
                pass
        self._closed = True

    def __enter__(self) -> StateWriter:
        return self

    def __exit__(self, exc_type: Any, *_: object) -> None:
        if exc_type is not None:
            self.abort()


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def write_state(tree: Any, directory: str | os.PathLike[str], *,
                shard_bytes: int = DEFAULT_SHARD_BYTES, fsync: bool = False) -> dict[str, Any]:
    """Write a state tree's files into a local directory (docs/state.md).

    Args:
        tree: the state (:func:`~checkpoint_store.state.flatten_state`).
        directory: created if missing; must not hold a state already.
        shard_bytes: largest tensor data per safetensors file (bytes).
        fsync: flush files and directory to disk before returning.

    Returns:
        The tensor index: key -> ``{file, dtype, shape, offsets, crc32c,
        framework}`` (offsets ``[begin, end)`` in bytes from the file start).

    Raises:
        UnsupportedStateError: the tree cannot be stored (``.key`` names the
            entry); nothing written.
        InvalidConfigError: ``shard_bytes`` <= 0, or the directory holds a
            state; nothing written.
    """
    flat = flatten_state(tree)
    with StateWriter(directory, flat.layout, shard_bytes=shard_bytes) as writer:
        for key, data in flat.buffers():
            writer.write(key, data)
        return writer.close(fsync=fsync)


def layout_of_buffers(specs: Mapping[str, tuple[str, Sequence[int]]],
                      frameworks: Mapping[str, str] | None = None) -> StateLayout:
    """The layout of a state that is only tensors named by flattened keys:
    ``"model/layer1.weight"`` nests as ``{"model": {"layer1.weight": ...}}``
    (keys split at ``/``, ``~1`` and ``~0`` unescaped).

    Args:
        specs: flattened key -> ``(safetensors dtype, shape)``.
        frameworks: key -> ``"torch"`` or ``"numpy"`` (what a load returns);
            default ``"numpy"``, ``"torch"`` for dtypes numpy lacks (BF16, F8).

    Raises:
        UnsupportedStateError: an unknown dtype, a bad shape, one key
            that is a prefix of another (``"a"`` and ``"a/b"``), or a key
            that is no flattened key: a ``~`` not written ``~0`` or ``~1``
            (``"a~2"``; the entry ``a~2`` is keyed ``"a~02"``), which would
            load under another key than it was written with.
    """
    tensors: dict[str, TensorSpec] = {}
    root: dict[str, Any] = {}
    for key, (dtype, shape) in specs.items():
        if dtype not in DTYPES:
            raise UnsupportedStateError(
                f"tensor {key!r} has dtype {dtype!r}; safetensors dtypes are "
                f"{', '.join(DTYPES)}", key=key)
        dims = tuple(shape)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in dims):
            raise UnsupportedStateError(f"tensor {key!r} has shape {shape!r}; dimensions "
                                        "are ints >= 0", key=key)
        fw = (frameworks or {}).get(key) or ("numpy" if DTYPES[dtype][1] else "torch")
        if fw not in ("torch", "numpy") or (fw == "numpy" and DTYPES[dtype][1] is None):
            raise UnsupportedStateError(f"tensor {key!r}: framework {fw!r} cannot hold "
                                        f"dtype {dtype}", key=key)
        parts = split_key(key)
        canonical = "/".join(escape_key(p) for p in parts)
        if canonical != key:
            raise UnsupportedStateError(
                f"tensor key {key!r} is not a flattened key: inside a name '~' is written "
                f"'~0' and '/' '~1' (docs/state.md); did you mean {canonical!r}?", key=key)
        tensors[key] = TensorSpec(dtype, dims, fw)
        node = root
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            have = node.get(part)
            clash = (have is not None and (last or not isinstance(have, dict)))
            if clash:
                raise UnsupportedStateError(
                    f"tensor keys {key!r} and one under it (or above it) both exist; a key "
                    "cannot be both a tensor and a subtree", key=key)
            if last:
                node[part] = key
            else:
                node = node.setdefault(part, {})

    def skeleton(node: Any) -> Any:
        if isinstance(node, str):
            return {"tensor": node}
        return {"dict": [[k, skeleton(v)] for k, v in node.items()]}

    return StateLayout(skeleton(root), tensors)


def write_buffers(buffers: Mapping[str, tuple[str, Sequence[int], Any]],
                  directory: str | os.PathLike[str], *,
                  layout: StateLayout | None = None,
                  shard_bytes: int = DEFAULT_SHARD_BYTES,
                  fsync: bool = False) -> dict[str, Any]:
    """Write safetensors shards (and ``state.json``) from raw buffers: no
    torch or numpy needed, no copy beyond the write itself.

    Args:
        buffers: flattened key -> ``(dtype, shape, data)``: a safetensors
            dtype name (``"F32"``, ``"BF16"``), the shape, and the tensor's
            bytes in C order, little-endian (bytes, memoryview, a
            ``multiprocessing.shared_memory`` buffer).
        directory: a local directory (created if missing).
        layout: the state these are the tensors of (its skeleton and JSON
            leaves are written too; ``buffers`` must hold exactly its tensors
            with its dtypes and shapes). None: the state is the tensors
            alone, nested by their keys (:func:`layout_of_buffers`).
        shard_bytes: largest tensor data per safetensors file (bytes).
        fsync: flush files and directory to disk before returning.

    Returns:
        The tensor index, as :func:`write_state`.

    Raises:
        UnsupportedStateError: a buffer's size is not its dtype and shape's,
            or (with ``layout``) it does not match the layout; nothing written.
        InvalidConfigError: ``shard_bytes`` <= 0, or the directory holds a state.
    """
    if layout is None:
        layout = layout_of_buffers({k: (d, s) for k, (d, s, _) in buffers.items()})
    else:
        missing = sorted(set(layout.tensors) - set(buffers))
        extra = sorted(set(buffers) - set(layout.tensors))
        if missing or extra:
            key = (missing or extra)[0]
            raise UnsupportedStateError(
                f"buffers do not match the layout: {key!r} is "
                f"{'missing' if missing else 'not a tensor of it'}", key=key)
    for key, (dtype, shape, data) in buffers.items():
        spec = layout.tensors[key]
        if (dtype, tuple(shape)) != (spec.dtype, spec.shape):
            raise UnsupportedStateError(
                f"buffer {key!r} is {dtype} {list(shape)}, the layout says {spec.describe()}",
                key=key)
        n = memoryview(data).nbytes
        if n != spec.nbytes:
            raise UnsupportedStateError(
                f"buffer {key!r} holds {n} bytes; {spec.describe()} takes {spec.nbytes}",
                key=key)
    with StateWriter(directory, layout, shard_bytes=shard_bytes) as writer:
        for key, (_, _, data) in buffers.items():
            writer.write(key, data)
        return writer.close(fsync=fsync)


def shard_names(index: Mapping[str, Any]) -> list[str]:
    """The safetensors files an index names, sorted."""
    return sorted({e["file"] for e in index.values()})

