"""``export_checkpoint``: a checkpoint's tensors written in another tool's format.

The source is opened by :func:`~._api.open_source`; a Hugging Face folder
is written shard by shard (:mod:`._shards`), a ``torch.save`` file or a
DCP directory by :mod:`._torch` on a local disk, uploaded afterwards when
the target is remote. What an export refuses (names that collide once
mapped, a target that holds the files or lies inside a checkpoint) is
refused before the first write, and an export failing half-way removes the
files it wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any, Literal

import pyarrow.fs as pafs

from checkpoint_store._format.layout import INTERNAL_METADATA
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.backends.base import Backend
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import FormatConversionError, InvalidConfigError
from checkpoint_store.formats._api import (
    Exported,
    SourceFormat,
    _copy,
    _listing,
    open_source,
)
from checkpoint_store.formats._shards import plan_shards, write_shard
from checkpoint_store.formats._sources import HF_INDEX, Entry, Source
from checkpoint_store.registry import resolve
from checkpoint_store.state import split_key

__all__ = ["HF_SHARD_BYTES", "export_checkpoint"]

ExportFormat = Literal["hf", "torch_save", "dcp"]
EXPORT_FORMATS = ("hf", "torch_save", "dcp")
#: Hugging Face's default largest shard (``save_pretrained(max_shard_size="5GB")``).
HF_SHARD_BYTES = 5 * 10**9
#: The name a safetensors header keeps for its own metadata, never a tensor's.
_SAFETENSORS_RESERVED = "__metadata__"


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


def _refuse_other_weights(backend: Backend, path: str, files: Mapping[str, int]) -> None:
    """Raise when folder ``path`` (its listing: ``files``) holds safetensors
    files or an index already: readers take every one of them as the
    model's (``transformers`` loads ``model.safetensors`` before an index;
    an import reads every ``*.safetensors``), so the export would be mixed
    with, or hidden behind, another model's weights."""
    old = sorted(n for n in files if n.endswith(".safetensors") or n == HF_INDEX)
    if old:
        raise InvalidConfigError(
            f"{backend.uri_for(path)} holds another model's weights already ({old[0]!r}"
            f"{', ...' if len(old) > 1 else ''}); readers would mix them with the export: "
            "export into a new or empty folder")


def _refuse_inside_checkpoint(src_backend: Backend, src_path: str, backend: Backend,
                              path: str) -> None:
    """Raise before any write when the target ``path`` is at or below the
    source's own folder, or below a committed checkpoint's folder (one
    holding a commit marker; the folder itself is :func:`_refuse_existing`'s):
    files added there are outside its manifest, and it would fail
    verification (resume skips it); or below a file, where there are folders.

    Raises:
        InvalidConfigError: naming the checkpoint, or the file.
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
        if backend.capabilities.directories and _fsutil.is_file(fs, at):
            raise InvalidConfigError(
                f"{backend.uri_for(path)} lies below {backend.uri_for(at)}, which is a file; "
                "export to a place whose folders are folders")
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
    _refuse_other_weights(backend, path, _refuse_existing(backend, path, names))
    fs = backend.filesystem
    made = not _fsutil.exists(fs, path)
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
        if made and backend.capabilities.directories:
            with contextlib.suppress(OSError):  # the folder it made, now empty
                if not _fsutil.list_dir(fs, path):
                    fs.delete_dir(path)
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
        InvalidConfigError: a bad argument, or the target holds the files
            (``hf``: any ``.safetensors`` file or index; ``dcp``: any
            ``.distcp`` file or ``.metadata``).
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
