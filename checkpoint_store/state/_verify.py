"""Checking tensors' bytes against the index's CRC32C.

:func:`_check_all` checksums what a load read, in pieces of
:data:`PIECE_BYTES` in parallel, combined with ``crc32c_combine``;
:func:`verify_tensors` and :func:`name_corrupt_tensor` read a file's tensors
back for ``Checkpoint.verify()`` to name the damaged one.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._format.manifest import is_chunked
from checkpoint_store._transfer.crc32c import crc32c_combine
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.errors import (
    CheckpointCorruptError,
    CheckpointStoreError,
    TensorCorruptError,
)
from checkpoint_store.state._fetch import _Fetcher
from checkpoint_store.state._files import STATE_FILE, crc32c_of
from checkpoint_store.state._index import read_state_index

__all__ = ["name_corrupt_tensor", "verify_tensors"]


def _corrupt(path: str, key: str, e: Mapping[str, Any], got: int) -> TensorCorruptError:
    return TensorCorruptError(
        f"tensor {key!r} ({e['file']!r}, bytes [{e['offsets'][0]}, {e['offsets'][1]})) of "
        f"checkpoint {path!r} does not match its checksum (crc32c {got:08x}, the index says "
        f"{e['crc32c']}); the checkpoint is damaged: resume from an earlier one",
        path=path, file=e["file"], tensor=key)


def _check(path: str, key: str, e: Mapping[str, Any], data: Any) -> None:
    """``data`` against the entry's CRC32C and, where it has them, each of
    its blocks' (one pass: the whole's CRC combined from the blocks'), so a
    block checksum that a partial read would reject fails here too."""
    blocks = e.get("blocks")
    if not blocks:
        got = crc32c_of(data)
        if f"{got:08x}" != e["crc32c"]:
            raise _corrupt(path, key, e, got)
        return
    view = memoryview(data).cast("B")
    rows = e["shape"][0] if e["shape"] else 1  # a scalar is one row, as the reader takes it
    step = blocks[0] * (len(view) // rows) if rows else 0
    got = 0
    for i, want in enumerate(blocks[1]):
        part = view[i * step:(i + 1) * step]
        crc = crc32c_of(part)
        got = crc32c_combine(got, crc, len(part)) if i else crc
        if f"{crc:08x}" != want:
            raise TensorCorruptError(
                f"tensor {key!r} ({e['file']!r}, bytes [{e['offsets'][0]}, "
                f"{e['offsets'][1]})) of checkpoint {path!r}: its block {i} does not match "
                f"its checksum (crc32c {crc:08x}, the index says {want}); the checkpoint is "
                "damaged: resume from an earlier one", path=path, file=e["file"], tensor=key)
    if f"{got:08x}" != e["crc32c"]:
        raise _corrupt(path, key, e, got)


#: Bytes per piece a tensor is read and checksummed in, in parallel
#: (google-crc32c releases the GIL: pieces on several cores at once).
PIECE_BYTES = 64 << 20


def _pieces(n: int) -> list[tuple[int, int]]:
    return [(a, min(a + PIECE_BYTES, n)) for a in range(0, n, PIECE_BYTES)]


def _check_all(path: str, items: Sequence[tuple[str, Mapping[str, Any], memoryview]],
               run: Any) -> None:
    """Check every ``(key, entry, bytes)``, pieces checksummed in parallel
    (``run(fn, items)``) and combined; raises for the first failure in order."""
    pieces = [(i, a, b) for i, (_, _, view) in enumerate(items) for a, b in _pieces(len(view))]
    crcs: dict[tuple[int, int], int] = {}

    def one(piece: tuple[int, int, int]) -> None:
        i, a, b = piece
        crcs[(i, a)] = crc32c_of(items[i][2][a:b])

    run(one, pieces)
    for i, (key, e, view) in enumerate(items):
        crc = 0
        for a, b in _pieces(len(view)):
            crc = crc32c_combine(crc, crcs[(i, a)], b - a) if a else crcs[(i, a)]
        if f"{crc:08x}" != e["crc32c"]:
            raise _corrupt(path, key, e, crc)


def verify_tensors(fs: pafs.FileSystem, path: str, tensors: Mapping[str, Any], *,
                   file: str | None = None, retry: RetryPolicy | None = None,
                   sizes: Mapping[str, int] | None = None) -> None:
    """Check each stored tensor's bytes (of ``file`` only, when given)
    against the index's CRC32C.

    Raises:
        TensorCorruptError: the first tensor (by file, then offset) whose
            bytes differ or lie past its file's end; ``.tensor`` names it.
    """
    from checkpoint_store.state._shards import pieces_bytes

    # A tensor stored in pieces (several ranks) is checked piece by piece.
    entries = sorted(((k, e) for k, e in pieces_bytes(tensors)
                      if file is None or e.get("file") == file),
                     key=lambda ke: (ke[1]["file"], ke[1]["offsets"][0]))
    if sizes is None:
        sizes = {}
        for _, e in entries:
            if e["file"] not in sizes:
                try:
                    sizes[e["file"]] = fs.get_file_info(posixpath.join(path, e["file"])).size
                except OSError:
                    sizes[e["file"]] = 0
    fetch = _Fetcher(fs, path, sizes, retry, 4)
    for key, e in entries:
        begin, end = e["offsets"]
        if end > (sizes.get(e["file"]) or 0):
            raise TensorCorruptError(
                f"tensor {key!r} of checkpoint {path!r} lies past the end of {e['file']!r} "
                "(the file is truncated); resume from an earlier checkpoint",
                path=path, file=e["file"], tensor=key)
        buf = memoryview(bytearray(end - begin))
        fetch.fill([(e["file"], begin, buf)])
        _check(path, key, e, buf)



def name_corrupt_tensor(fs: pafs.FileSystem, path: str, meta: Mapping[str, Any] | None,
                        sizes: Mapping[str, int] | None, error: CheckpointCorruptError,
                        *, retry: RetryPolicy | None = None) -> None:
    """For ``Checkpoint.verify()``: when the file ``error`` names is one of a
    state's safetensors shards, raise a :class:`TensorCorruptError` naming
    the first tensor of it whose bytes fail their checksum (chained to
    ``error``); return quietly otherwise (the header is what differs, the
    checkpoint holds no state, or the shard is kept as chunks, whose
    ``error`` already names the chunk), so the caller raises ``error`` itself.

    The index is the marker's ``"tensors"``, else that of ``state.json``
    (a state reported as a directory).
    """
    if error.file is None or isinstance(error, TensorCorruptError):
        return
    if meta is not None and any(isinstance(e, dict) and e.get("path") == error.file
                                and is_chunked(e) for e in meta.get("manifest") or ()):
        return  # kept as chunks: ``error`` names the chunk; the file is not there to read
    tensors = meta.get("tensors") if meta is not None else None
    if not isinstance(tensors, dict):
        if error.file == STATE_FILE or not sizes or STATE_FILE not in sizes:
            return
        try:
            tensors = read_state_index(fs, path, retry=retry).tensors
        except CheckpointStoreError:
            return
    from checkpoint_store.state._shards import pieces_bytes

    if not any(e.get("file") == error.file for _, e in pieces_bytes(tensors)):
        return
    try:
        verify_tensors(fs, path, tensors, file=error.file, retry=retry, sizes=sizes)
    except TensorCorruptError as exc:
        raise exc from error
    except (OSError, KeyError, TypeError, ValueError):
        return
