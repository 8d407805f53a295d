"""Reading a state back: whole, in part, memory-mapped, or into existing tensors.

:func:`load_state` is what ``Checkpoint.load_state`` calls. Its cost on
storage: one listing and one read of the commit marker (what every check of
a checkpoint costs), one read of ``state.json``, then only the byte ranges of
the tensors asked for: on a local disk ``preadv`` straight into each new
tensor's memory (or a memory map, ``mmap=True``); on an object store ranged
GETs of at most :data:`PART_BYTES` each, adjacent tensors of one file
coalesced, :data:`concurrency` at a time. Every tensor's CRC32C is checked
against the index before it is returned or copied into ``into``.

The steps live beside it: the index in :mod:`._index`, ``keys=`` in
:mod:`._select`, ``into=`` in :mod:`._into`, the bytes (ranged reads,
coalescing, memory maps; :data:`PART_BYTES`) in :mod:`._fetch`, the
checksums in :mod:`._verify`.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.errors import InvalidConfigError, StateMismatchError
from checkpoint_store.state._box import dest_array, read_box
from checkpoint_store.state._fetch import _Fetcher, _from_buffer, _Maps, _new_tensor
from checkpoint_store.state._index import read_state_index
from checkpoint_store.state._into import _check_into, _fill, _into_leaves
from checkpoint_store.state._overlap import check_apart, memory_of
from checkpoint_store.state._placement import StateSlice, _is_dtensor, box_of_target
from checkpoint_store.state._select import _nodes, _patterns, _select, _selected, _tensor_refs
from checkpoint_store.state._shards import ShardIndex
from checkpoint_store.state._tree import DTYPES, build_tree
from checkpoint_store.state._verify import _check_all, _pieces

__all__ = ["load_state"]


def _finish(e: Mapping[str, Any], t: Any) -> Any:
    if e.get("scalar") and e["framework"] == "numpy":
        return t[()]
    return t


def _read_boxed(fetch: _Fetcher, path: str, key: str, e: Mapping[str, Any], target: Any,
                verify: bool) -> Any:
    """A new tensor holding the box of ``key`` that ``target`` asks for (a
    DTensor: its local shard; else the whole logical tensor), read from the
    pieces that overlap it, every piece checked before it is copied."""
    box: Mapping[str, Any]
    if target is not None and (_is_dtensor(target) or isinstance(target, StateSlice)):
        lo, shape, _local = box_of_target(target)
        box = {**e, "shape": shape}
    else:
        lo, box = [0] * len(e["shape"]), e
    t, _view = _new_tensor(box)
    read_box(fetch, path, key, ShardIndex(e), lo, dest_array(t), verify=verify)
    return t


class _Meter:
    """``progress(done, total)`` of a load: 0 first, then as bytes arrive
    (reader threads: one call at a time), ``done`` never past ``total``."""

    def __init__(self, progress: Callable[[int, int], None] | None, total: int):
        self.progress, self.total, self.done = progress, total, 0
        self._lock = threading.Lock()
        if progress is not None:
            progress(0, total)

    def add(self, n: int) -> None:
        if self.progress is None or not n:
            return
        with self._lock:
            self.done = min(self.total, self.done + n)
            self.progress(self.done, self.total)


def _box_bytes(e: Mapping[str, Any], target: Any) -> int:
    """Bytes of what a boxed read fills: the target's box, else the tensor."""
    shape = (box_of_target(target)[1] if target is not None
             and (_is_dtensor(target) or isinstance(target, StateSlice)) else e["shape"])
    return math.prod(shape) * DTYPES[e["dtype"]][0]


