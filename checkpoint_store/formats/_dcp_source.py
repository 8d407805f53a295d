"""A torch.distributed.checkpoint (DCP) directory read as a :class:`~._sources.Source`.

DCP keeps a tree as flat entries named by their path in it
(``Metadata.planner_data``): tensors, each read here one at a time with
``torch.distributed.checkpoint.load`` and no process group (DCP's planner
reads only that tensor's byte ranges), and every other value pickled whole
(a tuple, a list of plain values, an int), loaded at once and flattened as
a state (:func:`~checkpoint_store.state.flatten_state`), tensors inside
included. DCP names a list's items by their index (an ``int`` in a path;
the int keys of a dict it writes as strings), so the tree comes back with
its lists, as DCP's own ``dcp_to_torch_save`` gives them.

Nothing is unpickled that could run code: DCP's own reader unpickles its
``.metadata`` with ``pickle.load`` and each pickled value with
``torch.load(weights_only=False)``; here the ``.metadata`` is read by an
unpickler that builds DCP's metadata classes and torch's sizes and dtypes
only (:func:`read_dcp_metadata`) and each value with ``weights_only=True``
(:func:`_reader`, :func:`_planner`), as a ``torch.save`` file is read.

The path is local: :mod:`._api` downloads a remote directory first.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from checkpoint_store.errors import (
    CheckpointCorruptError,
    FormatConversionError,
    UnsupportedStateError,
)
from checkpoint_store.formats._sources import Entry, Source
from checkpoint_store.formats._torch import (
    DCP_METADATA,
    _byte_view,
    _dtype_name,
    _pieces_of,
    _quiet,
)
from checkpoint_store.state import DTYPES, FlatState, escape_key, flatten_state
from checkpoint_store.state._tree import iter_leaves, rekey_skeleton

__all__ = ["DCPSource", "dcp_skeleton", "read_dcp_metadata"]

#: Marks a leaf among a node's children (no key of a tree can be it).
_LEAF = object()


class DCPSource(Source):
    """The tensors and values of a local DCP directory.

    Keys come from DCP's ``planner_data`` (the path in the saved tree), so
    ``{"model": sd}`` saved by DCP reads back as ``model/<name>``; a
    pickled value holding tensors (a tuple of tensors) gives its tensors
    keys below its own (``model/pair/0``), held in memory once loaded.

    Raises (at construction):
        CheckpointCorruptError: no ``.metadata`` (an unfinished save: DCP
            writes it last; without it the data cannot be read), or files
            DCP cannot read.
        FormatConversionError: a pickled value a state cannot hold, or one
            that pickles objects other than tensors, containers and plain
            values (never unpickled: ``.key`` names it); a key both a value
            and a subtree.
    """

    kind = "dcp"

    def __init__(self, path: str):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        self.where, self.path = path, path
        meta = read_dcp_metadata(path)
        paths = meta.planner_data or {}
        self._fqn: dict[str, str] = {}
        self._held: dict[str, tuple[FlatState, str]] = {}
        self.entries, self.values = {}, {}
        placed: list[tuple[tuple[Any, ...], str, Any]] = []
        objects: list[tuple[tuple[Any, ...], str, str]] = []
        for fqn, md in meta.state_dict_metadata.items():
            parts = tuple(paths.get(fqn) or (fqn,))
            key = "/".join(escape_key(p) for p in parts)
            self._fqn[key] = fqn
            if isinstance(md, BytesStorageMetadata):
                objects.append((parts, key, fqn))
                continue
            self.entries[key] = Entry(key, _dtype_name(md.properties.dtype, key),
                                      tuple(int(n) for n in md.size))
            placed.append((parts, key, {"tensor": key}))
        if objects:
            loaded: dict[str, Any] = {fqn: None for *_, fqn in objects}
            with self._damaged(None):
                dcp.load(loaded, storage_reader=_reader(path), planner=_planner(),
                         no_dist=True)
            for parts, key, fqn in objects:
                placed.append((parts, key, self._graft(key, fqn, loaded[fqn])))
        self.skeleton = dcp_skeleton(placed)
        self.values = {k: n["value"] for k, n in iter_leaves(self.skeleton) if "value" in n}

    def _graft(self, key: str, fqn: str, value: Any) -> Any:
        """The skeleton of pickled ``value`` at ``key``; its tensors become
        entries below ``key``, their bytes held."""
        try:
            flat = flatten_state(value)
        except UnsupportedStateError as exc:
            raise FormatConversionError(
                f"DCP entry {fqn!r} of {self.path} is a {type(value).__name__} a state cannot "
                f"hold ({exc}); save it as tensors and plain values", key=key) from exc

        def full(sub: str) -> str:
            return f"{key}/{sub}" if sub else key

        for sub, spec in flat.layout.tensors.items():
            self.entries[full(sub)] = Entry(full(sub), spec.dtype, tuple(spec.shape))
            self._held[full(sub)] = (flat, sub)
        for sub, target in flat.layout.aliases.items():
            spec = flat.layout.tensors[target]
            self.entries[full(sub)] = Entry(full(sub), spec.dtype, tuple(spec.shape),
                                            full(target))
        return rekey_skeleton(flat.layout.skeleton, full)

    def load(self, key: str) -> Any:
        """Tensor ``key`` (not one held), read from the directory now."""
        import torch
        import torch.distributed.checkpoint as dcp

        e = self.entries[key]
        t = torch.empty(e.shape, dtype=getattr(torch, str(DTYPES[e.dtype][2])))
        sd = {self._fqn[key]: t}
        with self._damaged(key):
            dcp.load(sd, storage_reader=_reader(self.path), planner=_planner(), no_dist=True)
        return sd[self._fqn[key]]

    @contextmanager
    def _damaged(self, key: str | None) -> Iterator[None]:
        """Around a ``dcp.load``: a file DCP cannot read (truncated, not a
        zip, missing) is a :class:`CheckpointCorruptError` naming ``key``; a
        value that ``weights_only`` loading refuses, a
        :class:`FormatConversionError`."""
        try:
            with _quiet():
                yield
        except pickle.UnpicklingError as exc:  # weights_only refused it: never run
            raise FormatConversionError(
                f"a value of DCP directory {self.path} pickles objects other than tensors, "
                "containers and plain values (torch.load(weights_only=True) says: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); it is not loaded: save "
                "such values as plain ones", key=key) from exc
        except (RuntimeError, OSError, EOFError, ValueError) as exc:
            what = f"tensor {key!r}" if key else "a value"
            raise CheckpointCorruptError(
                f"{what} of DCP directory {self.path} cannot be read "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "its files are damaged or missing: use an earlier checkpoint",
                path=self.path) from exc

    def chunks(self, key: str) -> Iterator[Any]:
        e = self.entries[key]
        held = self._held.get(e.alias_of or key)
        if held is not None:
            flat, sub = held
            yield from _pieces_of(flat.tensor_bytes(sub))
            return
        yield from _pieces_of(_byte_view(self.load(key)))


#: What a DCP ``.metadata`` pickles, besides plain values: every class of
#: ``torch.distributed.checkpoint.metadata`` and these ``(module, name)``;
#: any torch dtype, layout or memory format (``torch.bfloat16``) too.
_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
})


class _MetadataUnpickler(pickle.Unpickler):
    """Builds what a DCP ``.metadata`` holds and refuses any other global
    (``os.system``, ...) before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        ok = (module, name) in _METADATA_GLOBALS
        if module == "torch.distributed.checkpoint.metadata":
            ok = isinstance(getattr(__import__(module, fromlist=[name]), name, None), type)
        elif module == "torch" and not ok:
            ok = isinstance(getattr(torch, name, None),
                            (torch.dtype, torch.layout, torch.memory_format))
        if not ok:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")
        return super().find_class(module, name)


