"""The report paths of a Session without a local tier: one rank and several
ranks, synchronous (``report(metrics, checkpoint)``), and the commit every
path shares: persist ``checkpoint_<index>``, settle an ambiguous commit.

Functions of a :class:`~checkpoint_store.session.Session` (passed first), as
:mod:`~checkpoint_store.session._tiered` and
:mod:`~checkpoint_store.session._state_report` are; the row's bookkeeping
(``_prepare_row``, ``_accept_row``, ``_record_commit``) stays on the Session.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from checkpoint_store._format.layout import checkpoint_dir_name
from checkpoint_store._util.inspect import read_internal_metadata
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import AmbiguousCommitError, CheckpointStoreError

# The Session's logger: its records keep the name they always had.
_logger = logging.getLogger("checkpoint_store.session._session")


def report_single(
    session: Any, metrics: Mapping[str, Any], checkpoint: Checkpoint | None
) -> tuple[dict[str, Any], Checkpoint | None]:
    with session._lock:
        if session._closed:
            raise CheckpointStoreError("this session has ended; start a new one to report")
        # Refuse bad metrics or a bad score before anything is uploaded.
        row = session._prepare_row(metrics, checkpoint, validate_score=True)
        persisted = None
        if checkpoint is not None:
            settle(session)
            index = session._next_index
            internal = session._checkpoint_internal(row, index)
            try:
                persisted = persist(session, checkpoint, index, internal, row)
            except AmbiguousCommitError:
                # It may be committed: its row is kept (it names the
                # directory), the next report settles it and moves on.
                session._next_index = index + 1
                session._accept_row(row)
                session._append_row(row, flush=False)
                raise
            # Committed: from here on nothing may hand this index out again.
            session._next_index = index + 1
            session._record_commit(persisted, row)
        session._accept_row(row)
        # A checkpoint's row is on storage with it.
        session._append_row(row, flush=checkpoint is not None)
        return row, persisted


def report_multirank(
    session: Any, metrics: Mapping[str, Any], checkpoint: Checkpoint | None
) -> tuple[dict[str, Any], Checkpoint | None]:
    coord = session._coordinator
    assert coord is not None
    with session._lock:
        if session._closed:
            raise CheckpointStoreError("this session has ended; start a new one to report")
        # An error found here must still take part in the rendezvous below,
        # or the other ranks would wait for this one until the timeout.
        error: BaseException | None = None
        row: dict[str, Any] = {}
        try:
            row = session._prepare_row(metrics, checkpoint,
                                    validate_score=session.world_rank == 0)
        except Exception as exc:
            error = exc
        persisted = None
        in_place = session._in_place(checkpoint, session._next_index)
        if coord.any_checkpoint(checkpoint is not None or in_place):
            index = session._next_index
            # Every rank moves on, committed or not: a failed index is never reused.
            session._next_index = index + 1
            row["checkpoint_dir_name"] = checkpoint_dir_name(index)
            internal = session.storage.internal_metadata(
                index, {"metrics": row, "run_id": session.manager.run_id})
            persisted = coord.commit(index, checkpoint, internal, error, in_place=in_place)
            session._record_commit(persisted, row)
        elif error is not None:
            raise error
        session._accept_row(row)
        if session._results is not None:
            session._results.append(row)
            if persisted is not None:
                session._results.flush()  # a checkpoint's row is on storage with it
        return row, persisted


def persist(session: Any, source: Checkpoint, index: int, internal: Mapping[str, Any],
            row: Mapping[str, Any]) -> Checkpoint:
    """Upload and commit ``source`` as ``checkpoint_<index>``.

    Raises:
        AmbiguousCommitError: it may be committed; ``index`` is remembered
            for :func:`settle` and must not be used again.
        Any other error of the commit: nothing was committed.
    """
    try:
        if session._in_place(source, index):
            return session.storage.commit_in_place(index, internal)
        return session.storage.persist_checkpoint(source, index, internal,
                                               writer_id=session._writer_id)
    except AmbiguousCommitError:
        session._unsettled.append((index, dict(row)))
        raise


def settle(session: Any) -> None:
    """Settle the indexes whose commit may have landed: a marker of this
    session's writer there is registered with retention; anything else is
    left for cleanup. An index that still cannot be read stays unsettled;
    none is ever reused. Never raises."""
    for index, row in list(session._unsettled):
        path = session.storage.checkpoint_path(index)
        try:
            meta = read_internal_metadata(session.storage.filesystem, path,
                                          retry=session.storage.retry)
            session._unsettled.remove((index, row))
            if meta is None or meta.get("writer_id") != session._writer_id:
                _logger.warning("%s was not committed (its report failed)",
                                session.storage.uri(path))
                continue
            session._record_commit(Checkpoint._from_backend(session.storage.backend, path, meta),
                                row)
        except Exception as exc:  # settled at the next report, or by cleanup
            _logger.warning("could not settle whether %s was committed: %s",
                            session.storage.uri(path), exc)
