"""A local tier at the start of a session, and what it answers afterwards.

At start (:func:`open_tier`): the rows of copies a killed run reported but
never stored are appended again, the numbering continues past the tier's
copies, the ranks agree on which local copies every rank has (over the
process group, else through ``<trial>/.cs_tier-<attempt>-<rank>.json``), and
the copies a killed run left pending are queued for their durable copy.

Afterwards: ``get_checkpoint()`` prefers the tier's newest copy that
verifies (:func:`newest_local`), ``durable_index`` and ``wait(checkpoint=)``.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Callable, Mapping
from typing import Any

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    checkpoint_dir_name,
    parse_checkpoint_dir_name,
    parse_tier_exchange_name,
    tier_exchange_name,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import InvalidConfigError, RankTimeoutError
from checkpoint_store.session._ledger import CommitRecorder, ReportLedger
from checkpoint_store.session._multirank import Coordinator
from checkpoint_store.session._rendezvous import Backoff
from checkpoint_store.session._targets import LOCAL_STATE_PART, TieredTarget, is_state_part
from checkpoint_store.storage import StorageContext
from checkpoint_store.tiers import FastTier

__all__ = ["checkpoint_index", "newest_local", "open_tier", "wait_durable"]

logger = logging.getLogger("checkpoint_store.session._tiered")

def open_tier(target: TieredTarget, ledger: ReportLedger, recorder: CommitRecorder,
              coordinator: Coordinator | None, run_id: str, world_size: int) -> None:
    """Resume the local tier of ``target`` (the session's constructor calls
    this once the persistent tier is open and the numbering agreed)."""
    tier = target.tier
    if ledger.results is not None:
        _restore_rows(tier, ledger)
    if coordinator is None:
        ledger.number_from(tier.next_index)
        pending = tier.pending()
    else:
        pending = _agree(tier, ledger, recorder, coordinator)
    for index in pending:
        _queue_recovered(target, index, run_id, world_size)


def _restore_rows(tier: FastTier, ledger: ReportLedger) -> None:
    """Rank 0: the result rows of local copies a killed run reported but never
    wrote to the persistent tier (rows go out with the durable copies, not in
    ``report()``) are appended again from the copies' metadata, and the
    counters continue after them."""
    rows = []
    for entry in tier.entries():
        try:
            row = dict(tier.checkpoint(entry.index).internal_metadata.get("metrics") or {})
        except Exception:  # unreadable: its row stays lost
            continue
        it = row.get("training_iteration")
        if isinstance(it, int) and not isinstance(it, bool) and it > ledger.iteration:
            rows.append(row)
    rows.sort(key=lambda r: r["training_iteration"])
    for row in rows:
        ledger.restore_row(row)
    if rows:
        logger.info("restored %d result row(s) from the local tier %s", len(rows), tier.trial_dir)


def _agree(tier: FastTier, ledger: ReportLedger, recorder: CommitRecorder,
           coordinator: Coordinator) -> list[int]:
    """Several ranks: exchange which local copies verify and which are pending;
    keep the copies every rank has, continue the numbering past every rank's,
    and return the pending copies to persist (every rank the same list)."""
    verified = _same_world(tier, tier.verified_indexes(), coordinator.world_size)
    mine = {"rank": coordinator.rank, "verified": verified,
            "pending": tier.pending(), "next": tier.next_index}
    bodies = _exchange(coordinator, mine)
    common = set.intersection(*(set(b["verified"]) for b in bodies))
    recorder.set_among(common)
    ledger.number_from(max(int(b["next"]) for b in bodies))
    wanted = set().union(*(set(b["pending"]) for b in bodies))
    for index in sorted(wanted - common):
        tier.forget(index, "the part of another rank is not on its local tier")
    pending = []
    for index in sorted(wanted & common):
        if _durable_has(coordinator.storage, index):  # committed there before the kill
            tier.mark_durable(index)
        else:
            pending.append(index)
    return pending


def _same_world(tier: FastTier, indexes: list[int], world_size: int) -> list[int]:
    """Of ``indexes`` (copies that verify), those written by a run of
    ``world_size`` ranks. A copy of another number of ranks is never restored
    nor persisted by this run: the parts on this run's tiers need not be all
    of it (a restart on fewer ranks would commit it without the other ranks'
    files). One still pending stops being so (it stays local only)."""
    same = []
    for index in indexes:
        try:
            written = tier.checkpoint(index).internal_metadata.get("world_size", world_size)
        except Exception:  # unreadable: as if it did not verify
            written = None
        if written == world_size:
            same.append(index)
        else:
            tier.forget(index, "its metadata cannot be read" if written is None else
                        f"it was written by {written} ranks, this run has {world_size}")
    return same


def _durable_has(storage: StorageContext, index: int) -> bool:
    try:
        return bool(storage.checkpoint(checkpoint_dir_name(index)).is_committed)
    except Exception:
        return False


def _exchange(coord: Coordinator, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``mine``, rank by rank: over the process group when there
    is one, else through ``<trial>/.cs_tier-<attempt>-<rank>.json`` files."""
    if coord.uses_torch:
        return coord.all_gather(mine)
    storage = coord.storage
    fs, caps = storage.filesystem, storage.backend.capabilities
    trial = storage.trial_path
    attempt = coord.attempt_id
    if coord.rank == 0:  # files of earlier attempts
        for fi in _fsutil.list_dir(fs, trial):
            parsed = parse_tier_exchange_name(posixpath.basename(fi.path))
            if parsed is not None and parsed[0] != attempt:
                _fsutil.delete_file(fs, fi.path)
    own = posixpath.join(trial, tier_exchange_name(attempt, coord.rank))
    _fsutil.write_bytes(fs, own, _json.dumps(mine), caps, fsync=storage.fsync)
    bodies: dict[int, dict[str, Any]] = {}
    backoff = Backoff(coord.timeout_s)
    while True:
        for r in range(coord.world_size):
            if r in bodies:
                continue
            path = posixpath.join(trial, tier_exchange_name(attempt, r))
            try:
                body = _json.loads(_fsutil.read_bytes(fs, path))
            except (FileNotFoundError, ValueError, OSError):
                continue
            if isinstance(body, dict):
                bodies[r] = body
        missing = sorted(set(range(coord.world_size)) - set(bodies))
        if not missing:
            return [bodies[r] for r in range(coord.world_size)]
        if not backoff.sleep():
            raise RankTimeoutError(
                f"rank {coord.rank} waited {coord.timeout_s:g}s for ranks {missing} to "
                f"list their local tier copies (attempt {attempt!r}); start every rank with "
                "the same local_tier setting", missing_ranks=missing)


