"""The one Session implementation behind ``report()``, for training and tuning."""

from __future__ import annotations

import logging
import os
import posixpath
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._results.writer import ResultLog, last_result_rows
from checkpoint_store._util import transferlog as _transferlog
from checkpoint_store._util.ids import new_writer_id
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.retention import CheckpointConfig, CheckpointManager
from checkpoint_store.retention.restore import Listing
from checkpoint_store.session._checks import (
    check_checkpoint_config,
    check_resume_source,
    check_timeout,
    check_upload_config,
    check_wait_timeout,
    int_from,
    resume_source,
)
from checkpoint_store.session._closing import close_session, record_end
from checkpoint_store.session._committers import Committer, RankCommitter, SingleCommitter
from checkpoint_store.session._context import (
    RESUME_FROM_KEY,
    SessionContext,
    checkpoint_counters,
    recorded_resume_from,
    resume_counters,
)
from checkpoint_store.session._executors import BackgroundWork
from checkpoint_store.session._ledger import CommitRecorder, ReportLedger
from checkpoint_store.session._multirank import Coordinator
from checkpoint_store.session._pipeline import ASYNC_RANKS, ReportHook, ReportPipeline
from checkpoint_store.session._preemption import (
    PreemptionConfig,
    PreemptionWatch,
    check_installable,
    check_preemption,
    install_exit_on_sigterm,
    uninstall_exit_on_sigterm,
    unwatch,
    watch,
)
from checkpoint_store.session._sources import StateStaging, state_bytes
from checkpoint_store.session._targets import DurableTarget, Target, TieredTarget
from checkpoint_store.session._tier_recovery import (
    checkpoint_index,
    index_of,
    newest_local,
    open_tier,
    wait_durable,
)
from checkpoint_store.session._uploads import BackgroundUploader, UploadConfig
from checkpoint_store.state import sweep_staging_root
from checkpoint_store.storage import StorageContext
from checkpoint_store.tiers import FastTier, LocalTier, check_local_tier
from checkpoint_store.tiers.view import record_local_tier

AUTO_FILLED = (
    "training_iteration",
    "timestamp",
    "time_total_s",
    "time_this_iter_s",
    "trial_id",
    "checkpoint_dir_name",
)


