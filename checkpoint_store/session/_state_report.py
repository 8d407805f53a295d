"""``session.report(metrics, state=...)``: save a state tree from memory.

What blocks the training loop, and what runs behind it:

1. ``report()`` checks the metrics and the state (a leaf that cannot be
   stored is refused before anything is copied or written), raises the error
   of an earlier background save, waits while ``max_pending_uploads`` saves
   are pending (as ``upload_mode="async"`` does), then copies every tensor
   into the session's shared-memory staging area
   (:class:`~checkpoint_store.state._staging.Stager`, bounded by
   ``UploadConfig.staging_budget``) and returns. A state larger than the
   free staging memory is copied while the persist process drains it: the
   report blocks only for the bytes that do not fit.
2. The persist process (:mod:`checkpoint_store.state._persist`, started on
   the first state report) writes the staged bytes into safetensors files
   and checksums them. On local storage it writes straight into the
   checkpoint directory, claimed like :meth:`Session.next_checkpoint_dir`'s;
   on any other storage into a local scratch directory under
   :func:`~checkpoint_store.session._uploads.staging_root`.
3. The session's background worker (the one of ``upload_mode="async"``)
   waits for those files, then commits them (in place, or uploads the
   scratch directory) with the tensor index in the internal metadata
   (``"tensors"``), and registers the checkpoint with retention, in report
   order.

The result row is written at once, naming the checkpoint directory, as with
``upload_mode="async"``. ``report(..., state=..., upload_mode="sync")`` does
all three steps before it returns. One rank only.

With a local tier (``session.start(local_tier=LocalTier(...))``) the persist
process writes straight into ``checkpoint_<index>`` of the local tier, the
tier's worker commits it there and then queues the durable copy its
``persist`` policy selects (:meth:`Session._tier_commit_staged`); with
``upload_mode="sync"`` the report returns once the local commit and, where
``persist`` selects it, the durable copy are done.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from checkpoint_store._format.layout import checkpoint_dir_name
from checkpoint_store._results.writer import finish_before_exit_flush
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.errors import CheckpointStoreError, InvalidConfigError
from checkpoint_store.session._uploads import BackgroundUploader, check_upload_mode, staging_root

__all__ = ["close_stager", "report_state", "stager_of"]

_ATTR = "_state_stager"


def stager_of(session: Any) -> Any:
    """The session's :class:`~checkpoint_store.state._staging.Stager` (made on first use)."""
    from checkpoint_store.state._staging import Stager

    stager = getattr(session, _ATTR, None)
    if stager is None:
        stager = Stager(session.upload_config.staging_budget)
        setattr(session, _ATTR, stager)
    return stager


def close_stager(session: Any) -> None:
    """Stop the session's persist process (after every background save finished)."""
    stager = getattr(session, _ATTR, None)
    if stager is not None:
        setattr(session, _ATTR, None)
        stager.close()


def _uploader(session: Any) -> BackgroundUploader:
    if session._uploader is None:
        session._uploader = BackgroundUploader(session.upload_config.max_pending_uploads)
        # A process that exits without ending the session still commits them.
        finish_before_exit_flush(session)
    up: BackgroundUploader = session._uploader
    return up


def _target(storage: Any, index: int) -> tuple[str, bool]:
    """``(local directory the persist process writes, True when that is the
    checkpoint directory itself)``."""
    dest = storage.checkpoint_path(index)
    local = _fsutil.local_path(storage.filesystem, dest)
    if local is not None:
        storage.reserve_in_place(index)
        return local, True
    return tempfile.mkdtemp(prefix="state-", dir=staging_root()), False


def _remove_quietly(storage: Any, index: int) -> None:
    import logging

    path = storage.checkpoint_path(index)
    try:
        storage.commit_protocol.remove_leftover(path)
    except Exception as exc:  # the next session's cleanup removes it
        logging.getLogger(__name__).warning("could not remove the unfinished %s: %s",
                                            storage.uri(path), exc)


