"""``import_checkpoint``: a Hugging Face folder, a ``torch.save`` file or a DCP
directory made a committed checkpoint holding a state.

The source is opened by :func:`~._api.open_source`. In place (no ``dest``)
the folder gains ``state.json`` and the commit marker: a safetensors
folder's own files are the state's shards (each read once for its
checksums, no byte copied), a DCP directory's tensors are written as state
shards beside its files. Else the safetensors files are copied, or the
tensors written as state shards (:mod:`._shards`), into a new checkpoint
committed through :mod:`checkpoint_store._commit`; the marker carries the
``tensors`` index either way (docs/state.md).
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._commit.nesting import ancestors, refuse_inside_checkpoint
from checkpoint_store._commit.protocols import protocol_for
from checkpoint_store._format.layout import parse_checkpoint_dir_name, written_record_name
from checkpoint_store._format.manifest import ManifestEntry, is_checkpoint_data
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.backends.base import Backend
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import (
    CheckpointConflictError,
    InvalidConfigError,
    PermanentBackendError,
)
from checkpoint_store.formats._api import SourceFormat, _listing, detect_format, open_source
from checkpoint_store.formats._shards import Written, copy_file, plan_shards, write_shard
from checkpoint_store.formats._sources import Entry, SafetensorsSource, Source
from checkpoint_store.registry import resolve
from checkpoint_store.state import (
    DEFAULT_SHARD_BYTES,
    STATE_FILE,
    STATE_FORMAT_VERSION,
    escape_key,
    layout_of_buffers,
    shard_name,
)
from checkpoint_store.state._tree import rekey_skeleton

__all__ = ["import_checkpoint"]


def _state_json(skeleton: Any, index: Mapping[str, Any]) -> bytes:
    body = {"kind": "checkpoint_store_state", "format_version": STATE_FORMAT_VERSION,
            "tree": skeleton, "tensors": dict(index)}
    return json.dumps(body, ensure_ascii=False, allow_nan=True,
                      separators=(",", ":")).encode("utf-8")


def _index_entry(w: Written, name: str, e: Entry) -> dict[str, Any]:
    begin, end, crc = w.tensors[name]
    out = {"file": w.name, "dtype": e.dtype, "shape": list(e.shape), "offsets": [begin, end],
           "crc32c": crc, "framework": "torch"}
    if name in w.blocks:
        out["blocks"] = w.blocks[name]
    return out


def _put_json(fs: pafs.FileSystem, path: str, raw: bytes) -> ManifestEntry:
    from checkpoint_store.formats._sources import crc_extend

    with fs.open_output_stream(path) as out:
        out.write(raw)
    return ManifestEntry(posixpath.basename(path), len(raw), f"{crc_extend(0, raw):08x}")


def _internal(path: str, fmt: str, src_uri: str, tensors: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """The marker's fields for an import: the index its name says (a
    ``checkpoint_NNNNNN`` directory), else 0, where it came from, and the
    ``tensors`` index (docs/state.md) when given.

    A copied import passes an empty dict its ``write=`` callback fills: the
    protocol copies these fields (shallowly) before it calls ``write`` and
    builds the marker from the copy after ``write`` returns, so the marker
    carries the filled index, as an in-place import's does."""
    index = parse_checkpoint_dir_name(posixpath.basename(path.rstrip("/")))
    out: dict[str, Any] = {"index": index if index is not None else 0,
                           "imported_from": {"format": fmt, "uri": src_uri}}
    if tensors is not None:
        out["tensors"] = tensors  # not a copy: see above
    return out


def _refuse_bad_place(backend: Backend, path: str) -> None:
    """Raise before any write when the checkpoint directory ``path`` is a
    file, lies below a file (where there are folders), or lies inside a
    committed checkpoint (its manifest would not list the files: it would
    fail verification).

    Raises:
        InvalidConfigError: a file; NestedCheckpointError: inside a checkpoint.
    """
    if backend.capabilities.directories:
        for level in ancestors(path):
            if _fsutil.is_file(backend.filesystem, level):
                where = ("is" if level == path.rstrip("/") else
                         f"lies below {backend.uri_for(level)}, which is")
                raise InvalidConfigError(
                    f"{backend.uri_for(path)} {where} a file; import into a new folder "
                    "(dest=; the CLI's DEST)")
    parent = posixpath.dirname(path.rstrip("/"))
    if parent:
        refuse_inside_checkpoint(backend, parent, "import destination")


