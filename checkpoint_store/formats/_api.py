"""What export and import share: the formats of a source and how it is opened.

:class:`Exported`, which reader a location needs (:func:`detect_format`,
decided from its listing unless ``source_format`` says) and the
:class:`~._sources.Source` it is read through (:func:`open_source`; a
``torch.save`` file or DCP directory on a remote backend is read from a
local copy), and the streamed copy of files between filesystems. The two
calls of this package, :mod:`._export` and :mod:`._import`, build on these:
both take locations as everything else does (a local path, any backend URI,
or a path with ``filesystem=``) and stream tensor by tensor (:mod:`._shards`).
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow.fs as pafs

from checkpoint_store._chunks.files import chunked_entries
from checkpoint_store._chunks.read import materialized
from checkpoint_store._format.layout import INTERNAL_METADATA
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import read_internal_metadata
from checkpoint_store.backends.base import Backend
from checkpoint_store.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    InvalidConfigError,
)
from checkpoint_store.formats._sources import (
    CHUNK_BYTES,
    SafetensorsSource,
    Source,
    StateSource,
)
from checkpoint_store.registry import resolve
from checkpoint_store.state import STATE_FILE, escape_key

__all__ = ["Exported", "detect_format", "open_source"]

SourceFormat = Literal["state", "hf", "safetensors", "torch_save", "dcp"]
SOURCE_FORMATS = ("state", "hf", "safetensors", "torch_save", "dcp")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


@dataclass(frozen=True)
class Exported:
    """What :func:`export_checkpoint` wrote.

    Attributes:
        uri: the target (a folder for ``hf`` and ``dcp``, a file for ``torch_save``).
        files: the names written, relative to a folder target.
        tensors: tensors written; nbytes: their bytes.
    """

    uri: str
    files: tuple[str, ...]
    tensors: int
    nbytes: int


# -- sources ------------------------------------------------------------------------


def _listing(backend: Backend, path: str) -> dict[str, int] | None:
    """``{relative path: size}`` of a folder's top-level files; None for a file."""
    kind = _fsutil.kind(backend.filesystem, path)
    if kind == pafs.FileType.File:
        return None
    if kind != pafs.FileType.Directory:
        raise CheckpointNotFoundError(f"{backend.uri_for(path)} does not exist")
    infos = _fsutil.list_dir(backend.filesystem, path)
    files = {posixpath.basename(i.path): i.size for i in infos if i.type == pafs.FileType.File}
    meta = _chunked_meta(backend, path, files)
    for e in chunked_entries(meta):  # kept as chunks (dedup): listed by the manifest
        if "/" not in e["path"]:
            files[e["path"]] = e["size"]
    return files


def _chunked_meta(backend: Backend, path: str,
                  files: Mapping[str, int]) -> dict[str, Any] | None:
    """The marker of the checkpoint at ``path`` when some of its files live
    as chunks (saved with dedup), else None."""
    if INTERNAL_METADATA not in files:
        return None
    meta = read_internal_metadata(backend.filesystem, path)
    return meta if chunked_entries(meta) else None


def detect_format(backend: Backend, path: str) -> SourceFormat:
    """Which reader a location needs: ``state`` (a ``state.json``),
    ``dcp`` (a ``.metadata``), ``hf`` (``.safetensors`` files),
    ``torch_save`` (a file, or a folder with one ``.pt``/``.pth``/``.bin``/``.ckpt``).

    Raises:
        CheckpointNotFoundError: nothing there, or no tensors in a known format.
        InvalidConfigError: several ``torch.save`` files: name one.
    """
    files = _listing(backend, path)
    if files is None:
        return "safetensors" if path.endswith(".safetensors") else "torch_save"
    if STATE_FILE in files:
        return "state"
    if ".metadata" in files:
        return "dcp"
    if any(n.endswith(".safetensors") for n in files):
        return "hf"
    pts = [n for n in files if n.endswith(_TORCH_SUFFIXES)]
    if len(pts) == 1:
        return "torch_save"
    if pts:
        raise InvalidConfigError(f"{backend.uri_for(path)} holds several torch.save files "
                                 f"({', '.join(sorted(pts))}); give the path of one")
    if any(n.endswith(".distcp") for n in files):
        raise CheckpointCorruptError(
            f"{backend.uri_for(path)} holds DCP .distcp files but no .metadata: the save did "
            "not finish (DCP writes .metadata last); use an earlier checkpoint", path=path,
            file=".metadata")
    raise CheckpointNotFoundError(
        f"{backend.uri_for(path)} holds no state.json, safetensors, DCP or torch.save files")