def report_state(
    session: Any, metrics: Mapping[str, Any], state: Mapping[str, Any],
    upload_mode: str | None,
) -> tuple[dict[str, Any], Any]:
    """The ``state=`` half of ``Session.report``; see this module's docstring.

    Args:
        session: the :class:`~checkpoint_store.session.Session`.
        metrics: as for ``report()``.
        state: a dict of tensors (torch CPU tensors, numpy arrays) and JSON
            values, nested (``{"model": model.state_dict(), "optim":
            opt.state_dict(), "step": 7}``).
        upload_mode: ``"sync"`` (write and commit before returning) or
            ``"async"``; None: ``"async"``.

    Returns:
        ``(row, committed Checkpoint or None)`` (None when asynchronous).

    Raises:
        InvalidConfigError: ``world_size > 1``, a bad ``upload_mode``, or a
            score retention refuses.
        MetadataError: a key or leaf of ``state`` (or of ``metrics``) cannot
            be stored; nothing is copied or written.
        PersistProcessError: the persist process died while the report waited
            for staging memory (nothing committed for this report; the
            next one starts a new process); or, raised by a later report,
            ``wait()`` or the end of the session, while it wrote an earlier one.
        CheckpointStoreError: the session has ended.
    """
    from checkpoint_store.state._staging import plan_state

    mode = check_upload_mode(upload_mode or "async")
    if session.world_size > 1:
        raise InvalidConfigError(
            "report(state=...) supports one rank only for now; with world_size > 1 save "
            "each rank's shard with torch.distributed.checkpoint into "
            "session.next_checkpoint_dir() and report checkpoint=")
    plan = plan_state(state)  # refused leaves: before anything waits or is written
    row = session._prepare_row(metrics, None, validate_score=False)
    session.manager.validate_metrics(row)
    up = _uploader(session)
    up.raise_error()
    if mode == "sync":
        up.wait()  # commits keep report order: earlier background saves first
    else:
        up.reserve()
    up.raise_error()
    stager = stager_of(session)
    with session._lock:
        if session._closed:
            raise CheckpointStoreError("this session has ended; start a new one to report")
        row = session._prepare_row(metrics, None, validate_score=False)
        index = session._next_index
        if session._tier is not None:
            return _report_to_tier(session, stager, plan, row, index, mode)
        directory, in_place = _target(session.storage, index)

        def drop() -> None:
            if not in_place:
                shutil.rmtree(directory, ignore_errors=True)

        def drop_uncommitted() -> None:
            # Before the commit began: nothing of this index is committed, and
            # the directory is this session's alone (never reused, see below).
            if in_place:
                _remove_quietly(session.storage, index)

        try:
            staged = stager.stage(plan, directory)
        except BaseException:
            # Nothing committed; the index is not reused.
            if in_place:
                session._next_index = index + 1
            drop_uncommitted()
            drop()
            raise
        internal = session._checkpoint_internal(row, index)
        session._next_index = index + 1

        def persist() -> Any:
            try:
                tensors = staged.write_to(record=in_place)
            except BaseException:
                drop_uncommitted()
                raise
            internal["tensors"] = tensors
            if in_place:
                source = session.storage.checkpoint(checkpoint_dir_name(index))
            else:
                from checkpoint_store.checkpoint import Checkpoint

                source = Checkpoint.from_directory(directory)
            return session._commit(source, index, internal, row)

        def cleanup() -> None:
            staged.release()
            drop()

        if mode == "sync":
            try:
                persisted = persist()
            finally:
                cleanup()
            session._accept_row(row)
            session._append_row(row, flush=True)
            return row, persisted
        session._accept_row(row)
        up.submit(persist, cleanup, row["checkpoint_dir_name"])
        if session._results is not None:
            session._results.append(row)
            session._results.flush()  # a checkpoint report: its row goes out now
    return row, None



def _report_to_tier(session: Any, stager: Any, plan: Any, row: dict[str, Any], index: int,
                    mode: str) -> tuple[dict[str, Any], Any]:
    """``report(state=...)`` with a local tier, under ``session._lock``: stage
    into the tier's ``checkpoint_<index>`` and hand the staged state to the
    tier (:meth:`Session._tier_commit_staged`), which writes, commits and
    persists it in the background."""
    from checkpoint_store.session import _tiered

    tier = session._tier
    path = tier.reserve_in_place(index)
    directory = _fsutil.local_path(tier.storage.filesystem, path) or path
    try:
        staged = stager.stage(plan, directory)
    except BaseException:
        session._next_index = index + 1  # claimed: never reused
        try:
            tier.storage.commit_protocol.remove_leftover(path)
        except Exception:  # the next start's cleanup removes it
            pass
        raise
    internal = session._checkpoint_internal(row, index)
    session._next_index = index + 1
    session._accept_row(row)
    session._append_row(row, flush=False)
    session._tier_commit_staged(staged, index, internal, row)
    if mode == "sync":  # as for checkpoint=: the local commit, then a selected durable copy
        worker = _tiered._worker(session)
        worker.wait()
        worker.raise_error()
        if tier.status(index) == "pending":
            tier.wait_durable(index)
        _tiered.raise_errors(session)
    return row, None