def _refuse_committed(backend: Backend, path: str) -> None:
    """Raise before any write when ``path`` is committed already."""
    if protocol_for(backend).inspect(path).meta is not None:
        raise CheckpointConflictError(f"{backend.uri_for(path)} is a committed checkpoint "
                                      "already; import it into another place (dest=)")


@contextmanager
def _undone_on_failure(backend: Backend, path: str) -> Iterator[None]:
    """Around an in-place import's writes into folder ``path``: when they
    fail (a damaged tensor half-way, a failed write), the files they added
    are removed, so the folder is as it was (a retry starts clean); a folder
    that takes no writes is a :class:`PermanentBackendError` saying to
    import elsewhere.

    Raises:
        PermanentBackendError: ``path`` cannot be written (read-only,
            permission denied).
    """
    fs = backend.filesystem
    before = set(_listing(backend, path) or {})
    try:
        yield
    except BaseException as exc:
        for name in sorted(set(_listing(backend, path) or {}) - before):
            try:
                fs.delete_file(posixpath.join(path, name))
            except OSError:
                pass
        refused = isinstance(exc, PermissionError) or (
            isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM))
        if refused and not isinstance(exc, PermanentBackendError):
            raise PermanentBackendError(
                f"{backend.uri_for(path)} cannot be written ({exc}), so it cannot be "
                "committed in place: import it into another place (dest=; the CLI's DEST)",
                cause=exc) from exc
        raise


def _import_hf_in_place(src: SafetensorsSource, backend: Backend, path: str,
                        files: Mapping[str, int]) -> Checkpoint:
    _refuse_committed(backend, path)
    if STATE_FILE in files:
        raise InvalidConfigError(f"{backend.uri_for(path)} holds a {STATE_FILE} already; "
                                 "import into another folder (dest=)")
    with _undone_on_failure(backend, path):
        return _commit_hf_in_place(src, backend, path, files)


def _commit_hf_in_place(src: SafetensorsSource, backend: Backend, path: str,
                        files: Mapping[str, int]) -> Checkpoint:
    fs = backend.filesystem
    index: dict[str, Any] = {}
    written: list[ManifestEntry] = []
    for rel in src.headers:
        spans = {k: src.file_of(k)[1:] for k in src.entries
                 if src.file_of(k)[0] == posixpath.join(path, rel)}
        w = copy_file(fs, posixpath.join(path, rel), None, None, spans, files[rel],
                      {k: src.entries[k].shape for k in spans})
        w = replace(w, name=rel)
        written.append(ManifestEntry(rel, w.size, w.crc32c))
        index.update({k: _index_entry(w, k, src.entries[k]) for k in spans})
    index = {k: index[k] for k in src.entries}
    skeleton = layout_of_buffers({k: (e.dtype, e.shape) for k, e in src.entries.items()},
                                 {k: "torch" for k in src.entries}).skeleton
    written.append(_put_json(fs, posixpath.join(path, STATE_FILE), _state_json(skeleton, index)))
    record = {"files": [e.to_json() for e in written]}
    _fsutil.write_bytes(fs, posixpath.join(path, written_record_name("import")),
                        json.dumps(record).encode(), backend.capabilities)
    meta = protocol_for(backend).commit_in_place(
        path, _internal(path, "hf", backend.uri_for(path), index))
    return Checkpoint._from_backend(backend, path, meta)


