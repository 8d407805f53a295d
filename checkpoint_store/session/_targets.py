"""Where a report's checkpoint is committed: the storage_path
(:class:`DurableTarget`), or a local tier in front of it (:class:`TieredTarget`:
committed locally, then a durable copy in the background when the tier's
``persist`` policy selects it; Orbax's "a tier is another manager", at the
size of one class).

Both answer the same questions: which directory ``next_checkpoint_dir()``
hands out, whether a reported checkpoint is that directory (in place), where
a state is staged, and :meth:`commit`, which runs inline or on a background
lane (the same code either way).

The durable copies (:class:`TieredTarget`) run on the durable lane in report
order: rows are flushed first (a checkpoint's row is on storage no later than
the checkpoint), then the local copy is committed on the storage_path by the
committer (several ranks: meeting through storage only), retried by
:meth:`FastTier.persist <checkpoint_store.tiers.FastTier.persist>`.

A state saved on several ranks is staged by each rank into its own tier's
``checkpoint_<index>`` and committed there as that rank's part (its pieces,
the part's index in the local metadata); the durable copy uploads the part
with the index in the rank marker, and rank 0 commits the merged
``state.json``, as without a tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from checkpoint_store._format.layout import checkpoint_dir_name
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.checkpoint import Checkpoint, written_metadata
from checkpoint_store.errors import CheckpointConflictError, CheckpointStoreError
from checkpoint_store.session._committers import CheckpointJob, Committer, RankCommitter
from checkpoint_store.session._executors import BackgroundWork
from checkpoint_store.session._ledger import CommitRecorder, ReportLedger, Row
from checkpoint_store.session._sources import EmptyPart, Source, StateSource
from checkpoint_store.storage import StorageContext
from checkpoint_store.tiers import FastTier
from checkpoint_store.tiers.local import source_bytes

__all__ = ["LOCAL_STATE_PART", "DurableTarget", "Target", "TieredTarget", "is_state_part"]

logger = logging.getLogger(__name__)

#: The key of a local tier copy's internal metadata that holds this rank's
#: part of a state saved on several ranks (docs/format.md, "Local tier"):
#: ``{"tree", "tensors", "sharding"}``, as its rank marker carries it.
LOCAL_STATE_PART = "state_part"


def is_state_part(meta: Mapping[str, Any]) -> bool:
    """Whether a local tier copy (its internal metadata ``meta``) is one rank's
    part of a state saved on several ranks: it holds only the pieces that
    rank wrote, never the whole state a load needs."""
    return isinstance(meta.get(LOCAL_STATE_PART), dict)


def _no_op() -> None:
    pass


class Target:
    """Where checkpoints are committed (see the module docstring)."""

    #: The lane a background commit of this target runs on.
    lane: str = "durable"

    def reserve(self, index: int) -> str:
        """Create and claim ``checkpoint_<index>`` for a writer that fills it in
        place; returns a local path where there is one, else a URI."""
        raise NotImplementedError

    def directory(self, index: int) -> str:
        """``checkpoint_<index>``: a local path where there is one, else a URI."""
        raise NotImplementedError

    def in_place(self, checkpoint: Checkpoint | None, index: int, reserved: int | None,
                 ranks: bool) -> bool:
        """Whether ``checkpoint`` is ``checkpoint_<index>`` itself (the directory
        :meth:`reserve` handed out); with several ranks, ``None`` is when it
        was handed out."""
        raise NotImplementedError

    def state_directory(self, index: int) -> str | None:
        """Where a state of ``index`` is staged: ``checkpoint_<index>``
        (reserved) when it is on a local disk, else None (a scratch directory)."""
        raise NotImplementedError

    def drop(self, index: int) -> None:
        """Remove what a failed report left in ``checkpoint_<index>`` (never
        committed); a failure is logged, cleanup at the next start removes it."""
        raise NotImplementedError

    def make_room(self, source: Source | Checkpoint | None, nbytes: int, busy: Callable[[], bool]
                  ) -> None:
        """Backpressure before a report stages: a local tier's ``max_bytes``."""

    def commit(self, job: CheckpointJob, committer: Committer) -> Checkpoint | None:
        """Commit ``job`` (inline or on a lane). Returns the committed checkpoint
        (a local tier's copy), or None for a rank whose local part failed."""
        raise NotImplementedError


