"""Level 2 of :mod:`checkpoint_store.integrations.ray`: committed checkpoints from Ray Train.

Owns the worker side, :func:`upload_fn` (each rank uploads its files with our
transfer and writes its rank marker), and the controller side,
``CommitCallback`` (built on first use by :func:`_commit_callback_class`, as
it subclasses ``ray.train.UserCallback``), which commits a directory from
its rank markers. The rank part (include rule, marker, merge, commit from
markers) is :mod:`checkpoint_store._commit.rankparts`, the same code a
multi-rank session runs. Ray is imported only inside those calls. Import the
public names from :mod:`checkpoint_store.integrations.ray`.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._commit.commit import delete_checkpoint_dir
from checkpoint_store._commit.protocols import protocol_for
from checkpoint_store._commit.rankparts import (
    RankDir,
    RankSource,
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
    parse_checkpoint_dir_name,
    parse_rank_marker_name,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.inspect import read_internal_metadata
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend
from checkpoint_store.errors import CheckpointStoreError
from checkpoint_store.integrations.ray._filesystem import backend_of

__all__ = ["upload_fn"]

# Named for the public module, as before the split: logging configuration and
# filters that select "checkpoint_store.integrations.ray" keep working.
logger = logging.getLogger("checkpoint_store.integrations.ray")


def upload_fn() -> Callable[[Any, str], Any]:
    """The ``checkpoint_upload_fn`` for ``ray.train.report`` (Ray Train workers).

    Each worker copies its checkpoint's files with our transfer (parallel,
    CRC32C computed on the bytes in flight, retried per file) into the
    directory Ray names, on Ray's storage filesystem, then writes its rank
    marker ``.cs_rank-<rank>.json`` listing them. Rank 0 alone contributes
    ``.user_metadata.json``. :class:`CommitCallback` commits the directory
    once Ray has every rank's report; without it nothing is committed.

    Returns:
        ``fn(checkpoint, checkpoint_dir_name) -> ray.train.Checkpoint`` on
        Ray's filesystem object (Ray compares it with its own).

    Raises (from the returned function):
        CheckpointNotFoundError: the local checkpoint directory is gone.
        TransientBackendError, PermanentBackendError: storage failed; the
            rank's marker then records the failure, and the checkpoint is
            never committed (Ray fails the worker and, with
            ``FailureConfig(max_failures=...)``, resumes from the previous one).
    """

    def _upload(checkpoint: Any, checkpoint_dir_name: str) -> Any:
        import ray.train

        ctx = ray.train.get_context()
        storage = ctx.get_storage()
        fs = storage.storage_filesystem
        dest = storage.build_checkpoint_path_from_name(checkpoint_dir_name)
        _upload_rank(checkpoint.filesystem, checkpoint.path, fs, dest, ctx.get_world_rank())
        return ray.train.Checkpoint(path=dest, filesystem=fs)

    return _upload


def _upload_rank(
    src_fs: pafs.FileSystem, src: str, fs: pafs.FileSystem, dest: str, rank: int
) -> list[dict[str, Any]]:
    """A Ray Train worker's share: its files, then its marker (also when the
    copy failed), stamped with the time Ray's controller compares in
    :func:`_remove_failed`. Returns the files' manifest entries."""
    backend, retry = backend_of(fs)
    part = write_rank_part(
        RankDir(backend, dest, retry=retry), rank, RankSource(src_fs, src),
        fields=lambda: {"time": time.time()},
    )
    if part.marker_error is not None:
        raise part.marker_error
    if part.error is not None:
        raise part.error
    return part.files


def _commit_from_markers(
    backend: Backend,
    path: str,
    internal: dict[str, Any],
    world_size: int,
    retry: RetryPolicy | None,
) -> dict[str, Any] | None:
    """Ray's controller: commit ``path`` from its rank markers; None (and a
    warning) when a rank failed.

    Every marker present must report success and no path may come from two
    ranks. The markers are deleted after the commit marker is written.
    """
    part_dir = RankDir(backend, path, retry=retry)
    markers = {r: _marker_or_failure(read_rank_marker(part_dir, r))
               for r in rank_markers_present(part_dir)}
    where = backend.uri_for(path)
    failed = failed_ranks(markers)
    if not markers or failed:
        logger.warning(
            "%s is not committed: %s",
            where,
            f"ranks failed: {failed}" if failed else "no rank uploaded with upload_fn()",
        )
        return None
    merged = merge_rank_files(markers)
    if merged.clash is not None:
        logger.warning("%s is not committed: ranks %d and %d both wrote %r", where, *merged.clash)
        return None
    meta = dict(internal)
    meta["world_size"] = world_size
    protocol = protocol_for(backend, retry=retry)
    return _retry.with_rebuild(
        backend,
        lambda: finalize_from_markers(protocol, path, path, meta, merged, retry=retry),
        what=f"commit {where}",
    )


def _marker_or_failure(body: Any) -> dict[str, Any]:
    """A marker as read, or a failure when it is not a JSON object."""
    return body if isinstance(body, dict) else {"ok": False}


