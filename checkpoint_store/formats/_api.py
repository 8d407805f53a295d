"""``export_checkpoint`` and ``import_checkpoint``: the two calls of this package.

Both take locations as everything else does (a local path, any backend URI,
or a path with ``filesystem=``) and stream tensor by tensor
(:mod:`._shards`). Which reader a source gets is decided from its listing
(:func:`detect_format`) unless ``source_format`` says.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

import pyarrow.fs as pafs

from checkpoint_store._chunks.files import chunked_entries
from checkpoint_store._chunks.read import materialized
from checkpoint_store._commit.protocols import protocol_for
from checkpoint_store._format.layout import (
    INTERNAL_METADATA,
    parse_checkpoint_dir_name,
    written_record_name,
)
from checkpoint_store._format.manifest import ManifestEntry, is_checkpoint_data
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.inspect import read_internal_metadata
from checkpoint_store.backends.base import Backend
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    FormatConversionError,
    InvalidConfigError,
)
from checkpoint_store.formats._shards import Written, copy_file, plan_shards, write_shard
from checkpoint_store.formats._sources import (
    CHUNK_BYTES,
    HF_INDEX,
    Entry,
    SafetensorsSource,
    Source,
    StateSource,
)
from checkpoint_store.registry import resolve
from checkpoint_store.state import (
    DEFAULT_SHARD_BYTES,
    STATE_FILE,
    STATE_FORMAT_VERSION,
    escape_key,
    layout_of_buffers,
    shard_name,
    split_key,
)
from checkpoint_store.state._tree import rekey_skeleton

__all__ = ["Exported", "detect_format", "export_checkpoint", "import_checkpoint"]

ExportFormat = Literal["hf", "torch_save", "dcp"]
SourceFormat = Literal["state", "hf", "safetensors", "torch_save", "dcp"]
EXPORT_FORMATS = ("hf", "torch_save", "dcp")
SOURCE_FORMATS = ("state", "hf", "safetensors", "torch_save", "dcp")
#: Hugging Face's default largest shard (``save_pretrained(max_shard_size="5GB")``).
HF_SHARD_BYTES = 5 * 10**9
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
#: The name a safetensors header keeps for its own metadata, never a tensor's.
_SAFETENSORS_RESERVED = "__metadata__"


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


# -- export ---------------------------------------------------------------------------


def _selected(source: Source, prefix: str) -> list[tuple[list[str], Entry]]:
    """``(components below prefix, entry)`` of the tensors under ``prefix``.

    Raises:
        FormatConversionError: no tensor there.
    """
    out = []
    want = split_key(prefix) if prefix else []
    for key, e in source.entries.items():
        parts = split_key(key)
        if parts[:len(want)] == want and len(parts) > len(want):
            out.append((parts[len(want):], e))
    if not out:
        raise FormatConversionError(
            f"{source.where} holds no tensor under {prefix!r} (its keys start "
            f"{sorted({split_key(k)[0] for k in source.entries})[:5]}); pass prefix= (the CLI's "
            "--prefix)",
            key=prefix)
    return out


def _default_prefix(source: Source, fmt: str) -> str:
    if fmt == "hf" and source.kind == "state" and any(
            split_key(k)[0] == "model" and len(split_key(k)) > 1 for k in source.entries):
        return "model"
    return ""


def hf_items(source: Source, prefix: str, name_prefix: str,
             shared: str) -> list[tuple[str, Entry]]:
    """``(Hugging Face name, entry)`` of the tensors under ``prefix``: the
    components below it joined by ``.``, after ``name_prefix``.

    Raises:
        FormatConversionError: two tensors map to one name, or one maps to
            ``__metadata__`` (safetensors' reserved name); a tensor that
            shares another's storage with ``shared="error"``; a non-tensor
            value under ``prefix``; no tensor there. Nothing is written.
    """
    if shared not in ("error", "drop", "copy"):
        raise InvalidConfigError(f"shared must be 'error', 'drop' or 'copy', got {shared!r}")
    want = split_key(prefix) if prefix else []
    for key in source.values:
        if split_key(key)[:len(want)] == want:
            raise FormatConversionError(
                f"{key!r} is a {type(source.values[key]).__name__} value, not a tensor; "
                "safetensors holds tensors only: export a prefix without it (prefix=; the CLI's "
                "--prefix)",
                key=key)
    seen: dict[str, str] = {}
    out = []
    for parts, e in _selected(source, prefix):
        name = name_prefix + ".".join(parts)
        if e.alias_of is not None:
            if shared == "error":
                raise FormatConversionError(
                    f"tensor {e.key!r} shares its storage with {e.alias_of!r} (tied weights); "
                    "safetensors cannot share: pass shared='drop' (transformers re-ties "
                    "them on load) or shared='copy'", key=e.key)
            if shared == "drop":
                continue
        if name in seen:
            raise FormatConversionError(
                f"tensors {seen[name]!r} and {e.key!r} both map to the name {name!r}; "
                "rename one or export them separately", key=e.key)
        if name == _SAFETENSORS_RESERVED:
            # The header's own entry: no safetensors reader would open the shard.
            raise FormatConversionError(
                f"tensor {e.key!r} maps to the name {name!r}, which safetensors reserves for "
                "its header's metadata; export it under another name (name_prefix=, or a "
                "prefix= that leaves it out; the CLI's --name-prefix, --prefix)", key=e.key)
        seen[name] = e.key
        out.append((name, e))
    return out


def _hf_shard_name(k: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"


def _refuse_existing(backend: Backend, path: str, names: list[str]) -> dict[str, int]:
    """Raise before any write when the target folder ``path`` is a file, a
    checkpoint, or holds one of ``names``; else return its listing
    (:func:`_listing`; empty when it does not exist yet)."""
    files = _listing(backend, path) if _fsutil.exists(backend.filesystem, path) else {}
    if files is None:
        raise InvalidConfigError(f"{backend.uri_for(path)} is a file; export into a folder")
    if INTERNAL_METADATA in files:
        # Files added to a checkpoint's directory are outside its manifest:
        # it would fail verification, and resume would skip it.
        raise InvalidConfigError(
            f"{backend.uri_for(path)} is a checkpoint (it holds {INTERNAL_METADATA}); "
            "exporting into it would change its files and make it fail verification: "
            "export into a new or empty folder")
    clash = sorted(set(files) & set(names))
    if clash:
        raise InvalidConfigError(f"{backend.uri_for(path)} holds {clash[0]!r} already; "
                                 "export into a new or empty folder")
    return files


def _refuse_inside_checkpoint(src_backend: Backend, src_path: str, backend: Backend,
                              path: str) -> None:
    """Raise before any write when the target ``path`` is at or below the
    source's own folder, or below a committed checkpoint's folder (one
    holding a commit marker; the folder itself is :func:`_refuse_existing`'s):
    files added there are outside its manifest, and it would fail
    verification (resume skips it).

    Raises:
        InvalidConfigError: naming the checkpoint.
    """
    same = (src_backend.filesystem is backend.filesystem
            or src_backend.uri_for(src_path) == backend.uri_for(src_path))
    base = src_path.rstrip("/")
    if same and (path.rstrip("/") == base or path.startswith(base + "/")):
        raise InvalidConfigError(
            f"{backend.uri_for(path)} is inside the checkpoint it exports "
            f"({src_backend.uri_for(src_path)}); export to a place outside it")
    fs = backend.filesystem
    at = posixpath.dirname(path.rstrip("/"))
    while at and at not in ("/", "."):
        if _fsutil.is_file(fs, posixpath.join(at, INTERNAL_METADATA)):
            raise InvalidConfigError(
                f"{backend.uri_for(path)} is inside the checkpoint {backend.uri_for(at)}: "
                "files added there are outside its manifest and it would fail "
                "verification; export to a place outside it")
        at = posixpath.dirname(at)


def _export_hf(source: Source, backend: Backend, path: str, prefix: str, name_prefix: str,
               max_shard_size: int, shared: str) -> Exported:
    items = hf_items(source, prefix, name_prefix, shared)
    plans = plan_shards(items, max_shard_size, _hf_shard_name)
    names = [p.name for p in plans] + ([HF_INDEX] if len(plans) > 1 else [])
    _refuse_existing(backend, path, names)
    fs = backend.filesystem
    _fsutil.ensure_dir(fs, path, backend.capabilities)
    done: list[str] = []
    try:
        weight_map: dict[str, str] = {}
        for plan in plans:
            done.append(plan.name)
            write_shard(fs, posixpath.join(path, plan.name), plan, source, crcs=False)
            weight_map.update({name: plan.name for name, _ in plan.items})
        if len(plans) > 1:
            total = sum(e.nbytes for _, e in items)
            body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(
                weight_map.items()))}
            done.append(HF_INDEX)
            _fsutil.write_bytes(fs, posixpath.join(path, HF_INDEX),
                                json.dumps(body, indent=2).encode(), backend.capabilities)
    except BaseException:
        for name in done:
            _delete_quietly(fs, posixpath.join(path, name))
        raise
    return Exported(backend.uri_for(path), tuple(names), len(items),
                    sum(e.nbytes for _, e in items))


def _remove_local_output(out: str, had: set[str] | None) -> None:
    """Remove a torch export's file ``out``, or the files of DCP directory
    ``out`` not in ``had`` (what was there before; None: it did not exist)."""
    if os.path.isfile(out):
        os.remove(out)
        return
    if not os.path.isdir(out):
        return
    if had is None:
        shutil.rmtree(out, ignore_errors=True)
        return
    for name in set(os.listdir(out)) - had:
        full = os.path.join(out, name)
        shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except OSError:
        pass


def _refuse_dcp_files(backend: Backend, path: str, files: Mapping[str, int]) -> None:
    """Raise when folder ``path`` (its listing: ``files``) holds ``.distcp``
    files (an unfinished DCP save's): a DCP export would overwrite some
    (``__0_0.distcp``) and leave the others beside its ``.metadata``."""
    old = sorted(n for n in files if n.endswith(".distcp"))
    if old:
        raise InvalidConfigError(f"{backend.uri_for(path)} holds DCP files already "
                                 f"({old[0]!r}, ...); export into a new or empty folder")


def _upload(local: str, backend: Backend, path: str) -> None:
    """Copy a torch export written at ``local`` (a file, or a DCP folder) to
    ``path``: a DCP ``.metadata`` last, so a folder never names files that
    are not there yet; an upload that fails removes the files it put there.
    """
    fs = backend.filesystem
    if os.path.isfile(local):
        pairs = [(local, path)]
    else:
        names = sorted(os.listdir(local), key=lambda n: (n == ".metadata", n))
        pairs = [(os.path.join(local, n), posixpath.join(path, n)) for n in names]
        _fsutil.ensure_dir(fs, path, backend.capabilities)
    done: list[str] = []
    try:
        for a, b in pairs:
            done.append(b)
            _copy(pafs.LocalFileSystem(), a, fs, b)
    except BaseException:
        for b in done:
            _delete_quietly(fs, b)
        raise


def _subtree_skeleton(source: Source, prefix: str, keys: list[str]) -> Any:
    if source.skeleton is None:
        return {"dict": [[".".join(split_key(k)), {"tensor": k}] for k in keys]}
    node = source.skeleton
    for part in split_key(prefix) if prefix else []:
        node = next((v for k, v in node.get("dict", []) if str(k) == part), None)
        if node is None:
            raise FormatConversionError(f"{source.where} has no subtree {prefix!r}", key=prefix)
    return node


def _export_torch(source: Source, backend: Backend, path: str, prefix: str,
                  fmt: str) -> Exported:
    from checkpoint_store.formats._torch import write_dcp, write_torch_save

    selected = _selected(source, prefix)
    keys = [e.key for _, e in selected]
    if fmt == "torch_save":
        if _fsutil.exists(backend.filesystem, path):
            raise InvalidConfigError(f"{backend.uri_for(path)} exists already; export to a "
                                     "new file")
    else:
        _refuse_dcp_files(backend, path, _refuse_existing(backend, path, [".metadata"]))
    skeleton = _subtree_skeleton(source, prefix, keys)
    local = _fsutil.local_path(backend.filesystem, path)
    tmp = None if local is not None else tempfile.mkdtemp(prefix="checkpoint-store-export-")
    out = local or os.path.join(tmp or "", "out")
    had = set(os.listdir(out)) if fmt == "dcp" and os.path.isdir(out) else None
    try:
        if fmt == "torch_save":
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            write_torch_save(source, keys, skeleton, out)
            files: tuple[str, ...] = (posixpath.basename(path),)
        else:
            write_dcp(source, keys, skeleton, out)
            files = tuple(sorted(os.listdir(out)))
        if tmp is not None:
            _upload(out, backend, path)
    except BaseException:
        # The writers stream: a damaged tensor stops them half-way. Remove
        # what this export wrote (an upload happens only after the write).
        if local is not None:
            _remove_local_output(local, had)
        raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    nbytes = sum(source.entries[k].nbytes for k in keys if source.entries[k].alias_of is None)
    return Exported(backend.uri_for(path), files, len(keys), nbytes)


def export_checkpoint(
    source: str | os.PathLike[str] | Checkpoint,
    target: str | os.PathLike[str],
    *,
    format: ExportFormat = "hf",
    prefix: str | None = None,
    name_prefix: str = "",
    max_shard_size: int = HF_SHARD_BYTES,
    shared: Literal["error", "drop", "copy"] = "error",
    source_format: SourceFormat | None = None,
    storage_options: Mapping[str, Any] | None = None,
    target_storage_options: Mapping[str, Any] | None = None,
    filesystem: Any = None,
    target_filesystem: Any = None,
) -> Exported:
    """Write a checkpoint's tensors in another tool's format (docs/formats.md).

    Args:
        source: a checkpoint (a saved state, or a folder of safetensors,
            DCP or ``torch.save`` files), as a ``Checkpoint``, a path or a URI.
        target: where to write: a folder (``hf``, ``dcp``) or a file
            (``torch_save``), on any backend; it must not hold the files
            the export writes.
        format: ``"hf"`` (``model-0000k-of-0000n.safetensors`` and
            ``model.safetensors.index.json``, or one ``model.safetensors``),
            ``"torch_save"`` or ``"dcp"``.
        prefix: the state subtree to export (``"model"`` for
            ``report(state={"model": model.state_dict(), ...})``); ""
            everything. None: ``"model"`` for ``hf`` when the state has it, else "".
        name_prefix: prepended to each Hugging Face name (``"model."``).
        max_shard_size: ``hf``: most tensor bytes per file (a larger tensor
            gets a file of its own); default 5 GB as ``save_pretrained``.
        shared: ``hf``: a tensor that is the same storage as another (tied
            weights): ``"error"``, ``"drop"`` it (transformers re-ties it) or
            ``"copy"`` its bytes.
        source_format: force the reader (:func:`detect_format` otherwise).
        storage_options, target_storage_options: backend options of each side.
        filesystem, target_filesystem: a ``pyarrow.fs.FileSystem`` or fsspec
            filesystem each side's path is in (instead of a URI).

    Returns:
        :class:`Exported`.

    Raises:
        FormatConversionError: names collide once mapped, shared storage,
            a value the format cannot hold, no tensor under ``prefix``;
            nothing written.
        InvalidConfigError: a bad argument, or the target holds the files.
        CheckpointNotFoundError, CheckpointCorruptError: the source is
            missing or damaged (a tensor failing its CRC32C mid-export: the
            files written are removed).
    """
    if format not in EXPORT_FORMATS:
        raise InvalidConfigError(f"format must be one of {EXPORT_FORMATS}, got {format!r}")
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) \
            or max_shard_size <= 0:
        raise InvalidConfigError(f"max_shard_size must be a positive int, got {max_shard_size!r}")
    if isinstance(source, Checkpoint):
        src_backend, src_path = source.backend, source.path
    else:
        src_backend, src_path = resolve(source, filesystem=filesystem,
                                        storage_options=storage_options)
    dst_backend, dst_path = resolve(target, filesystem=target_filesystem,
                                    storage_options=target_storage_options)
    with open_source(src_backend, src_path, source_format) as src:
        _refuse_inside_checkpoint(src_backend, src_path, dst_backend, dst_path)
        chosen = _default_prefix(src, format) if prefix is None else prefix
        if format == "hf":
            return _export_hf(src, dst_backend, dst_path, chosen, name_prefix,
                              max_shard_size, shared)
        return _export_torch(src, dst_backend, dst_path, chosen, format)


# -- import ----------------------------------------------------------------------------


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


def _refuse_committed(backend: Backend, path: str) -> None:
    """Raise before any write when ``path`` is committed already."""
    if protocol_for(backend).inspect(path).meta is not None:
        raise CheckpointConflictError(f"{backend.uri_for(path)} is a committed checkpoint "
                                      "already; import it into another place (dest=)")


def _import_hf_in_place(src: SafetensorsSource, backend: Backend, path: str,
                        files: Mapping[str, int]) -> Checkpoint:
    fs = backend.filesystem
    _refuse_committed(backend, path)
    if STATE_FILE in files:
        raise InvalidConfigError(f"{backend.uri_for(path)} holds a {STATE_FILE} already; "
                                 "import into another folder (dest=)")
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
            ``.safetensors`` file; a ``state.json`` already there.
        FormatConversionError, UnsupportedStateError: a value a state cannot
            hold; nothing written.
        CheckpointConflictError: ``dest`` is committed already.
        CheckpointNotFoundError, CheckpointCorruptError: the source is
            missing or damaged (a DCP directory without ``.metadata``; a
            Hugging Face index that disagrees with the shards' headers).
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
            raise InvalidConfigError(f"{backend.uri_for(path)} is a file: give dest=, the "
                                     "checkpoint directory to create")
        dst_backend, dst_path = backend, path
    else:
        dst_backend, dst_path = resolve(dest, filesystem=dest_filesystem,
                                        storage_options=dest_storage_options)
    in_place = (dst_backend.filesystem is backend.filesystem or
                dst_backend.uri_for(dst_path) == backend.uri_for(path)) and dst_path == path
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
            entries, index = _write_state_files(src, fs, path, shard_bytes, key_of)
            _fsutil.write_bytes(fs, posixpath.join(path, written_record_name("import")),
                                json.dumps({"files": [e.to_json() for e in entries]}).encode(),
                                backend.capabilities)
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
