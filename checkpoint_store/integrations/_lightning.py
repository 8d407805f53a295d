"""The PyTorch Lightning integration, whichever package name Lightning comes under.

Nothing here imports Lightning: :mod:`checkpoint_store.integrations.lightning`
(``lightning``) and :mod:`checkpoint_store.integrations.pytorch_lightning`
(the old ``pytorch_lightning`` name) bind these classes to their package's
``CheckpointIO`` and ``Callback`` base classes, since the Trainer checks
plugins and callbacks by ``isinstance`` against its own package.

On storage, a Lightning checkpoint path ``<dirpath>/epoch=3-step=8.ckpt``
names a directory holding the state as one file plus our two metadata files::

    <dirpath>/epoch=3-step=8.ckpt/
        checkpoint.ckpt             torch.save() of Lightning's checkpoint dict
        .internal_metadata.json     index = global_step, run_id, metrics, manifest (last)

Retention: with Lightning's ``ModelCheckpoint`` Lightning owns top-K and this
plugin only commits, indexes and verifies (it never evicts on its own); with
:class:`ReportCheckpointCallback` our session's retention owns it.

The parts live in private modules, one idea each: ``_lightning_state`` (the
state file: write, read, verify), ``_lightning_async`` (the ordered background
queue), ``_lightning_io`` (the plugin's save, load, remove),
``_lightning_resume`` (``resume_path``), ``_lightning_mc`` (``ModelCheckpoint``
through the plugin's storage options) and ``_lightning_callback`` (the
report callback). This module gathers them for the public modules.
"""

from __future__ import annotations

from checkpoint_store.integrations._lightning_callback import _ReportCallback
from checkpoint_store.integrations._lightning_io import _StoreIO
from checkpoint_store.integrations._lightning_mc import _StoreModelCheckpoint
from checkpoint_store.integrations._lightning_resume import checkpoint_file, resume_path
from checkpoint_store.integrations._lightning_state import STATE_FILE, verified_state

__all__ = ["STATE_FILE", "_ReportCallback", "_StoreIO", "_StoreModelCheckpoint", "checkpoint_file",
           "resume_path", "verified_state"]