def _local_root(fs: pafs.FileSystem, path: str) -> str | None:
    from checkpoint_store._util import fs as _fsutil

    return _fsutil.local_path(fs, path)


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
    progress: Callable[[int, int], None] | None = None,
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
        progress: ``progress(done_bytes, total_bytes)`` of the tensor bytes
            asked for: called with 0 once the index is read, then as reads
            finish (from reader threads, one call at a time), last with
            ``(total, total)``; drive a ``tqdm`` or ``rich`` bar with it.
            Memory maps count as read when mapped.

    Returns:
        The tree: dicts (as ``dict``), lists, tuples, JSON values; tensors
        as torch tensors (on the CPU) or numpy arrays as they were saved
        (numpy scalars as numpy scalars); tensors saved as the same view
        (tied weights) as one object. With ``keys``, dicts hold only what
        was selected and lists keep their length (``None`` where not selected).

    Raises:
        CheckpointNotFoundError: no checkpoint, or it holds no state, or a
            file of it was deleted while it was read (a retention pass).
        StateKeyError: a name or glob of ``keys`` matches nothing, or ``into``
            holds a key the state lacks; nothing read.
        StateMismatchError: an ``into`` tensor has another dtype or shape
            (or the saved entry is no tensor), or is given under several keys
            the state holds different values for, or two ``into`` tensors
            overlap in memory without being the same view (``t[0:2]`` and
            ``t[1:3]``; interleaved views such as ``t[:, 0]`` and ``t[:, 1]``
            are fine); nothing changed.
        TensorCorruptError: a tensor fails its checksum (``.tensor`` names
            it); every checksum is checked before ``into`` is changed.
        CheckpointCorruptError: ``state.json`` or the marker is damaged.
        InvalidConfigError: ``keys`` is not a string or strings, ``mmap`` or
            ``verify`` is not a bool; nothing read.
    """
    for name, flag in (("mmap", mmap), ("verify", verify)):
        if not isinstance(flag, bool):
            raise InvalidConfigError(f"{name} must be True or False, got {flag!r}")
    if progress is not None and not callable(progress):
        raise InvalidConfigError(f"load_state(progress=) must be a callable (done_bytes, "
                                 f"total_bytes), got {type(progress).__name__}")
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
            chosen = set(leaves)
            targets = {k: v for k, v in targets.items() if k in chosen}
        check_apart(targets)  # the targets this load fills: none may overlap another
        skeleton = _select(saved.skeleton, nodes, leaves)
    elif pats is not None:
        skeleton = _select(saved.skeleton, nodes, pats)
    else:
        skeleton = saved.skeleton
    # Which stored tensors to read: aliases read their target's bytes.
    wanted = _tensor_refs(skeleton)
    # With into, a tensor of it stands for the saved key at its place.
    target_of = {nodes[k]["tensor"]: v for k, v in targets.items()}
    # A key asked for as a box (a DTensor's local shard, a StateSlice) is
    # read as its own box, even when it is an alias (tied weights): another
    # key of the same bytes may ask for another box, or for all of them.
    own = [k for k in wanted if _is_dtensor(target_of.get(k))
           or isinstance(target_of.get(k), StateSlice)]
    own_set = set(own)
    stored = list(dict.fromkeys(saved.tensors[k].get("alias_of", k) for k in wanted
                                if k not in own_set))
    # Tensors stored in pieces are read box by box (docs/sharded-state.md);
    # the rest as whole tensors.
    boxed = [k for k in stored if "shards" in saved.tensors[k]]
    boxed_set = set(boxed)
    stored = [k for k in stored if k not in boxed_set]
    stored.sort(key=lambda k: (saved.tensors[k]["file"], saved.tensors[k]["offsets"][0]))
    meter = _Meter(progress, sum(_box_bytes(saved.tensors[k], target_of.get(k)) for k in own)
                   + sum(_box_bytes(saved.tensors[k], None) for k in boxed)
                   + sum(saved.tensors[k]["offsets"][1] - saved.tensors[k]["offsets"][0]
                         for k in stored))
    local_root = _local_root(fs, path)
    maps = _Maps(local_root) if local_root is not None and (mmap or targets) else None
    fetch = _Fetcher(fs, path, saved.sizes, retry, concurrency, on_read=meter.add,
                     chunked=saved.chunked)
    loaded: dict[str, Any] = {}
    own_loaded: dict[str, Any] = {}
    for out, keys_, asked in ((own_loaded, own, True), (loaded, boxed, False)):
        for key in keys_:
            box_fetch = _Fetcher(fs, path, saved.sizes, retry, concurrency,
                                 chunked=saved.chunked)
            root = saved.tensors[key].get("alias_of", key)
            target = target_of.get(key) if asked else None
            out[key] = _read_boxed(box_fetch, path, root, saved.tensors[root], target, verify)
            meter.add(_box_bytes(saved.tensors[key], target))
    views: list[tuple[str, Mapping[str, Any], memoryview]] = []
    jobs: list[tuple[str, int, memoryview]] = []
    for key in stored:
        e = saved.tensors[key]
        # A chunked file is not on the disk to map: its tensors are read
        # into memory, mmap=True or not (docs/state.md).
        if maps is not None and e["file"] not in saved.chunked:
            begin, end = e["offsets"]
            m = maps.get(e["file"])
            views.append((key, e, memoryview(m)[begin:end]))
            loaded[key] = _from_buffer(e, m, begin)
            meter.add(end - begin)
            continue
        t, view = _new_tensor(e)
        loaded[key] = t
        views.append((key, e, view))
        jobs.extend((e["file"], e["offsets"][0] + a, view[a:b]) for a, b in _pieces(len(view)))
    fetch.fill(jobs)
    if verify:
        _check_all(path, views, fetch._run)

    def source_of(key: str) -> Any:
        return (own_loaded[key] if key in own_loaded
                else loaded[saved.tensors[key].get("alias_of", key)])

    _check_shared_targets(wanted, target_of, source_of)
    # Every checksum passed: only now is any tensor of into changed.
    result: dict[str, Any] = {}
    filled: set[int] = set()
    for key in wanted:
        source = source_of(key)
        target = target_of.get(key)
        if target is not None:
            if id(target) not in filled:
                _fill(target, source)
                filled.add(id(target))
            result[key] = target.tensor if isinstance(target, StateSlice) else target
        else:
            result[key] = _finish(saved.tensors[key], source)
    return build_tree(skeleton, result.__getitem__)


def _check_shared_targets(wanted: Iterable[str], target_of: Mapping[str, Any],
                          source_of: Callable[[str], Any]) -> None:
    """Refuse, before any target is changed, one tensor of ``into`` under
    several keys (tied weights) whose saved values differ: it can hold only
    one of them, and the others would be returned as loaded."""
    first: dict[Any, tuple[str, Any, Any]] = {}
    for key in wanted:
        target = target_of.get(key)
        if target is None:
            continue
        seen = first.setdefault(memory_of(target), (key, target, source_of(key)))
        if seen[0] == key:
            continue
        a, b = seen[2], source_of(key)
        if a is b:  # one loaded value (tied weights saved once): nothing to compare
            continue
        same_box = (not isinstance(target, StateSlice) or not isinstance(seen[1], StateSlice)
                    or target.offset == seen[1].offset)
        same = (same_box and tuple(a.shape) == tuple(b.shape)
                and _raw(a) == _raw(b))
        if not same:
            raise StateMismatchError(
                f"into: {seen[0]!r} and {key!r} are the same tensor, but the saved state holds "
                "different values for them; give each key its own tensor (or untie the "
                "weights before loading)", key=key, expected="a tensor of its own",
                found=f"the tensor of {seen[0]!r}")


def _raw(t: Any) -> bytes:
    """A loaded tensor's bytes (any dtype, bfloat16 included)."""
    import numpy as np

    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).tobytes()
    torch = sys.modules["torch"]  # a torch tensor: torch is imported
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())
