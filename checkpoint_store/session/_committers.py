"""Who commits a checkpoint on the storage_path: this rank alone
(:class:`SingleCommitter`), or every rank's part with rank 0's marker last
(:class:`RankCommitter`, over :class:`~checkpoint_store.session._multirank.Coordinator`).

One rank is the no-op case of several, as DCP's ``_DistWrapper`` makes its
collectives no-ops without a process group: :meth:`agree` is the identity
and :meth:`commit` commits this rank's files itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from checkpoint_store._util import transferlog as _transferlog
from checkpoint_store.checkpoint import Checkpoint, written_metadata
from checkpoint_store.errors import AmbiguousCommitError
from checkpoint_store.session._ledger import CommitRecorder, Row
from checkpoint_store.session._multirank import Coordinator
from checkpoint_store.session._sources import Source
from checkpoint_store.storage import StorageContext

__all__ = ["CheckpointJob", "Committer", "RankCommitter", "SingleCommitter"]

logger = logging.getLogger(__name__)


@dataclass
class CheckpointJob:
    """One report's checkpoint: what to commit as ``checkpoint_<index>``.

    Attributes:
        index: the checkpoint index (consumed by the report).
        row: the report's result row (its ``checkpoint_dir_name`` set).
        internal: fields of the internal metadata (metrics, run id ...).
        source: the files (None: this rank contributes none; several ranks).
        own_error: several ranks: an error this rank hit before the commit,
            published so the index is aborted on every rank.
        state_part: several ranks saving a state: this rank's part.
    """

    index: int
    row: Row
    internal: dict[str, Any]
    source: Source | None
    own_error: BaseException | None = field(default=None)
    #: Several ranks saving a state: this rank's part of it (its pieces'
    #: index), which rank 0 merges into the checkpoint's one index.
    state_part: dict[str, Any] | None = field(default=None)


class Committer:
    """Commits a job's files on the storage_path and records the commit."""

    ranks = False

    def agree(self, has_checkpoint: bool) -> bool:
        """Whether this report saves a checkpoint (several ranks: any rank's)."""
        return has_checkpoint

    def commit(self, job: CheckpointJob, source: Checkpoint | None,
               in_place: bool) -> Checkpoint:
        raise NotImplementedError


class SingleCommitter(Committer):
    """This rank commits alone (``world_size == 1``).

    Args:
        storage: the trial on the storage_path.
        recorder: where a commit, or an unknown outcome, is recorded.
        writer_id: the session's writer id (its own claims and markers).
    """

    def __init__(self, storage: StorageContext, recorder: CommitRecorder, writer_id: str):
        self._storage = storage
        self._recorder = recorder
        self._writer_id = writer_id

    def commit(self, job: CheckpointJob, source: Checkpoint | None,
               in_place: bool) -> Checkpoint:
        """Upload ``source`` (or commit ``checkpoint_<index>`` as it is, ``in_place``)
        and record it.

        Raises:
            AmbiguousCommitError: it may be committed; the index is left for
                :meth:`CommitRecorder.settle`.
            Any other error of the commit: nothing was committed.
        """
        storage = self._storage
        started = time.monotonic()
        try:
            if in_place:
                committed = storage.commit_in_place(job.index, job.internal)
            else:
                assert source is not None
                committed = storage.persist_checkpoint(source, job.index, job.internal,
                                                       writer_id=self._writer_id)
        except AmbiguousCommitError:
            self._recorder.unsettled(job.index, job.row)
            raise
        # The marker the commit wrote (no storage call): its manifest's bytes.
        _transferlog.log_if_long(
            logger, f"commit {committed.uri}",
            lambda: _transferlog.manifest_bytes(written_metadata(committed)),
            time.monotonic() - started)
        self._recorder.record(committed, job.row)
        return committed


class RankCommitter(Committer):
    """Every rank uploads its part; rank 0 commits once all ranks are done
    (:meth:`Coordinator.commit`). Called on every rank, the same number of
    times, in the same order."""

    ranks = True

    def __init__(self, coordinator: Coordinator, recorder: CommitRecorder):
        self.coordinator = coordinator
        self._recorder = recorder

    def agree(self, has_checkpoint: bool) -> bool:
        return self.coordinator.any_checkpoint(has_checkpoint)

    def commit(self, job: CheckpointJob, source: Checkpoint | None,
               in_place: bool) -> Checkpoint:
        # The marker's fields as the storage fills them; rank 0 adds world_size.
        extra = {k: v for k, v in job.internal.items() if k != "world_size"}
        internal = self.coordinator.storage.internal_metadata(job.index, extra)
        committed = self.coordinator.commit(job.index, source, internal, job.own_error,
                                            in_place=in_place, state_part=job.state_part)
        self._recorder.record(committed, job.row)
        return committed

    def storage_only(self) -> RankCommitter:
        """The same ranks meeting through storage only (rank markers and polls),
        for commits on a background thread: collectives stay on the training
        thread."""
        return RankCommitter(self.coordinator.storage_only(), self._recorder)
