"""Ray Train and Ray Tune keep their checkpoints through checkpoint-store.

Three levels, each usable alone (docs/integrations/ray.md):

1. **Our backends as Ray's filesystem.** :func:`ray_filesystem` returns
   ``(pyarrow.fs.PyFileSystem(handler), path)`` for
   ``RunConfig(storage_path=path, storage_filesystem=fs)`` and
   ``Tuner.restore(..., storage_filesystem=fs)``. Every storage call Ray
   makes goes through :class:`CheckpointStoreHandler`: our backend (Azure
   without hand wrapping, any plugin), its retries and credential rebuilds,
   one-level listings, and marker-first deletes of committed checkpoints.
2. **Committed checkpoints from Ray Train.** :func:`upload_fn` for
   ``ray.train.report(..., checkpoint_upload_fn=upload_fn())``: each worker
   uploads its files with our transfer (parallel, CRC32C on the fly) into
   the directory Ray names and writes its rank marker.
   :class:`CommitCallback` (``RunConfig(callbacks=[CommitCallback()])``)
   writes ``.internal_metadata.json`` last once Ray has every rank's report.
3. **Our session under Ray.** Inside a Ray Train worker or a Ray Tune
   function trainable, with no checkpoint-store session started there,
   ``checkpoint_store.session.report()`` and ``get_checkpoint()`` forward to
   Ray (:func:`active_session`), so a function written for
   :class:`~checkpoint_store.TrialRunner` runs unchanged in a ``Tuner`` or a
   ``TorchTrainer``.

Retention belongs to Ray here (``CheckpointConfig(num_to_keep=...)`` of
Ray's ``RunConfig``): we commit, index and verify, never evict. Ray's
deletes reach storage through the handler, which removes the commit marker
first. Requires ``pip install 'checkpoint-store[ray]'`` (Ray 2.60); importing
this module does not import Ray, only the Ray-facing calls do.
"""

from __future__ import annotations

from typing import Any

# The three levels live in private modules, one idea each; this module is the
# public face and re-exports their names (private ones too, for existing
# imports and tests).
from checkpoint_store.integrations.ray._filesystem import (
    CheckpointStoreHandler,
    as_checkpoint,
    backend_of,
    committed_checkpoint,
    ray_filesystem,
)
from checkpoint_store.integrations.ray._filesystem import _restore_handler as _restore_handler
from checkpoint_store.integrations.ray._filesystem import _split_secrets as _split_secrets
from checkpoint_store.integrations.ray._session import RaySession as RaySession
from checkpoint_store.integrations.ray._session import _commit_for_tune as _commit_for_tune
from checkpoint_store.integrations.ray._session import active_session
from checkpoint_store.integrations.ray._train import (
    _commit_callback_class,
    upload_fn,
)
from checkpoint_store.integrations.ray._train import _commit_from_markers as _commit_from_markers
from checkpoint_store.integrations.ray._train import _upload_rank as _upload_rank

__all__ = [
    "CheckpointStoreHandler",
    "CommitCallback",  # noqa: F822 - built on first use, see __getattr__
    "active_session",
    "as_checkpoint",
    "backend_of",
    "committed_checkpoint",
    "ray_filesystem",
    "upload_fn",
]


def __getattr__(name: str) -> Any:
    # CommitCallback subclasses ray.train.UserCallback: built on first use so
    # that importing this module (e.g. to unpickle the handler) needs no Ray.
    if name == "CommitCallback":
        cls = _commit_callback_class()
        globals()["CommitCallback"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
