"""Reading a state back: whole, in part, memory-mapped, or into existing tensors.

:func:`load_state` is what ``Checkpoint.load_state`` calls. Its cost on
storage: one listing and one read of the commit marker (what every check of
a checkpoint costs), one read of ``state.json``, then only the byte ranges of
the tensors asked for: on a local disk ``preadv`` straight into each new
tensor's memory (or a memory map, ``mmap=True``); on an object store ranged
GETs of at most :data:`PART_BYTES` each, adjacent tensors of one file
coalesced, :data:`concurrency` at a time. Every tensor's CRC32C is checked
against the index before it is returned or copied into ``into``.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
import mmap as mmap_module
import os
import posixpath
import sys
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._transfer.crc32c import crc32c_combine
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.inspect import inspect_checkpoint, read_checked
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.clients import _client_of, _native_of, keeps_names
from checkpoint_store.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointStoreError,
    InvalidConfigError,
    StateKeyError,
    StateMismatchError,
    TensorCorruptError,
)
from checkpoint_store.state._files import STATE_FILE, STATE_FORMAT_VERSION, crc32c_of
from checkpoint_store.state._tree import (
    DTYPES,
    build_tree,
    escape_key,
    join_key,
)

__all__ = ["PART_BYTES", "SavedState", "load_state", "local_state_index", "name_corrupt_tensor",
           "read_state_index", "verify_tensors"]

#: Largest single ranged read from an object store (bytes); larger ranges
#: are split and fetched in parallel.
PART_BYTES = 32 << 20


@dataclass(frozen=True)
class SavedState:
    """What a checkpoint says about its state, read without any tensor byte.

    Attributes:
        skeleton: the tree of containers and JSON leaves (``state.json``'s ``tree``).
        tensors: the tensor index: key -> ``{file, dtype, shape, offsets,
            crc32c, framework}`` (aliases carry ``alias_of``).
        sizes: ``{relative path: bytes}`` of the checkpoint's files as listed.
        committed: the directory carries a valid commit marker.
    """

    skeleton: Any
    tensors: dict[str, Any]
    sizes: dict[str, int]
    committed: bool


def _where(fs: pafs.FileSystem, path: str) -> str:
    return f"{fs.type_name}:{path}"


def read_state_index(fs: pafs.FileSystem, path: str, *,
                     retry: RetryPolicy | None = None) -> SavedState:
    """The skeleton and tensor index of the state saved at ``path``.

    A committed checkpoint (one listing and one marker read) has its
    ``state.json`` checked against the manifest (size and CRC32C) as it is
    read; a local directory not committed yet (``Checkpoint.from_state``)
    is read as it is. The marker's ``"tensors"`` (format version 2) must
    agree with ``state.json``'s.

    Raises:
        CheckpointNotFoundError: nothing at ``path``, or it holds no saved
            state (no ``state.json``: it was saved from a directory; use
            ``to_directory()``).
        CheckpointCorruptError: the marker or ``state.json`` is damaged, or
            the two indexes disagree.
    """
    insp = inspect_checkpoint(fs, path, retry=retry)
    where = _where(fs, path)
    if insp.state == "missing":
        raise CheckpointNotFoundError(f"checkpoint {where} does not exist")
    if insp.state == "invalid":
        raise CheckpointCorruptError(f"checkpoint {where} is corrupt: {insp.reason}",
                                     path=path, file=insp.file)
    sizes = dict(insp.files or {})
    if STATE_FILE not in sizes:
        raise CheckpointNotFoundError(
            f"checkpoint {where} holds no saved state (no {STATE_FILE}): it was saved from "
            "a directory, not a state; read its files with to_directory() or as_directory()"
        )
    meta = insp.meta
    if meta is not None:
        entry = next((e for e in meta["manifest"] if e["path"] == STATE_FILE), None)
        if entry is None:  # listed but not in the manifest: inspect would say invalid
            raise CheckpointCorruptError(f"{STATE_FILE} of {where} is not in its manifest",
                                         path=path, file=STATE_FILE)
        raw = read_checked(fs, path, entry, retry=retry)
    else:
        raw = _fsutil.read_bytes(fs, posixpath.join(path, STATE_FILE), retry=retry)
    try:
        body = json.loads(raw)
        ok = (isinstance(body, dict) and body.get("kind") == "checkpoint_store_state"
              and isinstance(body.get("tensors"), dict) and isinstance(body.get("tree"), dict))
    except (ValueError, UnicodeDecodeError):
        ok, body = False, None
    if not ok:
        raise CheckpointCorruptError(f"{STATE_FILE} of {where} is not a saved state's index",
                                     path=path, file=STATE_FILE)
    assert isinstance(body, dict)
    version = body.get("format_version")
    if version != STATE_FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{STATE_FILE} of {where} has format_version {version!r}; this checkpoint-store "
            f"reads {STATE_FORMAT_VERSION} (upgrade checkpoint-store)", path=path, file=STATE_FILE)
    tensors = body["tensors"]
    if meta is not None and "tensors" in meta and meta["tensors"] != tensors:
        raise CheckpointCorruptError(
            f"the tensor index in the commit marker of {where} differs from {STATE_FILE}'s",
            path=path, file=STATE_FILE)
    for key, e in tensors.items():
        why = _bad_entry(e, sizes)
        if why:
            raise CheckpointCorruptError(f"tensor {key!r} of {where}: {why}", path=path,
                                         file=e.get("file") if isinstance(e, dict) else None)
    return SavedState(body["tree"], tensors, sizes, meta is not None)


def _bad_entry(e: Any, sizes: Mapping[str, int]) -> str | None:
    if not isinstance(e, dict):
        return "its index entry is not an object"
    dtype, shape, off = e.get("dtype"), e.get("shape"), e.get("offsets")
    if dtype not in DTYPES:
        return f"unknown dtype {dtype!r}"
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        return f"bad shape {shape!r}"
    if not (isinstance(off, list) and len(off) == 2 and all(isinstance(n, int) for n in off)
            and 0 <= off[0] <= off[1]):
        return f"bad offsets {off!r}"
    if off[1] - off[0] != math.prod(shape) * DTYPES[dtype][0]:
        return f"offsets {off} do not hold {dtype} {shape}"
    if e.get("file") not in sizes:
        return f"its file {e.get('file')!r} is missing"
    if off[1] > sizes[e["file"]]:
        return f"offsets {off} run past the end of {e['file']!r} ({sizes[e['file']]} bytes)"
    if e.get("framework") not in ("torch", "numpy"):
        return f"unknown framework {e.get('framework')!r}"
    return None


# -- selection ------------------------------------------------------------------


def _nodes(skeleton: Any) -> dict[str, Any]:
    """Every node of a skeleton (containers and leaves) by flattened key."""
    out: dict[str, Any] = {}
    stack: list[tuple[str, Any, bool]] = [("", skeleton, True)]
    while stack:
        key, node, root = stack.pop()
        out[key] = node
        stack.extend(_children(key, node, root))
    return out


def _children(key: str, node: Any, root: bool) -> list[tuple[str, Any, bool]]:
    if "dict" in node:
        return [(join_key(key, escape_key(k), root=root), v, False) for k, v in node["dict"]]
    for kind in ("list", "tuple"):
        if kind in node:
            return [(join_key(key, str(i), root=root), v, False)
                    for i, v in enumerate(node[kind])]
    return []


def _is_container(node: Any) -> bool:
    return "dict" in node or "list" in node or "tuple" in node


def _patterns(keys: str | Iterable[str] | None) -> list[str] | None:
    if keys is None:
        return None
    pats = [keys] if isinstance(keys, str) else list(keys)
    for p in pats:
        if not isinstance(p, str):
            raise InvalidConfigError(f"keys must be strings (names or globs), got {p!r}")
    return pats


def _select(skeleton: Any, nodes: Mapping[str, Any], pats: list[str]) -> Any:
    """The skeleton pruned to the nodes the patterns name (a whole subtree for
    a container), keeping the path down to them. Dicts keep only what is
    selected; a list or tuple keeps its length, unselected positions None."""
    matched: set[str] = set()
    for p in pats:
        hits = {k for k in nodes if k == p}
        if not hits and any(c in p for c in "*?["):
            hits = {k for k in nodes if fnmatch.fnmatchcase(k, p)}
        if not hits:
            close = difflib.get_close_matches(p, [k for k in nodes if k], n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise StateKeyError(
                f"the saved state holds no key matching {p!r}{hint} (keys are flattened "
                "paths such as 'model/layer1.weight'; a container's key selects all of it; "
                "'*' and '?' glob)", key=p)
        matched |= hits

    def prune(key: str, node: Any, root: bool) -> Any:
        if key in matched:
            return node
        if not _is_container(node):
            return None
        kids = [(k, prune(k, n, False)) for k, n, _ in _children(key, node, root)]
        if "dict" in node:
            names = [name for name, _ in node["dict"]]
            kept = [[name, sub] for name, (_, sub) in zip(names, kids, strict=True)
                    if sub is not None]
            return {"dict": kept} if kept else None
        if all(sub is None for _, sub in kids):
            return None
        kind = "list" if "list" in node else "tuple"
        return {kind: [sub if sub is not None else {"value": None} for _, sub in kids]}

    out = prune("", skeleton, True)
    if out is None:
        return {"dict": []} if "dict" in skeleton else {
            ("list" if "list" in skeleton else "tuple"): []}
    return out


def _selected(key: str, pats: Sequence[str]) -> bool:
    """Whether ``key`` or a container above it matches one of ``pats``."""
    parts = key.split("/")
    for i in range(len(parts), 0, -1):
        k = "/".join(parts[:i])
        if any(k == p or (any(c in p for c in "*?[") and fnmatch.fnmatchcase(k, p))
               for p in pats):
            return True
    return any(p == "" for p in pats)


def _tensor_refs(skeleton: Any) -> list[str]:
    out = []
    for node in _nodes(skeleton).values():
        if "tensor" in node:
            out.append(node["tensor"])
    return out


# -- into ---------------------------------------------------------------------------


def _into_leaves(into: Any) -> dict[str, Any]:
    """``into``'s leaves by flattened key (containers: Mappings, lists, tuples)."""
    out: dict[str, Any] = {}
    stack: list[tuple[str, Any, bool]] = [("", into, True)]
    while stack:
        key, value, root = stack.pop()
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise InvalidConfigError(
                        f"into: key {k!r} under {key or 'the root'!r} is not a string "
                        "(nor an int)")
                stack.append((join_key(key, escape_key(k), root=root), v, False))
        elif isinstance(value, (list, tuple)) and not _is_tensor(value):
            for i, v in enumerate(value):
                stack.append((join_key(key, str(i), root=root), v, False))
        else:
            out[key] = value
    return out


def _is_tensor(value: Any) -> bool:
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    return bool((torch is not None and isinstance(value, torch.Tensor))
                or (np is not None and isinstance(value, np.ndarray)))


def _describe_target(value: Any) -> str:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return f"torch {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        return f"numpy {value.dtype} {list(value.shape)}"
    return type(value).__name__


def _target_dtype(value: Any) -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        name = str(value.dtype).removeprefix("torch.")
    else:
        name = value.dtype.name
    return next((k for k, (_, n, t) in DTYPES.items()
                 if (n == name if not (torch is not None and isinstance(value, torch.Tensor))
                     else t == name)), None)


def _check_into(into: Any, nodes: Mapping[str, Any], tensors: Mapping[str, Any]
                ) -> dict[str, Any]:
    """``{key: target tensor}`` for every tensor of ``into``; refuses before any change."""
    leaves = _into_leaves(into)
    targets: dict[str, Any] = {}
    for key, value in leaves.items():
        node = nodes.get(key)
        if node is None:
            raise StateKeyError(f"into: {key!r} is not in the saved state", key=key)
        saved_is_tensor = "tensor" in node
        if saved_is_tensor != _is_tensor(value) or _is_container(node):
            e = tensors.get(node.get("tensor", ""), {})
            saved = (f"{e.get('dtype')} {e.get('shape')}" if saved_is_tensor
                     else "a subtree" if _is_container(node) else "a JSON value")
            raise StateMismatchError(
                f"into: {key!r} holds {_describe_target(value)}; the saved state holds "
                f"{saved} there", key=key, expected=saved, found=_describe_target(value))
        if not saved_is_tensor:
            continue
        e = tensors[node["tensor"]]
        expected = f"{e['dtype']} {e['shape']}"
        dtype = _target_dtype(value)
        if dtype != e["dtype"] or list(value.shape) != e["shape"]:
            raise StateMismatchError(
                f"into: {key!r} is {_describe_target(value)}; the saved tensor is {expected} "
                "(no conversion: give a tensor of that dtype and shape, or load without "
                "into= and convert)", key=key, expected=expected, found=_describe_target(value))
        targets[key] = value
    return targets


def _fill(target: Any, source: Any) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(target, torch.Tensor):
        if not isinstance(source, torch.Tensor):
            source = torch.from_numpy(source)
        with torch.no_grad():
            target.copy_(source)
        return
    np = sys.modules["numpy"]
    if torch is not None and isinstance(source, torch.Tensor):
        source = source.numpy()
    np.copyto(target, source)


# -- bytes ------------------------------------------------------------------------


def _new_tensor(e: Mapping[str, Any]) -> tuple[Any, memoryview]:
    """A new tensor for an index entry and a writable byte view of its memory."""
    size, np_name, torch_name = DTYPES[e["dtype"]]
    shape = tuple(e["shape"])
    if e["framework"] == "torch":
        import ctypes

        import torch

        t = torch.empty(shape, dtype=getattr(torch, str(torch_name)))
        n = t.numel() * size
        if n == 0:
            return t, memoryview(bytearray())
        buf = (ctypes.c_char * n).from_address(t.data_ptr())
        buf.tensor = t  # type: ignore[attr-defined]
        return t, memoryview(buf).cast("B")
    import numpy as np

    a = np.empty(shape, dtype=np_name)
    return a, a.reshape(-1).view(np.uint8).data


def _from_buffer(e: Mapping[str, Any], buf: Any, begin: int) -> Any:
    """A tensor viewing ``buf`` (a memory map) at byte ``begin``: no copy."""
    size, np_name, torch_name = DTYPES[e["dtype"]]
    shape = tuple(e["shape"])
    count = math.prod(shape)
    if e["framework"] == "torch":
        import torch

        dtype = getattr(torch, str(torch_name))
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=begin).reshape(shape)
    import numpy as np

    return np.frombuffer(buf, dtype=np_name, count=count, offset=begin).reshape(shape)


