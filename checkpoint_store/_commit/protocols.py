"""The commit protocols: how a directory becomes a committed checkpoint, and stops being one.

One class per protocol (docs/format.md, "Commit protocol"), chosen from the
destination's declared :class:`~checkpoint_store.backends.Capabilities` by
:func:`protocol_for`:

* :class:`RenameCommit` (``atomic_rename``: local disks): everything, the
  marker included, is written into a staging sibling
  ``.cs_staging-<name>-<writer>``, fsynced, then renamed to its final name
  under a lock (threads always, processes by a file lock in the parent).
* :class:`MarkerLastCommit` (object stores, memory): the data files go into
  the final directory, ``.internal_metadata.json`` last, behind a claim that
  makes concurrent writers of one directory take turns.

Each has ``commit`` (copy or stream a tree and commit it), ``finalize``
(commit a tree other writers filled: the multi-rank rank 0, Ray's
``CommitCallback``), ``commit_in_place``/``adopt`` (commit files already at
the final path), ``delete`` (the commit in reverse) and ``inspect``. The
marker itself is built by :func:`~checkpoint_store._util.inspect.internal_metadata`
alone; how marker-last writers take turns is :mod:`checkpoint_store._commit.claims`,
how a directory is removed so that a removal cut short stays ours is
:mod:`checkpoint_store._commit.removal`.

Who calls what: the single-rank session, ``StorageContext.adopt`` and the
Lightning plugin call ``commit``/``adopt`` from the training thread (or the
async uploader's thread); in a multi-rank run every rank writes its files
into :meth:`CommitProtocol.workdir` and rank 0 alone calls ``finalize``;
retention calls ``delete``. A protocol object holds no state beyond its
arguments: any thread may use one, and two writers of one directory are kept
apart by the lock or the claims, not by the object.
"""

from __future__ import annotations

import abc
import logging
import posixpath
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import pyarrow.fs as pafs

from checkpoint_store._commit.claims import (
    CLAIM_STALE_S,
    is_claim,
    own_claims,
    put_claim,
    take_turn,
)
from checkpoint_store._commit.refusals import DCP_METADATA as DCP_METADATA
from checkpoint_store._commit.refusals import (
    _cleanup_quietly,
    _conflict,
    _refuse_changed_sizes,
    _refuse_marked,
    _refuse_unfinished_dcp,
    _warn_replacing,
)
from checkpoint_store._commit.removal import move_away, remove_in_order, rename_away
from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import (
    COMMIT_LOCK,
    DELETE_TOMBSTONE,
    INTERNAL_METADATA,
    is_internal_name,
    is_written_record,
    staging_dir_name,
)
from checkpoint_store._transfer.plan import Previous
from checkpoint_store._transfer.trees import copy_tree, source_files
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util.ids import new_writer_id
from checkpoint_store._util.inspect import (
    Inspection,
    ManifestEntry,
    compute_manifest,
    inspect_checkpoint,
    internal_metadata,
    is_checkpoint_data,
    written_crcs,
)
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend, Capabilities
from checkpoint_store.errors import (
    AmbiguousCommitError,
    CheckpointConflictError,
    CheckpointNotFoundError,
)

__all__ = [
    "CLAIM_STALE_S",
    "DCP_METADATA",
    "CommitKind",
    "CommitProtocol",
    "MarkerLastCommit",
    "RenameCommit",
    "WriteContents",
    "protocol_for",
]

logger = logging.getLogger(__name__)

#: ``write(filesystem, directory) -> entries``: writes a checkpoint's data files
#: into ``directory`` itself (see :meth:`CommitProtocol.commit`).
WriteContents = Callable[[pafs.FileSystem, str], "list[ManifestEntry]"]

CommitKind = Literal["rename", "marker_last"]



