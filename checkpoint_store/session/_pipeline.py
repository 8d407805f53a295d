"""The one report algorithm: every ``report()`` of a Session, whatever it
saves, wherever, whenever and on however many ranks.

A report is planned once (:func:`plan_report`: every mode choice and every
refusal), then runs the same steps for every combination of

- source (:mod:`~checkpoint_store.session._sources`): a directory, a staged
  copy of it, the reserved directory itself, a state from memory, nothing;
- target (:mod:`~checkpoint_store.session._targets`): the storage_path, or a
  local tier in front of it;
- committer (:mod:`~checkpoint_store.session._committers`): one rank, or
  every rank's part with rank 0's marker last;
- executor (:mod:`~checkpoint_store.session._executors`): inline, or a
  background lane;

with the row's bookkeeping in :mod:`~checkpoint_store.session._ledger`. As
in torch DCP and Orbax v1, a background save is the synchronous save run on
an executor, not a second save.

Every path keeps the same rules (docs/sessions.md, "What report() promises"):

- a refused report writes nothing and moves no counter;
- an index is consumed once the report writes under it, reused only after a
  refusal (:mod:`~checkpoint_store.session._ledger`);
- an earlier background error is raised by the next report of any kind,
  ``wait()`` or the end of the session;
- commits keep report order (an inline commit waits for the queued ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from checkpoint_store._util.locks import TakeBack
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import (
    AmbiguousCommitError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    InvalidConfigError,
    NestedCheckpointError,
)
from checkpoint_store.retention.upload_config import check_staging, check_upload_mode
from checkpoint_store.session._committers import CheckpointJob, Committer, RankCommitter
from checkpoint_store.session._executors import BackgroundWork
from checkpoint_store.session._ledger import CommitRecorder, ReportLedger, Row, Txn
from checkpoint_store.session._sources import (
    DirectorySource,
    InPlaceSource,
    Planned,
    Source,
    StagedCopySource,
    StagedWrite,
    StateSource,
    StateStaging,
)
from checkpoint_store.session._targets import Target, TieredTarget

__all__ = ["ReportHook", "ReportPipeline", "ReportPlan", "plan_report"]


class ReportHook(Protocol):
    """Called by ``Session.report`` around every report (a TrialRunner's)."""

    def before_report(self) -> None: ...

    def after_report(self, row: Row, checkpoint: Checkpoint | None) -> None: ...

ASYNC_RANKS = (
    "upload_mode='async' supports one rank only without a local tier; use 'sync' "
    "with world_size > 1, or start the session with local_tier=LocalTier(...) "
    "(its durable copies run in the background on every rank)")
STATE_RESERVED = (
    "report(state=...) after next_checkpoint_dir(): that directory holds files written "
    "in place, which a state would be committed with; report it with checkpoint=, or "
    "save the state without calling next_checkpoint_dir()")
STAGING_WHERE = (
    "staging= applies only where report() stages a copy of a directory: "
    "checkpoint= with upload_mode='async', one rank, no local tier, not the "
    "directory next_checkpoint_dir() handed out; got staging={staging!r} for {what}")


@dataclass(frozen=True)
class ReportPlan:
    """How one report runs.

    Attributes:
        saves: this rank passes something to commit (a directory, a state,
            or files written in place).
        in_place: the files are in ``checkpoint_<index>`` already.
        state: a state tree saved from memory.
        background: the commit runs on the target's background lane.
        wait_durable: with a local tier, the report waits for the durable
            copy (an explicit ``upload_mode="sync"``).
        staging: how a background directory report stages its copy.
    """

    saves: bool
    in_place: bool = False
    state: bool = False
    background: bool = False
    wait_durable: bool = False
    staging: str | None = None


def plan_report(*, checkpoint: Checkpoint | None, state: Mapping[str, Any] | None,
                upload_mode: str | None, staging: str | None, default_mode: str,
                default_staging: str, tiered: bool, ranks: bool, in_place: bool,
                reserved: bool = False) -> ReportPlan:
    """Every mode choice and refusal of ``report()``, in one place.

    Raises:
        InvalidConfigError: both ``checkpoint`` and ``state``; an unknown
            ``upload_mode`` or ``staging``; ``upload_mode="async"`` with
            several ranks, no local tier and no state; ``staging`` where no
            copy is staged; ``state`` after ``next_checkpoint_dir()``
            reserved the directory.

    A state is accepted on any number of ranks, with or without a local
    tier: each rank stages its part (with a tier, into its own tier
    directory, committed there; docs/sharded-state.md) and the commit on
    the storage_path runs in the background unless ``upload_mode="sync"``.
    """
    if checkpoint is not None and state is not None:
        raise InvalidConfigError("pass checkpoint= or state= to report(), not both")
    if upload_mode is not None:
        check_upload_mode(upload_mode)
    if staging is not None:
        check_staging(staging)
    if ranks and not tiered and upload_mode == "async" and state is None:
        raise InvalidConfigError(ASYNC_RANKS)
    if state is not None:
        if reserved:
            raise InvalidConfigError(STATE_RESERVED)
        if staging is not None:
            raise InvalidConfigError(STAGING_WHERE.format(staging=staging, what="state="))
        mode = upload_mode or "async"
        return ReportPlan(saves=True, state=True, background=tiered or mode == "async",
                          wait_durable=tiered and mode == "sync")
    saves = checkpoint is not None or in_place
    background = (saves and not in_place and not tiered and not ranks
                  and (upload_mode or default_mode) == "async")
    if staging is not None and not background:
        what = ("a metrics-only report" if not saves else "an in-place checkpoint" if in_place
                else "a report with a local tier" if tiered else "several ranks" if ranks
                else "upload_mode='sync'")
        raise InvalidConfigError(STAGING_WHERE.format(staging=staging, what=what))
    return ReportPlan(saves=saves, in_place=in_place, background=background,
                      wait_durable=tiered and saves and upload_mode == "sync",
                      staging=(staging or default_staging) if background else None)


class ReportPipeline:
    """One session's report path (one rank of a trial).

    Args:
        ledger: rows, counters, numbering.
        recorder: commits to retention and ``get_checkpoint()``.
        work: the background lanes.
        target: where checkpoints are committed.
        committer: who commits them (one rank, or every rank).
        staging: the shared-memory staging of states.
        run_id: the trial's run id (internal metadata).
        world_size, world_rank: the ranks.
        default_mode, default_staging: ``UploadConfig.upload_mode`` / ``.staging``.
    """

    def __init__(self, *, ledger: ReportLedger, recorder: CommitRecorder, work: BackgroundWork,
                 target: Target, committer: Committer, staging: StateStaging, run_id: str,
                 world_size: int, world_rank: int, default_mode: str, default_staging: str):
        self.ledger = ledger
        self.recorder = recorder
        self.work = work
        self.target = target
        self.committer = committer
        self.staging = staging
        self._run_id = run_id
        self._world_size = world_size
        self._rank = world_rank
        self._writer = world_rank == 0
        self._default_mode = default_mode
        self._default_staging = default_staging
        self._background_committer: RankCommitter | None = None

    @property
    def tiered(self) -> bool:
        return isinstance(self.target, TieredTarget)

    def report(self, metrics: Mapping[str, Any], checkpoint: Checkpoint | None = None, *,
               state: Mapping[str, Any] | None = None, upload_mode: str | None = None,
               staging: str | None = None, preemption: Mapping[str, Any] | None = None
               ) -> tuple[Row, Checkpoint | None]:
        """``Session.report``: ``(row, the committed checkpoint or None)``;
        ``preemption``: recorded in the checkpoint's internal metadata."""
        self.ledger.ensure_open()
        ranks = self.committer.ranks
        in_place = state is None and self.target.in_place(
            checkpoint, self.ledger.next_index, self.ledger.reserved, ranks)
        plan = plan_report(checkpoint=checkpoint, state=state, upload_mode=upload_mode,
                           staging=staging, default_mode=self._default_mode,
                           default_staging=self._default_staging, tiered=self.tiered,
                           ranks=ranks, in_place=in_place,
                           reserved=self.ledger.reserved == self.ledger.next_index)
        # An earlier background error: raised now (one rank); with several ranks
        # it takes part in this report's rendezvous first, aborting its
        # checkpoint on every rank, so the ranks never fall out of step.
        background_error = self.work.take_error() if ranks else None
        if not ranks:
            self.work.raise_errors()
        try:
            planned = (self.staging.plan(state, self._rank, self._world_size)
                       if state is not None else None)
        except Exception as exc:
            if not ranks:
                raise
            # A state this rank cannot save: published at the rendezvous, so
            # the index is aborted on every rank, then raised here.
            background_error, planned = background_error or exc, None
        if not ranks:  # a refused row: raised before any wait (ranks raise after the rendezvous)
            self.ledger.prepare_row(metrics, checkpoint, validate_score=plan.saves)
            if plan.saves:
                self._admit(plan, checkpoint, planned)
        if ranks and plan.saves:
            # Every rank, without raising (an error is published at the
            # rendezvous): room on its own local tier (max_bytes), then a slot
            # on the lane of a background commit, or the queued commits done
            # before an inline one (commits keep order).
            if not plan.in_place and background_error is None:
                try:
                    self.target.make_room(checkpoint,
                                          planned.nbytes if planned is not None else 0,
                                          self.work.durable_busy)
                except Exception as exc:
                    background_error = exc
            if plan.background:
                self.work.lane(self.target.lane).reserve()  # type: ignore[arg-type]
            else:
                self.work.wait_queued()
        with self.ledger.lock:
            txn = self.ledger.open_txn()
            return self._report(txn, plan, metrics, checkpoint, planned, background_error,
                                preemption)

    def _admit(self, plan: ReportPlan, checkpoint: Checkpoint | None,
               planned: Planned | None) -> None:
        """Backpressure and order before the report stages anything."""
        if not plan.in_place:
            nbytes = planned.nbytes if planned is not None else 0
            self.target.make_room(checkpoint, nbytes, self.work.durable_busy)
        if plan.background:
            self.work.admit(reserve="durable" if self.target.lane == "durable" else None,
                            after=())
        else:  # inline: after every queued commit of the same target
            self.work.admit(reserve=None,
                            after=("local",) if self.tiered else ("local", "durable"))

    def _report(self, txn: Txn, plan: ReportPlan, metrics: Mapping[str, Any],
                checkpoint: Checkpoint | None, planned: Planned | None,
                error: BaseException | None, preemption: Mapping[str, Any] | None = None,
                ) -> tuple[Row, Checkpoint | None]:
        ledger, ranks = self.ledger, self.committer.ranks
        row: Row = {}
        try:
            row = ledger.prepare_row(metrics, checkpoint,
                                     validate_score=plan.saves and self._writer)
        except Exception as exc:
            if not ranks:
                raise
            error = error or exc  # still takes part in the rendezvous below, then raised
        if not self.committer.agree(plan.saves):
            if error is not None:
                raise error
            txn.accept(row, flush=False)
            return row, None
        if not ranks and not self.tiered:  # a tier's durable copies settle their own
            self.recorder.settle()
        name = txn.name_checkpoint(row)
        if ranks:  # every rank moves on together, committed or not
            txn.consume_index()
        source: Source | None = None
        queued: TakeBack[Checkpoint | None] | None = None
        try:
            try:
                if plan.state and planned is None:  # several ranks: this rank's plan failed
                    assert error is not None
                    raise error
                source = self._open_source(txn, plan, checkpoint, planned)
            except Exception as exc:
                if not ranks:
                    raise
                error, source = error or exc, None
            internal = {"metrics": row, "world_size": self._world_size,
                        "run_id": self._run_id}
            if preemption is not None:
                internal["preemption"] = dict(preemption)
            job = CheckpointJob(txn.index, row, internal, source, error)
            flush = not self.tiered
            if plan.background:
                txn.consume_index()
                queued = TakeBack(lambda: self._commit(job, abandon=True),
                                  source.release if source is not None else None)
                self.work.submit(self.target.lane,  # type: ignore[arg-type]
                                 queued, queued.release, name)
        except BaseException:
            # A signal's exception between the staging and the queueing: the
            # report raised, so it acknowledged nothing. Its commit is taken
            # back unless its worker took it (then it runs), and what was
            # staged for it goes: a state's staging, a directory's private
            # copy (moved files back into the reported directory). Several
            # ranks commit together: not there.
            if not ranks and source is not None and (queued is None or queued.take_back()):
                source.take_back()
                if source.state and source.in_place:
                    self.target.drop(txn.index)
            raise
        if plan.background:
            if ranks and job.own_error is not None:
                # This rank failed before its commit: the abort goes through
                # the same background rendezvous as the other ranks' commit,
                # then the error is raised here, by this report.
                self.work.wait_queued()
                raise self.work.take_error() or job.own_error
            txn.accept(row, flush=flush)
            committed = None
        else:
            try:
                committed = self._commit(job)
            except AmbiguousCommitError:
                txn.consume_index()
                txn.accept(row, flush=False)  # it may be committed: its row names it
                raise
            except BaseException as exc:
                if not _refused_before_writing(exc, source):
                    txn.consume_index()
                    if not ranks and not self.tiered:  # its leftovers: removed by settle()
                        self.recorder.abandon(txn.index)
                raise
            finally:
                if source is not None:
                    source.release()
            txn.consume_index()
            txn.accept(row, flush=flush)
        if plan.wait_durable:
            assert isinstance(self.target, TieredTarget)
            self.target.wait_sync(txn.index, self.work)
        return row, committed

    def _open_source(self, txn: Txn, plan: ReportPlan, checkpoint: Checkpoint | None,
                     planned: Planned | None) -> Source | None:
        """The files of this report, opened under the lock (the index is known).
        The index is consumed before anything is written under it."""
        if plan.state:
            assert planned is not None
            # Without a tier several ranks write their pieces into a scratch
            # directory each, copied as their part (never into the shared
            # checkpoint_<index> itself); with one, each rank's tier directory
            # is its own: its part is committed there, then copied.
            directory = (None if self.committer.ranks and not self.tiered
                         else self.target.state_directory(txn.index))
            if directory is not None:
                txn.consume_index()  # staged straight into checkpoint_<index>
            try:
                if directory is not None:
                    # Inside the try: a signal's exception once the directory
                    # is made and claimed drops it too.
                    self.target.reserve(txn.index)
                return self.staging.stage(planned, directory, txn.index)
            except BaseException:
                if directory is not None:
                    self.target.drop(txn.index)
                raise
        if plan.in_place:
            return InPlaceSource()
        if checkpoint is None:
            return None  # several ranks: this rank contributes no files
        if plan.background:
            assert plan.staging is not None
            return StagedCopySource(checkpoint, plan.staging)
        return DirectorySource(checkpoint, check=not self.committer.ranks)

    def _commit(self, job: CheckpointJob, abandon: bool = False) -> Checkpoint | None:
        """Commit ``job`` on the target: inline, or on a background lane
        (``abandon``: a failure leaves the index to :meth:`CommitRecorder.settle`).
        Several ranks committing in the background meet through storage only:
        the training thread keeps the process group's collectives."""
        committer = self.committer
        if abandon and isinstance(committer, RankCommitter):
            if self._background_committer is None:
                self._background_committer = committer.storage_only()
            committer = self._background_committer
        try:
            return self.target.commit(job, committer)
        except AmbiguousCommitError:
            raise
        except BaseException:
            if abandon and not self.committer.ranks and not self.tiered:
                self.recorder.abandon(job.index)
            raise

    def report_source(self, metrics: Mapping[str, Any], source: StagedWrite) -> Row:
        """``report(metrics, state=...)`` with ``source`` standing in for the staged
        state (anything with ``write_to``, ``release`` and ``nbytes``), through the
        same steps; for tests of the background commit (``testing.session_internals``)."""
        from checkpoint_store.session._sources import StateSource

        class _Given(StateStaging):
            def plan(self, state: Mapping[str, Any], rank: int = 0,
                     world_size: int = 1) -> Planned:
                return source

            def stage(self, plan: Planned, directory: str | None, index: int) -> StateSource:
                assert directory is not None, "report_source needs a local directory target"
                return StateSource(source, directory, True)

        real, self.staging = self.staging, _Given(0)
        try:
            row, _ = self.report(metrics, state={})
        finally:
            self.staging = real
        return row


def _refused_before_writing(error: BaseException, source: Source | None) -> bool:
    """Whether a failed inline commit wrote nothing under its index, so the
    index is handed out again: a source refused by the commit's own checks
    (names no store keeps, a checkpoint nested in another), or an in-place
    directory refused as it is (an unfinished save: the directory stays
    reserved for the retry). Anything else may have written: consumed."""
    if isinstance(error, (InvalidConfigError, NestedCheckpointError)):
        return True
    in_place = source is not None and source.in_place and not source.state
    return in_place and isinstance(error, (CheckpointCorruptError, CheckpointNotFoundError))
