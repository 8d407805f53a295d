"""Multi-rank checkpoints: every rank uploads its own files, rank 0 commits.

One checkpoint index ``X`` of one launch attempt (its ranks share an
attempt id ``R``) goes through four steps (docs/format.md, "Multi-rank"):

1. Every rank copies its files into the shared target (``checkpoint_X/``
   on object stores, the staging sibling ``.cs_staging-checkpoint_X-R`` on
   local disks), then writes its marker ``.cs_rank-<rank>.json`` there:
   success or the error, and the files it wrote with sizes and CRC32C.
2. Rank 0 waits until every marker is there: one listing per poll, or one
   listing after a torch.distributed barrier when a process group exists.
   It reads each marker once, so a commit costs O(world_size) storage calls.
3. Rank 0 commits (``.internal_metadata.json`` last, every rank's files in
   the manifest) only if every rank succeeded and no two ranks wrote the same
   file; otherwise it deletes the partial target and writes
   ``<trial>/.cs_abort-checkpoint_X-R.json``.
4. The other ranks learn the outcome from a broadcast, or by polling the
   commit marker and the abort file.

A failed index is never reused within an attempt, and a new attempt starts
past every ``checkpoint_*`` directory already present, so a committed
checkpoint never mixes files from two attempts. Rank 0 decides the first
index of an attempt and
shares it (broadcast, or ``<trial>/.cs_attempt-R.json``) before any rank writes.
How the ranks meet (the attempt id, the process group, the backoff of polls)
is :mod:`checkpoint_store.session._rendezvous`. The rank part itself (the
include rule, the marker, the merge, the commit from markers) is
:mod:`checkpoint_store._commit.rankparts`, which Ray Train's ``upload_fn``
and ``CommitCallback`` share; this module owns the rendezvous around it:
the attempt's first index, the waits, the verdict and the abort.
"""

from __future__ import annotations

import copy
import functools
import posixpath
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol, TypedDict

import pyarrow.fs as pafs

from checkpoint_store._commit.claims import put_claim
from checkpoint_store._commit.rankparts import (
    RankDir,
    RankFiles,
    RankSource,
    delete_rank_markers,
    failed_ranks,
    finalize_from_markers,
    merge_rank_files,
    rank_markers_present,
    read_rank_marker,
    write_rank_part,
)
from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    INTERNAL_METADATA,
    abort_file_name,
    attempt_file_name,
    checkpoint_dir_name,
    is_abort_file_name,
    is_attempt_file_name,
    rank_marker_name,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.ids import new_writer_id
from checkpoint_store.checkpoint import Checkpoint, written_metadata
from checkpoint_store.errors import (
    CheckpointAbortedError,
    CheckpointConflictError,
    CheckpointNotFoundError,
    CheckpointStoreError,
    InvalidConfigError,
    RankTimeoutError,
)
from checkpoint_store.session._rendezvous import Backoff, checked_attempt_id, torch_group
from checkpoint_store.storage import StorageContext

#: Why rank 0 did not commit: a rank missing, a rank failed, two ranks wrote
#: one path, or the commit itself failed.
OutcomeKind = Literal["timeout", "aborted", "conflict", "error"]


class RankSignals(Protocol):
    """How a preemption signal travels between the ranks (the session's
    :class:`~checkpoint_store.session._preemption.PreemptionWatch`)."""

    def shared(self) -> dict[str, Any] | None:
        """This rank's signal (None: not signalled)."""
        ...

    def adopt(self, signals: Iterable[Any]) -> bool:
        """Every rank's :meth:`shared`; flags this rank if any was signalled."""
        ...


class _Deadline:
    """When waits for other ranks must end (a preemption's grace), shared by
    a coordinator and its :meth:`Coordinator.storage_only` copies."""

    at: float | None = None  # time.monotonic()


class _OutcomeBase(TypedDict):
    ok: bool


class Outcome(_OutcomeBase, total=False):
    """Rank 0's verdict on one index, as broadcast to the other ranks and
    written to ``<trial>/.cs_abort-...json`` (JSON: a dict on the wire)."""

    kind: OutcomeKind
    ranks: list[int]
    error: str
    preemption: dict[str, Any]