@dataclass(frozen=True)
class _Contents:
    """What a commit writes: ``files`` of ``src_dir`` copied, or ``write`` called."""

    src_fs: pafs.FileSystem | None
    src_dir: str | None
    files: list[tuple[str, int]]
    write: WriteContents | None
    previous: Previous | None = None


def protocol_for(
    dest: Backend, *, fsync: bool = True, retry: RetryPolicy | None = None
) -> CommitProtocol:
    """The commit protocol ``dest``'s capabilities call for: :class:`RenameCommit`
    where directories rename atomically, else :class:`MarkerLastCommit`."""
    cls = RenameCommit if dest.capabilities.atomic_rename else MarkerLastCommit
    return cls(dest, fsync=fsync, retry=retry)


class CommitProtocol(abc.ABC):
    """Commit, finalize, delete and inspect checkpoint directories on one backend.

    Args:
        dest: the destination backend.
        fsync: on local disks, fsync data and directories before the commit.
        retry: retry policy for every storage call (default from environment).
    """

    kind: ClassVar[CommitKind]

    def __init__(self, dest: Backend, *, fsync: bool = True, retry: RetryPolicy | None = None):
        self.dest = dest
        self.fsync = fsync
        self.retry = retry

    # Read on each use: a retry may rebuild the backend's filesystem.
    @property
    def fs(self) -> pafs.FileSystem:
        return self.dest.filesystem

    @property
    def caps(self) -> Capabilities:
        return self.dest.capabilities

    def inspect(self, path: str) -> Inspection:
        """What ``path`` is (:func:`~checkpoint_store._util.inspect.inspect_checkpoint`)."""
        return inspect_checkpoint(self.fs, path, retry=self.retry)

    def commit(
        self,
        src_fs: pafs.FileSystem | None,
        src_dir: str | None,
        dest_dir: str,
        internal: Mapping[str, Any],
        *,
        writer_id: str | None = None,
        claim_timeout: float = 120.0,
        confine_links: bool = False,
        write: WriteContents | None = None,
        previous: Previous | None = None,
    ) -> dict[str, Any]:
        """Upload ``src_dir`` (or call ``write``) and commit it as ``dest_dir``.

        See :func:`commit_checkpoint` for the arguments, return value and errors.
        """
        writer_id = writer_id or new_writer_id()
        # Names the writer in the marker, so that a commit whose outcome a
        # failure left unknown is settled by reading it back.
        internal = {**internal, "writer_id": writer_id}
        files: list[tuple[str, int]] = []
        if write is None:
            assert src_fs is not None and src_dir is not None
            files = source_files(src_fs, src_dir, include=is_checkpoint_data,
                                 confine_links=confine_links, retry=self.retry,
                                 dest_caps=self.caps,
                                 dest_name=self.dest.name or self.dest.scheme, committing=True)
        contents = _Contents(src_fs, src_dir, files, write, previous)
        return self._commit(contents, dest_dir, internal, writer_id, claim_timeout)

    @abc.abstractmethod
    def _commit(self, contents: _Contents, dest_dir: str, internal: Mapping[str, Any],
                writer_id: str, claim_timeout: float) -> dict[str, Any]: ...

    @abc.abstractmethod
    def workdir(self, dest_dir: str, writer: str) -> str:
        """Where the writers of ``dest_dir`` (every rank of attempt ``writer``)
        put their files before :meth:`finalize`."""

    @abc.abstractmethod
    def finalize(self, workdir: str, dest_dir: str, internal: Mapping[str, Any],
                 manifest: Sequence[Mapping[str, Any]], writer: str | None = None
                 ) -> dict[str, Any]:
        """Commit the files other writers left in ``workdir`` (their union is
        ``manifest``) as ``dest_dir``. Called by one writer alone (rank 0, or
        Ray's driver); ``writer`` names it in a leftover's tombstone name.

        Returns:
            The internal metadata as written.

        Raises:
            CheckpointConflictError: ``dest_dir`` is already committed, or is
                somebody else's directory.
        """

    @abc.abstractmethod
    def delete(self, path: str, writer_id: str | None = None) -> None:
        """Delete a checkpoint directory: the commit in reverse. Absent is fine.

        Raises:
            CheckpointConflictError: not committed and without any trace of
                our writers (somebody else's files); nothing is deleted.
        """

    @abc.abstractmethod
    def uncommit(self, path: str, writer_id: str | None = None) -> str | None:
        """The first step of :meth:`delete`, alone: after it returns, ``path``
        no longer lists as a committed checkpoint to any reader; the files stay.
        One short step (a rename, or a tombstone and the marker's delete), so
        retention can take an evicted checkpoint out of every listing before
        ``report()`` returns and delete the rest in the background.

        Returns:
            The path of what is left, for :meth:`remove_leftover` (now or
            later; a crash before that leaves a directory that cleanup knows
            is ours and removes), or None when ``path`` was absent.

        Raises:
            CheckpointConflictError: as :meth:`delete`; nothing is changed.
        """

    def remove_leftover(self, path: str, writer_id: str | None = None) -> None:
        """Remove the uncommitted directory (or ``.cs_*`` file) ``path`` so that
        a removal cut short leaves what is left recognisably ours: a directory
        is renamed away first where directories rename atomically, else its
        data files go before the claims, rank markers and tombstone that tell
        cleanup whose it is. Absent is fine. Callers checked it is not
        committed (:func:`~checkpoint_store._commit.leftovers.scan_trial`)."""
        if is_internal_name(posixpath.basename(path.rstrip("/"))):
            # A staging or deleting directory, a temporary file: its name is the trace.
            _fsutil.delete_dir(self.fs, path, retry=self.retry)
            return
        self._remove_tree(path, writer_id)

    @abc.abstractmethod
    def _remove_tree(self, path: str, writer_id: str | None) -> None: ...

    def claim_in_place(self, dest_dir: str, writer_id: str) -> None:
        """Create ``dest_dir`` for a writer that fills it in place, with a claim
        ``.cs_claim-<ns>-<writer_id>`` in it.

        The claim tells cleanup the directory is ours and, while its run is
        current, still being written (:meth:`StorageContext.scan`); a crash
        before :meth:`commit_in_place` leaves a directory a later run removes.
        """
        _fsutil.ensure_dir(self.fs, dest_dir, self.caps, retry=self.retry)
        put_claim(self.dest, dest_dir, writer_id, self.retry)

    def commit_in_place(self, dest_dir: str, internal: Mapping[str, Any]) -> dict[str, Any]:
        """Commit the files already written into ``dest_dir``; no byte is copied.

        The manifest lists every user file found there (one recursive
        listing). A file's CRC32C comes from a ``.cs_written-*.json`` record
        when our writer computed it while writing and the listed size
        matches; any other file is read once. On local disks files and
        directories are fsynced, then the marker goes last (also where
        directories rename atomically: the directory already has its final
        name). Claims and written records are removed afterwards.

        A torch.distributed.checkpoint save that did not finish (``*.distcp``
        files without DCP's ``.metadata``) is refused: DCP writes ``.metadata``
        last, so without it the save failed on some rank.

        Raises:
            CheckpointNotFoundError: ``dest_dir`` is missing or holds no user file.
            CheckpointCorruptError: an unfinished DCP save; nothing is written.
            CheckpointConflictError: ``dest_dir`` is already committed, or holds
                a marker this version cannot read; nothing is changed.
        """
        listed, data = self._uncommitted_data(dest_dir)
        _refuse_unfinished_dcp(self.dest, dest_dir, data)
        known = written_crcs(self.fs, dest_dir, listed, self.retry)
        entries = [{"path": rel, "size": size, "crc32c": known[rel][1]}
                   for rel, size in data.items() if rel in known and known[rel][0] == size]
        trusted = {e["path"] for e in entries}
        entries += compute_manifest(self.fs, dest_dir, [r for r in data if r not in trusted],
                                    self.caps, retry=self.retry)
        if self.fsync and self.caps.needs_fsync:
            _fsutil.fsync_tree(self.fs, dest_dir, data)
        meta = self._write_marker(dest_dir, internal_metadata(internal, entries))
        drop = [rel for rel in listed if is_claim(rel.rsplit("/", 1)[-1])
                or is_written_record(rel.rsplit("/", 1)[-1])]
        _cleanup_quietly(lambda: self._delete_files(dest_dir, drop))
        return meta

    def adopt(self, path: str, files: Iterable[str], internal: Mapping[str, Any]
              ) -> dict[str, Any]:
        """Commit a directory copied in by other means (the caller checked it
        holds user ``files`` and no marker): each file is read once for the
        manifest, then the marker is written."""
        manifest = compute_manifest(self.fs, path, files, self.caps, retry=self.retry)
        return self._write_marker(path, internal_metadata(internal, manifest))

    # -- steps shared by the protocols ------------------------------------------

    def _uncommitted_data(self, path: str) -> tuple[dict[str, int], dict[str, int]]:
        """``(every file, the user's files)`` of ``path``, which must hold user
        files and no marker."""
        insp = self.inspect(path)
        _refuse_marked(self.dest, path, insp, by_other=False)
        listed = insp.files or {}
        data = {rel: size for rel, size in listed.items() if is_checkpoint_data(rel)}
        if not data:
            raise CheckpointNotFoundError(
                f"{self.dest.uri_for(path)} holds no files to commit; write the checkpoint "
                "there (e.g. dcp.save(state, checkpoint_id=session.next_checkpoint_dir())) first"
            )
        return listed, data

    def _write_contents(self, contents: _Contents, target: str,
                        internal: Mapping[str, Any]) -> dict[str, Any]:
        """Copy (or ``write``) the data files into ``target``, then the marker last."""
        if contents.write is not None:
            _fsutil.ensure_dir(self.fs, target, self.caps, retry=self.retry)
            entries = contents.write(self.fs, target)
        else:
            assert contents.src_fs is not None and contents.src_dir is not None
            entries = copy_tree(contents.src_fs, contents.src_dir, self.fs, target, self.caps,
                                files=contents.files, fsync=self.fsync, retry=self.retry,
                                previous=contents.previous)
        manifest = [e.to_json() for e in entries]
        self._check_written(target, manifest)
        return self._write_marker(target, internal_metadata(internal, manifest))

    def _check_written(self, target: str, manifest: Sequence[Mapping[str, Any]]) -> None:
        """Before the marker: raise if ``target`` does not hold what ``manifest``
        says was written. The rename protocol (``atomic_rename``: local disks)
        checks nothing here; see :meth:`MarkerLastCommit._check_written`."""
        return None

    def _write_marker(self, target: str, meta: dict[str, Any]) -> dict[str, Any]:
        """Write the commit marker ``meta`` into ``target``.

        A write that failed may still have landed (the store took the PUT,
        its answer was lost): the marker is read back, and the commit stands
        when it holds our bytes.

        Raises:
            AmbiguousCommitError: the write failed and reading it back failed too.
            The write's own error: the marker is not ours (nothing committed).
        """
        data = _json.dumps(meta)
        try:
            _fsutil.write_bytes(self.fs, posixpath.join(target, INTERNAL_METADATA), data,
                                self.caps, fsync=self.fsync, retry=self.retry)
        except Exception as exc:
            if not self._landed(target, data, exc):
                raise
        return meta

    def _landed(self, target: str, data: bytes, exc: BaseException) -> bool:
        """Whether ``target``'s marker is ``data`` after a commit step failed with ``exc``.

        Raises:
            AmbiguousCommitError: the marker cannot be read either.
        """
        try:
            found = _fsutil.read_bytes(self.fs, posixpath.join(target, INTERNAL_METADATA),
                                       retry=self.retry)
        except FileNotFoundError:
            return False
        except Exception as read_exc:
            uri = self.dest.uri_for(target)
            raise AmbiguousCommitError(
                f"committing {uri} failed ({exc}) and reading its commit marker back failed "
                f"too ({read_exc}): it may have been committed. A session's next report "
                "uses the next index and settles this one; elsewhere, inspect it "
                "(checkpoint-store ls) before committing that index again.",
                path=uri,
            ) from exc
        if found == data:
            logger.warning("committing %s reported an error (%s), but its commit marker is "
                           "ours: committed", self.dest.uri_for(target), exc)
            return True
        return False

    def _ours(self, insp: Inspection, internal: Mapping[str, Any]) -> dict[str, Any] | None:
        """The marker ``insp`` found when an earlier try of this same writer
        wrote it (a commit run again after a failure whose outcome was unknown)."""
        meta = insp.meta
        if insp.state != "committed" or meta is None or "writer_id" not in internal:
            return None
        same = (meta.get("writer_id"), meta.get("index")) == (internal["writer_id"],
                                                               internal.get("index"))
        return meta if same else None

    def _put(self, path: str, data: bytes) -> None:
        _fsutil.write_bytes(self.fs, path, data, self.caps, fsync=False, retry=self.retry)

    def _delete_files(self, root: str, rels: Sequence[str]) -> None:
        for rel in rels:
            _fsutil.delete_file(self.fs, posixpath.join(root, rel), retry=self.retry)


