"""State in, state out: a tree of tensors and plain values as checkpoint files.

A **state** is what ``model.state_dict()``, ``optimizer.state_dict()`` and a
step counter make together: nested dicts (string or int keys), lists and tuples
whose leaves are torch tensors, numpy arrays or JSON values. This package
turns one into checkpoint files (safetensors shards for the tensors, one
``state.json`` for the rest; never pickle) and reads them back, whole, in
part (``keys``), memory-mapped (``mmap``) or into existing tensors
(``into``). docs/state.md describes the API and the format.

Layer: below :mod:`checkpoint_store.checkpoint` (which calls it from
``Checkpoint.from_state`` / ``Checkpoint.load_state``); it never imports the
checkpoint, storage or session modules. numpy and torch are imported only
when a state holds their objects; each public name below is imported on
first use, so the persist process, which reaches the writer through this
package, loads neither pyarrow nor numpy.

Public names:

* :func:`flatten_state`, :class:`FlatState`, :class:`StateLayout`,
  :class:`TensorSpec`: a tree flattened into tensors plus a picklable layout;
* :func:`write_state`, :func:`write_buffers`, :class:`StateWriter`: the
  files, from a tree or from raw bytes (shared memory), returning the
  tensor index;
* :func:`load_state`, :func:`read_state_index`, :func:`verify_tensors`: reading back;
* :func:`write_part`, :func:`merge_parts`, :class:`StateSlice`,
  :class:`RankLocal`: a state saved
  in pieces on many ranks and read back in other pieces (docs/sharded-state.md);
* :data:`STATE_FILE`, :data:`DEFAULT_SHARD_BYTES`, :data:`DTYPES`;
* :func:`staging_root`, :data:`ENV_STAGING_DIR`: the local directory staged
  copies go to (the session's and Lightning's); :func:`scratch_dir` makes one
  there, :func:`sweep_staging_root` removes those of dead processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from checkpoint_store.state._fetch import PART_BYTES
    from checkpoint_store.state._files import (
        DEFAULT_SHARD_BYTES,
        STATE_FILE,
        STATE_FORMAT_VERSION,
        StateWriter,
        encode_header,
        header_name,
        key_of_header_name,
        layout_of_buffers,
        shard_name,
        write_buffers,
        write_state,
    )
    from checkpoint_store.state._index import SavedState, local_state_index, read_state_index
    from checkpoint_store.state._placement import RankLocal, StateSlice, write_part
    from checkpoint_store.state._read import load_state
    from checkpoint_store.state._shards import merge_parts
    from checkpoint_store.state._staging_dir import (
        ENV_STAGING_DIR,
        scratch_dir,
        staging_root,
        sweep_staging_root,
    )
    from checkpoint_store.state._tree import (
        DTYPES,
        FlatState,
        StateLayout,
        TensorSpec,
        escape_key,
        flatten_state,
        split_key,
        unescape_key,
    )
    from checkpoint_store.state._verify import name_corrupt_tensor, verify_tensors

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "DTYPES",
    "ENV_STAGING_DIR",
    "STATE_FILE",
    "STATE_FORMAT_VERSION",
    "FlatState",
    "PART_BYTES",
    "RankLocal",
    "SavedState",
    "StateLayout",
    "StateSlice",
    "StateWriter",
    "TensorSpec",
    "escape_key",
    "flatten_state",
    "encode_header",
    "header_name",
    "key_of_header_name",
    "layout_of_buffers",
    "load_state",
    "local_state_index",
    "merge_parts",
    "name_corrupt_tensor",
    "read_state_index",
    "shard_name",
    "split_key",
    "scratch_dir",
    "staging_root",
    "sweep_staging_root",
    "unescape_key",
    "verify_tensors",
    "write_buffers",
    "write_part",
    "write_state",
]


# Imported on first use: the persist process (state/_persist.py) imports this
# package on its way to the writer and must not load pyarrow (through
# _fetch) or numpy with it; its memory is bounded by budget + 64 MiB.
_LAZY = {
    "DEFAULT_SHARD_BYTES": "checkpoint_store.state._files",
    "DTYPES": "checkpoint_store.state._tree",
    "ENV_STAGING_DIR": "checkpoint_store.state._staging_dir",
    "FlatState": "checkpoint_store.state._tree",
    "PART_BYTES": "checkpoint_store.state._fetch",
    "RankLocal": "checkpoint_store.state._placement",
    "STATE_FILE": "checkpoint_store.state._files",
    "STATE_FORMAT_VERSION": "checkpoint_store.state._files",
    "SavedState": "checkpoint_store.state._index",
    "StateLayout": "checkpoint_store.state._tree",
    "StateSlice": "checkpoint_store.state._placement",
    "StateWriter": "checkpoint_store.state._files",
    "TensorSpec": "checkpoint_store.state._tree",
    "encode_header": "checkpoint_store.state._files",
    "escape_key": "checkpoint_store.state._tree",
    "flatten_state": "checkpoint_store.state._tree",
    "header_name": "checkpoint_store.state._files",
    "key_of_header_name": "checkpoint_store.state._files",
    "layout_of_buffers": "checkpoint_store.state._files",
    "load_state": "checkpoint_store.state._read",
    "local_state_index": "checkpoint_store.state._index",
    "merge_parts": "checkpoint_store.state._shards",
    "name_corrupt_tensor": "checkpoint_store.state._verify",
    "read_state_index": "checkpoint_store.state._index",
    "scratch_dir": "checkpoint_store.state._staging_dir",
    "shard_name": "checkpoint_store.state._files",
    "split_key": "checkpoint_store.state._tree",
    "staging_root": "checkpoint_store.state._staging_dir",
    "sweep_staging_root": "checkpoint_store.state._staging_dir",
    "unescape_key": "checkpoint_store.state._tree",
    "verify_tensors": "checkpoint_store.state._verify",
    "write_buffers": "checkpoint_store.state._files",
    "write_part": "checkpoint_store.state._placement",
    "write_state": "checkpoint_store.state._files",
}


def __getattr__(name: str) -> Any:
    import importlib

    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'checkpoint_store.state' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
