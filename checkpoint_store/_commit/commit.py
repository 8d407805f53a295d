"""The two calls most callers need: commit a directory, delete a committed one.

:func:`commit_checkpoint` copies a directory's files to a destination and
commits them there by the destination's protocol (chosen from its
capabilities by :func:`~checkpoint_store._commit.protocols.protocol_for`);
:func:`delete_checkpoint_dir` removes a committed checkpoint marker first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._commit.protocols import (
    WriteContents,
    protocol_for,
)
from checkpoint_store._transfer.plan import Previous
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend

__all__ = ["commit_checkpoint", "delete_checkpoint_dir"]

# Logged under the protocols' name, as before these lines moved out of it.
logger = logging.getLogger("checkpoint_store._commit.protocols")


def commit_checkpoint(
    src_fs: pafs.FileSystem | None,
    src_dir: str | None,
    dest: Backend,
    dest_dir: str,
    internal: Mapping[str, Any],
    *,
    fsync: bool = True,
    writer_id: str | None = None,
    retry: RetryPolicy | None = None,
    claim_timeout: float = 120.0,
    confine_links: bool = False,
    write: WriteContents | None = None,
    previous: Previous | None = None,
) -> dict[str, Any]:
    """Upload ``src_dir`` as the committed checkpoint ``dest_dir`` with the
    protocol :func:`protocol_for` picks.

    Args:
        src_fs, src_dir: where the user's files are. Our internal files found
            there (say, from a downloaded checkpoint reported again) are skipped.
            None with ``write``.
        dest, dest_dir: the destination backend and the final directory path.
        internal: fields of ``.internal_metadata.json`` (index, metrics, ...);
            ``format_version``, ``created_at`` and ``manifest`` are filled in.
        fsync: on local disks, fsync data and directories before the commit.
        writer_id: this writer's id (default :func:`~checkpoint_store._util.ids.new_writer_id`).
        retry: retry policy for every storage call (default from environment).
        claim_timeout: seconds to wait for another writer of the same
            directory (marker-last stores) before giving up.
        confine_links: refuse a symlink in a local ``src_dir`` that leads out
            of it (set when the source is itself a checkpoint); by default
            a linked file's bytes are uploaded.
        write: instead of copying ``src_dir`` (then None), a function
            ``write(filesystem, directory)`` that writes the data files into
            ``directory`` and returns their :class:`ManifestEntry` list; the
            protocol around it is the same. It may be called again when a
            retry rebuilds the filesystem. Used to stream a state straight to
            storage without a local copy.
        previous: a :class:`checkpoint_store._transfer.plan.Previous` (the last
            committed checkpoint of the trial): files equal to its files are
            copied inside the store (marker-last stores, local source only).

    Returns:
        The internal metadata as written.

    Raises:
        CheckpointConflictError: ``dest_dir`` is already committed (by an
            earlier or a concurrent writer), holds a commit marker this
            version cannot use, or another writer's live claim outlasted
            ``claim_timeout``; nothing of it was changed. Files there without
            a marker (a writer killed before its commit, with or without its
            claim) are replaced, with a warning naming them.
        CheckpointNotFoundError: ``src_dir`` does not exist.
        UnsafePathError: a source file's name or link cannot be committed as
            it is (see :func:`~checkpoint_store._transfer.trees.source_files`); checked
            before the first write, so nothing was written.
        TransientBackendError, PermanentBackendError: storage failed; nothing
            was committed and earlier checkpoints are untouched.
    """
    return protocol_for(dest, fsync=fsync, retry=retry).commit(
        src_fs, src_dir, dest_dir, internal, writer_id=writer_id,
        claim_timeout=claim_timeout, confine_links=confine_links, write=write,
        previous=previous,
    )


def delete_checkpoint_dir(
    dest: Backend, path: str, *, writer_id: str | None = None, retry: RetryPolicy | None = None
) -> None:
    """Delete a checkpoint directory with the protocol :func:`protocol_for`
    picks (:meth:`CommitProtocol.delete`). Absent is fine.

    Where directories rename atomically, the directory is first renamed to
    ``.cs_deleting-<name>-<writer>`` (it stops being listed in one step),
    then removed. Elsewhere see :meth:`MarkerLastCommit.delete`.
    """
    protocol_for(dest, retry=retry).delete(path, writer_id)