def _remove_failed(
    backend: Backend, parent: str, before: float, retry: RetryPolicy | None
) -> list[str]:
    """Delete the uncommitted directories under ``parent`` where a rank recorded a
    failed upload before ``before`` (the time Ray saw a worker fail, after which
    it replaced every worker, so nobody writes there any more). Returns their paths."""
    fs = backend.filesystem
    removed = []
    for fi in _fsutil.list_dir(fs, parent, retry=retry):
        if fi.type != pafs.FileType.Directory:
            continue
        names = {
            posixpath.basename(e.path): e.path for e in _fsutil.list_tree(fs, fi.path, retry=retry)
        }
        if INTERNAL_METADATA in names:
            continue
        for name, full in names.items():
            if parse_rank_marker_name(name) is None:
                continue
            body = _json.loads(_fsutil.read_bytes(fs, full, retry=retry))
            if isinstance(body, dict) and not body.get("ok") and body.get("time", 0) < before:
                delete_checkpoint_dir(backend, fi.path, retry=retry)
                removed.append(fi.path)
                break
    return removed


def _next_index(backend: Backend, parent: str, retry: RetryPolicy | None) -> int:
    """One past the highest index committed under ``parent`` (one listing and
    one read per directory, once per run)."""
    best = -1
    for fi in _fsutil.list_dir(backend.filesystem, parent, retry=retry):
        if fi.type != pafs.FileType.Directory:
            continue
        meta = read_internal_metadata(backend.filesystem, fi.path, retry=retry)
        if meta is not None:
            best = max(best, int(meta["index"]))
    return best + 1


def _commit_callback_class() -> type:
    import ray.train

    class CommitCallback(ray.train.UserCallback):
        """Commits each Ray Train checkpoint uploaded with :func:`upload_fn`.

        Runs in Ray Train's controller (``after_report``), which Ray calls
        once every rank's ``ray.train.report`` has returned. Writes
        ``.internal_metadata.json`` last: the manifest is the union of the
        ranks' markers, the metrics are rank 0's, the index counts on past
        the highest committed one in the run directory. A checkpoint with a
        failed or conflicting rank is left uncommitted (a warning names it);
        after Ray has replaced the failed workers, the next commit removes
        the directories where a rank recorded a failed upload.

        Ray's ``CheckpointConfig`` keeps the top K and deletes the rest,
        through the storage filesystem; with :func:`ray_filesystem` those
        deletes remove the marker first. Ray registers a checkpoint (its
        latest, in the run's snapshot, with older ones beyond ``num_to_keep``
        deleted) before this callback commits it; a controller that dies in
        between, or a refused commit, leaves Ray's latest uncommitted. Resume
        with ``checkpoint_store.session.get_checkpoint()`` or
        :func:`~checkpoint_store.integrations.ray.committed_checkpoint`
        (``ray.train.get_checkpoint()``), which never hand out an uncommitted
        checkpoint: they fall back to the newest committed one.
        """

        def __init__(self) -> None:
            self._index: int | None = None
            self._failed_at: float | None = None

        def after_exception(self, run_context: Any, worker_exceptions: dict) -> None:
            # Cleaned at the next commit, when Ray has replaced the failed workers.
            self._failed_at = time.time()

        def after_report(
            self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any
        ) -> None:
            if checkpoint is None:
                return
            backend, retry = backend_of(checkpoint.filesystem)
            path = checkpoint.path.rstrip("/")
            parent = posixpath.dirname(path)
            if self._index is None:
                self._index = _next_index(backend, parent, retry)
            if self._failed_at is not None:
                for gone in _remove_failed(backend, parent, self._failed_at, retry):
                    logger.info("removed %s: a rank failed to upload it", backend.uri_for(gone))
                self._failed_at = None
            name = run_context.run_config.name or posixpath.basename(posixpath.dirname(path))
            row = _json_safe(metrics[0] if metrics else {})
            row["checkpoint_dir_name"] = posixpath.basename(path)
            # A directory named checkpoint_NNNNNN (a report's checkpoint_dir_name)
            # is that index: its name is its identity for every reader.
            named = parse_checkpoint_dir_name(posixpath.basename(path))
            index = self._index if named is None else named
            internal = {
                "index": index,
                "metrics": row,
                "experiment_name": name,
                "trial_name": name,
                "created_at": time.time(),
            }
            if _commit_from_markers(backend, path, internal, len(metrics), retry) is not None:
                self._index = max(self._index, index) + 1

    # Pickled by reference to the public module, whose __getattr__ rebuilds it.
    CommitCallback.__module__ = "checkpoint_store.integrations.ray"
    CommitCallback.__qualname__ = "CommitCallback"
    return CommitCallback


def _json_safe(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Rank 0's metrics as a JSON object; values JSON cannot hold are dropped
    (Ray accepts any picklable metric)."""
    out: dict[str, Any] = {}
    for k, v in dict(metrics).items():
        try:
            out.update(_json.to_json_object({k: v}, "metrics"))
        except CheckpointStoreError:
            logger.debug("metric %r is not JSON; left out of the internal metadata", k)
    return out
