"""The session's side of a local tier (``session.start(local_tier=LocalTier(...))``).

:class:`~checkpoint_store.tiers.FastTier` owns the local tier (commits,
retention, state file, the retried copy); this module wires it into a
:class:`~checkpoint_store.session.Session`: the report paths, the restore
(``get_checkpoint()``), the ranks' agreement on which local copies are
complete, the copies a killed run left pending, and ``wait(checkpoint=...)``.

Report (one rank)::

    report()  ── under the session lock ──────────────────────────────┐
      make_room(bytes)          backpressure at max_bytes only          │
      FastTier.commit()         copy + commit on the local tier         │
      row appended, flushed     names checkpoint_<index>               ─┘
      uploader.submit(job)      if persist selects it; returns
    background (the session's uploader, FIFO, report order):
      FastTier.persist(index, commit)  retried for persist_timeout_s
        commit = Session._commit(local copy)   upload, commit, register

With several ranks every rank commits its own part on its own local tier;
the background copies meet through storage (rank markers, rank 0 commits:
:mod:`~checkpoint_store.session._multirank`), never through the process
group, so collectives stay on the training thread. At start the ranks
exchange which local copies verify; a local copy counts only where every
rank's part does.
"""

from __future__ import annotations

import copy
import logging
import os
import posixpath
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    INTERNAL_PREFIX,
    checkpoint_dir_name,
    parse_checkpoint_dir_name,
)
from checkpoint_store._results.writer import finish_before_exit_flush
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.checkpoint import Checkpoint, _require_checkpoint, written_metadata
from checkpoint_store.errors import (
    CheckpointConflictError,
    CheckpointStoreError,
    InvalidConfigError,
    RankTimeoutError,
)
from checkpoint_store.session._rendezvous import Backoff
from checkpoint_store.session._uploads import BackgroundUploader, first_error
from checkpoint_store.tiers import FastTier, LocalTier
from checkpoint_store.tiers.local import source_bytes
from checkpoint_store.tiers.view import record_local_tier

__all__ = ["durable_index", "get_fast_checkpoint", "open_tier", "report", "wait"]

logger = logging.getLogger(__name__)

_EXCHANGE_PREFIX = f"{INTERNAL_PREFIX}tier-"


# -- start ---------------------------------------------------------------------------


def open_tier(session: Any, config: LocalTier | None) -> FastTier | None:
    """Open the local tier of ``session`` (its constructor calls this once the
    persistent tier is open and the numbering agreed), continue the numbering
    past it, and queue the copies a killed run left pending."""
    if config is None:
        return None
    tier = FastTier(config, session.storage, world_rank=session.world_rank,
                    world_size=session.world_size, run_id=session.storage.run_id)
    session._tier = tier
    # Where this local tier is, for ls, show and the web page (tiers/view.py).
    record_local_tier(session.storage.filesystem, session.storage.trial_path, tier.trial_dir,
                      session.world_rank, session.storage.backend.capabilities)
    _restore_rows(session, tier)
    if session._coordinator is None:
        session._next_index = max(session._next_index, tier.next_index)
        pending = tier.pending()
    else:
        pending = _agree(session, tier)
    for index in pending:
        _queue_recovered(session, tier, index)
    return tier


def _restore_rows(session: Any, tier: FastTier) -> None:
    """Rank 0: the result rows of local copies a killed run reported but never
    wrote to the persistent tier (rows go out with the durable copies, not in
    ``report()``) are appended again from the copies' metadata, and the
    counters continue after them."""
    if session._results is None:
        return
    rows = []
    for entry in tier.entries():
        try:
            row = dict(tier.checkpoint(entry.index).internal_metadata.get("metrics") or {})
        except Exception:  # unreadable: its row stays lost
            continue
        it = row.get("training_iteration")
        if isinstance(it, int) and not isinstance(it, bool) and it > session._iteration:
            rows.append(row)
    rows.sort(key=lambda r: r["training_iteration"])
    for row in rows:
        session._results.append(row)
        session._iteration = int(row["training_iteration"])
        t = row.get("time_total_s")
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            session._time_offset = max(session._time_offset, float(t))
    if rows:
        logger.info("restored %d result row(s) from the local tier %s", len(rows), tier.trial_dir)