class Coordinator:
    """Rendezvous and commit for one rank of a multi-rank session.

    Args:
        storage: the trial's storage (every rank the same).
        world_rank, world_size: this rank and the number of ranks (>= 2).
        attempt_id: shared by every rank of one launch attempt, unique per
            attempt. None: broadcast by rank 0 when a torch.distributed process
            group exists, else ``TORCHELASTIC_RUN_ID`` plus the restart count.
        timeout_s: how long any wait for other ranks may take, in seconds.

    Raises:
        InvalidConfigError: no attempt id can be found, or it is not made of
            letters, digits, ``_``, ``.`` and ``-``.
    """

    def __init__(
        self, storage: StorageContext, world_rank: int, world_size: int, *,
        attempt_id: str | None, timeout_s: float,
    ):
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise InvalidConfigError(f"sync_timeout_s must be a number > 0, got {timeout_s!r}")
        self.storage = storage
        self.rank = world_rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self._uses_torch, self._group = torch_group(world_rank, world_size)
        self.attempt_id = self._agree_attempt_id(attempt_id)
        # The marker rank 0's last commit wrote (rank 0 only).
        self._written: dict[str, Any] | None = None
        #: Set by a session with preemption on: the signal travels with the
        #: flags every report gathers (process group), or in the rank markers
        #: and the commit of every checkpoint report (storage only).
        self.signals: RankSignals | None = None
        self._deadline = _Deadline()

    def limit_waits(self, seconds: float | None) -> None:
        """From now on no wait for other ranks lasts past ``seconds`` (a
        preemption's grace left; None: only ``timeout_s``), also on the
        :meth:`storage_only` copies. Collectives of the process group are
        not bounded by it: gloo fails them as soon as a peer process is gone."""
        self._deadline.at = None if seconds is None else time.monotonic() + max(0.0, seconds)

    def _wait_s(self, seconds: float) -> float:
        """``seconds``, or less when :meth:`limit_waits` set an earlier end."""
        at = self._deadline.at
        return seconds if at is None else max(0.0, min(seconds, at - time.monotonic()))

    # -- collectives --------------------------------------------------------------

    @property
    def uses_torch(self) -> bool:
        return self._uses_torch

    def close(self) -> None:
        """Drop the gloo subgroup made for an NCCL job (the session has ended),
        so that ``destroy_process_group()`` frees it."""
        self._group = None

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, rank by rank, over the process group (called
        by every rank; only with :attr:`uses_torch`)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self._group)
        return out

    def storage_only(self) -> Coordinator:
        """A copy of this coordinator that meets the other ranks through
        storage only: rank markers, the abort file and polls, never the torch
        process group.

        For commits made off the training thread: the local tier's background
        copies to the persistent tier commit on each rank's uploader thread.
        Collectives must be called in the same order on every rank, and the
        training thread keeps calling them (barriers, broadcasts of its own
        reports), so a second thread must never use the process group.

        Every rank calls it (the thread that reports, once, when it first
        queues such a copy) and hands the copy to its background thread. The
        copy shares storage, rank, world size, attempt id and timeout, never
        the group, and keeps its own record of the marker rank 0 last wrote,
        so the two never see each other's commit. Without a process group it
        behaves as this coordinator does.
        """
        other = copy.copy(self)
        other._uses_torch = False
        other._group = None
        other._written = None
        # Signals are exchanged at the training thread's reports only, so
        # every rank learns them at the same report.
        other.signals = None
        return other

    def _broadcast(self, value: Any) -> Any:
        import torch.distributed as dist

        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self._group)

    def _agree_attempt_id(self, attempt_id: str | None) -> str:
        if attempt_id is None and self._uses_torch:
            attempt_id = self._broadcast(uuid.uuid4().hex[:16])
        return checked_attempt_id(attempt_id, self.world_size)

    def agree_start_index(self, compute: Callable[[], int]) -> int:
        """Rank 0 computes the attempt's first checkpoint index; every rank gets it.

        Rank 0 first removes attempt and abort files of earlier attempts (no
        rank of this attempt writes before it has the index).

        Raises:
            RankTimeoutError: a non-zero rank waited ``timeout_s`` for rank 0.
        """
        fs = self.storage.filesystem
        caps = self.storage.backend.capabilities
        trial = self.storage.trial_path
        index = None
        if self.rank == 0:
            for fi in _fsutil.list_dir(fs, trial):
                name = posixpath.basename(fi.path)
                if fi.type == pafs.FileType.File and (
                    is_attempt_file_name(name) or is_abort_file_name(name)
                ):
                    _fsutil.delete_file(fs, fi.path)
            index = compute()
        if self._uses_torch:
            return int(self._broadcast(index))
        path = posixpath.join(trial, attempt_file_name(self.attempt_id))
        body: Any
        if self.rank == 0:
            body = {"attempt_id": self.attempt_id, "world_size": self.world_size,
                    "start_index": index}
            _fsutil.write_bytes(fs, path, _json.dumps(body), caps, fsync=self.storage.fsync)
            return int(index)  # type: ignore[arg-type]
        backoff = Backoff(self.timeout_s)
        while True:
            try:
                body = _json.loads(_fsutil.read_bytes(fs, path))
            except (FileNotFoundError, ValueError):
                body = None
            except OSError:
                if _fsutil.exists(fs, path):
                    raise
                body = None
            if isinstance(body, dict) and body.get("attempt_id") == self.attempt_id:
                if body.get("world_size") != self.world_size:
                    raise InvalidConfigError(
                        f"rank 0 of attempt {self.attempt_id} started with world_size "
                        f"{body.get('world_size')}, this rank with {self.world_size}"
                    )
                return int(body["start_index"])
            if not backoff.sleep():
                raise RankTimeoutError(
                    f"rank {self.rank} waited {self.timeout_s:g}s for rank 0 to start attempt "
                    f"{self.attempt_id!r} in {self.storage.uri(trial)}; missing ranks: [0]. Start "
                    "rank 0 with the same storage, experiment, trial and attempt_id",
                    missing_ranks=[0],
                )

    def any_checkpoint(self, has_checkpoint: bool) -> bool:
        """Whether any rank passes a checkpoint to this report().

        With a process group the ranks ask each other, so ranks may pass None
        while others pass a checkpoint. Storage alone cannot tell without a
        round trip per report, so there every rank must pass a checkpoint to
        the same report() (an empty directory is fine) or none must.

        With :attr:`signals` set (preemption on), each rank's preemption
        signal rides on the same gather, and every rank adopts it at once.
        """
        if not self._uses_torch:
            return has_checkpoint
        import torch.distributed as dist

        mine: Any = bool(has_checkpoint)
        if self.signals is not None:  # the preemption flags ride along
            mine = (mine, self.signals.shared())
        flags: list[Any] = [None] * self.world_size
        dist.all_gather_object(flags, mine, group=self._group)
        # A rank started without preemption= sends its bare flag.
        pairs = [f if isinstance(f, tuple) else (f, None) for f in flags]
        if self.signals is not None:
            self.signals.adopt(signal for _, signal in pairs)
        return any(bool(has) for has, _ in pairs)

    # -- the commit ---------------------------------------------------------------------

    def commit(
        self,
        index: int,
        checkpoint: Checkpoint | None,
        internal: dict[str, Any],
        own_error: BaseException | None = None,
        *,
        in_place: bool = False,
        state_part: dict[str, Any] | None = None,
    ) -> Checkpoint:
        """Upload this rank's files for ``index``; rank 0 commits once all ranks are done.

        Args:
            index: the checkpoint index, the same on every rank.
            checkpoint: this rank's files, or None to contribute none.
            internal: internal metadata fields (rank 0's are written).
            own_error: an error this rank already hit for this report; it is
                published as a failure, so the index is aborted everywhere.
            in_place: the ranks wrote their files straight into
                ``checkpoint_<index>`` (``dcp.save`` into
                ``next_checkpoint_dir()``): nothing is copied, the rank
                markers go there, and rank 0 commits the directory as it is
                (:meth:`StorageContext.commit_in_place`). Same on every rank.
            state_part: this rank's part of a state saved on every rank
                (:func:`checkpoint_store.state._shards.finish_part`): it
                rides in the rank's marker, and rank 0 commits the merged
                ``state.json`` with the ranks' files. Given on every rank or
                on none.

        Returns:
            The committed checkpoint (the same on every rank).

        Raises:
            CheckpointNotFoundError: this rank's source directory vanished
                (the message names the path). Other ranks then raise
                CheckpointAbortedError.
            CheckpointConflictError: two ranks wrote the same relative path
                (the message names both ranks).
            RankTimeoutError: some rank did not finish within the timeout
                (the message lists the missing ranks).
        """
        storage = self.storage
        final = storage.checkpoint_path(index)
        dir_name = checkpoint_dir_name(index)
        target = final if in_place else storage.commit_protocol.workdir(final, self.attempt_id)
        storage.ensure_trial_dir()
        to_copy = None if in_place else checkpoint
        own_error = self._write_part(index, to_copy, target, own_error, state_part)
        if self._uses_torch:
            self._barrier()
        if self.rank == 0:
            outcome, rank0_error = self._decide(index, dir_name, target, final, internal,
                                                in_place)
            if self._uses_torch:
                self._broadcast(outcome)
        else:
            rank0_error = None
            if self._uses_torch:
                outcome = self._broadcast(None)
            else:
                outcome = self._await_outcome(index, dir_name, final)
        if own_error is not None:
            raise own_error
        if rank0_error is not None:
            raise rank0_error
        if not outcome["ok"]:
            raise _error_from_outcome(outcome, index)
        # Rank 0 registers the marker it wrote, without reading it back.
        written, self._written = self._written, None
        return Checkpoint._from_backend(storage.backend, final, written)

    def _part_dir(self, target: str) -> RankDir:
        """Where the ranks write their parts for one index (``target``)."""
        return RankDir(self.storage.backend, target, fsync=self.storage.fsync)

    def _write_part(self, index: int, checkpoint: Checkpoint | None, target: str,
                    own_error: BaseException | None,
                    state_part: dict[str, Any] | None = None) -> BaseException | None:
        """Every rank (its reporting thread): copy its files into ``target``
        (unless it already failed or has none to copy), then write its marker
        there (:func:`~checkpoint_store._commit.rankparts.write_rank_part`).
        Never raises: returns this rank's error, which the other ranks learn
        from the marker."""
        claim: str | None = None
        source: RankSource | None = None
        wrap_error: Callable[[Exception], BaseException] | None = None
        if own_error is None and checkpoint is not None:
            wrap_error = functools.partial(_upload_error, checkpoint=checkpoint, rank=self.rank)
            try:
                claim = self._claim_before_data(index, target)
                source = RankSource(checkpoint.filesystem, checkpoint.path)
            except Exception as exc:  # published to the other ranks, then re-raised
                own_error = wrap_error(exc)
        part = write_rank_part(
            self._part_dir(target), self.rank, source, error=own_error,
            fields=functools.partial(self._marker_fields, index, state_part),
            wrap_error=wrap_error,
        )
        # Without a marker rank 0 reports this rank missing; keep the
        # collectives in step so no rank hangs.
        own_error = part.error or part.marker_error
        if claim is not None and own_error is None:
            # The rank marker is now this rank's trace; a claim left behind
            # (this delete failing) is an internal file and changes nothing.
            try:
                _fsutil.delete_file(self.storage.filesystem, claim)
            except OSError:
                pass
        return own_error

    def _marker_fields(self, index: int,
                       state_part: dict[str, Any] | None = None) -> dict[str, Any]:
        """This rank's own fields of its marker; without a process group the
        preemption signal travels there, and a sharded state's part always."""
        fields: dict[str, Any] = {"attempt_id": self.attempt_id, "index": index}
        if state_part is not None:
            fields["state"] = state_part
        signal = self.signals.shared() if self.signals is not None else None
        if signal is not None and not self._uses_torch:
            fields["preemption"] = signal
        return fields

    def _claim_before_data(self, index: int, target: str) -> str | None:
        """Where ranks copy straight into ``checkpoint_<index>`` (marker-last
        stores), PUT this rank's claim there first: a rank killed before its
        marker then leaves data cleanup knows is this attempt's (active while
        it runs, removed by a later one), never foreign-looking files. A
        staging directory's name is trace enough. Returns the claim's path."""
        if target != self.storage.checkpoint_path(index):
            return None
        writer = new_writer_id(self.attempt_id)
        return posixpath.join(target, put_claim(self.storage.backend, target, writer))

    def _decide(
        self, index: int, dir_name: str, target: str, final: str, internal: dict[str, Any],
        in_place: bool = False,
    ) -> tuple[Outcome, BaseException | None]:
        """Rank 0: wait for every marker, then commit or abort. Never raises;
        returns the outcome for the other ranks and the error for rank 0."""
        storage = self.storage
        # What the ranks wrote in place stays on an abort (uncommitted, it is
        # ignored, and cleanup of a later run removes it); staged copies go.
        drop = None if in_place else target
        try:
            markers = self._collect_markers(index, dir_name, target)
            signal = self._signal_of(markers.values())
            if signal is not None:
                internal = {**internal, "preemption": internal.get("preemption") or signal}
        except RankTimeoutError as timeout:
            return self._abort(dir_name, timeout, "timeout", timeout.missing_ranks, None), timeout
        except Exception as error:
            return self._abort(dir_name, error, "error", [], None), error
        failed = failed_ranks(markers)
        if failed:
            detail = "; ".join(f"rank {r} failed: {e}" for r, e in failed.items())
            exc = CheckpointAbortedError(
                f"{dir_name} of {storage.uri(storage.trial_path)} was not committed: {detail}",
                index=index, failed_ranks=sorted(failed),
            )
            return self._abort(dir_name, exc, "aborted", sorted(failed), drop), exc
        merged = merge_rank_files(markers)
        if merged.clash is not None:
            first, second, path = merged.clash
            clash = CheckpointConflictError(
                f"ranks {first} and {second} both wrote {path!r} into {dir_name}; "
                f"nothing was committed. Give each rank's files distinct names "
                f"(e.g. 'shard_{{rank}}.pt') or write shared files from one rank only"
            )
            return self._abort(dir_name, clash, "conflict", [first, second], drop), clash
        parts = [markers[r].get("state") for r in sorted(markers)]
        if any(p is not None for p in parts):
            try:
                merged, internal = self._merge_state(dir_name, target, parts, merged, internal)
            except CheckpointConflictError as conflict:
                return self._abort(dir_name, conflict, "conflict", [], drop), conflict
            except Exception as exc:
                return self._abort(dir_name, exc, "error", [], drop), exc
        try:
            self._written = self._finalize(index, target, final, internal, merged, in_place)
        except Exception as exc:
            return self._abort(dir_name, exc, "error", [], None), exc
        return {"ok": True}, None

    def _merge_state(self, dir_name: str, target: str, parts: list[Any], merged: RankFiles,
                     internal: dict[str, Any]) -> tuple[RankFiles, dict[str, Any]]:
        """Rank 0, every rank's pieces written: the one ``state.json`` of the
        logical state (:func:`~checkpoint_store.state._shards.merged_state_file`),
        written into ``target`` and added to the manifest as rank 0's file;
        the index recorded as the marker's ``"tensors"``.

        Raises:
            CheckpointConflictError: some rank saved no state, or the ranks'
                states differ or their pieces do not tile a tensor.
        """
        import google_crc32c

        from checkpoint_store.state import STATE_FILE
        from checkpoint_store.state._shards import merged_state_file

        missing = [r for r, p in enumerate(parts) if not isinstance(p, dict)]
        if missing:
            raise CheckpointConflictError(
                f"{dir_name}: ranks {missing} reported no state while others reported one; "
                "pass state= to the same report() on every rank")
        raw, tensors = merged_state_file(parts)
        storage = self.storage
        _fsutil.write_bytes(storage.filesystem, posixpath.join(target, STATE_FILE), raw,
                            storage.backend.capabilities, fsync=storage.fsync)
        entry = {"path": STATE_FILE, "size": len(raw),
                 "crc32c": f"{google_crc32c.value(raw):08x}"}
        ranks = dict(merged.ranks)
        ranks["0"] = sorted([*ranks.get("0", []), STATE_FILE])
        return (RankFiles([*merged.manifest, entry], ranks, None),
                {**internal, "tensors": tensors})

    def _finalize(self, index: int, target: str, final: str, internal: dict[str, Any],
                  merged: RankFiles, in_place: bool) -> dict[str, Any]:
        """Rank 0, every part good: commit, then delete the rank markers.
        Returns the internal metadata as written."""
        storage = self.storage
        meta = dict(internal)
        meta.setdefault("index", index)
        meta["world_size"] = self.world_size
        meta["attempt_id"] = self.attempt_id
        if not in_place:
            return finalize_from_markers(storage.commit_protocol, target, final, meta, merged,
                                         writer=self.attempt_id)
        written = dict(written_metadata(storage.commit_in_place(index, meta)))
        delete_rank_markers(storage.filesystem, final, (int(r) for r in merged.ranks))
        return written

    def _collect_markers(self, index: int, dir_name: str, target: str) -> dict[int, dict]:
        """Rank 0: wait until every rank's marker is in ``target`` (one listing
        per poll), then read each once it parses (a marker listed while it is
        still being written is read again).

        Raises:
            RankTimeoutError: some ranks' markers are still missing.
            CheckpointStoreError: a marker belongs to another attempt.
        """
        part_dir = self._part_dir(target)
        # After a barrier every rank has tried to write its marker: one missing
        # now failed to write, so only a listing's lag is worth waiting for.
        timeout_s = self._wait_s(min(self.timeout_s, 10.0) if self._uses_torch
                                 else self.timeout_s)
        backoff = Backoff(timeout_s)
        bodies: dict[int, dict[str, Any]] = {}
        while True:
            for r in sorted(set(rank_markers_present(part_dir)) - set(bodies)):
                try:
                    bodies[r] = self._own_marker(part_dir, r)
                except ValueError:
                    # Listed while its bytes are still being written (a store
                    # whose writes are not atomic, memory://): read it again.
                    continue
            missing = sorted(set(range(self.world_size)) - set(bodies))
            if not missing:
                break
            if not backoff.sleep():
                raise RankTimeoutError(
                    f"{dir_name} was not committed: ranks {missing} of {self.world_size} did "
                    f"not finish writing within {timeout_s:g}s (attempt {self.attempt_id!r}). "
                    "Every rank must call report() the same number of times, and without "
                    "torch.distributed pass a checkpoint on every rank or on none",
                    missing_ranks=missing, index=index,
                )
        return bodies

    def _own_marker(self, part_dir: RankDir, rank: int) -> dict[str, Any]:
        """Rank 0: ``rank``'s marker, refused unless this attempt wrote it."""
        body = read_rank_marker(part_dir, rank)
        if not isinstance(body, dict) or body.get("attempt_id") != self.attempt_id:
            other = body.get("attempt_id") if isinstance(body, dict) else "?"
            raise CheckpointStoreError(
                f"rank marker {rank_marker_name(rank)} in {self.storage.uri(part_dir.path)} "
                f"belongs to another attempt ({other}); two launches share this trial and "
                "attempt id: give each launch its own attempt_id"
            )
        return body

    def _abort(
        self, dir_name: str, exc: BaseException, kind: OutcomeKind, ranks: list[int],
        target: str | None,
    ) -> Outcome:
        """Rank 0: drop what was uploaded (when every rank is done) and publish the abort."""
        storage = self.storage
        outcome: Outcome = {"ok": False, "kind": kind, "ranks": ranks, "error": str(exc)}
        signal = self.signals.shared() if self.signals is not None else None
        if signal is not None:
            outcome["preemption"] = _recorded(signal)
        if target is not None:
            try:
                storage.commit_protocol.remove_leftover(target)
            except OSError:
                pass  # an uncommitted directory is ignored by readers; cleanup retries
        if not self._uses_torch:
            _fsutil.write_bytes(
                storage.filesystem,
                posixpath.join(storage.trial_path, abort_file_name(dir_name, self.attempt_id)),
                _json.dumps(outcome), storage.backend.capabilities, fsync=storage.fsync,
            )
        return outcome

    def _await_outcome(self, index: int, dir_name: str, final: str) -> Outcome:
        """Non-zero rank without a process group: poll the commit marker and the abort file."""
        fs = self.storage.filesystem
        meta_path = posixpath.join(final, INTERNAL_METADATA)
        abort_path = posixpath.join(
            self.storage.trial_path, abort_file_name(dir_name, self.attempt_id)
        )
        # Rank 0 waits up to timeout_s for the slowest rank and then publishes
        # which ranks were missing; wait past that to report its verdict.
        wait_s = self._wait_s(2 * self.timeout_s + 1.0)
        backoff = Backoff(wait_s)
        while True:
            meta_info, abort_info = fs.get_file_info([meta_path, abort_path])
            if abort_info.type == pafs.FileType.File:
                outcome = self._read_abort(abort_path, dir_name)
                if self.signals is not None and isinstance(outcome, dict):
                    self.signals.adopt([outcome.get("preemption")])
                return outcome
            if meta_info.type == pafs.FileType.File:
                if self.signals is not None:  # one read, with preemption on only
                    self._adopt_committed(meta_path)
                return {"ok": True}
            if not backoff.sleep():
                return {
                    "ok": False, "kind": "timeout", "ranks": [0],
                    "error": (
                        f"rank {self.rank} waited {wait_s:g}s for rank 0 to commit "
                        f"{dir_name} (attempt {self.attempt_id!r}); missing ranks: [0]"
                    ),
                }

    def _read_abort(self, abort_path: str, dir_name: str) -> Outcome:
        """The outcome rank 0 published in its abort file. Read again while
        torn (rank 0 may still be writing it in place); one that stays
        unreadable still says rank 0 aborted."""
        try:
            return _fsutil.read_control(self.storage.filesystem, abort_path)  # type: ignore[no-any-return]
        except _fsutil.UnparsableFileError as exc:
            return {"ok": False, "kind": "aborted", "ranks": [],
                    "error": f"rank 0 aborted {dir_name}; its abort file "
                             f"{self.storage.uri(abort_path)} is unreadable ({exc})"}

    def _signal_of(self, markers: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
        """Rank 0, storage only: the preemption signal some rank's marker
        carries (this index is then every rank's preemption checkpoint)."""
        if self.signals is None or self._uses_torch:
            return None
        signals = [m.get("preemption") for m in markers]
        if not self.signals.adopt(signals):
            return None
        shared = self.signals.shared()
        return _recorded(shared) if shared is not None else None

    def _adopt_committed(self, meta_path: str) -> None:
        """A non-zero rank, storage only: whether rank 0 committed this index
        as a preemption checkpoint (some rank's marker said so)."""
        try:
            meta = _fsutil.read_control(self.storage.filesystem, meta_path)
        except (OSError, ValueError):
            return  # committed; a rank signalled later still stops at its own report
        if isinstance(meta, dict) and isinstance(meta.get("preemption"), dict):
            self.signals.adopt([{**meta["preemption"], "left_s": None}])  # type: ignore[union-attr]


def _recorded(signal: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint records of a signal (not the grace one rank had left)."""
    return {k: v for k, v in signal.items() if k != "left_s"}


def _upload_error(exc: Exception, checkpoint: Checkpoint, rank: int) -> Exception:
    """A clear error for a failed upload; a vanished source names the path."""
    if isinstance(exc, FileNotFoundError):
        missing = getattr(exc, "filename", None) or checkpoint.path
        err = CheckpointNotFoundError(
            f"rank {rank}: {missing} disappeared while uploading checkpoint "
            f"{checkpoint.uri}; keep the checkpoint directory until report() returns ({exc})"
        )
        err.__cause__ = exc
        return err
    return exc


def _error_from_outcome(outcome: Outcome, index: int) -> Exception:
    kind = outcome.get("kind")
    ranks = list(outcome.get("ranks") or [])
    message = str(outcome.get("error"))
    if kind == "timeout":
        return RankTimeoutError(message, missing_ranks=ranks, index=index)
    if kind == "conflict":
        return CheckpointConflictError(message)
    return CheckpointAbortedError(message, index=index, failed_ranks=ranks)