def _copy(src_fs: pafs.FileSystem, src: str, dst_fs: pafs.FileSystem, dst: str) -> None:
    """Copy a file, or a folder's files (dot files included), streamed."""
    if _fsutil.kind(src_fs, src) == pafs.FileType.File:
        pairs = [(src, dst)]
    else:
        pairs = [(i.path, posixpath.join(dst, _fsutil.relative(src, i.path)))
                 for i in _fsutil.list_tree(src_fs, src) if i.type == pafs.FileType.File]
        dst_fs.create_dir(dst, recursive=True)
    for a, b in pairs:
        parent = posixpath.dirname(b)
        if parent:
            dst_fs.create_dir(parent, recursive=True)
        with src_fs.open_input_stream(a) as fin, dst_fs.open_output_stream(b) as fout:
            while True:
                piece = fin.read(CHUNK_BYTES)
                if not piece:
                    break
                fout.write(piece)


@contextmanager
def _local_copy(backend: Backend, path: str) -> Iterator[str]:
    """A local path of ``path``: itself on a local disk, else a temporary copy."""
    local = _fsutil.local_path(backend.filesystem, path)
    if local is not None:
        yield local
        return
    tmp = tempfile.mkdtemp(prefix="checkpoint-store-format-")
    try:
        target = os.path.join(tmp, posixpath.basename(path.rstrip("/")) or "source")
        _copy(backend.filesystem, path, pafs.LocalFileSystem(), target)
        yield target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def open_source(backend: Backend, path: str, fmt: SourceFormat | None = None,
                key_of: Callable[[str], str] = escape_key) -> Iterator[Source]:
    """The :class:`Source` of a location (see :func:`detect_format`);
    ``key_of`` turns a safetensors name into a state key."""
    fmt = fmt or detect_format(backend, path)
    if fmt not in SOURCE_FORMATS:
        raise InvalidConfigError(f"source format {fmt!r} is not one of {SOURCE_FORMATS}")
    fs = backend.filesystem
    if fmt != "state":
        files = _listing(backend, path)
        meta = None if files is None else _chunked_meta(backend, path, files)
        if meta is not None:
            # Files kept as chunks are not in the folder: read a verified
            # local copy (a state's reader fetches its chunks itself).
            with materialized(fs, path, backend.capabilities, meta) as local:
                with open_source(resolve(local)[0], local, fmt, key_of) as source:
                    yield source
            return
    if fmt == "state":
        yield StateSource(fs, path)
    elif fmt in ("hf", "safetensors"):
        files = _listing(backend, path)
        yield SafetensorsSource(fs, path, {"": fs.get_file_info(path).size}
                                if files is None else files, key_of)
    else:
        from checkpoint_store.formats._dcp_source import DCPSource
        from checkpoint_store.formats._torch import TorchSaveSource

        with _local_copy(backend, path) as local:
            if fmt == "dcp":
                yield DCPSource(local)
            else:
                if os.path.isdir(local):
                    pts = [n for n in os.listdir(local) if n.endswith(_TORCH_SUFFIXES)]
                    local = os.path.join(local, pts[0]) if len(pts) == 1 else local
                yield TorchSaveSource(local)