class DurableTarget(Target):
    """The storage_path itself."""

    def __init__(self, storage: StorageContext):
        self.storage = storage

    def reserve(self, index: int) -> str:
        self.storage.reserve_in_place(index)
        return self.directory(index)

    def directory(self, index: int) -> str:
        path = self.storage.checkpoint_path(index)
        local = _fsutil.local_path(self.storage.filesystem, path)
        return local if local is not None else self.storage.uri(path)

    def in_place(self, checkpoint: Checkpoint | None, index: int, reserved: int | None,
                 ranks: bool) -> bool:
        if checkpoint is None:
            return ranks and reserved == index
        if not isinstance(checkpoint, Checkpoint):
            return False
        return checkpoint.uri == self.storage.uri(self.storage.checkpoint_path(index))

    def state_directory(self, index: int) -> str | None:
        if self.storage.dedup:  # staged apart, then committed as chunks
            return None
        return _fsutil.local_path(self.storage.filesystem, self.storage.checkpoint_path(index))

    def drop(self, index: int) -> None:
        path = self.storage.checkpoint_path(index)
        try:
            self.storage.commit_protocol.remove_leftover(path)
        except Exception as exc:  # the next session's cleanup removes it
            logger.warning("could not remove the unfinished %s: %s", self.storage.uri(path), exc)

    def commit(self, job: CheckpointJob, committer: Committer) -> Checkpoint | None:
        source = job.source
        if isinstance(source, StateSource):
            try:
                tensors = source.write()
            except Exception as exc:
                if not committer.ranks:
                    if source.in_place:  # nothing of this index is committed
                        self.drop(job.index)
                    raise
                # Published in this rank's marker: the index is aborted on every rank.
                job.own_error, tensors = job.own_error or exc, {}
            except BaseException:
                if source.in_place:
                    self.drop(job.index)
                raise
            if source.part is not None:  # a rank's part: rank 0 merges the index
                job.state_part = source.part
            else:
                job.internal["tensors"] = tensors
        in_place = source is not None and source.in_place
        files = None if source is None or in_place else source.files()
        return committer.commit(job, files, in_place)


