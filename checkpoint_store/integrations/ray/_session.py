"""Level 3 of :mod:`checkpoint_store.integrations.ray`: our session under Ray.

Owns :class:`RaySession` and :func:`active_session`, through which
``checkpoint_store.session.report()`` and ``get_checkpoint()`` forward to
Ray Train or Ray Tune when no checkpoint-store session runs here, and
:func:`_commit_for_tune`, which commits a Tune report's checkpoint by our
protocol. Never imports Ray unless Ray is already imported. Import the
public names from :mod:`checkpoint_store.integrations.ray`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import checkpoint_dir_name
from checkpoint_store.checkpoint import Checkpoint, _require_checkpoint
from checkpoint_store.errors import CheckpointStoreError, InvalidConfigError
from checkpoint_store.integrations.ray._filesystem import (
    as_checkpoint,
    backend_of,
    committed_checkpoint,
)
from checkpoint_store.integrations.ray._train import upload_fn

__all__ = ["RaySession", "active_session"]

# Named for the public module, as before the split: logging configuration and
# filters that select "checkpoint_store.integrations.ray" keep working.
logger = logging.getLogger("checkpoint_store.integrations.ray")


class RaySession:
    """What ``checkpoint_store.session.report()``/``get_checkpoint()`` do under Ray.

    Obtained from :func:`active_session`; ``kind`` is ``"train"`` (a Ray
    Train worker) or ``"tune"`` (a Ray Tune function trainable).
    """

    def __init__(self, kind: str):
        self.kind = kind

    def report(
        self, metrics: Mapping[str, Any], *, checkpoint: Checkpoint | None = None,
        state: Any = None,
    ) -> dict[str, Any]:
        """Forward to ``ray.train.report`` (with :func:`upload_fn`) or ``ray.tune.report``.

        Under Tune the checkpoint is committed first, by our protocol, as
        ``<trial dir>/checkpoint_NNNNNN`` (the directory Tune then records
        for that report, Tune's numbering), and Tune is handed an empty
        directory to copy there.

        A ``state`` (docs/state.md) is written into a local scratch
        directory (:meth:`Checkpoint.from_state`, synchronously: a Tune
        trial, or a Ray Train run of one worker, is one process writing the
        whole state) and reported as that checkpoint; the directory is
        removed once reported. With several Ray Train workers it is refused:
        each worker's state would be a whole state of the same file names.

        Returns:
            The metrics as reported (a copy); under Tune with the auto-filled
            keys of :data:`checkpoint_store.session.AUTO_FILLED`.

        Raises:
            MetadataError: ``metrics`` is not a JSON object.
            InvalidConfigError: ``checkpoint`` is not a Checkpoint; both
                ``checkpoint`` and ``state``; ``state`` in a Ray Train run of
                several workers.
            UnsupportedStateError: ``state`` holds what the state format
                cannot store; nothing reported.
        """
        clean = _json.to_json_object(metrics, "metrics")
        if checkpoint is not None:
            _require_checkpoint(checkpoint)
        if state is not None:
            return self._report_state(clean, checkpoint, state)
        if self.kind == "train":
            return self._report_train(clean, checkpoint)
        return self._report_tune(clean, checkpoint)

    def _report_state(self, clean: dict[str, Any], checkpoint: Checkpoint | None,
                      state: Any) -> dict[str, Any]:
        if checkpoint is not None:
            raise InvalidConfigError("pass checkpoint= or state= to report(), not both")
        if self.kind == "train":
            import ray.train

            world = ray.train.get_context().get_world_size()
            if world > 1:
                raise InvalidConfigError(
                    f"report(state=...) in a Ray Train run of {world} workers: each worker "
                    "would write a whole state under the same file names. Save each "
                    "worker's shard into a directory of its own names (torch DCP) and "
                    "report checkpoint=, or run one worker")
        with tempfile.TemporaryDirectory(prefix="cs-ray-") as scratch:
            written = Checkpoint.from_state(state, os.path.join(scratch, "state"))
            if self.kind == "train":
                return self._report_train(clean, written)
            return self._report_tune(clean, written)

    def _report_train(self, clean: dict[str, Any], checkpoint: Checkpoint | None) -> dict:
        import ray.train

        ray_ckpt = None
        if checkpoint is not None:
            ray_ckpt = ray.train.Checkpoint(path=checkpoint.path, filesystem=checkpoint.filesystem)
        ray.train.report(clean, checkpoint=ray_ckpt, checkpoint_upload_fn=upload_fn())
        return clean

    def _report_tune(self, clean: dict[str, Any], checkpoint: Checkpoint | None) -> dict:
        import ray.tune
        from ray.train._internal.session import get_session

        tune_session = get_session()
        row = self._tune_row(clean, tune_session)
        if checkpoint is None:
            ray.tune.report(clean)
            return row
        _commit_for_tune(tune_session, checkpoint, row)
        with tempfile.TemporaryDirectory(prefix="cs-ray-") as empty:
            # Tune records the directory we committed; there is nothing left to copy.
            ray.tune.report(clean, checkpoint=ray.tune.Checkpoint.from_directory(empty))
        return row

    @staticmethod
    def _tune_row(clean: dict[str, Any], tune_session: Any) -> dict[str, Any]:
        """Our auto-filled keys (docs/format.md), counted from Tune's session; after
        a restore ``training_iteration`` continues from the restored checkpoint."""
        state = tune_session.__dict__.setdefault("_checkpoint_store", {})
        if "offset" not in state:
            state["offset"] = 0
            if tune_session.loaded_checkpoint is not None:
                meta = as_checkpoint(tune_session.loaded_checkpoint).internal_metadata
                state["offset"] = int(dict(meta).get("metrics", {}).get("training_iteration", 0))
        now = time.time()
        row = dict(clean)
        row.update(
            training_iteration=state["offset"] + int(tune_session.iteration) + 1,
            timestamp=now,
            time_total_s=tune_session.time_total + (now - tune_session.last_report_time),
            time_this_iter_s=now - tune_session.last_report_time,
            trial_id=f"{tune_session.experiment_name}/{tune_session.trial_name}",
            checkpoint_dir_name=None,
        )
        return row

    def get_checkpoint(self) -> Checkpoint | None:
        """Ray's restored checkpoint as ours (None when Ray has none); when Ray
        hands one that is not committed, the newest committed one beside it
        (:func:`~checkpoint_store.integrations.ray.committed_checkpoint`,
        which also says what it raises)."""
        if self.kind == "train":
            import ray.train

            ray_ckpt = ray.train.get_checkpoint()
        else:
            import ray.tune

            ray_ckpt = ray.tune.get_checkpoint()
        return None if ray_ckpt is None else committed_checkpoint(ray_ckpt)


def _commit_for_tune(tune_session: Any, checkpoint: Checkpoint, row: dict[str, Any]) -> Checkpoint:
    """Commit ``checkpoint`` where Tune will record this report's checkpoint:
    ``<trial dir>/checkpoint_<Tune's index + 1>``. Sets ``row["checkpoint_dir_name"]``.

    A committed directory already there is one Tune never recorded (a trial
    that died between our commit and Tune's record reuses the index after a
    restore): it is deleted, marker first, and committed again. An
    uncommitted one (a report killed before its marker) is replaced by the
    commit.

    Raises:
        CheckpointStoreError: this Ray version numbers Tune checkpoints differently.
    """
    from ray.train._internal.storage import StorageContext as TuneStorage

    from checkpoint_store.storage import StorageContext

    tstore = tune_session.storage
    if type(tstore)._update_checkpoint_index is not TuneStorage._update_checkpoint_index:
        raise CheckpointStoreError(
            f"{type(tstore).__name__} numbers Tune checkpoints its own way; "
            "checkpoint_store.session.report() cannot commit them under Ray Tune here"
        )
    index = tstore.current_checkpoint_index + 1
    name = checkpoint_dir_name(index)
    row["checkpoint_dir_name"] = name
    backend, retry = backend_of(tstore.storage_filesystem)
    ours = StorageContext.from_backend(
        backend,
        tstore.storage_fs_path,
        tstore.experiment_dir_name,
        tstore.trial_dir_name,
        retry=retry,
        run_id=f"ray_{tune_session.trial_id}",
    )
    if ours.checkpoint(name).is_committed:
        logger.warning(
            "%s was never recorded by Tune; replacing it", ours.uri(ours.checkpoint_path(index))
        )
        ours.delete_checkpoint(name)
    # An uncommitted leftover there (a writer killed before its marker) is
    # replaced by the commit itself.
    return ours.persist_checkpoint(
        checkpoint, index, {"metrics": row, "world_size": 1, "run_id": ours.run_id}
    )


def active_session() -> RaySession | None:
    """A :class:`RaySession` when this code runs in a Ray Train worker or a
    Ray Tune function trainable, else None. Never imports Ray itself."""
    import sys

    if "ray" not in sys.modules:
        return None
    try:
        from ray.train.v2._internal.util import _in_ray_train_worker
        from ray.tune.trainable.trainable_fn_utils import _in_tune_session
    except ImportError:  # pragma: no cover - another Ray version
        return None
    if _in_tune_session():
        return RaySession("tune")
    if _in_ray_train_worker():
        return RaySession("train")
    return None