def _finish(e: Mapping[str, Any], t: Any) -> Any:
    if e.get("scalar") and e["framework"] == "numpy":
        return t[()]
    return t


def _corrupt(path: str, key: str, e: Mapping[str, Any], got: int) -> TensorCorruptError:
    return TensorCorruptError(
        f"tensor {key!r} ({e['file']!r}, bytes [{e['offsets'][0]}, {e['offsets'][1]})) of "
        f"checkpoint {path!r} does not match its checksum (crc32c {got:08x}, the index says "
        f"{e['crc32c']}); the checkpoint is damaged: resume from an earlier one",
        path=path, file=e["file"], tensor=key)


def _check(path: str, key: str, e: Mapping[str, Any], data: Any) -> None:
    got = crc32c_of(data)
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


class _Fetcher:
    """Byte ranges of a checkpoint's files: local preadv, or ranged reads."""

    def __init__(self, fs: pafs.FileSystem, root: str, sizes: Mapping[str, int],
                 retry: RetryPolicy | None, concurrency: int):
        self.fs, self.root, self.sizes, self.retry = fs, root, sizes, retry
        self.concurrency = max(1, concurrency)
        self.local = _fsutil.local_path(fs, root)
        self.native = _native_of(fs)
        # An fsspec client reads a range with one GET, no HEAD first: the one
        # behind the filesystem's handler, or the twin of a pyarrow S3 or
        # Azure filesystem passed in (what the downloads use too).
        fss = _client_of(fs)
        self.fss = fss if fss is not None and keeps_names(fss, [root]) else None

    def _read_remote(self, rel: str, begin: int, end: int) -> Any:
        path = posixpath.join(self.root, rel)

        def go() -> Any:
            if self.fss is not None:
                return self.fss.cat_file(path, start=begin, end=end)
            # pyarrow's Python API asks for the size (a HEAD) before it reads.
            with self.native.open_input_file(path) as f:
                return f.read_at(end - begin, begin)

        data = _retry.call(go, policy=self.retry, store=self.fs,
                           what=f"read bytes {begin}-{end} of {path}")
        if len(data) != end - begin:
            raise CheckpointCorruptError(
                f"{path!r} ended early: asked for bytes [{begin}, {end}), got {len(data)}",
                path=self.root, file=rel)
        return data

    def fill(self, jobs: Sequence[tuple[str, int, memoryview]]) -> None:
        """Fill each ``(file, begin, view)`` with the file's bytes from ``begin``."""
        jobs = [j for j in jobs if len(j[2])]
        if not jobs:
            return
        if self.local is not None:
            self._fill_local(jobs)
            return
        # Coalesce tensors adjacent in one file, then cut into parts.
        runs: list[list[Any]] = []  # [file, begin, end, [(begin, view), ...]]
        for rel, begin, view in sorted(jobs, key=lambda j: (j[0], j[1])):
            end = begin + len(view)
            if runs and runs[-1][0] == rel and runs[-1][2] == begin:
                runs[-1][2] = end
                runs[-1][3].append((begin, view))
            else:
                runs.append([rel, begin, end, [(begin, view)]])
        parts = []
        for rel, start, end, dests in runs:
            first = 0  # dests are sorted and adjacent: walk them along the parts
            for b in range(start, end, PART_BYTES):
                e = min(b + PART_BYTES, end)
                while dests[first][0] + len(dests[first][1]) <= b:
                    first += 1
                last = first
                while last < len(dests) and dests[last][0] < e:
                    last += 1
                parts.append((rel, b, e, dests[first:last]))

        def one(part: tuple[str, int, int, list[tuple[int, memoryview]]]) -> None:
            rel, b, e, dests = part
            data = memoryview(self._read_remote(rel, b, e)).cast("B")
            for at, view in dests:
                lo, hi = max(at, b), min(at + len(view), e)
                if lo < hi:
                    view[lo - at:hi - at] = data[lo - b:hi - b]

        self._run(one, parts)

    def _fill_local(self, jobs: Sequence[tuple[str, int, memoryview]]) -> None:
        assert self.local is not None
        fds: dict[str, int] = {}
        try:
            for rel, _, _ in jobs:
                if rel not in fds:
                    fds[rel] = os.open(os.path.join(self.local, rel), os.O_RDONLY)

            def one(job: tuple[str, int, memoryview]) -> None:
                rel, begin, view = job
                got = 0
                while got < len(view):
                    n = os.preadv(fds[rel], [view[got:]], begin + got)
                    if n == 0:
                        raise CheckpointCorruptError(
                            f"{rel!r} of {self.local!r} ended early at byte {begin + got}",
                            path=self.root, file=rel)
                    got += n

            self._run(one, jobs)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _run(self, fn: Any, items: Sequence[Any]) -> None:
        if self.concurrency == 1 or len(items) <= 1:
            for it in items:
                fn(it)
            return
        with ThreadPoolExecutor(min(self.concurrency, len(items)),
                                thread_name_prefix="cs-state-read") as pool:
            for _ in pool.map(fn, items):
                pass