class RenameCommit(CommitProtocol):
    """Stage, then rename into place (stores with atomic directory rename)."""

    kind: ClassVar[CommitKind] = "rename"

    def _commit(self, contents: _Contents, dest_dir: str, internal: Mapping[str, Any],
                writer_id: str, claim_timeout: float) -> dict[str, Any]:
        insp = self.inspect(dest_dir)
        earlier = self._ours(insp, internal)
        if earlier is not None:
            return earlier
        if insp.state == "committed":
            raise _conflict(self.dest, dest_dir, by_other=False)
        staging = self.workdir(dest_dir, writer_id)
        try:
            meta = self._write_contents(contents, staging, internal)
            self._settled_move(staging, dest_dir, writer_id, meta)
            return meta
        except AmbiguousCommitError:
            raise  # perhaps committed: nothing of it may go
        except BaseException:
            # A signal's exception too: once the rename landed, the staging
            # directory is gone and this removes nothing.
            _cleanup_quietly(lambda: _fsutil.delete_dir(self.fs, staging, retry=self.retry))
            raise

    def _settled_move(self, staging: str, dest_dir: str, writer: str | None,
                      meta: dict[str, Any]) -> None:
        """:meth:`_move_in`; a rename that failed but landed (our marker at
        ``dest_dir``: a network filesystem lost its answer) stands."""
        try:
            self._move_in(staging, dest_dir, writer)
        except CheckpointConflictError:
            raise
        except Exception as exc:
            if not self._landed(dest_dir, _json.dumps(meta), exc):
                raise

    def workdir(self, dest_dir: str, writer: str) -> str:
        parent, name = posixpath.split(dest_dir)
        return posixpath.join(parent, staging_dir_name(name, writer))

    def finalize(self, workdir: str, dest_dir: str, internal: Mapping[str, Any],
                 manifest: Sequence[Mapping[str, Any]], writer: str | None = None
                 ) -> dict[str, Any]:
        if self.inspect(dest_dir).state == "committed":
            raise _conflict(self.dest, dest_dir, by_other=False)
        meta = self._write_marker(workdir, internal_metadata(internal, manifest))
        if workdir != dest_dir:
            self._settled_move(workdir, dest_dir, writer, meta)
        return meta

    def delete(self, path: str, writer_id: str | None = None) -> None:
        self._remove_tree(path, writer_id)

    def uncommit(self, path: str, writer_id: str | None = None) -> str | None:
        """Renames ``path`` away to ``.cs_deleting-<name>-<writer>``, the path returned."""
        return move_away(self.dest, path, writer_id, self.retry)

    def _remove_tree(self, path: str, writer_id: str | None) -> None:
        rename_away(self.dest, path, writer_id, self.retry)

    def _move_in(self, staging: str, dest_dir: str, writer: str | None) -> None:
        """Rename the complete ``staging`` to ``dest_dir`` under the commit lock,
        first moving away an uncommitted leftover of ours found there."""
        parent = posixpath.dirname(dest_dir)
        # Serialises the check-then-rename of commits into ``parent``.
        with _fsutil.dir_lock(self.fs, parent, COMMIT_LOCK):
            now = self.inspect(dest_dir)
            _refuse_marked(self.dest, dest_dir, now, by_other=True)
            if now.state != "missing":
                # No marker: a writer that died before its commit (with or
                # without a claim yet), or a removal cut short. A live writer
                # of this trial writes into its own staging directory (or, in
                # place, under this run's lease), never here: rename the
                # leftover away (atomic), then drop it.
                _warn_replacing(self.dest, dest_dir, now.files or {})
                rename_away(self.dest, dest_dir, writer, self.retry)
            _fsutil.move(self.fs, staging, dest_dir, retry=self.retry)
            if self.fsync and self.caps.needs_fsync:
                parent_os = _fsutil.local_path(self.fs, parent)
                if parent_os is not None:
                    _fsutil.fsync_dir(parent_os)