class Session:
    """One training run's (or trial's) reporting state. Build it with
    :func:`checkpoint_store.session.start`.

    With ``world_size > 1`` every rank has a Session on the same trial; rank 0
    writes ``params.json``, ``result.json`` and the retention state and holds
    the trial's lease, the other ranks only upload their checkpoint files
    (see :mod:`checkpoint_store.session._multirank`).

    Thread-safety: one thread reports; ``report`` is serialised by a lock.
    """

    def __init__(
        self,
        storage: StorageContext,
        checkpoint_config: CheckpointConfig | None = None,
        *,
        upload_config: UploadConfig | None = None,
        config: Mapping[str, Any] | None = None,
        world_rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        attempt_id: str | None = None,
        sync_timeout_s: float = 1800.0,
        resume_from: Checkpoint | str | os.PathLike[str] | None = None,
        local_tier: LocalTier | None = None,
        preemption: PreemptionConfig | bool | None = None,
    ):
        # Every argument is checked before the first storage call: a refused
        # start writes nothing (no trial directory, no params.json).
        if not isinstance(storage, StorageContext):
            raise InvalidConfigError(
                f"storage must be a StorageContext, got {type(storage).__name__}"
            )
        self.storage = storage
        self.checkpoint_config = check_checkpoint_config(checkpoint_config)
        self.upload_config = check_upload_config(upload_config, self.checkpoint_config)
        self.config = _json.to_json_object(config or {}, "config")
        self.world_rank = int_from(world_rank, "RANK", 0, "world_rank")
        self.world_size = int_from(world_size, "WORLD_SIZE", 1, "world_size")
        self.local_rank = int_from(local_rank, "LOCAL_RANK", 0, "local_rank")
        if self.world_size < 1 or self.world_rank >= self.world_size:
            raise InvalidConfigError(
                f"world_rank {self.world_rank} must be in [0, world_size={self.world_size})"
            )
        if self.upload_config.dedup and self.world_size > 1:
            raise InvalidConfigError(
                "UploadConfig(dedup=True) stores one rank's checkpoints as chunks; with "
                f"world_size={self.world_size} leave dedup off (each rank's files are "
                "committed as files)")
        if self.upload_config.dedup:
            storage.set_chunking(True, self.upload_config.compression)
        sync_timeout_s = check_timeout(sync_timeout_s)
        local_tier = check_local_tier(local_tier, storage)
        preemption_config = check_preemption(preemption)
        if preemption_config is not None:
            check_installable(preemption_config)
        self._preemption: PreemptionWatch | None = None
        self._exit_on_sigterm = False
        # The local tier (session.start(local_tier=...)), opened below; its
        # worker for staged states; the copies every rank has (several ranks).
        # Read only, never registered, moved or deleted by this trial: it lives
        # outside the trial directory, where retention never looks. A starting
        # point, read once: a trial with checkpoints of its own never reads it
        # (another run's retention may have deleted it since).
        self._resume_from = resume_source(resume_from, storage)
        self._resume_checked = False
        if self._resume_from is not None and not Listing.of(storage).dirs:
            self._check_resume_from()  # a new trial: refused before anything is written
        if (self.world_size > 1 and local_tier is None
                and self.upload_config.upload_mode == "async"):
            raise InvalidConfigError(ASYNC_RANKS)
        # Watched from here: a signal during the start is answered by the
        # first report (the handler is given back if the start fails).
        if preemption_config is not None:
            self._preemption = PreemptionWatch(preemption_config, on_signal=self._on_preemption)
            watch(self._preemption)
        try:
            # One writer id for every commit of this session: a claim or a marker
            # an earlier report left is then recognisably this session's own.
            self._writer_id = new_writer_id(storage.run_id)
            # Set by a TrialRunner: called at the start and the end of report().
            self._hooks: list[ReportHook] = []
            self._tier: FastTier | None = None
            self._coordinator: Coordinator | None = None
            if self.world_size > 1:
                self._coordinator = Coordinator(
                    storage, self.world_rank, self.world_size,
                    attempt_id=attempt_id, timeout_s=sync_timeout_s,
                )
                # The ranks exchange the preemption flag on their reports.
                self._coordinator.signals = self._preemption
            is_writer = self.world_rank == 0
            storage.ensure_trial_dir()
            # What killed saves and downloads left on this machine (their maker dead).
            sweep_staging_root()
            # Only the last rows: a start costs the same after a million reports.
            iteration, time_offset = resume_counters(
                last_result_rows(storage), storage.uri(storage.trial_path))
            # Only rank 0 keeps the retention state and the trial's lease.
            # Evicted checkpoints are deleted off the training loop (retention/deletes.py).
            self.manager = CheckpointManager(self.checkpoint_config, storage,
                                             read_only=not is_writer, background_deletes=True)
            try:
                # After the lease: it may fold a copied trial's segments.
                results = ResultLog(storage) if is_writer else None
                self._ledger = ReportLedger(self.trial_id, self.manager, results, iteration,
                                            time_offset)
                # From the retention state, not a scan of every checkpoint.
                committed = self.manager.resume_candidates()
                if not committed:
                    self._check_resume_from()
                else:
                    # Damaged or lost last rows never number a report twice: the
                    # newest checkpoint holds the row it was reported with.
                    self._ledger.continue_after(*checkpoint_counters(committed[-1][1]))
                # After the lease: a start refused because another session holds
                # the trial leaves that session's params.json alone.
                if (self.config or self._resume_from is not None) and is_writer:
                    storage.write_params(self._params())
                if is_writer:
                    self._remove_leftovers()
                self._recorder = CommitRecorder(
                    storage, self.manager, writer=is_writer, writer_id=self._writer_id,
                    latest=committed[-1][0] if committed else None)
                # get_checkpoint() verifies these lazily, newest first (resume only).
                self._resume_candidates: Sequence[tuple[Checkpoint, dict[str, Any]]] | None = (
                    committed)
                if self._coordinator is None:
                    # Numbering continues past every index the retention state remembers.
                    self._ledger.number_from(self.manager.next_index)  # past every directory listed
                else:
                    self._ledger.number_from(self._coordinator.agree_start_index(
                        lambda: max(storage.next_checkpoint_index(), self.manager.next_index)
                    ))
                self._pipeline = self._build_pipeline(local_tier)
                self._warm_staging(committed)
            except BaseException:
                if self._tier is not None:
                    self._tier.close()
                self.manager.close()
                raise
            self._ledger.begin(time.time())
        except BaseException:
            if self._preemption is not None:
                unwatch(self._preemption)
            raise
        # A SIGTERM nobody handles ends the session through its normal path.
        self._exit_on_sigterm = install_exit_on_sigterm()

    def _warm_staging(self, committed: Sequence[tuple[Checkpoint, dict[str, Any]]]) -> None:
        """``UploadConfig.warm_staging``: ready the staging of states before
        the first ``report(state=...)`` (on a background thread). With several
        ranks each rank warms its own staging; a resumed trial faults an even
        share of the newest state on each (what a sharded save writes per
        rank, whatever the world size that saved it)."""
        warm = self.upload_config.warm_staging
        if warm is False:
            return
        if warm:
            self._pipeline.staging.warm(lambda: -1)
        elif committed:
            newest, ranks = committed[-1][0], self.world_size

            def share() -> int | None:
                total = state_bytes(newest)
                return None if total is None else -(-total // ranks)

            self._pipeline.staging.warm(share)

    def _remove_leftovers(self) -> None:
        """Rank 0: remove what crashed writers left uncommitted, after the lease
        (no other live run on this trial) and before any rank of this attempt
        writes: no rank writes before rank 0 passed agree_start_index(), so
        whatever is uncommitted now is an earlier attempt's. A rank > 0 must
        never clean (it would delete a staging directory another rank is filling).

        With several ranks the current run id's leftovers stay (a rank of this
        run that was not restarted may still be writing them). With one rank
        there is no such writer: a launcher's run id kept across restarts
        (``CHECKPOINT_STORE_RUN_ID``) names a dead process's upload, whose
        claim would hold that index for an hour (a local tier's pending copy
        of it could not be persisted) and whose files would never go."""
        storage = self.storage
        try:
            # The restore's listing leaves out the checkpoints the retention
            # state vouches for (committed), and names those it inspected.
            listing = self.manager.restore_listing
            storage.remove_uncommitted(
                self.attempt_id, listing=listing,
                known=(self.manager.restore_known if listing is not None
                       else self.manager.known_committed()),
                sole_owner=self.world_size == 1)
        except Exception as exc:  # cleanup must never stop a run from starting
            logging.getLogger(__name__).warning("cleanup of %s failed: %s",
                                                storage.uri(storage.trial_path), exc)

    def _build_pipeline(self, local_tier: LocalTier | None) -> ReportPipeline:
        """The report path's parts; with a local tier, opened after the
        numbering (it continues past the tier's copies too)."""
        work = BackgroundWork(self.upload_config.max_pending_uploads, self)
        committer: Committer
        if self._coordinator is None:
            committer = SingleCommitter(self.storage, self._recorder, self._writer_id)
        else:
            committer = RankCommitter(self._coordinator, self._recorder)
        target: Target = DurableTarget(self.storage)
        if local_tier is not None:
            tier = FastTier(local_tier, self.storage, world_rank=self.world_rank,
                            world_size=self.world_size, run_id=self.storage.run_id)
            self._tier = tier
            # Where this local tier is, for ls, show and the web page (tiers/view.py).
            record_local_tier(self.storage.filesystem, self.storage.trial_path, tier.trial_dir,
                              self.world_rank, self.storage.backend.capabilities)
            target = TieredTarget(tier, committer, work, self._ledger, self._recorder,
                                  self._writer_id)
        pipeline = ReportPipeline(
            ledger=self._ledger, recorder=self._recorder, work=work, target=target,
            committer=committer, staging=StateStaging(self.upload_config.staging_budget),
            run_id=self.manager.run_id, world_size=self.world_size, world_rank=self.world_rank,
            default_mode=self.upload_config.upload_mode,
            default_staging=self.upload_config.staging)
        if isinstance(target, TieredTarget):
            open_tier(target, self._ledger, self._recorder, self._coordinator,
                      self.manager.run_id, self.world_size)
        return pipeline

    @property
    def trial_id(self) -> str:
        return f"{self.storage.experiment_name}/{self.storage.trial_name}"

    @property
    def attempt_id(self) -> str | None:
        """The id shared by all ranks of this launch (None for one rank)."""
        return self._coordinator.attempt_id if self._coordinator is not None else None

    def get_context(self) -> SessionContext:
        s = self.storage
        return SessionContext(
            experiment_name=s.experiment_name,
            trial_name=s.trial_name,
            trial_id=self.trial_id,
            world_rank=self.world_rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            trial_dir=s.uri(s.trial_path),
            storage=s,
            config=dict(self.config),
        )

    def get_checkpoint(self) -> Checkpoint | None:
        """The newest committed checkpoint of this trial (also one written by an
        earlier process); before this trial has one, the ``resume_from``
        checkpoint given to :func:`~checkpoint_store.session.start`; else None.

        A checkpoint found at session start is verified (sizes and CRC32C)
        on the first call; one that fails is skipped with a warning naming
        it, falling back to the newest one that verifies. One that a read
        found damaged since it was handed out (its ``to_directory()`` or
        ``verify()`` failed) is never returned again: the newest kept one is.

        Raises:
            CheckpointNotFoundError, CheckpointCorruptError: the trial has no
                checkpoint of its own that verifies, and ``resume_from`` (not
                read at start, since the trial had checkpoints then) is missing,
                not committed or corrupt.
        """
        recorder = self._recorder
        if self._tier is not None:  # local tier first, when as new
            latest = recorder.latest
            fast = newest_local(self._tier, index_of(latest), recorder.among())
            if fast is not None:
                return fast
        cands, self._resume_candidates = self._resume_candidates, None
        latest = recorder.latest
        if cands and latest is cands[-1][0]:
            recorder.set_latest(self.storage.latest_verified_checkpoint(cands))
        elif (latest is not None
              and posixpath.basename(latest.path) in self.manager.invalid):
            # A read of it failed since it was handed out: the newest good one.
            recorder.set_latest(self.manager.latest_checkpoint)
        latest = recorder.latest
        return latest if latest is not None else self._check_resume_from()

    def _check_resume_from(self) -> Checkpoint | None:
        """The ``resume_from`` checkpoint, checked the first time it is needed
        (:func:`~checkpoint_store.session._checks.check_resume_source`)."""
        source = self._resume_from
        if source is not None and not self._resume_checked:
            check_resume_source(source, verify=self.world_rank == 0)
            self._resume_checked = True
        return source

    def _params(self) -> dict[str, Any]:
        """``params.json``: the config, plus where the trial started from."""
        params = dict(self.config)
        source = self._resume_from
        if source is not None and not self._resume_checked:
            params[RESUME_FROM_KEY] = recorded_resume_from(self.storage, source.uri)
        elif source is not None:
            meta = source.internal_metadata
            params[RESUME_FROM_KEY] = {
                "uri": source.uri, "index": meta.get("index"), "run_id": meta.get("run_id"),
                "experiment_name": meta.get("experiment_name"),
                "trial_name": meta.get("trial_name"),
            }
        return params

    def next_checkpoint_dir(self) -> str:
        """Where the next reported checkpoint will live, for writers that save
        straight into it (``dcp.save(state, checkpoint_id=...)``).

        Returns a local path on local storage, else a URI (``s3://...``); the
        same value on every rank (the ranks agree on the index at start and
        move on together). The directory is created (where directories exist)
        and claimed by this run, so if it is never committed a later run's
        cleanup removes it. Then ``report(metrics,
        checkpoint=Checkpoint(that))`` commits it in place: the manifest is
        built from the files there (sizes, CRC32C) and the marker written last;
        no byte is copied. An unfinished DCP save there (no ``.metadata``) is
        refused. Calling this again before that report returns the same
        directory. With several ranks, a rank may pass ``checkpoint=None`` to
        that report.

        Raises:
            CheckpointStoreError: the session has ended.
        """
        target = self._pipeline.target
        with self._ledger.lock:
            txn = self._ledger.open_txn()
            if not txn.reserved:
                target.reserve(txn.index)
                txn.mark_reserved()
            return target.directory(txn.index)

    def report(
        self, metrics: Mapping[str, Any], checkpoint: Checkpoint | None = None,
        *, upload_mode: str | None = None, staging: str | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Record ``metrics`` and, optionally, persist and commit ``checkpoint``
        (a directory) or ``state`` (tensors and values, saved from memory).

        Auto-filled keys (override anything reported under the same name):
        ``training_iteration`` (1-based count of reports of this trial, across
        restarts), ``timestamp`` (Unix seconds), ``time_total_s`` (seconds
        since the trial first started, across restarts), ``time_this_iter_s``
        (seconds since the previous report), ``trial_id``
        (``"<experiment>/<trial>"``), ``checkpoint_dir_name``
        (``"checkpoint_000003"`` or None).

        With several ranks, every rank must call ``report`` the same number of
        times; each rank's ``checkpoint`` files go into the same
        ``checkpoint_<index>`` directory, committed by rank 0 once all ranks
        uploaded. Rank 0's metrics are recorded and ranked. Without a
        torch.distributed process group, pass a checkpoint on every rank or on
        none (with one, ranks may pass None).

        A ``checkpoint`` that is the directory :meth:`next_checkpoint_dir`
        handed out is committed in place (nothing copied; always synchronous).

        With a local tier (``session.start(local_tier=LocalTier(...))``) the
        checkpoint is committed on it and ``report`` returns; its copy to the
        storage_path is made in the background when the tier's ``persist``
        selects it (:meth:`wait`, :attr:`durable_index`; docs/tiers.md).

        ``upload_mode`` (default: the session's ``upload_config.upload_mode``):
        ``"async"`` stages the checkpoint (``staging``: ``"copy"``,
        ``"hardlink"`` or ``"move"``) and returns while it uploads in the
        background; see :mod:`checkpoint_store.session._uploads` and :meth:`wait`. An
        error of a background upload is raised by the next ``report()``,
        :meth:`wait` or the end of the session. One rank only.

        ``state`` (instead of ``checkpoint``): a dict of torch CPU tensors,
        numpy arrays and JSON values, nested (``{"model": model.state_dict(),
        "optim": opt.state_dict(), "step": 7}``). Its tensors are copied into
        shared-memory staging (at most ``upload_config.staging_budget``
        bytes), then ``report`` returns; a persist process writes them as
        safetensors files and the checkpoint is committed in the background
        (``upload_mode="sync"``: before ``report`` returns). Changing the
        tensors after ``report`` returns does not change what is saved. On
        several ranks each rank passes its own state (``DTensor`` shards,
        replicated tensors) and writes its part; rank 0 commits one state
        of the whole (docs/sharded-state.md); with a local tier each rank's
        part is committed on its own tier first. See
        :mod:`checkpoint_store.session._pipeline` and docs/sessions.md.

        Returns:
            The result row (metrics plus the auto-filled keys); rank 0 writes
            it to ``result.json``.

        Raises:
            MetadataError: ``metrics`` is not a dict of values JSON can store
                (a lone surrogate, an int of more than 4300 digits, nesting
                deeper than 100, bytes, sets ...; the message names the key).
            InvalidConfigError: ``checkpoint`` is not a Checkpoint, or its score
                is not numeric or beyond the float range; both ``checkpoint``
                and ``state``; an unknown ``upload_mode``; ``staging`` where
                no copy is staged (only a ``checkpoint=`` directory uploaded
                in the background, one rank, no local tier, stages one);
                ``upload_mode="async"`` with several ranks and no local tier.

        A refused report writes nothing and leaves ``training_iteration`` and
        the checkpoint numbering where they were.
            CheckpointNotFoundError: the checkpoint's directory vanished before
                or during the upload; nothing is committed for that index.
            CheckpointConflictError: two ranks wrote the same file (names both).
            CheckpointAbortedError: another rank failed; nothing is committed.
            RankTimeoutError: some rank did not finish within ``sync_timeout_s``.
            AmbiguousCommitError: storage failed while the commit marker was
                written, and reading it back failed too: the checkpoint may be
                committed. Its row is recorded; the next report uses the next
                index and first settles this one (registered with retention
                if committed). Any other error: nothing was committed; the
                next report takes the next index if this one wrote anything
                under its index (on any tier), the same index if it was
                refused before writing (an unfinished save refused in
                :meth:`next_checkpoint_dir`'s directory: that directory, for
                the retry).
            TransientBackendError, PermanentBackendError: storage failed
                before the commit; nothing was committed.
            CheckpointStoreError: the session has ended.
            TrialStopped: the trial runner of this session was stopped or paused.
        """
        preempted = self._preempts(checkpoint, state)
        for hook in self._hooks:
            hook.before_report()
        if preempted:
            return self._report_preempted(metrics, checkpoint, state)
        try:
            row, committed = self._pipeline.report(metrics, checkpoint, state=state,
                                                   upload_mode=upload_mode, staging=staging)
        except BaseException as exc:
            # Signalled (here or on another rank): the run ends as preempted
            # even when the other ranks are gone and this report fails.
            watch = self._preemption
            if watch is not None and watch.requested and self._coordinator is not None:
                self._end_preempted(exc)
            raise
        for hook in self._hooks:
            hook.after_report(row, committed)
        if self._peer_preempted():
            self._end_preempted(None)
        return row

    def _group(self) -> bool:
        """Several ranks over a torch.distributed process group."""
        return self._coordinator is not None and self._coordinator.uses_torch

    def _preempts(self, checkpoint: Checkpoint | None, state: Mapping[str, Any] | None) -> bool:
        """Whether this report is the preemption report (docs/sessions.md, "A
        preemption signal with several ranks"): one rank, the first after the
        signal; a process group, the first after the report at which the ranks
        exchanged it (the same report on every rank); storage only, the first
        checkpoint report after this rank's signal (the flag travels in its
        marker)."""
        watch = self._preemption
        if watch is None or not watch.requested:
            return False
        if self._coordinator is None:
            return True
        if self._group():
            return watch.agreed
        return checkpoint is not None or state is not None or (
            self._ledger.reserved is not None and self._ledger.reserved == self._ledger.next_index)

    def _peer_preempted(self) -> bool:
        """Storage only: this checkpoint report learnt that another rank's
        signal made it the preemption checkpoint of every rank."""
        watch = self._preemption
        return (watch is not None and watch.agreed and self._coordinator is not None
                and not self._group())

    @property
    def reached_preemption(self) -> bool:
        """A preemption signal arrived (``session.start(preemption=...)``): pass
        a checkpoint or state to the next ``report()``, which commits it and
        raises :class:`~checkpoint_store.errors.Preempted`. As Orbax's
        ``CheckpointManager.reached_preemption``. False without ``preemption=``.
        With several ranks and a process group, the flag the ranks exchanged:
        it turns True on every rank at the same report (the next report is
        every rank's preemption checkpoint)."""
        watch = self._preemption
        if watch is None:
            return False
        # A process group: the flag every rank exchanged, so that every rank
        # sees it change at the same report and saves the same index.
        return watch.agreed if self._group() else watch.requested

    @property
    def preemption(self) -> PreemptionConfig | None:
        """The session's :class:`PreemptionConfig` (``session.start(preemption=...)``),
        or None."""
        return self._preemption.config if self._preemption is not None else None

    @property
    def preemption_signalled(self) -> bool:
        """This rank's own flag: a preemption signal reached it (or it adopted
        another rank's), before the ranks agreed on it. What a framework
        callback exchanges at each step's end (:meth:`join_preemption`);
        :attr:`reached_preemption` is the flag the ranks agreed on."""
        return self._preemption is not None and self._preemption.requested

    def join_preemption(self) -> None:
        """The ranks agreed (a framework callback, at a step's end, on every
        rank) that a preemption signal reached one of them: the next
        ``report()`` of every rank is the preemption report (same index),
        which commits a preemption checkpoint and raises
        :class:`~checkpoint_store.errors.Preempted`. A rank the signal did not
        reach takes it as the config's first signal, now. Nothing without
        ``preemption=``, once agreed, or after the session ended."""
        w = self._preemption
        if w is None or w.closed or w.agreed:
            return
        own = w.shared()
        w.adopt([own if own is not None else {
            "signal": w.config.signals[0], "signalled_at": time.time(),
            "left_s": w.config.grace_period_s}])

    def _on_preemption(self) -> None:
        """On a helper thread, as the first signal arrives: the pending durable
        copies go newest first (one rank: ranks must commit in one order),
        and the log says what happens next."""
        watch = self._preemption
        assert watch is not None
        pipeline = getattr(self, "_pipeline", None)  # None: the signal came during start
        if pipeline is not None and self.world_size == 1:
            pipeline.work.prefer_newest()
        logging.getLogger(__name__).warning(
            "preemption: %s received by %s (rank %d%s); %d save(s) in flight; the next report() "
            "commits a preemption checkpoint and stops the run (grace %.0f s)",
            watch.metadata()["signal"], self.trial_id, self.world_rank,
            "" if watch.local else ", from another rank",
            pipeline.work.pending() if pipeline is not None else 0,
            watch.config.grace_period_s)

    def _report_preempted(self, metrics: Mapping[str, Any], checkpoint: Checkpoint | None,
                          state: Mapping[str, Any] | None) -> dict[str, Any]:
        """The first report after a preemption signal: commit its checkpoint
        on the storage_path (whatever the local tier's ``persist`` says), wait
        until every acknowledged save is durable (bounded by the grace
        period), end the session as ``preempted`` and raise
        :class:`~checkpoint_store.errors.Preempted`."""
        watch = self._preemption
        assert watch is not None
        watch.stopping()
        saves = checkpoint is not None or state is not None or (
            self._ledger.reserved is not None and self._ledger.reserved == self._ledger.next_index)
        ranks = self._coordinator is not None
        if self._tier is not None and (saves or ranks):  # ranks: another rank may save
            self._tier.force_persist(self._ledger.next_index)
        left = watch.left_s()
        if ranks and left is not None:
            # A rank that is gone never holds the others past the grace: they
            # stop waiting with the loop's margin left to end the session.
            assert self._coordinator is not None
            self._coordinator.limit_waits(max(0.0, left - watch.config.margin_s))
        try:
            row, committed = self._pipeline.report(
                metrics, checkpoint, state=state, upload_mode="sync",
                preemption=watch.metadata() if saves or ranks else None)
        except BaseException as exc:
            self._end_preempted(exc)
            raise  # not reached: _end_preempted raises
        for hook in self._hooks:
            hook.after_report(row, committed)
        self._end_preempted(None)
        raise AssertionError("not reached")

    def _end_preempted(self, error: BaseException | None) -> None:
        """End the session as preempted (bounded by the grace) and raise
        :class:`~checkpoint_store.errors.Preempted` (from ``error``, the
        report's failure, if any)."""
        watch = self._preemption
        assert watch is not None
        watch.stopping()
        stop = watch.exception()
        if error is not None:
            logging.getLogger(__name__).error(
                "preemption: the preemption report failed (%s: %s); the newest committed "
                "checkpoint is the resume point", type(error).__name__, error)
        try:
            left = watch.left_s()
            self.wait(timeout=None if left is None else max(0.0, left - 1.0))
        except TimeoutError as exc:
            logging.getLogger(__name__).error(
                "preemption: %s; the newest durable checkpoint is %s", exc, self.durable_index)
        except Exception as exc:  # a background error: recorded by close() below
            logging.getLogger(__name__).error("preemption: %s", exc)
        finally:
            try:
                self.close(stop)
            except Exception as exc:
                logging.getLogger(__name__).error("preemption: closing failed: %s", exc)
        raise stop from error

    def add_report_hook(self, hook: ReportHook) -> None:
        """Call ``hook`` at the start and the end of every report (a
        :class:`~checkpoint_store.session.TrialRunner`'s stop and pause)."""
        self._hooks.append(hook)

    def wait(self, timeout: float | None = None, *, checkpoint: Any = None) -> None:
        """Wait until every background upload (``upload_mode="async"``, and with a
        local tier every durable copy) is committed, and retention's background
        deletes of evicted checkpoints are done (a delete that failed is logged
        and retried later, never raised).

        Args:
            timeout: seconds, or None to wait as long as it takes.
            checkpoint: wait only until this checkpoint (a Checkpoint, its
                ``checkpoint_NNNNNN`` name, its index, or the row ``report()``
                returned) is durable: committed on the storage_path
                (:meth:`durable_index`; docs/tiers.md).

        Raises:
            TimeoutError: uploads or deletes are still pending after ``timeout``
                seconds.
            CheckpointStoreError: with a local tier, ``checkpoint`` is not
                selected by its ``persist`` policy (it stays local only).
            InvalidConfigError: ``checkpoint`` names none (see
                :func:`~checkpoint_store.session._tier_recovery.checkpoint_index`),
                or an index this trial has not reached (never reported); or
                ``timeout`` is not None or a number of seconds >= 0.
            Exception: the first error of a background upload (that
                checkpoint was not committed).
        """
        timeout = check_wait_timeout(timeout)
        if checkpoint is not None:
            wait_durable(self._tier, checkpoint_index(checkpoint), self._ledger.next_index,
                         timeout, self.wait, self._pipeline.work.raise_errors)
            return
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        self._pipeline.work.wait(timeout)
        _transferlog.log_if_long(logging.getLogger(__name__), "wait for background saves", None,
                                 time.monotonic() - started)

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if not self.manager.wait_deletes(left()) or (
                self._tier is not None and not self._tier.wait_deletes(left())):
            raise TimeoutError(f"deletes of evicted checkpoints still running after {timeout} s")

    @property
    def durable_index(self) -> int | None:
        """The highest checkpoint index whose copy on the storage_path is committed
        (with a local tier, the durable copies made in the background; without,
        the newest committed checkpoint), or None."""
        known = [index_of(self._recorder.latest),
                 self._tier.durable_index if self._tier is not None else None]
        return max((i for i in known if i is not None), default=None)

    def _finish_at_exit(self) -> None:
        """Called at interpreter exit, before the rows are flushed
        (:func:`~checkpoint_store._results.writer.finish_before_exit_flush`), for a
        session never ended: commit its pending uploads, waiting as long as they
        take (each bounded by the retry policy); log, never raise, what was lost."""
        storage = self.storage
        ended = self._ledger.closed
        errors = self._pipeline.work.finish_at_exit(ended, storage.uri(storage.trial_path))
        if ended:
            return
        self.manager.wait_deletes()  # else resumed by the next session
        if errors:
            logging.getLogger(__name__).error(
                "at exit, the background upload of %s failed: not committed (lost); the "
                "result.json rows naming them point to no checkpoint, and "
                "get_checkpoint() returns an older one. First error: %r",
                ", ".join(what for what, _ in errors), errors[0][1])

    def close(self, error: BaseException | None = None) -> None:
        """End the session: finish background uploads, record how it ended,
        release the trial's lease.

        Args:
            error: the exception that ended the session (``with`` passes it),
                or None for a clean end.

        On rank 0, an ``error`` (or the error of a background upload, raised
        here) is added to the trial's ``error.txt``; a clean end removes that
        file, since this run supersedes the failures of earlier ones. Both
        happen before the lease is released, so a reader never sees a trial
        without a lease that is not yet marked errored. A
        :class:`~checkpoint_store.session.TrialStopped` (a runner's stop or
        pause), a ``GeneratorExit`` and a ``SystemExit`` with status 0 or None
        count as clean ends. Recording never replaces ``error``: a failure to
        write the file is logged.
        """
        first_close = not self._ledger.closed
        close_session(self._ledger, self._recorder, self._pipeline.work, first_close=first_close,
                      record=(lambda e: record_end(self.storage, e))
                      if first_close and self.world_rank == 0 else None,
                      error=error, finish=self._release)

    def _release(self) -> None:
        """The end's last steps, whatever happened before them."""
        if self._preemption is not None:
            unwatch(self._preemption)
        if self._exit_on_sigterm:
            self._exit_on_sigterm = False
            uninstall_exit_on_sigterm()
        if self._tier is not None:
            try:
                self._tier.wait_deletes()  # the local tier's evictions
            finally:
                self._tier.close()  # its directory's lock
        # Releases the trial's retention lease (also when an exception ends the session).
        self.manager.close()
        if self._coordinator is not None:
            self._coordinator.close()
        self._pipeline.staging.close()


@dataclass(frozen=True)
class SessionInternals:
    """What tests of this package may look at inside a Session (through
    :func:`checkpoint_store.testing.session_internals`), so that field names
    can change without touching tests.

    Attributes:
        tier: the local tier, or None.
        uploader: the durable background lane, once started.
        results: rank 0's ``result.json`` writer.
        pipeline: the report path (``report_source`` injects a staged state).
    """

    tier: FastTier | None
    uploader: BackgroundUploader | None
    results: ResultLog | None
    pipeline: ReportPipeline

    @property
    def stager(self) -> Any:
        """The shared-memory staging of state reports (started on first use)."""
        return self.pipeline.staging.stager


def session_internals(session: Session) -> SessionInternals:
    """The :class:`SessionInternals` of ``session`` (tests only)."""
    pipeline = session._pipeline
    return SessionInternals(session._tier, pipeline.work.uploader, pipeline.ledger.results,
                            pipeline)