class _Maps:
    """One copy-on-write memory map per local file, opened on first use."""

    def __init__(self, local_root: str):
        self.root = local_root
        self.maps: dict[str, mmap_module.mmap] = {}

    def get(self, rel: str) -> mmap_module.mmap:
        m = self.maps.get(rel)
        if m is None:
            with open(os.path.join(self.root, rel), "rb") as f:
                # ACCESS_COPY: writable views (torch.frombuffer wants them), and
                # writes to them stay in this process: the file never changes.
                m = mmap_module.mmap(f.fileno(), 0, access=mmap_module.ACCESS_COPY)
            self.maps[rel] = m
        return m


# -- load ---------------------------------------------------------------------------


def load_state(
    fs: pafs.FileSystem,
    path: str,
    *,
    keys: str | Iterable[str] | None = None,
    mmap: bool = False,
    into: Any = None,
    verify: bool = True,
    concurrency: int = 8,
    retry: RetryPolicy | None = None,
) -> Any:
    """The state saved at ``path`` (docs/state.md), as the tree it was saved.

    Args:
        fs, path: where the checkpoint is (what ``Checkpoint`` holds).
        keys: None for everything; else a name or a list of names and globs
            over the flattened keys (``"model"`` a whole subtree,
            ``"model/layer1.weight"`` one tensor, ``"model/*.bias"`` a glob
            whose ``*`` also crosses ``/``). Only the matched tensors' bytes
            are read.
        mmap: on a local disk, tensors are memory-mapped views of the files
            (copy-on-write: writing to one never changes the checkpoint); no
            copy, pages read on first touch. Ignored elsewhere (read into memory).
        into: a tree of existing tensors (``{"model": model.state_dict()}``)
            to fill in place (``copy_``): its leaves say what is read (with
            ``keys``, only those matched too), every one must be in the saved
            state with the same dtype and shape; non-tensor leaves of
            ``into`` are returned as saved. The returned tree holds
            ``into``'s own tensor objects.
        verify: check each tensor's CRC32C against the index (default True).
        concurrency: parallel reads (files' byte ranges) at most.
        retry: storage retry policy.

    Returns:
        The tree: dicts (as ``dict``), lists, tuples, JSON values; tensors
        as torch tensors (on the CPU) or numpy arrays as they were saved
        (numpy scalars as numpy scalars); tensors saved as the same view
        (tied weights) as one object. With ``keys``, dicts hold only what
        was selected and lists keep their length (``None`` where not selected).

    Raises:
        CheckpointNotFoundError: no checkpoint, or it holds no state.
        StateKeyError: a name or glob of ``keys`` matches nothing, or ``into``
            holds a key the state lacks; nothing read.
        StateMismatchError: an ``into`` tensor has another dtype or shape
            (or the saved entry is no tensor); nothing changed.
        TensorCorruptError: a tensor fails its checksum (``.tensor`` names
            it); every checksum is checked before ``into`` is changed.
        CheckpointCorruptError: ``state.json`` or the marker is damaged.
    """
    saved = read_state_index(fs, path, retry=retry)
    nodes = _nodes(saved.skeleton)
    pats = _patterns(keys)
    targets: dict[str, Any] = {}
    if into is not None:
        targets = _check_into(into, nodes, saved.tensors)
        leaves = list(_into_leaves(into))
        if pats is not None:
            _select(saved.skeleton, nodes, pats)  # refuses a pattern matching nothing
            leaves = [k for k in leaves if _selected(k, pats)]
            targets = {k: v for k, v in targets.items() if k in set(leaves)}
        skeleton = _select(saved.skeleton, nodes, leaves)
    elif pats is not None:
        skeleton = _select(saved.skeleton, nodes, pats)
    else:
        skeleton = saved.skeleton
    # Which stored tensors to read: aliases read their target's bytes.
    wanted = _tensor_refs(skeleton)
    stored = list(dict.fromkeys(saved.tensors[k].get("alias_of", k) for k in wanted))
    stored.sort(key=lambda k: (saved.tensors[k]["file"], saved.tensors[k]["offsets"][0]))
    fetch = _Fetcher(fs, path, saved.sizes, retry, concurrency)
    loaded: dict[str, Any] = {}
    maps = _Maps(fetch.local) if fetch.local is not None and (mmap or targets) else None
    # With into, a tensor of it stands for the saved key at its place.
    target_of = {nodes[k]["tensor"]: v for k, v in targets.items()}
    views: list[tuple[str, Mapping[str, Any], memoryview]] = []
    if maps is not None:
        for key in stored:
            e = saved.tensors[key]
            begin, end = e["offsets"]
            m = maps.get(e["file"])
            views.append((key, e, memoryview(m)[begin:end]))
            loaded[key] = _from_buffer(e, m, begin)
    else:
        jobs: list[tuple[str, int, memoryview]] = []
        for key in stored:
            e = saved.tensors[key]
            t, view = _new_tensor(e)
            loaded[key] = t
            views.append((key, e, view))
            jobs.extend((e["file"], e["offsets"][0] + a, view[a:b])
                        for a, b in _pieces(len(view)))
        fetch.fill(jobs)
    if verify:
        _check_all(path, views, fetch._run)

    # Every checksum passed: only now is any tensor of into changed.
    result: dict[str, Any] = {}
    filled: set[int] = set()
    for key in wanted:
        source = loaded[saved.tensors[key].get("alias_of", key)]
        target = target_of.get(key)
        if target is not None:
            if id(target) not in filled:
                _fill(target, source)
                filled.add(id(target))
            result[key] = target
        else:
            result[key] = _finish(saved.tensors[key], source)
    return build_tree(skeleton, result.__getitem__)