class TieredTarget(Target):
    """A local tier (:class:`~checkpoint_store.tiers.FastTier`) in front of the
    storage_path.

    Args:
        tier: the opened local tier.
        durable_committer: commits the durable copies (several ranks: its
            ``storage_only()`` twin is used, on the durable lane).
        work: the session's lanes.
        ledger: flushes the rows before a durable copy.
        recorder: records durable copies (and adopts one found committed).
        writer_id: the session's writer id.
    """

    lane = "local"

    def __init__(self, tier: FastTier, durable_committer: Committer, work: BackgroundWork,
                 ledger: ReportLedger, recorder: CommitRecorder, writer_id: str):
        self.tier = tier
        self._work = work
        self._ledger = ledger
        self._recorder = recorder
        self._writer_id = writer_id
        self._durable: Committer = durable_committer
        if isinstance(durable_committer, RankCommitter):
            self._durable = durable_committer.storage_only()

    def reserve(self, index: int) -> str:
        self.tier.reserve_in_place(index)
        return self.directory(index)

    def directory(self, index: int) -> str:
        return str(self.tier.checkpoint(index).path)

    def in_place(self, checkpoint: Checkpoint | None, index: int, reserved: int | None,
                 ranks: bool) -> bool:
        if reserved != index:
            return False
        if checkpoint is None:
            return ranks
        return isinstance(checkpoint, Checkpoint) and checkpoint.uri == self.tier.checkpoint(
            index).uri

    def state_directory(self, index: int) -> str | None:
        path = self.tier.storage.checkpoint_path(index)
        return _fsutil.local_path(self.tier.storage.filesystem, path) or path

    def wait_sync(self, index: int, work: BackgroundWork) -> None:
        """``upload_mode="sync"``: the local commit (a state's runs on the local
        lane), then the durable copy where ``persist`` selected it."""
        work.admit(reserve=None, after=("local",))
        if self.tier.status(index) == "pending":
            self.tier.wait_durable(index)
        work.raise_errors()

    def drop(self, index: int) -> None:
        try:
            self.tier.storage.commit_protocol.remove_leftover(
                self.tier.storage.checkpoint_path(index))
        except Exception:  # the next start's cleanup removes it
            pass

    def make_room(self, source: Source | Checkpoint | None, nbytes: int,
                  busy: Callable[[], bool]) -> None:
        if isinstance(source, Checkpoint):
            nbytes = source_bytes(source)
        self.tier.make_room(nbytes, busy)

    def commit(self, job: CheckpointJob, committer: Committer) -> Checkpoint | None:
        tier, source = self.tier, job.source
        fast: Checkpoint | None = None
        error = job.own_error
        selected = True
        durable = job.internal
        if error is None:
            try:
                if isinstance(source, StateSource) and source.sharding is not None:
                    fast, selected = self._commit_part(source, job)
                elif isinstance(source, StateSource):
                    fast, selected = tier.commit_staged(source.staged, job.index, job.internal,
                                                        job.row)
                    tensors = written_metadata(fast).get("tensors")
                    if tensors is not None:  # the same tensor index on every tier
                        durable = {**job.internal, "tensors": tensors}
                elif source is not None and source.in_place:
                    fast, selected = tier.commit_in_place(job.index, job.internal, job.row)
                else:
                    files = (source or EmptyPart()).files()
                    fast, selected = tier.commit(files, job.index, job.internal, job.row,
                                                 writer_id=self._writer_id)
            except Exception as exc:
                if not committer.ranks:
                    raise
                error = exc  # published to the other ranks by the durable copy
                selected = tier.selects(job.index, job.row)
        else:
            selected = tier.selects(job.index, job.row)
        if selected:
            own = None if fast is not None else (error or CheckpointStoreError("no local copy"))
            self.queue_durable(job.index, durable, job.row, own_error=own,
                               state_part=job.state_part)
        if error is not None:
            raise error
        return fast

    def _commit_part(self, source: StateSource, job: CheckpointJob) -> tuple[Checkpoint, bool]:
        """This rank's part of a state saved on several ranks: the persist
        process writes its pieces straight into this rank's ``checkpoint_<index>``
        (reserved by the report), committed there with the part's index in the
        local copy's metadata (:data:`LOCAL_STATE_PART`), which the durable
        copy's rank marker carries to rank 0's merge (also after a restart,
        from the local copy alone). Sets ``job.state_part``.

        Raises:
            Whatever the write or the local commit raises; what it left in
            ``checkpoint_<index>`` is removed (nothing is recorded then).
        """
        try:
            source.write()
            part = source.part
            assert part is not None, "a sharded state's source keeps its part"
            job.state_part = part
            return self.tier.commit_in_place(job.index, {**job.internal, LOCAL_STATE_PART: part},
                                             job.row)
        except BaseException:
            self.drop(job.index)
            raise

    def queue_durable(self, index: int, internal: dict[str, Any], row: Row,
                      own_error: BaseException | None = None,
                      state_part: dict[str, Any] | None = None) -> None:
        """Queue the durable copy of the local ``checkpoint_<index>`` (report
        order, the durable lane). ``own_error``: this rank has no local copy;
        its failure aborts the index on every rank. ``state_part``: the local
        copy is this rank's part of a state saved on several ranks (its
        rank marker carries it; rank 0 commits the merged ``state.json``)."""
        job = CheckpointJob(index, row, internal, None, own_error, state_part=state_part)
        name = checkpoint_dir_name(index)
        tier, durable = self.tier, self._durable

        def commit(local: Checkpoint | None) -> None:
            self._ledger.flush()  # the row before the checkpoint
            try:
                durable.commit(job, local, False)
            except CheckpointConflictError:
                # Committed there already: by the run a kill stopped before its
                # local tier recorded it (a restart that could not read the
                # persistent tier then). Registered once; anything else raises.
                if durable.ranks or not self._recorder.adopt(index, row):
                    raise
            # A retry after an ambiguous commit found its own marker: settled.
            self._recorder.forget_unsettled(index)
            self._recorder.add_among(index)

        if own_error is not None:
            def abort() -> None:
                # Publishes this rank's failure, so every rank aborts the index;
                # the error itself was raised by the report already.
                try:
                    commit(None)
                except BaseException as exc:
                    if exc is not own_error:
                        raise

            self._work.submit("durable", abort, _no_op, name)
        elif durable.ranks:  # an aborted index is never retried: the next session persists it
            self._work.submit("durable", lambda: tier.persist(index, commit, deadline_s=0),
                              _no_op, name)
        else:
            self._work.submit("durable", lambda: tier.persist(index, commit), _no_op, name)