def _write_state_files(src: Source, fs: pafs.FileSystem, directory: str, shard_bytes: int,
                       key_of: Callable[[str], str]) -> tuple[list[ManifestEntry], dict[str, Any]]:
    """Write ``src``'s tensors as state shards plus ``state.json`` into ``directory``."""
    stored = [(key_of(k), e) for k, e in src.entries.items() if e.alias_of is None]
    plans = plan_shards(stored, shard_bytes, shard_name)
    entries: list[ManifestEntry] = []
    index: dict[str, Any] = {}
    for plan in plans:
        w = write_shard(fs, posixpath.join(directory, plan.name), plan, src)
        entries.append(ManifestEntry(plan.name, w.size, w.crc32c))
        index.update({name: _index_entry(w, name, e) for name, e in plan.items})
    for key, e in src.entries.items():
        if e.alias_of is not None:
            index[key_of(key)] = {**index[key_of(e.alias_of)], "alias_of": key_of(e.alias_of)}
    index = {key_of(k): index[key_of(k)] for k in src.entries}
    skeleton = rekey_skeleton(src.skeleton, key_of) if src.skeleton is not None else \
        layout_of_buffers({key_of(k): (e.dtype, e.shape) for k, e in src.entries.items()},
                          {key_of(k): "torch" for k in src.entries}).skeleton
    entries.append(_put_json(fs, posixpath.join(directory, STATE_FILE),
                             _state_json(skeleton, index)))
    return entries, index


def import_checkpoint(
    source: str | os.PathLike[str] | Checkpoint,
    dest: str | os.PathLike[str] | None = None,
    *,
    source_format: SourceFormat | None = None,
    prefix: str | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    storage_options: Mapping[str, Any] | None = None,
    dest_storage_options: Mapping[str, Any] | None = None,
    filesystem: Any = None,
    dest_filesystem: Any = None,
) -> Checkpoint:
    """Make a Hugging Face folder, a ``torch.save`` file or a DCP directory a
    committed checkpoint holding a state (docs/formats.md): ``load_state``,
    ``load_state(keys=...)`` and ``resume_from`` work on it.

    Args:
        source: the folder or file, on any backend (a ``Checkpoint`` too:
            an integration's checkpoint of DCP or ``torch.save`` files).
        dest: the checkpoint directory to create (any backend; must not be
            committed). None: in place: a Hugging Face or DCP folder is
            committed where it is (``state.json`` and the commit marker are
            added; no tensor byte is copied; each file is read once for its
            checksums).
        source_format: force the reader (:func:`detect_format` otherwise).
        prefix: the state key the tensors go under: a Hugging Face name
            ``h.0.attn.weight`` becomes ``model/h.0.attn.weight`` with the
            default (``"model"`` for safetensors, "" for ``torch.save`` and
            DCP, whose own trees are kept).
        shard_bytes: largest state shard written (``torch.save`` and DCP).
        storage_options, dest_storage_options: backend options of each side.
        filesystem, dest_filesystem: a ``pyarrow.fs.FileSystem`` or fsspec
            filesystem each side's path is in (instead of a URI).

    Returns:
        The committed :class:`~checkpoint_store.Checkpoint`.

    Raises:
        InvalidConfigError: ``dest`` None for a ``torch.save`` file or one
            ``.safetensors`` file; a ``state.json`` already there; ``dest``
            a file or below one.
        NestedCheckpointError: ``dest`` (or the folder, in place) lies
            inside a committed checkpoint.
        FormatConversionError, UnsupportedStateError: a value a state cannot
            hold; nothing written.
        CheckpointConflictError: ``dest`` is committed already.
        CheckpointNotFoundError, CheckpointCorruptError: the source is
            missing or damaged (a DCP directory without ``.metadata``; a
            Hugging Face index that disagrees with the shards' headers).
        PermanentBackendError: in place, the folder cannot be written
            (read-only): give ``dest``.

    An import that fails leaves nothing behind: in place, the files it
    added to the folder are removed; copied, nothing is committed.
    """
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes <= 0:
        raise InvalidConfigError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
    if isinstance(source, Checkpoint):
        backend, path = source.backend, source.path
    else:
        backend, path = resolve(source, filesystem=filesystem, storage_options=storage_options)
    fmt = source_format or detect_format(backend, path)
    if fmt == "state":
        raise InvalidConfigError(f"{backend.uri_for(path)} holds a state already: it needs no "
                                 "import (commit it with StorageContext.adopt)")
    safetensors = fmt in ("hf", "safetensors")
    pre = ("model" if safetensors else "") if prefix is None else prefix

    def key_of(name: str) -> str:
        return f"{escape_key(pre)}/{name}" if pre else name

    if dest is None:
        if fmt in ("torch_save", "safetensors") or _listing(backend, path) is None:
            what = ("a file" if _listing(backend, path) is None else
                    f"a folder of {fmt.replace('_', '.')} files, which is not imported in place")
            raise InvalidConfigError(f"{backend.uri_for(path)} is {what}: give dest= (DEST on "
                                     "the command line), the checkpoint directory to create")
        dst_backend, dst_path = backend, path
    else:
        dst_backend, dst_path = resolve(dest, filesystem=dest_filesystem,
                                        storage_options=dest_storage_options)
    in_place = (dst_backend.filesystem is backend.filesystem or
                dst_backend.uri_for(dst_path) == backend.uri_for(path)) and dst_path == path
    _refuse_bad_place(dst_backend, dst_path)
    if safetensors:
        with open_source(backend, path, fmt, lambda n: key_of(escape_key(n))) as src:
            files = _listing(backend, path)
            assert isinstance(src, SafetensorsSource)
            if in_place and files is not None:
                return _import_hf_in_place(src, backend, path, files)
            return _commit_copy(src, backend, path, files, dst_backend, dst_path)
    with open_source(backend, path, fmt) as src:
        if in_place:
            fs = backend.filesystem
            _refuse_committed(backend, path)
            with _undone_on_failure(backend, path):
                entries, index = _write_state_files(src, fs, path, shard_bytes, key_of)
                record = json.dumps({"files": [e.to_json() for e in entries]}).encode()
                _fsutil.write_bytes(fs, posixpath.join(path, written_record_name("import")),
                                    record, backend.capabilities)
                meta = protocol_for(backend).commit_in_place(
                    path, _internal(path, fmt, backend.uri_for(path), index))
            return Checkpoint._from_backend(backend, path, meta)

        filled: dict[str, Any] = {}

        def write(fs: pafs.FileSystem, directory: str) -> list[ManifestEntry]:
            entries, written = _write_state_files(src, fs, directory, shard_bytes, key_of)
            filled.clear()
            filled.update(written)
            return entries

        meta = protocol_for(dst_backend).commit(
            None, None, dst_path, _internal(dst_path, fmt, backend.uri_for(path), filled),
            write=write)
        return Checkpoint._from_backend(dst_backend, dst_path, meta)


