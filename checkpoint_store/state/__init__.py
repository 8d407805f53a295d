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
when a state holds their objects.

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
from checkpoint_store.state._read import load_state
from checkpoint_store.state._shards import RankLocal, StateSlice, merge_parts, write_part
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