def _agree(session: Any, tier: FastTier) -> list[int]:
    """Several ranks: exchange which local copies verify and which are pending;
    keep the copies every rank has, continue the numbering past every rank's,
    and return the pending copies to persist (every rank the same list)."""
    mine = {"rank": session.world_rank, "verified": tier.verified_indexes(),
            "pending": tier.pending(), "next": tier.next_index}
    bodies = _exchange(session, mine)
    common = set.intersection(*(set(b["verified"]) for b in bodies))
    session._tier_among = common
    session._next_index = max([session._next_index] + [int(b["next"]) for b in bodies])
    wanted = set().union(*(set(b["pending"]) for b in bodies))
    for index in sorted(wanted - common):
        tier.forget(index, "the part of another rank is not on its local tier")
    pending = []
    for index in sorted(wanted & common):
        if _durable_has(session, index):  # committed there before the kill
            tier.mark_durable(index)
        else:
            pending.append(index)
    return pending


def _durable_has(session: Any, index: int) -> bool:
    try:
        return bool(session.storage.checkpoint(checkpoint_dir_name(index)).is_committed)
    except Exception:
        return False


def _exchange(session: Any, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``mine``, rank by rank: over the process group when there
    is one, else through ``<trial>/.cs_tier-<attempt>-<rank>.json`` files."""
    coord = session._coordinator
    if coord.uses_torch:
        import torch.distributed as dist

        out: list[Any] = [None] * session.world_size
        dist.all_gather_object(out, mine, group=coord._group)
        return out
    storage = session.storage
    fs, caps = storage.filesystem, storage.backend.capabilities
    trial = storage.trial_path
    attempt = coord.attempt_id
    if session.world_rank == 0:  # files of earlier attempts
        for fi in _fsutil.list_dir(fs, trial):
            name = posixpath.basename(fi.path)
            if name.startswith(_EXCHANGE_PREFIX) and not name.startswith(
                    f"{_EXCHANGE_PREFIX}{attempt}-"):
                _fsutil.delete_file(fs, fi.path)
    own = posixpath.join(trial, f"{_EXCHANGE_PREFIX}{attempt}-{session.world_rank}.json")
    _fsutil.write_bytes(fs, own, _json.dumps(mine), caps, fsync=storage.fsync)
    bodies: dict[int, dict[str, Any]] = {}
    backoff = Backoff(coord.timeout_s)
    while True:
        for r in range(session.world_size):
            if r in bodies:
                continue
            path = posixpath.join(trial, f"{_EXCHANGE_PREFIX}{attempt}-{r}.json")
            try:
                body = _json.loads(_fsutil.read_bytes(fs, path))
            except (FileNotFoundError, ValueError, OSError):
                continue
            if isinstance(body, dict):
                bodies[r] = body
        missing = sorted(set(range(session.world_size)) - set(bodies))
        if not missing:
            return [bodies[r] for r in range(session.world_size)]
        if not backoff.sleep():
            raise RankTimeoutError(
                f"rank {session.world_rank} waited {coord.timeout_s:g}s for ranks {missing} to "
                f"list their local tier copies (attempt {attempt!r}); start every rank with "
                "the same local_tier setting", missing_ranks=missing)


def _queue_recovered(session: Any, tier: FastTier, index: int) -> None:
    """Queue the copy of a checkpoint a killed run committed on the local tier
    but never persisted, with the row it was reported with (its metadata)."""
    local = tier.checkpoint(index)
    try:
        local.verify()
        meta = dict(local.internal_metadata)
    except Exception as exc:
        logger.warning("the local tier's pending copy %s does not verify (%s); not persisting it",
                       local.uri, exc)
        tier.forget(index, "its local copy does not verify")
        return
    row = dict(meta.get("metrics") or {})
    if session._coordinator is None:
        internal = session._checkpoint_internal(row, index)
    else:
        row["checkpoint_dir_name"] = checkpoint_dir_name(index)
        internal = session.storage.internal_metadata(
            index, {"metrics": row, "run_id": session.manager.run_id})
    if "tensors" in meta:
        internal["tensors"] = meta["tensors"]
    logger.info("persisting %s, left pending on the local tier by an earlier run", local.uri)
    tier.queue(index)
    _submit_durable(session, tier, index, internal, row)


# -- the uploaders ---------------------------------------------------------------------


def _uploader(session: Any) -> BackgroundUploader:
    if session._uploader is None:
        session._uploader = BackgroundUploader(session.upload_config.max_pending_uploads)
        finish_before_exit_flush(session)
    return session._uploader


def _worker(session: Any) -> BackgroundUploader:
    """The second worker: local commits of staged states (``write_to``), so a
    slow durable copy never holds staging memory."""
    if session._tier_worker is None:
        session._tier_worker = BackgroundUploader(1)
        finish_before_exit_flush(session)
    return session._tier_worker


def raise_errors(session: Any) -> None:
    """Raise the first error of a finished background local commit or durable copy."""
    if session._tier_worker is not None:
        session._tier_worker.raise_error()
    if session._uploader is not None:
        session._uploader.raise_error()


def drain(session: Any, wait: bool = True) -> list[tuple[str, BaseException]]:
    """Wait for the local commits of staged states (the durable copies are on
    the session's uploader, drained by the session) and take their errors."""
    worker = session._tier_worker
    if worker is None:
        return []
    if wait:
        worker.wait()
    return worker.take_errors()


def _submit_durable(session: Any, tier: FastTier, index: int, internal: Mapping[str, Any],
                    row: Mapping[str, Any], own_error: BaseException | None = None) -> None:
    up = _uploader(session)
    name = checkpoint_dir_name(index)
    if session._coordinator is None:
        def commit(source: Checkpoint) -> None:
            _flush_rows(session)
            try:
                session._commit(source, index, internal, row)
            except CheckpointConflictError:
                # Committed there already: by the run a kill stopped before its
                # local tier recorded it (a restart that could not read the
                # persistent tier then). Registered once; anything else raises.
                if not _adopt_durable(session, index, row):
                    raise
            # A retry after an ambiguous commit found its own marker: settled.
            session._unsettled = [u for u in session._unsettled if u[0] != index]

        up.submit(lambda: tier.persist(index, commit), lambda: None, name)
        return
    background = _background_coordinator(session)

    def commit_part(source: Checkpoint | None) -> None:
        _flush_rows(session)
        persisted = background.commit(index, source, dict(internal), own_error)
        session._record_commit(persisted, row)
        if session._tier_among is not None:
            session._tier_among.add(index)

    if own_error is not None:
        up.submit(lambda: commit_part(None), lambda: None, name)
    else:  # an aborted index is never retried: the next session persists it
        up.submit(lambda: tier.persist(index, commit_part, deadline_s=0), lambda: None, name)


def _adopt_durable(session: Any, index: int, row: Mapping[str, Any]) -> bool:
    """True when ``checkpoint_<index>`` is committed on the persistent tier with
    that index (then registered with retention unless it already is)."""
    name = checkpoint_dir_name(index)
    meta = dict(session.storage.checkpoint(name).internal_metadata)
    if meta.get("index") != index:
        return False
    existing = Checkpoint._from_backend(session.storage.backend,
                                        session.storage.checkpoint_path(index), meta)
    if name not in session.manager.known_committed():
        session._record_commit(existing, row)
    return True


def _flush_rows(session: Any) -> None:
    """Write the buffered result rows (rank 0): before a durable commit, so the
    row of a checkpoint is on the persistent tier no later than the checkpoint."""
    if session._results is not None:
        session._results.flush()


def _background_coordinator(session: Any) -> Any:
    """The coordinator the background copies use: the session's, meeting
    through storage only (rank markers and polls), never the process group."""
    bg = getattr(session, "_tier_coordinator", None)
    if bg is None:
        bg = copy.copy(session._coordinator)
        bg._uses_torch = False
        bg._group = None
        bg._written = None
        session._tier_coordinator = bg
    return bg


# -- report -----------------------------------------------------------------------------


def _in_place(session: Any, tier: FastTier, checkpoint: Checkpoint | None, index: int) -> bool:
    if session._reserved != index:
        return False
    if checkpoint is None:
        return True
    return isinstance(checkpoint, Checkpoint) and checkpoint.uri == tier.checkpoint(index).uri


def next_checkpoint_dir(session: Any) -> str:
    """With a local tier: ``checkpoint_<index>`` of the local tier, created and claimed."""
    with session._lock:
        if session._closed:
            raise CheckpointStoreError("this session has ended; start a new one to report")
        index = session._next_index
        if session._reserved != index:
            session._tier.reserve_in_place(index)
            session._reserved = index
    return str(session._tier.checkpoint(index).path)


def report(session: Any, metrics: Mapping[str, Any], checkpoint: Checkpoint | None,
           upload_mode: str | None) -> tuple[dict[str, Any], Checkpoint | None]:
    """``Session.report`` with a local tier: commit on the local tier, queue the
    durable copy, return. An explicit ``upload_mode="sync"`` also waits for the
    durable copy (when ``persist`` selects it)."""
    tier: FastTier = session._tier
    if session._coordinator is not None:
        return _report_multirank(session, tier, metrics, checkpoint)
    if upload_mode is not None and upload_mode not in ("sync", "async"):
        raise InvalidConfigError(f"upload_mode must be 'sync' or 'async', got {upload_mode!r}")
    in_place = _in_place(session, tier, checkpoint, session._next_index)
    if checkpoint is None and not in_place:
        raise_errors(session)
        return session._report_single(metrics, None)
    raise_errors(session)
    if not in_place:
        _require_checkpoint(checkpoint)
    # Refused metrics or score: raised before waiting for room.
    session._prepare_row(metrics, checkpoint, validate_score=True)
    if session._tier_worker is not None:  # staged states first: report order
        session._tier_worker.wait()
    if not in_place:
        assert checkpoint is not None
        up = _uploader(session)
        tier.make_room(source_bytes(checkpoint), lambda: up.pending > 0)
    with session._lock:
        if session._closed:
            raise CheckpointStoreError("this session has ended; start a new one to report")
        row = session._prepare_row(metrics, checkpoint, validate_score=True)
        index = session._next_index
        internal = session._checkpoint_internal(row, index)
        if in_place:
            fast, selected = tier.commit_in_place(index, internal, row)
        else:
            assert checkpoint is not None
            fast, selected = tier.commit(checkpoint, index, internal, row,
                                         writer_id=session._writer_id)
        session._next_index = index + 1
        session._accept_row(row)
        if selected:
            _submit_durable(session, tier, index, internal, row)
        # Flushed by the durable copy's job (or the periodic flush): report()
        # never waits for the persistent tier.
        session._append_row(row, flush=False)
    if upload_mode == "sync" and selected:
        tier.wait_durable(index)
        raise_errors(session)
    return row, fast


def _report_multirank(session: Any, tier: FastTier, metrics: Mapping[str, Any],
                      checkpoint: Checkpoint | None) -> tuple[dict[str, Any], Checkpoint | None]:
    coord = session._coordinator
    raise_errors(session)
    with session._lock:
        if session._closed:
            raise CheckpointStoreError("this session has ended; start a new one to report")
        error: BaseException | None = None
        row: dict[str, Any] = {}
        try:
            row = session._prepare_row(metrics, checkpoint,
                                       validate_score=session.world_rank == 0)
        except Exception as exc:
            error = exc
        fast = None
        if coord.any_checkpoint(checkpoint is not None):
            index = session._next_index
            session._next_index = index + 1  # every rank moves on, committed or not
            row["checkpoint_dir_name"] = checkpoint_dir_name(index)
            internal = session.storage.internal_metadata(
                index, {"metrics": row, "run_id": session.manager.run_id})
            selected = True
            if error is None:
                try:
                    part = checkpoint if checkpoint is not None else _empty_part()
                    fast, selected = tier.commit(part, index, internal, row,
                                                 writer_id=session._writer_id)
                except Exception as exc:  # published to the other ranks by the copy
                    error = exc
                    selected = tier.selects(index, row)
            else:
                selected = tier.selects(index, row)
            if selected:
                if fast is not None:
                    _submit_durable(session, tier, index, internal, row)
                else:  # this rank's failure aborts the index everywhere
                    _submit_durable(session, tier, index, internal, row,
                                    own_error=error or CheckpointStoreError("no local copy"))
        if error is not None:
            raise error
        session._accept_row(row)
        if session._results is not None:
            session._results.append(row)  # flushed by the durable copy's job
        return row, fast


def _empty_part() -> Checkpoint:
    """A rank without files of its own for this checkpoint (``checkpoint=None``
    under a process group): an empty part."""
    global _EMPTY
    if _EMPTY is None or not os.path.isdir(_EMPTY):
        _EMPTY = tempfile.mkdtemp(prefix="cs-empty-part-")
    return Checkpoint.from_directory(_EMPTY)


_EMPTY: str | None = None


def commit_staged(session: Any, source: Any, index: int, internal: Mapping[str, Any],
                  row: Mapping[str, Any]) -> None:
    """The local tier half of ``report(state=...)`` (one rank): the caller has
    taken ``index``, accepted and written ``row``; this queues the write of
    ``source`` (``write_to(directory)``) straight into ``checkpoint_<index>``
    of the local tier and its commit there, then the durable copy. Blocks
    only for ``max_bytes`` (``source.nbytes``)."""
    tier: FastTier = session._tier
    worker = _worker(session)
    up = _uploader(session)
    tier.make_room(int(getattr(source, "nbytes", 0) or 0), lambda: up.pending > 0)

    def run() -> None:
        fast, selected = tier.commit_staged(source, index, internal, row)
        if selected:
            durable = dict(internal)
            tensors = written_metadata(fast).get("tensors")
            if tensors is not None:  # the same tensor index on every tier
                durable["tensors"] = tensors
            _submit_durable(session, tier, index, durable, row)

    def cleanup() -> None:
        release = getattr(source, "release", None)
        if release is not None:
            release()

    worker.submit(run, cleanup, checkpoint_dir_name(index))


# -- restore and durability ---------------------------------------------------------------


def _index_of(session: Any, checkpoint: Checkpoint | None) -> int | None:
    if checkpoint is None or checkpoint is session._resume_from:
        return None
    return parse_checkpoint_dir_name(posixpath.basename(checkpoint.path.rstrip("/")))


def get_fast_checkpoint(session: Any) -> Checkpoint | None:
    """The local tier's newest copy that verifies, if it is at least as new as
    the newest checkpoint of the persistent tier (``session._latest``, not
    verified here: a local copy of the same index is read instead); with
    several ranks only a copy every rank has. None: use the persistent tier."""
    tier: FastTier | None = session._tier
    if tier is None:
        return None
    newest = _index_of(session, session._latest)
    return tier.newest_verified(above=None if newest is None else newest - 1,
                                among=session._tier_among)


def wait(session: Any, timeout: float | None, checkpoint: Any) -> None:
    """``Session.wait(checkpoint=...)``: until that checkpoint's durable copy is committed."""
    tier: FastTier | None = session._tier
    index = checkpoint_index(checkpoint)
    if index >= session._next_index:
        # Nothing would ever make it durable: returning would say it is.
        raise InvalidConfigError(
            f"{checkpoint_dir_name(index)} was never reported to this trial (its next "
            f"checkpoint is {checkpoint_dir_name(session._next_index)}); wait for a "
            "checkpoint report() returned, or call wait() without checkpoint=")
    if tier is None or tier.status(index) is None:
        # No local tier (or not on it yet: a state report commits there in the
        # background): every queued job, then what the tier says of it.
        started = time.monotonic()
        session.wait(timeout)
        if tier is None or tier.status(index) is None:
            return
        if timeout is not None:
            timeout = max(0.0, timeout - (time.monotonic() - started))
    if not tier.wait_durable(index, timeout):
        raise TimeoutError(f"the durable copy of {checkpoint_dir_name(index)} is still pending "
                           f"after {timeout} s")
    raise_errors(session)


def checkpoint_index(checkpoint: Any) -> int:
    """The index of ``checkpoint``: a Checkpoint, a ``checkpoint_NNNNNN`` name,
    an int, or a result row (its ``checkpoint_dir_name``).

    Raises:
        InvalidConfigError: none of these.
    """
    if isinstance(checkpoint, Mapping):
        checkpoint = checkpoint.get("checkpoint_dir_name")
    if isinstance(checkpoint, Checkpoint):
        checkpoint = posixpath.basename(checkpoint.path.rstrip("/"))
    if isinstance(checkpoint, str):
        found = parse_checkpoint_dir_name(checkpoint)
        if found is not None:
            return found
    if isinstance(checkpoint, int) and not isinstance(checkpoint, bool) and checkpoint >= 0:
        return checkpoint
    raise InvalidConfigError(
        f"checkpoint must be a Checkpoint, a 'checkpoint_NNNNNN' name, an index or a result "
        f"row naming one, got {checkpoint!r}")


def durable_index(session: Any) -> int | None:
    """The highest index whose durable copy is committed (local tier's view;
    without a tier, the newest registered on the persistent tier)."""
    tier: FastTier | None = session._tier
    known = [i for i in (_index_of(session, session._latest),
                         tier.durable_index if tier is not None else None) if i is not None]
    return max(known, default=None)


def first_tier_error(errors: list[tuple[str, BaseException]]) -> BaseException | None:
    return first_error(errors)