def _commit_copy(src: SafetensorsSource, backend: Backend, path: str,
                 files: Mapping[str, int] | None, dst_backend: Backend,
                 dst_path: str) -> Checkpoint:
    """Copy a safetensors folder (every top-level file, as it is) into a new
    checkpoint, taking each tensor's CRC32C on the way, and commit it."""
    listing = ({rel: n for rel, n in files.items() if is_checkpoint_data(rel)}
               if files is not None else {"": src.headers[""].size})

    index: dict[str, Any] = {}

    def write(fs: pafs.FileSystem, directory: str) -> list[ManifestEntry]:
        entries: list[ManifestEntry] = []
        index.clear()
        for rel, size in sorted(listing.items()):
            full = posixpath.join(path, rel) if rel else path
            name = rel or posixpath.basename(path)
            spans = {k: src.file_of(k)[1:] for k in src.entries if src.file_of(k)[0] == full}
            w = copy_file(backend.filesystem, full, fs, posixpath.join(directory, name),
                          spans, size, {k: src.entries[k].shape for k in spans})
            w = replace(w, name=name)
            entries.append(ManifestEntry(name, w.size, w.crc32c))
            index.update({k: _index_entry(w, k, src.entries[k]) for k in spans})
        ordered = {k: index[k] for k in src.entries}
        index.clear()
        index.update(ordered)
        skeleton = layout_of_buffers({k: (e.dtype, e.shape) for k, e in src.entries.items()},
                                     {k: "torch" for k in src.entries}).skeleton
        entries.append(_put_json(fs, posixpath.join(directory, STATE_FILE),
                                 _state_json(skeleton, index)))
        return entries

    meta = protocol_for(dst_backend).commit(
        None, None, dst_path, _internal(dst_path, "hf", backend.uri_for(path), index),
        write=write)
    return Checkpoint._from_backend(dst_backend, dst_path, meta)