class MarkerLastCommit(CommitProtocol):
    """Data first, marker last, behind a claim (stores without atomic rename).

    Each writer PUTs its own claim object, then lists the directory, and
    writes only if its claim is the only live one
    (:func:`~checkpoint_store._commit.claims.take_turn`); one that is not alone
    tries again until the marker appears (conflict) or ``claim_timeout``.
    Claims older than :data:`CLAIM_STALE_S` belong to dead writers and are
    ignored. Before the marker, a second listing checks that the store holds
    each file at the size written (a client or proxy that changed a file's
    bytes on the way fails the commit, not the restore). A commit costs: one
    PUT and one listing for the claim, one PUT per file, one listing, one PUT
    for the marker, one DELETE for the claim.
    """

    kind: ClassVar[CommitKind] = "marker_last"

    def _commit(self, contents: _Contents, dest_dir: str, internal: Mapping[str, Any],
                writer_id: str, claim_timeout: float) -> dict[str, Any]:
        mine, listed = take_turn(self.dest, dest_dir, writer_id, timeout=claim_timeout,
                                 retry=self.retry)
        claim_path = posixpath.join(dest_dir, mine)
        if INTERNAL_METADATA in listed:
            earlier = self._ours(self.inspect(dest_dir), internal)
            if earlier is not None:  # an earlier try of ours landed: done
                ours = own_claims(listed, mine, writer_id)
                _cleanup_quietly(lambda: self._delete_files(dest_dir, ours))
                return earlier
            # Data files without a marker are no reason to refuse (a writer
            # died before its commit, or a removal was cut short): once we are
            # alone they are replaced, below.
            _cleanup_quietly(lambda: _fsutil.delete_file(self.fs, claim_path, retry=self.retry))
            raise _conflict(self.dest, dest_dir, by_other=False)
        try:
            # Alone, and the listing after our claim showed no marker: nobody can
            # commit this directory before we do. Data a dead writer (or an
            # earlier attempt of ours) left would not match our manifest.
            stale = [rel for rel in sorted(listed)
                     if rel != mine and not is_claim(rel.split("/")[-1])]
            if stale:
                _warn_replacing(self.dest, dest_dir, stale)
            self._delete_files(dest_dir, stale)
            meta = self._write_contents(contents, dest_dir, internal)
        except AmbiguousCommitError:
            raise  # perhaps committed: nothing of it may go
        except Exception:
            _cleanup_quietly(lambda: self._undo(dest_dir, claim_path))
            raise
        ours = own_claims(listed, mine, writer_id)
        _cleanup_quietly(lambda: self._delete_files(dest_dir, ours))
        return meta

    def _check_written(self, target: str, manifest: Sequence[Mapping[str, Any]]) -> None:
        # A second listing: a client or proxy may have changed the bytes on the way.
        _refuse_changed_sizes(self.dest, target, self.inspect(target).files or {}, manifest)

    def _undo(self, dest_dir: str, claim_path: str) -> None:
        # Data first, claim last: until the claim goes, the leftovers stay
        # recognisable as ours.
        self._delete_files(dest_dir, [rel for rel in sorted(self.inspect(dest_dir).files or {})
                                      if not is_claim(rel.split("/")[-1])])
        _fsutil.delete_file(self.fs, claim_path, retry=self.retry)

    def workdir(self, dest_dir: str, writer: str) -> str:
        return dest_dir

    def finalize(self, workdir: str, dest_dir: str, internal: Mapping[str, Any],
                 manifest: Sequence[Mapping[str, Any]], writer: str | None = None
                 ) -> dict[str, Any]:
        insp = self.inspect(dest_dir)
        if insp.state == "committed":
            raise _conflict(self.dest, dest_dir, by_other=False)
        _refuse_changed_sizes(self.dest, dest_dir, insp.files or {}, manifest)
        return self._write_marker(dest_dir, internal_metadata(internal, manifest))

    def delete(self, path: str, writer_id: str | None = None) -> None:
        """A ``.cs_deleting`` tombstone is written, the marker removed, then the
        rest (one batched delete on object stores): a delete cut short leaves a
        directory that is not a checkpoint and that cleanup knows is ours."""
        files = self._uncommit_listed(path)
        self._remove_tree(path, writer_id, files - {INTERNAL_METADATA})

    def uncommit(self, path: str, writer_id: str | None = None) -> str | None:
        """Writes the tombstone and removes the marker (one HEAD, one PUT, one
        DELETE: no listing, whatever the number of files); ``path`` itself,
        tombstoned, is what is left."""
        marker = posixpath.join(path, INTERNAL_METADATA)
        if _fsutil.exists(self.fs, marker, retry=self.retry):
            self._put(posixpath.join(path, DELETE_TOMBSTONE), b"deleting\n")
            _fsutil.delete_file(self.fs, marker, retry=self.retry)
            return path
        return path if self._uncommit_listed(path) else None

    def _uncommit_listed(self, path: str) -> set[str]:
        """Tombstone ``path`` and remove its marker; returns its files as listed
        before (relative). Raises CheckpointConflictError for a directory with
        neither a marker nor any trace of ours."""
        files = {_fsutil.relative(path, fi.path)
                 for fi in _fsutil.list_tree(self.fs, path, retry=self.retry)
                 if fi.type == pafs.FileType.File}
        if INTERNAL_METADATA in files:
            self._put(posixpath.join(path, DELETE_TOMBSTONE), b"deleting\n")
            _fsutil.delete_file(self.fs, posixpath.join(path, INTERNAL_METADATA),
                                retry=self.retry)
        elif files and not any(is_internal_name(rel.split("/")[-1]) for rel in files):
            # Not committed and no trace of ours: somebody else's files. Callers
            # only delete checkpoints; refuse rather than guess.
            raise CheckpointConflictError(
                f"{self.dest.uri_for(path)} is not a checkpoint of this tool; not deleting it"
            )
        return files

    def _remove_tree(self, path: str, writer_id: str | None,
                     files: Iterable[str] | None = None) -> None:
        remove_in_order(self.dest, path, files, self.retry)







# -- helpers -------------------------------------------------------------------------