def read_dcp_metadata(path: str) -> Any:
    """The ``Metadata`` of the local DCP directory ``path``, unpickled with
    DCP's classes and torch's sizes and dtypes only (DCP's own reader runs
    any pickle).

    Raises:
        CheckpointCorruptError: no ``.metadata`` (an unfinished save: DCP
            writes it last), or one that is not DCP's (damaged, or
            pickling other objects: refused before any runs).
    """
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    full = os.path.join(path, DCP_METADATA)
    if not os.path.exists(full):
        raise CheckpointCorruptError(
            f"{path} has no DCP {DCP_METADATA}: the save did not finish (DCP writes it "
            "last) and its data cannot be read; use an earlier checkpoint",
            path=path, file=DCP_METADATA)
    try:
        with open(full, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except Exception as exc:  # any damage: truncated, not a pickle, a foreign global
        raise CheckpointCorruptError(
            f"{full} is not a DCP metadata file ({type(exc).__name__}: {exc}); it was not "
            "run: use an earlier checkpoint, or one saved by torch.distributed.checkpoint",
            path=path, file=DCP_METADATA) from exc
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise CheckpointCorruptError(
            f"{full} is not a DCP metadata file (it holds a {type(meta).__name__}); use an "
            "earlier checkpoint", path=path, file=DCP_METADATA)
    if getattr(meta, "storage_meta", None) is None:
        meta.storage_meta = StorageMeta()  # as DCP's read_metadata does
    return meta


def _reader(path: str) -> Any:
    """DCP's ``FileSystemReader`` of ``path``, its ``.metadata`` read by
    :func:`read_dcp_metadata`."""
    import torch.distributed.checkpoint as dcp

    class _Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            meta = read_dcp_metadata(path)
            meta.storage_meta.load_id = self.load_id
            return meta

    return _Reader(path)


def _planner() -> Any:
    """DCP's ``DefaultLoadPlanner`` that loads each pickled value with
    ``weights_only=True`` (DCP's loads it with ``weights_only=False``)."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict,
                            self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _Planner()


def dcp_skeleton(placed: list[tuple[tuple[Any, ...], str, Any]]) -> Any:
    """A state skeleton of ``(DCP path, flattened key, leaf skeleton)``
    triples: a node whose children are named by the ints ``0..n-1`` is a
    list (DCP's name of a list's items), every other node a dict.

    Raises:
        FormatConversionError: one key is both a leaf and a subtree.
    """
    root: dict[Any, Any] = {}
    for parts, key, leaf in placed:
        node = root
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            have = node.get(part)
            if have is not None and (last or _LEAF in have):
                raise FormatConversionError(
                    f"key {key!r} is both a value and a subtree", key=key)
            if last:
                node[part] = {_LEAF: leaf}
            else:
                node = node.setdefault(part, {})
    return _built(root)


def _built(node: dict[Any, Any]) -> Any:
    if _LEAF in node:
        return node[_LEAF]
    names = list(node)
    if names and all(type(n) is int for n in names) and sorted(names) == list(range(len(names))):
        return {"list": [_built(node[i]) for i in range(len(names))]}
    return {"dict": [[n if isinstance(n, (str, int)) else str(n), _built(v)]
                     for n, v in node.items()]}