def verify_tensors(fs: pafs.FileSystem, path: str, tensors: Mapping[str, Any], *,
                   file: str | None = None, retry: RetryPolicy | None = None,
                   sizes: Mapping[str, int] | None = None) -> None:
    """Check each stored tensor's bytes (of ``file`` only, when given)
    against the index's CRC32C.

    Raises:
        TensorCorruptError: the first tensor (by file, then offset) whose
            bytes differ or lie past its file's end; ``.tensor`` names it.
    """
    entries = sorted(((k, e) for k, e in tensors.items()
                      if "alias_of" not in e and (file is None or e.get("file") == file)),
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
    ``error``); return quietly otherwise (the header is what differs, or the
    checkpoint holds no state), so the caller raises ``error`` itself.

    The index is the marker's ``"tensors"``, else that of ``state.json``
    (a state reported as a directory).
    """
    if error.file is None or isinstance(error, TensorCorruptError):
        return
    tensors = meta.get("tensors") if meta is not None else None
    if not isinstance(tensors, dict):
        if error.file == STATE_FILE or not sizes or STATE_FILE not in sizes:
            return
        try:
            tensors = read_state_index(fs, path, retry=retry).tensors
        except CheckpointStoreError:
            return
    if not any(isinstance(e, dict) and e.get("file") == error.file for e in tensors.values()):
        return
    try:
        verify_tensors(fs, path, tensors, file=error.file, retry=retry, sizes=sizes)
    except TensorCorruptError as exc:
        raise exc from error
    except (OSError, KeyError, TypeError, ValueError):
        return


def local_state_index(fs: pafs.FileSystem, path: str) -> dict[str, Any] | None:
    """The tensor index of a state written into the local directory ``path``
    (``Checkpoint.from_state``), for a commit to record in its marker; None
    when ``path`` is not on a local disk or holds no ``state.json`` of ours
    (a directory of files, or one whose ``state.json`` is another tool's).
    One stat and, for a state, one read of a small local file."""
    local = _fsutil.local_path(fs, path)
    if local is None:
        return None
    try:
        with open(os.path.join(local, STATE_FILE), "rb") as f:
            body = json.loads(f.read())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not (isinstance(body, dict) and body.get("kind") == "checkpoint_store_state"
            and body.get("format_version") == STATE_FORMAT_VERSION
            and isinstance(body.get("tensors"), dict)):
        return None
    tensors: dict[str, Any] = body["tensors"]
    return tensors
