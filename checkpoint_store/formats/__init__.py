"""Checkpoints in other tools' formats: export to, and import from, Hugging
Face model folders, ``torch.save`` files and torch.distributed.checkpoint
(DCP) directories (docs/formats.md).

* :func:`export_checkpoint`: any checkpoint (a saved state, or a folder of
  safetensors, DCP or ``torch.save`` files) written as a sharded Hugging
  Face folder (``model-0000k-of-0000n.safetensors`` +
  ``model.safetensors.index.json``), a ``torch.save`` file or a DCP
  directory, on any backend.
* :func:`import_checkpoint`: such a folder or file made a committed
  checkpoint holding a state (manifest, CRC32C, marker), in place where
  it can be, so ``load_state(keys=...)`` and ``resume_from`` work on it.

Tensors stream shard by shard, in pieces (:data:`CHUNK_BYTES`), each one
checked (CRC32C) as it is read; errors a format raises are checked before
the first write (:class:`~checkpoint_store.errors.FormatConversionError`).

Layer: above :mod:`checkpoint_store.checkpoint` (it returns ``Checkpoint``
objects and commits through :mod:`checkpoint_store._commit`), below the CLI.
torch is imported only for ``torch.save`` and DCP.
"""

from __future__ import annotations

from checkpoint_store.formats._api import Exported, detect_format
from checkpoint_store.formats._export import HF_SHARD_BYTES, export_checkpoint
from checkpoint_store.formats._import import import_checkpoint
from checkpoint_store.formats._sources import CHUNK_BYTES

__all__ = ["CHUNK_BYTES", "HF_SHARD_BYTES", "Exported", "detect_format", "export_checkpoint",
           "import_checkpoint"]
