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

The parts live in this private package, one idea each: ``state`` (the
state file: write, read, verify), ``queue`` (the ordered background
queue), ``io`` (the plugin's save, load, remove), ``resume``
(``resume_path``), ``modelcheckpoint`` (``ModelCheckpoint`` through the
plugin's storage options) and ``callback`` (the report callback). This
package imports no Lightning, so both public faces (``lightning`` and
``pytorch_lightning``, each importing its own package) sit on it.
"""

from __future__ import annotations

from checkpoint_store.integrations._lightning.callback import _ReportCallback
from checkpoint_store.integrations._lightning.io import _StoreIO
from checkpoint_store.integrations._lightning.modelcheckpoint import _StoreModelCheckpoint
from checkpoint_store.integrations._lightning.resume import checkpoint_file, resume_path
from checkpoint_store.integrations._lightning.state import STATE_FILE, verified_state

__all__ = ["STATE_FILE", "_ReportCallback", "_StoreIO", "_StoreModelCheckpoint", "checkpoint_file",
           "resume_path", "verified_state"]
