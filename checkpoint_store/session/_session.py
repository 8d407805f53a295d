"""The one Session implementation behind ``report()``, for training and tuning."""

from __future__ import annotations

import logging
import os
import posixpath
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import checkpoint_dir_name
from checkpoint_store._results.writer import (
    ResultLog,
    last_result_rows,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.ids import new_writer_id
from checkpoint_store.checkpoint import Checkpoint, _require_checkpoint
from checkpoint_store.errors import (
    CheckpointStoreError,
    InvalidConfigError,
)
from checkpoint_store.retention import CheckpointConfig, CheckpointManager
from checkpoint_store.retention.restore import Listing
from checkpoint_store.session import _background, _closing, _reporting, _state_report, _tiered
from checkpoint_store.session._checks import (
    check_checkpoint_config,
    check_resume_source,
    check_timeout,
    check_upload_config,
    int_from,
    resume_source,
)
from checkpoint_store.session._context import (
    RESUME_FROM_KEY,
    SessionContext,
    recorded_resume_from,
    resume_counters,
)
from checkpoint_store.session._multirank import Coordinator
from checkpoint_store.session._uploads import BackgroundUploader, UploadConfig
from checkpoint_store.storage import StorageContext
from checkpoint_store.tiers import FastTier, LocalTier, check_local_tier

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
        sync_timeout_s = check_timeout(sync_timeout_s)
        local_tier = check_local_tier(local_tier, storage)
        # The local tier (session.start(local_tier=...)), opened below; its
        # worker for staged states; the copies every rank has (several ranks).
        self._tier: FastTier | None = None
        self._tier_worker: BackgroundUploader | None = None
        self._tier_among: set[int] | None = None
        # Read only, never registered, moved or deleted by this trial: it lives
        # outside the trial directory, where retention never looks. A starting
        # point, read once: a trial with checkpoints of its own never reads it
        # (another run's retention may have deleted it since).
        self._resume_from = resume_source(resume_from, storage)
        self._resume_checked = False
        if self._resume_from is not None and not Listing.of(storage).dirs:
            self._check_resume_from()  # a new trial: refused before anything is written
        self._lock = threading.Lock()
        self._closed = False
        # Background uploads of upload_mode="async" (created on first use).
        self._uploader: BackgroundUploader | None = None
        # The index next_checkpoint_dir() reserved (created and claimed), if any.
        self._reserved: int | None = None
        # One writer id for every commit of this session: a claim or a marker
        # an earlier report left is then recognisably this session's own.
        self._writer_id = new_writer_id(storage.run_id)
        # Indexes whose commit may have landed (AmbiguousCommitError), with
        # their rows: never reused, settled by the next report.
        self._unsettled: list[tuple[int, dict[str, Any]]] = []
        # Set by a TrialRunner: called at the start and the end of report().
        self._runner_hook: Any = None
        self._coordinator: Coordinator | None = None
        if self.world_size > 1:
            self._coordinator = Coordinator(
                storage, self.world_rank, self.world_size,
                attempt_id=attempt_id, timeout_s=sync_timeout_s,
            )
        is_writer = self.world_rank == 0
        storage.ensure_trial_dir()
        # Only the last rows: a start costs the same after a million reports.
        self._iteration, self._time_offset = resume_counters(
            last_result_rows(storage), storage.uri(storage.trial_path))
        self._results: ResultLog | None = None
        # Only rank 0 keeps the retention state and the trial's lease.
        # Evicted checkpoints are deleted off the training loop (retention/deletes.py).
        self.manager = CheckpointManager(self.checkpoint_config, storage, read_only=not is_writer,
                                         background_deletes=True)
        try:
            if is_writer:  # after the lease: it may fold a copied trial's segments
                self._results = ResultLog(storage)
            # From the retention state, not a scan of every checkpoint.
            committed = self.manager.resume_candidates()
            if not committed:
                self._check_resume_from()
            # After the lease: a start refused because another session holds
            # the trial leaves that session's params.json alone.
            if (self.config or self._resume_from is not None) and is_writer:
                storage.write_params(self._params())
            if is_writer:
                # Leftovers of crashed writers are removed here, on rank 0 only,
                # after the lease (no other live run on this trial) and before
                # any rank of this attempt writes: no rank writes before rank 0
                # passed agree_start_index() below, so whatever is uncommitted
                # now is an earlier attempt's. A rank > 0 must never clean (it
                # would delete a staging directory another rank is filling).
                try:
                    # The restore's listing leaves out the checkpoints the retention
                    # state vouches for (committed), and names those it inspected.
                    listing = self.manager.restore_listing
                    storage.remove_uncommitted(
                        self.attempt_id, listing=listing,
                        known=(self.manager.restore_known if listing is not None
                               else self.manager.known_committed()))
                except Exception as exc:  # cleanup must never stop a run from starting
                    logging.getLogger(__name__).warning("cleanup of %s failed: %s",
                                                        storage.uri(storage.trial_path), exc)
            self._latest: Checkpoint | None = committed[-1][0] if committed else None
            # get_checkpoint() verifies these lazily, newest first (resume only).
            self._resume_candidates: Sequence[tuple[Checkpoint, dict[str, Any]]] | None = (
                committed)
            if self._coordinator is None:
                # Numbering continues past every index the retention state remembers.
                self._next_index = self.manager.next_index  # past every directory listed
            else:
                self._next_index = self._coordinator.agree_start_index(
                    lambda: max(storage.next_checkpoint_index(), self.manager.next_index)
                )
            # After the numbering: it continues past the local tier's copies too.
            self._tier = _tiered.open_tier(self, local_tier)
        except BaseException:
            self.manager.close()
            raise
        self._start = time.time()
        self._last_report = self._start

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
        fast = _tiered.get_fast_checkpoint(self)  # local tier first, when as new
        if fast is not None:
            return fast
        cands, self._resume_candidates = self._resume_candidates, None
        if cands and self._latest is cands[-1][0]:
            self._latest = self.storage.latest_verified_checkpoint(cands)
        elif (self._latest is not None
              and posixpath.basename(self._latest.path) in self.manager.invalid):
            # A read of it failed since it was handed out: the newest good one.
            self._latest = self.manager.latest_checkpoint
        return self._latest if self._latest is not None else self._check_resume_from()

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
        if self._tier is not None:  # the local tier's directory
            return _tiered.next_checkpoint_dir(self)
        with self._lock:
            if self._closed:
                raise CheckpointStoreError("this session has ended; start a new one to report")
            index = self._next_index
            if self._reserved != index:
                self.storage.reserve_in_place(index)
                self._reserved = index
        path = self.storage.checkpoint_path(index)
        local = _fsutil.local_path(self.storage.filesystem, path)
        return local if local is not None else self.storage.uri(path)

    def _in_place(self, checkpoint: Checkpoint | None, index: int) -> bool:
        """True when ``checkpoint`` is ``checkpoint_<index>`` itself, the directory
        :meth:`next_checkpoint_dir` handed out (None: when it handed it out)."""
        if checkpoint is None:
            return self._reserved == index
        if not isinstance(checkpoint, Checkpoint):
            return False
        return checkpoint.uri == self.storage.uri(self.storage.checkpoint_path(index))

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
        tensors after ``report`` returns does not change what is saved. One
        rank only; see :mod:`checkpoint_store.session._state_report` and
        docs/sessions.md.

        Returns:
            The result row (metrics plus the auto-filled keys); rank 0 writes
            it to ``result.json``.

        Raises:
            MetadataError: ``metrics`` is not a dict of values JSON can store
                (a lone surrogate, an int of more than 4300 digits, nesting
                deeper than 100, bytes, sets ...; the message names the key).
            InvalidConfigError: ``checkpoint`` is not a Checkpoint, or its score
                is not numeric or beyond the float range.

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
                if committed). Any other error: nothing was committed, and the
                next report uses the same index.
            TransientBackendError, PermanentBackendError: storage failed
                before the commit; nothing was committed.
            CheckpointStoreError: the session has ended.
            TrialStopped: the trial runner of this session was stopped or paused.
        """
        hook = self._runner_hook
        if hook is not None:
            hook.before_report()
        if state is not None:
            if checkpoint is not None:
                raise InvalidConfigError("pass checkpoint= or state= to report(), not both")
            row, persisted = _state_report.report_state(self, metrics, state, upload_mode)
            if hook is not None:
                hook.after_report(row, persisted)
            return row
        mode = upload_mode or self.upload_config.upload_mode
        if self._reserved is not None and self._in_place(checkpoint, self._next_index):
            mode = "sync"  # already in place: there is nothing to upload in the background
        if self._tier is not None:
            row, persisted = _tiered.report(self, metrics, checkpoint, upload_mode)
        elif mode != "sync" or self._uploader is not None:
            row, persisted = _background.report_with_uploader(self, metrics, checkpoint, mode,
                                                              staging)
        elif self._coordinator is not None:
            row, persisted = _reporting.report_multirank(self, metrics, checkpoint)
        else:
            row, persisted = self._report_single(metrics, checkpoint)
        if hook is not None:
            hook.after_report(row, persisted)
        return row

    # -- the bookkeeping every report path shares (sync, async, multi-rank) ------------
    #
    # A report is refused or accepted whole: _prepare_row() validates and
    # builds the row without touching a counter, _accept_row() moves the
    # counters once nothing can refuse the report any more, and
    # _record_commit() is the one place a committed checkpoint reaches
    # retention and get_checkpoint(), whichever thread committed it.

    def _prepare_row(
        self, metrics: Mapping[str, Any], checkpoint: Checkpoint | None, *,
        validate_score: bool,
    ) -> dict[str, Any]:
        """The result row for ``metrics``, checked as a whole; no counter moves.

        Raises:
            MetadataError: ``metrics`` cannot be stored as JSON (names the key).
            InvalidConfigError: ``checkpoint`` is not a Checkpoint, or (with
                ``validate_score``) its score is refused by retention.
        """
        clean = _json.to_json_object(metrics, "metrics")
        if checkpoint is not None:
            _require_checkpoint(checkpoint)
        now = time.time()
        row = dict(clean)
        row.update(
            training_iteration=self._iteration + 1,
            timestamp=now,
            time_total_s=self._time_offset + (now - self._start),
            time_this_iter_s=now - self._last_report,
            trial_id=self.trial_id,
            checkpoint_dir_name=None,
        )
        if validate_score and checkpoint is not None:
            self.manager.validate_metrics(row)
        return row

    def _accept_row(self, row: Mapping[str, Any]) -> None:
        self._iteration = int(row["training_iteration"])
        self._last_report = float(row["timestamp"])

    def _checkpoint_internal(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        row["checkpoint_dir_name"] = checkpoint_dir_name(index)
        return {"metrics": row, "world_size": self.world_size, "run_id": self.manager.run_id}

    def _commit(self, source: Checkpoint, index: int, internal: Mapping[str, Any],
                row: Mapping[str, Any]) -> Checkpoint:
        """Upload and commit ``source`` as ``checkpoint_<index>``, then record it.
        Runs on the upload thread (async), whose caller already moved past ``index``."""
        persisted = _reporting.persist(self, source, index, internal, row)
        self._record_commit(persisted, row)
        return persisted

    def _record_commit(self, persisted: Checkpoint, row: Mapping[str, Any]) -> None:
        self._latest = persisted
        if self.world_rank == 0:
            self.manager.register(persisted, row)
            # keep_latest=False may evict the newest: never hand out a deleted one.
            self._latest = self.manager.latest_checkpoint or persisted

    def _report_single(
        self, metrics: Mapping[str, Any], checkpoint: Checkpoint | None
    ) -> tuple[dict[str, Any], Checkpoint | None]:
        """One rank, synchronous (:func:`~checkpoint_store.session._reporting.report_single`)."""
        return _reporting.report_single(self, metrics, checkpoint)

    def _append_row(self, row: Mapping[str, Any], *, flush: bool) -> None:
        assert self._results is not None
        self._results.append(row)
        if flush:
            self._results.flush()

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
                :func:`~checkpoint_store.session._tiered.checkpoint_index`),
                or an index this trial has not reached (never reported).
            Exception: the first error of a background upload (that
                checkpoint was not committed).
        """
        _background.wait(self, timeout, checkpoint=checkpoint)

    @property
    def durable_index(self) -> int | None:
        """The highest checkpoint index whose copy on the storage_path is committed
        (with a local tier, the durable copies made in the background; without,
        the newest committed checkpoint), or None."""
        return _tiered.durable_index(self)

    def _tier_commit_staged(self, source: Any, index: int, internal: Mapping[str, Any],
                            row: Mapping[str, Any]) -> None:
        """``report(state=...)`` with a local tier (one rank): queue
        ``source.write_to(<local tier>/.../checkpoint_<index>)`` and its commit
        there on a background worker, then the durable copy (if the tier's
        ``persist`` selects it); returns at once, except for the tier's
        ``max_bytes`` backpressure (``source.nbytes``). ``source.release()`` is
        called when the job ends, whatever happens.

        The caller has done the report's bookkeeping under ``self._lock``:
        ``row = self._prepare_row(...)``, ``index = self._next_index``,
        ``internal = self._checkpoint_internal(row, index)``, moved
        ``_next_index`` past it, ``self._accept_row(row)`` and
        ``self._append_row(row, flush=False)``. Errors of the job are raised by
        the next ``report()``, ``wait()`` or the end of the session
        (:func:`checkpoint_store.session._tiered.commit_staged`)."""
        _tiered.commit_staged(self, source, index, internal, row)

    def _finish_at_exit(self) -> None:
        """Called at interpreter exit, before the rows are flushed
        (:func:`~checkpoint_store._results.writer.finish_before_exit_flush`), for a
        session never ended: commit its pending uploads, waiting as long as they
        take (each bounded by the retry policy); log, never raise, what was lost."""
        _background.finish_at_exit(self)

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
        _closing.close(self, error)
