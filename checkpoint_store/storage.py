"""Where a trial's files live: ``<storage_path>/<experiment>/<trial>/``.

:class:`StorageContext` turns the user's ``storage_path`` (plus an optional
filesystem instance or storage options) into a backend and owns the layout
documented in docs/format.md. It persists local checkpoints into the trial
directory and lists the committed ones. It knows nothing of scores or
sessions.
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from checkpoint_store._chunks.gc import GcReport, collect
from checkpoint_store._chunks.refs import experiment_refs
from checkpoint_store._chunks.store import ChunkStore
from checkpoint_store._chunks.writer import (
    ChunkedUpload,
    check_chunking,
    resolve_codec,
)
from checkpoint_store._commit import trialdir as _trialdir
from checkpoint_store._commit.leftovers import ScanResult, scan_trial
from checkpoint_store._commit.nesting import refuse_inside_checkpoint
from checkpoint_store._commit.protocols import CommitProtocol, protocol_for
from checkpoint_store._format.layout import (
    CHUNK_DIR,
    CHUNK_ROOT,
    ERROR_FILE,
    STOPPED_FILE,
    check_run_name,
    checkpoint_dir_name,
    validate_component,
)
from checkpoint_store._format.manifest import is_checkpoint_data
from checkpoint_store._results import trialfiles as _trialfiles
from checkpoint_store._results.writer import ResultLog, parse_result_rows, read_results
from checkpoint_store._transfer.plan import Previous
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.ids import default_run_id, new_writer_id, sanitize_run_id
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend, clean_components, local_absolute
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    InvalidConfigError,
    PermanentBackendError,
    TransientBackendError,
)
from checkpoint_store.registry import resolve

__all__ = ["ResultLog", "ScanResult", "StorageContext", "parse_result_rows"]

logger = logging.getLogger(__name__)


class StorageContext:
    """Resolves ``storage_path`` and owns the experiment/trial layout.

    Args:
        storage_path: local path (relative paths made absolute, ``~``
            expanded) or URI (``file://``, ``memory://``, ``s3://`` ...). With
            ``storage_filesystem``, a path inside that filesystem. Either way
            spelled once (:func:`checkpoint_store.registry.resolve`): empty and
            ``.`` components dropped, ``..`` refused off local disks, and URIs
            holding credentials, a query or a port refused.
        experiment_name, trial_name: one path component each (no ``/``,
            ``\\``, ``.`` or ``..``), not a name our layout uses inside a
            trial (:func:`~checkpoint_store._format.layout.is_reserved_name`:
            ``checkpoint_NNNNNN``, ``result.json``, ``.cs_*`` ...), and with
            no character the backend cannot store
            (:attr:`~checkpoint_store.backends.Capabilities.unsupported_name_characters`).
        storage_filesystem: a ``pyarrow.fs.FileSystem`` or fsspec filesystem
            used for every I/O instead of resolving the URI.
        storage_options: options for the backend factory (credentials ...).
        fsync: on local disks, fsync file data and directory entries before
            each commit (default True). False trades durability against
            machine crashes (not process crashes) for speed: about 1 GiB/s
            write+fsync against several GiB/s into the page cache.
        run_id: identifies this run for cleanup: uncommitted directories of
            the same run id are never removed (another rank may be writing).
            Default: ``CHECKPOINT_STORE_RUN_ID``, else torchrun's
            ``TORCHELASTIC_RUN_ID`` plus ``TORCHELASTIC_RESTART_COUNT``, else
            an id unique to this process.
        retry: retry policy for storage calls (default
            :meth:`RetryPolicy.from_env`: 3 attempts, 5 s max delay).
        max_concurrency: requests one transfer keeps in flight (files, parts
            of large files, batches of small files); default the backend's
            ``Capabilities.concurrency`` (local 4, S3 8, Azure 8, GCS 8).
        memory_budget: bytes of file data one transfer holds in memory at
            once, all its requests together (peak RSS grows by about this
            much); default 256 MiB, at most 1/16 of RAM. Larger parts and more
            of them in flight speed up object stores on slow links.
        incremental: on stores that copy objects server-side (S3, Azure,
            GCS, memory), a file whose size and CRC32C equal those of the
            same file in the trial's latest committed checkpoint is copied
            from it inside the store instead of uploaded (every checkpoint
            still holds all its files). Default True.
        dedup: store each large file of a checkpoint committed from a local
            directory (every safetensors shard of ``report(state=...)``) as
            content-addressed chunks in the experiment's chunk store
            (``<experiment>/.cs_chunks/``), each chunk stored once however
            many checkpoints, trials and forks of the experiment hold it;
            retention frees the chunks no checkpoint uses any more
            (docs/dedup.md). Default False. The local tier never uses chunks.
        compression: the codec of new chunks: ``"auto"`` (default: the
            byte-plane codec on object stores and remote filesystems, none
            on local disks and memory, where the store is faster than the
            codec), ``"on"`` or ``"off"``. Used with ``dedup`` only.

    Raises:
        InvalidConfigError: bad names or location, a ``storage_filesystem``
            that is no filesystem instance, or an option of the wrong type
            (``fsync="no"``). Nothing is written at construction.
    """

    def __init__(
        self,
        storage_path: str | os.PathLike[str],
        experiment_name: str,
        trial_name: str,
        *,
        storage_filesystem: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        fsync: bool = True,
        run_id: str | None = None,
        retry: RetryPolicy | None = None,
        max_concurrency: int | None = None,
        memory_budget: int | None = None,
        incremental: bool = True,
        dedup: bool = False,
        compression: str = "auto",
    ):
        self.experiment_name = check_run_name(experiment_name, "experiment_name")
        self.trial_name = check_run_name(trial_name, "trial_name")
        self.backend, self.storage_path = resolve(
            storage_path, filesystem=storage_filesystem, storage_options=storage_options
        )
        for part in self.storage_path.split("/"):
            self.backend.check_name(part, "storage_path component")
        self.backend.check_name(self.experiment_name, "experiment_name")
        self.backend.check_name(self.trial_name, "trial_name")
        self.fsync = fsync
        self._init_run(run_id, retry)
        self._init_transfer(max_concurrency, memory_budget, incremental)
        self.set_chunking(dedup, compression)

    def _init_transfer(self, max_concurrency: int | None, memory_budget: int | None,
                       incremental: bool) -> None:
        self.backend = _trialdir.transfer_backend(self.backend, max_concurrency, memory_budget,
                                                  incremental)
        self.incremental = incremental
        self.dedup, self.compression = False, "auto"

    def set_chunking(self, dedup: bool, compression: str = "auto") -> None:
        """Store the large files of later checkpoints as chunks (``dedup``)
        encoded with ``compression`` (see the class's arguments).

        Raises:
            InvalidConfigError: ``dedup`` is not a bool, or an unknown ``compression``.
        """
        self.dedup, self.compression = check_chunking(dedup, compression)

    def _init_run(self, run_id: str | None, retry: RetryPolicy | None) -> None:
        if not isinstance(self.fsync, bool):  # "no" would read as True
            raise InvalidConfigError(f"fsync must be True or False, got {self.fsync!r}")
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise InvalidConfigError(f"retry must be a RetryPolicy, got {type(retry).__name__}")
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise InvalidConfigError(f"run_id must be a non-empty string, got {run_id!r}")
        self.run_id = sanitize_run_id(run_id) if run_id else default_run_id()[0]
        self.retry = retry

    @classmethod
    def from_backend(
        cls, backend: Backend, storage_path: str, experiment_name: str, trial_name: str,
        *, fsync: bool = True, run_id: str | None = None, retry: RetryPolicy | None = None,
        max_concurrency: int | None = None, memory_budget: int | None = None,
        incremental: bool = True, dedup: bool = False, compression: str = "auto",
    ) -> StorageContext:
        """A StorageContext on a backend already resolved (an integration's or
        the UI's), with ``storage_path`` in the backend's own spelling.

        Names from elsewhere (a Ray trial's) pass the same checks as in the
        constructor: one path component, not reserved, storable by the backend;
        ``storage_path`` loses empty and ``.`` components
        (:func:`~checkpoint_store.backends.base.clean_components`).

        Raises:
            InvalidConfigError: a bad or unstorable name, or a ``..`` component.
        """
        self = cls.__new__(cls)
        self.experiment_name = check_run_name(experiment_name, "experiment_name")
        self.trial_name = check_run_name(trial_name, "trial_name")
        storage_path = clean_components(storage_path)
        for part in storage_path.split("/"):
            backend.check_name(part, "storage_path component")
        backend.check_name(self.experiment_name, "experiment_name")
        backend.check_name(self.trial_name, "trial_name")
        self.backend = backend
        self.storage_path = storage_path
        self.fsync = fsync
        self._init_run(run_id, retry)
        self._init_transfer(max_concurrency, memory_budget, incremental)
        self.set_chunking(dedup, compression)
        return self

    def __repr__(self) -> str:
        return (
            f"StorageContext({self.backend.uri_for(self.trial_path)!r}, "
            f"backend={self.backend.name or self.backend.scheme})"
        )

    @property
    def filesystem(self):  # -> pafs.FileSystem
        return self.backend.filesystem

    @property
    def commit_protocol(self) -> CommitProtocol:
        """The commit protocol of this storage (``_commit.protocols.protocol_for``)."""
        return protocol_for(self.backend, fsync=self.fsync, retry=self.retry)

    @property
    def experiment_path(self) -> str:
        return posixpath.join(self.storage_path, self.experiment_name)

    @property
    def trial_path(self) -> str:
        return posixpath.join(self.experiment_path, self.trial_name)

    def uri(self, path: str) -> str:
        return self.backend.uri_for(path)

    def canonical_uri(self, path: str) -> str:
        """The one URI naming ``path`` however it was spelled: on local disks the
        resolved real path (symlinks and ``..`` followed, as the OS does), else
        :meth:`Backend.canonical_uri` (one scheme per backend, no ``.``, empty
        or trailing components). The lease records it, so two spellings of
        one trial meet as the same trial."""
        osp = _fsutil.local_path(self.filesystem, path)
        if osp is None and self.backend.scheme == "file":
            # An fsspec or other local filesystem handed in by the user, or a
            # SubTreeFileSystem over the local disk (its paths are relative).
            absolute = local_absolute(self.filesystem, path)
            osp = absolute if os.path.isabs(absolute) else None
        if osp is None:
            return self.backend.canonical_uri(path)
        return "file://" + os.path.realpath(osp)

    def checkpoint_path(self, index: int) -> str:
        return posixpath.join(self.trial_path, checkpoint_dir_name(index))

    def checkpoint(self, dir_name: str) -> Checkpoint:
        """A Checkpoint for ``dir_name`` in this trial (not checked on storage)."""
        return Checkpoint._from_backend(self.backend, posixpath.join(self.trial_path, dir_name))

    def ensure_trial_dir(self) -> None:
        """Create the trial directory (and the directories above it).

        Raises:
            NestedCheckpointError: the trial directory would lie inside a committed
                checkpoint (see :meth:`refuse_inside_checkpoint`); nothing written.
        """
        self.refuse_inside_checkpoint()
        self._refuse_missing_bucket()
        _fsutil.ensure_dir(self.filesystem, self.trial_path, self.backend.capabilities,
                           retry=self.retry)

    def _refuse_missing_bucket(self) -> None:
        """Refuse, before the first write, a trial whose bucket or container
        does not exist, naming it (one stat, once per StorageContext); the
        store's own errors on each write would name a key instead."""
        if getattr(self, "_bucket_checked", False):
            return
        bucket = _fsutil.missing_bucket(self.filesystem, self.trial_path, self.backend.scheme)
        if bucket is not None:
            from checkpoint_store.errors import PermanentBackendError

            raise PermanentBackendError(_fsutil.missing_bucket_message(
                self.backend.scheme, bucket, self.uri(self.storage_path)))
        self._bucket_checked = True

    def refuse_inside_checkpoint(self) -> None:
        """Refuse a ``storage_path``/experiment/trial inside a committed
        checkpoint: files written there would corrupt it (its manifest does
        not list them). One stat per directory level, made once per
        StorageContext, before its first write (every write goes through
        :meth:`ensure_trial_dir`).

        Raises:
            NestedCheckpointError: a committed checkpoint holds the trial directory.
        """
        if getattr(self, "_outside_checked", False):
            return
        refuse_inside_checkpoint(self.backend, self.trial_path, "the trial directory",
                                 retry=self.retry)
        self._outside_checked = True

    # -- checkpoints ------------------------------------------------------------

    def checkpoint_dirs(self) -> list[tuple[int, str]]:
        """``(index, dir name)`` of every ``checkpoint_NNNNNN`` directory, committed
        or not, sorted by index."""
        return _trialdir.checkpoint_dirs(self.filesystem, self.trial_path, retry=self.retry)

    def committed_checkpoints(self) -> list[tuple[Checkpoint, dict[str, Any]]]:
        """Every committed checkpoint with its internal metadata, oldest first.

        Order is the index recorded in the internal metadata, never names or
        modification times. Directories without valid internal metadata are
        not checkpoints and are skipped.
        """
        found = _trialdir.committed_paths(self.filesystem, self.trial_path,
                                          self.checkpoint_dirs(), retry=self.retry)
        return [(Checkpoint._from_backend(self.backend, path), meta) for path, meta in found]

    def next_checkpoint_index(self) -> int:
        """One past the highest index of any checkpoint directory present (or
        of a file taking a checkpoint directory's name: nothing can be
        committed there)."""
        taken = _trialdir.checkpoint_dirs(self.filesystem, self.trial_path, retry=self.retry,
                                          files=True)
        return taken[-1][0] + 1 if taken else 0

    def internal_metadata(self, index: int, extra: Mapping[str, Any]) -> dict[str, Any]:
        """The fields of ``.internal_metadata.json`` that this trial fills in
        (index, experiment and trial names, ``created_at`` now), plus ``extra``;
        the commit adds ``format_version`` and ``manifest`` (docs/format.md)."""
        return {
            "index": index,
            "experiment_name": self.experiment_name,
            "trial_name": self.trial_name,
            "created_at": time.time(),
            **extra,
        }

    def persist_checkpoint(
        self, checkpoint: Checkpoint, index: int, internal: Mapping[str, Any], *,
        writer_id: str | None = None,
    ) -> Checkpoint:
        """Upload ``checkpoint`` as ``checkpoint_<index>`` of this trial and commit it.

        Args:
            checkpoint: where the files are (any filesystem, usually local).
            index: the checkpoint index (>= 0).
            internal: extra fields for the internal metadata (metrics ...).
                A source directory holding a state (``Checkpoint.from_state``)
                adds its tensor index as ``"tensors"`` unless given.
            writer_id: who commits (default: a new writer id of this run). One
                writer committing an index again finds its own claims and its
                own marker there as its own: a session passes the same one to
                every report.

        Returns:
            The committed Checkpoint on this storage.

        Raises:
            CheckpointConflictError: that index is already committed.
            CheckpointNotFoundError: the source directory is gone.
            NestedCheckpointError: the trial directory lies inside a committed
                checkpoint; nothing written.
            AmbiguousCommitError: writing the commit marker failed and reading
                it back failed too: it may be committed.
            TransientBackendError, PermanentBackendError: storage failed;
                nothing was committed.
        """
        dest = self.checkpoint_path(index)
        if "tensors" not in internal:  # a state reported as a directory: record its index
            from checkpoint_store.state import local_state_index

            tensors = local_state_index(checkpoint.filesystem, checkpoint.path)
            if tensors is not None:
                internal = {**internal, "tensors": tensors}
        meta = self.internal_metadata(index, internal)
        self.ensure_trial_dir()
        writer = writer_id or new_writer_id(self.run_id)
        chunked = self._chunked_upload(checkpoint, dest, writer)
        if chunked is not None:
            meta = {**meta, "chunk_root": CHUNK_ROOT}
            try:
                written = _retry.with_rebuild(self.backend, lambda: self.commit_protocol.commit(
                    None, None, dest, meta, writer_id=writer, write=chunked.write,
                ), what=f"commit {self.uri(dest)}")
            finally:
                chunked.finish()
            return Checkpoint._from_backend(self.backend, dest, written)
        previous = self._previous_quietly(index) if self._reuses(checkpoint) else None
        written = _retry.with_rebuild(self.backend, lambda: self.commit_protocol.commit(
            checkpoint.filesystem, checkpoint.path, dest, meta, writer_id=writer,
            previous=previous,
        ), what=f"commit {self.uri(dest)}")
        return Checkpoint._from_backend(self.backend, dest, written)

    def _chunked_upload(self, checkpoint: Checkpoint, dest: str,
                        writer: str) -> ChunkedUpload | None:
        """The chunked write of ``checkpoint`` when this storage dedups and the
        source is on the local disk (a state's staging directory, a report's
        directory), else None (copied as files)."""
        if not self.dedup or _fsutil.local_path(checkpoint.filesystem, checkpoint.path) is None:
            return None
        store = ChunkStore.for_checkpoint(self.filesystem, dest, retry=self.retry,
                                          capabilities=self.backend.capabilities)
        return ChunkedUpload(
            checkpoint.filesystem, checkpoint.path, self.backend, store,
            codec=resolve_codec(self.compression, self.backend), writer=writer,
            fsync=self.fsync, retry=self.retry, workers=self.backend.capabilities.concurrency,
            include=is_checkpoint_data,
        )

    def _previous_quietly(self, index: int) -> Previous | None:
        # Reuse saves bytes, it is not needed: a store that cannot be read
        # right now gets every file uploaded.
        try:
            return self.previous_checkpoint(index)
        except (TransientBackendError, PermanentBackendError) as exc:
            logger.warning("not reusing files of the previous checkpoint: %s", exc)
            return None

    def reserve_in_place(self, index: int) -> str:
        """Create ``checkpoint_<index>`` for a writer that fills it in place
        (``dcp.save(..., checkpoint_id=...)``), claimed by this run so cleanup
        of a later run removes it if it is never committed.

        Returns:
            The directory's path inside :attr:`filesystem`.
        """
        dest = self.checkpoint_path(index)
        self.ensure_trial_dir()
        self.commit_protocol.claim_in_place(dest, new_writer_id(self.run_id))
        return dest

    def commit_in_place(self, index: int, internal: Mapping[str, Any]) -> Checkpoint:
        """Commit ``checkpoint_<index>``, already filled in place; no byte is copied.

        See :meth:`checkpoint_store._commit.protocols.CommitProtocol.commit_in_place`
        (manifest built from the files there, marker last).

        Raises:
            CheckpointNotFoundError: the directory is missing or empty.
            CheckpointCorruptError: it holds an unfinished
                torch.distributed.checkpoint save (no ``.metadata``).
            CheckpointConflictError: that index is already committed.
        """
        dest = self.checkpoint_path(index)
        meta = self.internal_metadata(index, internal)
        written = _retry.with_rebuild(self.backend, lambda: self.commit_protocol.commit_in_place(
            dest, meta
        ), what=f"commit {self.uri(dest)} in place")
        return Checkpoint._from_backend(self.backend, dest, written)

    def _reuses(self, checkpoint: Checkpoint) -> bool:
        return _trialdir.reuses_previous(self.backend, self.incremental,
                                         checkpoint.filesystem, checkpoint.path)

    def previous_checkpoint(self, index: int) -> Previous | None:
        """The latest committed checkpoint below ``index`` as a
        :class:`~checkpoint_store._transfer.plan.Previous` (its path and manifest), or
        None. Reads ``checkpoint_<index - 1>`` first (numbering is contiguous
        and the newest is kept, so that is the usual answer, whatever the
        trial's history); else looks at the three highest directories: one
        listing of the trial plus one inspection each."""
        return _trialdir.previous_checkpoint(self.filesystem, self.trial_path, index,
                                             self.checkpoint_dirs, retry=self.retry)

    def delete_checkpoint(self, dir_name: str) -> None:
        """Delete a checkpoint directory of this trial; absent is fine.

        The commit in reverse (docs/format.md): on local disks the directory
        is renamed away first, elsewhere the commit marker goes first, so an
        interrupted delete never leaves a directory that still lists as a
        committed checkpoint, and what it leaves is recognisably ours.
        """
        validate_component(dir_name, "dir_name")
        _retry.with_rebuild(self.backend, lambda: self.commit_protocol.delete(
            posixpath.join(self.trial_path, dir_name), new_writer_id(self.run_id)
        ), what=f"delete {dir_name}")

    def uncommit_checkpoint(self, dir_name: str) -> str | None:
        """Take checkpoint ``dir_name`` of this trial out of every listing now,
        leaving its files for :meth:`remove_leftover` (the first step of
        :meth:`delete_checkpoint`, alone: a rename away on local disks, a
        tombstone and the marker's delete elsewhere). Retention calls it
        before ``report()`` returns and deletes the rest in the background; a
        crash in between leaves a directory :meth:`remove_uncommitted` removes.

        Returns:
            The directory name left to remove (``dir_name`` itself, or its
            ``.cs_deleting-<name>-<writer>``), or None when it was absent.

        Raises:
            CheckpointConflictError: not a directory of this tool; nothing changed.
            TransientBackendError, PermanentBackendError: storage failed.
        """
        validate_component(dir_name, "dir_name")
        left = _retry.with_rebuild(self.backend, lambda: self.commit_protocol.uncommit(
            posixpath.join(self.trial_path, dir_name), new_writer_id(self.run_id)
        ), what=f"uncommit {dir_name}")
        return None if left is None else posixpath.basename(left.rstrip("/"))

    def remove_leftover(self, dir_name: str) -> None:
        """Remove the uncommitted directory ``dir_name`` of this trial (what
        :meth:`uncommit_checkpoint` left), so that a removal cut short stays
        recognisably ours. Absent is fine.

        Raises:
            TransientBackendError, PermanentBackendError: storage failed.
        """
        _retry.with_rebuild(self.backend, lambda: self.commit_protocol.remove_leftover(
            posixpath.join(self.trial_path, dir_name), new_writer_id(self.run_id)
        ), what=f"remove {dir_name}")

    def collect_chunks(self) -> GcReport | None:
        """Delete the chunks of this trial's experiment that no checkpoint of
        any of its trials, committed or being written, references any more
        (:func:`checkpoint_store._chunks.gc.collect`; retention calls it after
        each eviction). None when the experiment has no chunk store.

        Raises:
            TransientBackendError, PermanentBackendError: storage failed; what
                was not deleted is left for the next collection.
        """
        root = posixpath.join(self.experiment_path, CHUNK_DIR)
        if not self.dedup and not _fsutil.is_dir(self.filesystem, root, retry=self.retry):
            return None
        store = ChunkStore(self.filesystem, root, retry=self.retry,
                           capabilities=self.backend.capabilities)
        return collect(store, lambda: experiment_refs(self.filesystem, self.experiment_path,
                                                      retry=self.retry))

    # -- orphans ------------------------------------------------------------------

    def scan(self, run_id: str | None = None, *, known: Mapping[str, int] | None = None,
             listing: list[_fsutil.pafs.FileInfo] | None = None) -> ScanResult:
        """Classify every directory of this trial: committed, uncommitted (ours),
        active (ours, current run) or foreign (``_commit.leftovers.scan_trial``).

        Args:
            run_id: a run id to protect besides this context's ``run_id`` (a
                multi-rank attempt id, say).
            known: committed checkpoints already known (directory name to
                index, from the retention state): not inspected again.
            listing: the trial directory's listing, when the caller just made
                it (the session's start: its manager's restore).

        Costs one listing of the trial directory plus one recursive listing
        (and at most one small read) per directory not in ``known``.
        """
        runs = {self.run_id}
        if run_id:
            runs |= {run_id, sanitize_run_id(run_id)}
        return scan_trial(self.filesystem, self.trial_path, runs, retry=self.retry, known=known,
                          listing=listing)

    def remove_uncommitted(self, run_id: str | None = None, *,
                           known: Mapping[str, int] | None = None,
                           listing: list[_fsutil.pafs.FileInfo] | None = None,
                           sole_owner: bool = False) -> list[str]:
        """Remove what this tool's writers left unfinished in this trial.

        Removes staging and deleting directories and partial uploads of other
        runs. Never removes a committed checkpoint, a foreign directory (see
        :meth:`scan`), or anything of the current run (``self.run_id`` or
        ``run_id``: another rank may still be writing it). Called by
        ``session.start`` on rank 0 after it holds the trial's lease.

        Args:
            sole_owner: the caller holds this trial directory for itself
                (a local tier, locked for its session's life:
                ``tiers/lock.py``; a one-rank session's trial, after its
                lease) and has not written in it yet: every
                writer that left something unfinished there is dead, the
                current run's included (a run id can repeat: a launcher's
                ``CHECKPOINT_STORE_RUN_ID`` kept across restarts), so
                nothing is spared as active.

        Returns:
            The directory names removed, sorted.

        Raises:
            TransientBackendError, PermanentBackendError: storage failed;
                what was removed so far stays removed.
        """
        found = (scan_trial(self.filesystem, self.trial_path, set(), retry=self.retry,
                            known=known, listing=listing) if sole_owner
                 else self.scan(run_id, known=known, listing=listing))
        active = set(found.active)
        removed = []
        for name in found.uncommitted:
            if name in active:
                continue
            # Traces (claims, markers) last: a removal cut short stays ours to clean.
            self.commit_protocol.remove_leftover(posixpath.join(self.trial_path, name))
            removed.append(name)
        if removed:
            logger.info("removed uncommitted directories from %s: %s",
                        self.uri(self.trial_path), ", ".join(removed))
        return removed

    def adopt(self, dir_name: str, *, metrics: Mapping[str, Any] | None = None) -> Checkpoint:
        """Turn a complete foreign directory ``checkpoint_NNNNNN`` into a committed
        checkpoint: checksums every file and writes ``.internal_metadata.json``.

        Args:
            dir_name: a directory of this trial named ``checkpoint_NNNNNN``; its
                index becomes the checkpoint's index.
            metrics: metrics to record with it (default ``{}``).

        Returns:
            The committed Checkpoint.

        Raises:
            InvalidConfigError: ``dir_name`` is not a ``checkpoint_NNNNNN`` name
                (rename the directory first), or ``metrics`` is not a JSON object.
            CheckpointNotFoundError: no such directory, or it holds no files.
            CheckpointConflictError: it is already a committed checkpoint, or
                carries a marker of a newer format.
        """
        path, index, clean_metrics, data = _trialdir.adoptable(
            self.filesystem, self.trial_path, dir_name, metrics, uri=self.uri,
            next_index=self.next_checkpoint_index, retry=self.retry,
        )
        internal = {
            "index": index,
            "experiment_name": self.experiment_name,
            "trial_name": self.trial_name,
            "metrics": clean_metrics,
            "world_size": 1,
            "adopted": True,
        }
        self.commit_protocol.adopt(path, data, internal)
        return Checkpoint._from_backend(self.backend, path)

    def latest_verified_checkpoint(
        self, committed: Sequence[tuple[Checkpoint, dict[str, Any]]] | None = None
    ) -> Checkpoint | None:
        """The newest committed checkpoint whose files all verify, or None.

        Each newer one that fails :meth:`Checkpoint.verify` is skipped with a
        warning naming it and the bad file. Reads every byte of the
        checkpoints it checks.
        """
        if committed is None:
            committed = self.committed_checkpoints()
        for ckpt, _meta in reversed(committed):
            try:
                ckpt.verify()
            except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
                warnings.warn(
                    f"skipping checkpoint {ckpt.uri}: it does not verify ({exc}); falling back "
                    "to the previous committed checkpoint",
                    RuntimeWarning, stacklevel=2,
                )
                continue
            return ckpt
        return None

    # -- trial files --------------------------------------------------------------

    def write_params(self, config: Mapping[str, Any]) -> None:
        _trialfiles.write_params(self.filesystem, self.trial_path, config,
                                 self.backend.capabilities)

    def record_error(self, error: BaseException, *, now: float | None = None) -> None:
        """Add ``error`` to the trial's ``error.txt`` (rank 0, when a session ends
        with an exception).

        The layout is Ray Tune's: each failure is a block ``Failure # N
        (occurred at YYYY-MM-DD_HH-MM-SS)`` (local time) followed by the
        exception's type, message and traceback as Python prints them, chained
        causes included; no frame's local variables. Failures of successive
        runs of the trial accumulate until a run ends cleanly
        (:meth:`clear_error`). One PUT on object stores, an atomic replace on
        local disks.
        """
        _trialfiles.write_error(self.filesystem, self.trial_path, self.read_error() or "",
                                error, now, self.backend.capabilities)

    def clear_error(self) -> None:
        """Remove ``error.txt``: a run of the trial ended cleanly, which supersedes
        the failures of earlier runs (nothing happens if there is none)."""
        _fsutil.delete_file(self.filesystem, posixpath.join(self.trial_path, ERROR_FILE))

    def record_stop(self, status: str, reason: str, *, now: float | None = None) -> None:
        """Write the trial's ``stopped.json``: its last run was ended early by its
        driver (rank 0, when a session ends with a :class:`TrialStopped` that
        carries a reason). One PUT on object stores, an atomic replace on local disks.

        Args:
            status: ``"pruned"`` (a pruner judged the trial hopeless, as Optuna's
                ``TrialPruned``), ``"preempted"`` (a preemption signal ended the
                run after its preemption checkpoint; resumable) or
                ``"stopped"`` (any other early stop).
            reason: one line for people, e.g. ``"pruned at training_iteration 3"``.

        Raises:
            InvalidConfigError: another ``status``.
        """
        _trialfiles.write_stop(self.filesystem, self.trial_path, status, reason, now,
                               self.backend.capabilities)

    def clear_stop(self) -> None:
        """Remove ``stopped.json``: a later run ended otherwise (nothing happens if
        there is none)."""
        _fsutil.delete_file(self.filesystem, posixpath.join(self.trial_path, STOPPED_FILE))

    def read_stop(self) -> dict[str, Any] | None:
        """``stopped.json`` as a dict, or None when the trial has none (or it is
        unreadable)."""
        return _trialfiles.read_stop(self.filesystem, self.trial_path)

    def read_error(self) -> str | None:
        """The text of ``error.txt``, or None when the trial has none."""
        return _trialfiles.read_error(self.filesystem, self.trial_path)

    def read_results(self) -> list[dict[str, Any]]:
        """Every row of the trial, oldest first: ``result.json``'s (one JSON
        object per line; a torn last line, a crash mid-append, is ignored),
        then those a live or killed run left in segments on object stores
        (:func:`checkpoint_store._results.writer.read_results`). ``[]`` if none."""
        return read_results(self.filesystem, self.trial_path, retry=self.retry)