def _queue_recovered(target: TieredTarget, index: int, run_id: str, world_size: int) -> None:
    """Queue the copy of a checkpoint a killed run committed on the local tier
    but never persisted, with the row it was reported with (its metadata)."""
    tier = target.tier
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
    row["checkpoint_dir_name"] = checkpoint_dir_name(index)
    internal: dict[str, Any] = {"metrics": row, "world_size": world_size, "run_id": run_id}
    if "tensors" in meta:
        internal["tensors"] = meta["tensors"]
    part = meta[LOCAL_STATE_PART] if is_state_part(meta) else None
    logger.info("persisting %s, left pending on the local tier by an earlier run", local.uri)
    tier.queue(index)
    target.queue_durable(index, internal, row, state_part=part)


def index_of(checkpoint: Checkpoint | None) -> int | None:
    """The index of a checkpoint of this trial (None: not one of its ``checkpoint_NNNNNN``)."""
    if checkpoint is None:
        return None
    return parse_checkpoint_dir_name(posixpath.basename(checkpoint.path.rstrip("/")))


def newest_local(tier: FastTier, latest: int | None, among: set[int] | None
                 ) -> Checkpoint | None:
    """The local tier's newest copy that verifies, if it is at least as new as
    ``latest`` (the persistent tier's newest index; a local copy of the same
    index is read instead); with several ranks only a copy every rank has
    (``among``). None: use the persistent tier.

    A rank's part of a state saved on several ranks is never returned: it
    holds the pieces this rank wrote, each byte of the logical state being
    written once (a replicated tensor split between the ranks, a small one
    written whole by one rank), so no rank's local copy holds all that rank
    loads, and only the storage_path's copy has the merged ``state.json``.
    When its durable copy is queued in this session (one a killed run left
    pending, queued at start), this waits for it, so that the persistent
    tier's newest is that checkpoint (docs/tiers.md, "Restore")."""
    fast = tier.newest_verified(above=None if latest is None else latest - 1, among=among)
    if fast is None:
        return None
    try:
        meta = fast.internal_metadata
    except Exception:  # verified a moment ago: resumed as before this check existed,
        return fast  # never silently older (a state part then fails to load, typed)
    if not is_state_part(meta):
        return fast
    index = index_of(fast)
    if index is not None and tier.status(index) == "pending":
        try:
            tier.wait_durable(index)
        except Exception as exc:  # not committed there: the persistent tier's newest
            logger.warning("restoring from the persistent tier: the durable copy of %s (a "
                           "state saved on several ranks) is not committed (%s)",
                           checkpoint_dir_name(index), exc)
    return None


def wait_durable(tier: FastTier | None, index: int, next_index: int, timeout: float | None,
                 wait_all: Callable[[float | None], None],
                 raise_errors: Callable[[], None]) -> None:
    """``Session.wait(checkpoint=...)``: until that checkpoint's durable copy is
    committed (``wait_all``: the session's wait for every queued job)."""
    if index >= next_index:
        # Nothing would ever make it durable: returning would say it is.
        raise InvalidConfigError(
            f"{checkpoint_dir_name(index)} was never reported to this trial (its next "
            f"checkpoint is {checkpoint_dir_name(next_index)}); wait for a "
            "checkpoint report() returned, or call wait() without checkpoint=")
    if tier is None or tier.status(index) is None:
        # No local tier (or not on it yet: a state report commits there in the
        # background): every queued job, then what the tier says of it.
        started = time.monotonic()
        wait_all(timeout)
        if tier is None or tier.status(index) is None:
            return
        if timeout is not None:
            timeout = max(0.0, timeout - (time.monotonic() - started))
    if not tier.wait_durable(index, timeout):
        raise TimeoutError(f"the durable copy of {checkpoint_dir_name(index)} is still pending "
                           f"after {timeout} s")
    raise_errors()


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
