"""The bookkeeping every report shares: the result row, the counters, the
checkpoint numbering (:class:`ReportLedger`), and what a commit does to
retention and ``get_checkpoint()`` (:class:`CommitRecorder`).

The rules, stated once for every report path (directory or state, no tier
or a local tier, synchronous or in the background, one rank or several):

- A report is refused or accepted whole: :meth:`ReportLedger.prepare_row`
  checks the row without moving a counter; :meth:`Txn.accept` moves them,
  once, when nothing can refuse the report any more.
- **The index** of a checkpoint is consumed (:meth:`Txn.consume_index`) as
  soon as the report starts writing under it, on any tier: a directory
  reserved or staged into, or its commit begun (inline or queued). It is
  reused only by a report refused before that. Apart from the numbering at
  start (:meth:`ReportLedger.number_from`), nothing else writes it.
- ``training_iteration`` moves, and the row goes to ``result.json``, when
  the report returns, or raises :class:`AmbiguousCommitError` (the row names
  a checkpoint that may be committed); a report whose commit failed
  otherwise leaves both where they were.
- A checkpoint's row is on storage no later than the checkpoint: flushed by
  the report that commits it, or (with a local tier) by the job that makes
  its durable copy.

Thread-safety: the ledger is used by the reporting thread, under its lock
(:meth:`ReportLedger.transaction`); the recorder is called from the
reporting thread and the background lanes, under a lock of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import checkpoint_dir_name
from checkpoint_store._results.writer import ResultLog
from checkpoint_store._util.inspect import read_internal_metadata
from checkpoint_store.checkpoint import Checkpoint, _require_checkpoint
from checkpoint_store.errors import CheckpointStoreError
from checkpoint_store.retention import CheckpointManager
from checkpoint_store.storage import StorageContext

__all__ = ["CommitRecorder", "ReportLedger", "Row", "Txn"]

#: A result row: the user's metrics plus the auto-filled keys.
Row = dict[str, Any]

# The Session's logger: its records keep the name they always had.
_logger = logging.getLogger("checkpoint_store.session._session")

ENDED = "this session has ended; start a new one to report"


class ReportLedger:
    """Rows, counters and checkpoint numbering of one session (one trial, one rank).

    Args:
        trial_id: ``"<experiment>/<trial>"`` (the rows' ``trial_id``).
        manager: the trial's retention (checks a checkpoint's score).
        results: rank 0's ``result.json`` writer; None on other ranks.
        iteration, time_offset: where the trial's counters stand (from its
            last rows; docs/sessions.md, "Step continuity").
    """

    def __init__(self, trial_id: str, manager: CheckpointManager, results: ResultLog | None,
                 iteration: int, time_offset: float):
        self.trial_id = trial_id
        self.manager = manager
        self.results = results
        self._lock = threading.Lock()
        self._closed = False
        self._iteration = iteration
        self._time_offset = time_offset
        self._start = time.time()
        self._last_report = self._start
        self._next_index = 0
        # The index next_checkpoint_dir() reserved (created and claimed), if any.
        self._reserved: int | None = None

    @property
    def reserved(self) -> int | None:
        """The index ``next_checkpoint_dir()`` reserved, if any."""
        return self._reserved

    @property
    def next_index(self) -> int:
        """The index the next checkpoint report takes."""
        return self._next_index

    @property
    def iteration(self) -> int:
        return self._iteration

    def number_from(self, index: int) -> None:
        """Continue the numbering at ``index`` or later (at start only: past
        every index the trial, its local tier or another rank has used)."""
        self._next_index = max(self._next_index, index)

    def begin(self, start: float) -> None:
        """The session's clock starts (``time_total_s``, ``time_this_iter_s``)."""
        self._start = self._last_report = start

    @property
    def closed(self) -> bool:
        return self._closed

    def ensure_open(self) -> None:
        """Raises CheckpointStoreError once the session has ended."""
        if self._closed:
            raise CheckpointStoreError(ENDED)

    def end(self) -> None:
        """The session has ended: every later report is refused."""
        self._closed = True

    def close_rows(self) -> None:
        """Write the last rows and assemble ``result.json`` (rank 0)."""
        if self.results is not None:
            self.results.close()

    def prepare_row(self, metrics: Mapping[str, Any], checkpoint: Checkpoint | None, *,
                    validate_score: bool) -> Row:
        """The result row for ``metrics``, checked as a whole; no counter moves.

        Args:
            checkpoint: the reported checkpoint (type-checked), or None.
            validate_score: check the row's score with retention (a report
                that saves; rank 0).

        Raises:
            MetadataError: ``metrics`` cannot be stored as JSON (names the key).
            InvalidConfigError: ``checkpoint`` is not a Checkpoint, or its
                score is refused by retention.
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
        if validate_score:
            self.manager.validate_metrics(row)
        return row

    @property
    def lock(self) -> threading.Lock:
        """The report lock: one report at a time holds it (``with ledger.lock:
        txn = ledger.open_txn()``). Entered as the lock itself, never through a
        generator or another Python ``__enter__``: a signal handler's
        exception raised after the acquire, before such an ``__enter__``
        returned, would leave the lock held for as long as the exception
        lives, and the session's end would wait for it for ever."""
        return self._lock

    def open_txn(self) -> Txn:
        """One report's transaction; under :attr:`lock`.

        Raises:
            CheckpointStoreError: the session has ended.
        """
        assert self._lock.locked()
        if self._closed:
            raise CheckpointStoreError(ENDED)
        return Txn(self)

    def restore_row(self, row: Mapping[str, Any]) -> None:
        """Append a row an earlier run reported but never stored (a local
        tier's copy), and continue the counters after it (rank 0, at start)."""
        assert self.results is not None
        self.results.append(row)
        self._iteration = int(row["training_iteration"])
        t = row.get("time_total_s")
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            self._time_offset = max(self._time_offset, float(t))

    def continue_after(self, iteration: int, time_total_s: float) -> None:
        """Continue the counters after ``iteration`` and ``time_total_s`` (seconds)
        at least (at start: what the newest committed checkpoint was reported
        with, when ``result.json``'s last rows say less)."""
        self._iteration = max(self._iteration, iteration)
        self._time_offset = max(self._time_offset, time_total_s)

    def flush(self) -> None:
        """Write the buffered rows (rank 0; a no-op elsewhere)."""
        if self.results is not None:
            self.results.flush()

    # -- used by Txn only ---------------------------------------------------------------

    def _consume(self, index: int) -> None:
        assert self._lock.locked() and index == self._next_index
        self._next_index = index + 1

    def _accept(self, row: Row, flush: bool) -> None:
        self._iteration = int(row["training_iteration"])
        self._last_report = float(row["timestamp"])
        if self.results is not None:
            self.results.append(row)
            if flush:
                self.results.flush()


class Txn:
    """One report under the ledger's lock: the index it may take, and the
    moves of the counters and the numbering, each at most once."""

    def __init__(self, ledger: ReportLedger):
        self._ledger = ledger
        self.index = ledger.next_index
        self.consumed = False
        self.accepted = False

    def name_checkpoint(self, row: Row) -> str:
        """Name this report's checkpoint in ``row`` (``checkpoint_dir_name``)."""
        row["checkpoint_dir_name"] = name = checkpoint_dir_name(self.index)
        return name

    @property
    def reserved(self) -> bool:
        """``checkpoint_<index>`` was reserved (``next_checkpoint_dir()``)."""
        return self._ledger._reserved == self.index

    def mark_reserved(self) -> None:
        self._ledger._reserved = self.index

    def consume_index(self) -> None:
        """The report starts writing under ``index``: never hand it out again."""
        if not self.consumed:
            self._ledger._consume(self.index)
            self.consumed = True

    def accept(self, row: Row, *, flush: bool) -> None:
        """The report is recorded: counters move, the row is appended (rank 0),
        and written now when ``flush``."""
        if not self.accepted:
            self._ledger._accept(row, flush)
            self.accepted = True


class CommitRecorder:
    """What a commit does: retention registers it (rank 0) and
    ``get_checkpoint()`` returns it; and the commits whose outcome is unknown
    (:class:`~checkpoint_store.errors.AmbiguousCommitError`), settled later.

    Called from the reporting thread and from the background lanes; every
    field is read and written under this object's lock.
    """

    def __init__(self, storage: StorageContext, manager: CheckpointManager, *,
                 writer: bool, writer_id: str, latest: Checkpoint | None):
        self._storage = storage
        self._manager = manager
        self._writer = writer
        self._writer_id = writer_id
        self._lock = threading.RLock()
        self._latest = latest
        self._unsettled: list[tuple[int, Row]] = []
        # Indexes a failed commit consumed (nothing committed): their leftovers,
        # this session's own, are removed by settle().
        self._abandoned: set[int] = set()
        # With several ranks and a local tier: the indexes whose local copy
        # every rank has (None: one rank, or no tier).
        self._among: set[int] | None = None

    @property
    def latest(self) -> Checkpoint | None:
        with self._lock:
            return self._latest

    def set_latest(self, checkpoint: Checkpoint | None) -> None:
        with self._lock:
            self._latest = checkpoint

    def record(self, committed: Checkpoint, row: Mapping[str, Any]) -> None:
        """``committed`` is committed on the storage_path with ``row``."""
        with self._lock:
            self._latest = committed
            if self._writer:
                self._manager.register(committed, row)
                # keep_latest=False may evict the newest: never hand out a deleted one.
                self._latest = self._manager.latest_checkpoint or committed

    def adopt(self, index: int, row: Mapping[str, Any]) -> bool:
        """True when ``checkpoint_<index>`` is committed on the storage_path with
        that index (registered with retention unless it already is): a copy a
        killed run committed before its local tier recorded it."""
        name = checkpoint_dir_name(index)
        meta = dict(self._storage.checkpoint(name).internal_metadata)
        if meta.get("index") != index:
            return False
        existing = Checkpoint._from_backend(self._storage.backend,
                                            self._storage.checkpoint_path(index), meta)
        with self._lock:
            if name not in self._manager.known_committed():
                self.record(existing, row)
        return True

    # -- local copies every rank has ----------------------------------------------------

    def among(self) -> set[int] | None:
        with self._lock:
            return None if self._among is None else set(self._among)

    def set_among(self, indexes: set[int]) -> None:
        with self._lock:
            self._among = set(indexes)

    def add_among(self, index: int) -> None:
        with self._lock:
            if self._among is not None:
                self._among.add(index)

    # -- ambiguous commits ----------------------------------------------------------------

    def unsettled(self, index: int, row: Mapping[str, Any]) -> None:
        """The commit of ``index`` may have landed: settled by :meth:`settle`."""
        with self._lock:
            self._unsettled.append((index, dict(row)))

    def abandon(self, index: int) -> None:
        """The commit of ``index`` failed after it began writing: what it left
        (this session's claim and files) is removed by :meth:`settle`."""
        with self._lock:
            self._abandoned.add(index)

    def forget_unsettled(self, index: int) -> None:
        """A retry of ``index`` found its own marker: settled."""
        with self._lock:
            self._unsettled = [u for u in self._unsettled if u[0] != index]

    def settle(self) -> None:
        """Settle the indexes whose commit may have landed: a marker of this
        session's writer there is registered with retention; anything else is
        left for cleanup. An index that still cannot be read stays unsettled;
        none is ever reused. Then removes what abandoned commits left. Never raises."""
        with self._lock:
            pending = list(self._unsettled)
        storage = self._storage
        self._remove_abandoned()
        for index, row in pending:
            path = storage.checkpoint_path(index)
            try:
                meta = read_internal_metadata(storage.filesystem, path, retry=storage.retry)
                with self._lock:
                    if (index, row) in self._unsettled:
                        self._unsettled.remove((index, row))
                if meta is None or meta.get("writer_id") != self._writer_id:
                    _logger.warning("%s was not committed (its report failed)", storage.uri(path))
                    continue
                self.record(Checkpoint._from_backend(storage.backend, path, meta), row)
            except Exception as exc:  # settled at the next report, or by cleanup
                _logger.warning("could not settle whether %s was committed: %s",
                                storage.uri(path), exc)

    def _remove_abandoned(self) -> None:
        with self._lock:
            abandoned = sorted(self._abandoned)
        storage = self._storage
        for index in abandoned:
            path = storage.checkpoint_path(index)
            try:
                if read_internal_metadata(storage.filesystem, path,
                                          retry=storage.retry) is None:
                    storage.commit_protocol.remove_leftover(path, self._writer_id)
                with self._lock:
                    self._abandoned.discard(index)
            except Exception as exc:  # tried again at the next report; else cleanup at start
                _logger.debug("could not remove what the failed commit of %s left: %s",
                              storage.uri(path), exc)
