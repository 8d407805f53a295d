"""The body of the ``CheckpointStoreIO`` plugin: Lightning's save, load and remove.

Each Lightning path names a checkpoint directory committed by our protocol
(see :mod:`checkpoint_store.integrations._lightning`); with ``async_save``
saves and removes run in order on :class:`._lightning_async._OrderedQueue`.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import posixpath
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store._commit.commit import delete_checkpoint_dir
from checkpoint_store._commit.nesting import refuse_inside_checkpoint
from checkpoint_store._commit.protocols import protocol_for
from checkpoint_store._format.layout import is_internal_name
from checkpoint_store._util import fs as _fsutil
from checkpoint_store._util import retry as _retry
from checkpoint_store._util.ids import new_writer_id
from checkpoint_store._util.inspect import inspect_checkpoint
from checkpoint_store._util.locks import TakeBack
from checkpoint_store._util.retry import RetryPolicy
from checkpoint_store.backends.base import Backend
from checkpoint_store.backends.clients import _client_of
from checkpoint_store.backends.handlers import check_filesystem
from checkpoint_store.errors import InvalidConfigError
from checkpoint_store.integrations._lightning.queue import _OrderedQueue
from checkpoint_store.integrations._lightning.replace import (
    POINTER_FILE,
    current_dir,
    has_pointer,
    replacement_dir,
    replacements,
    traces,
)
from checkpoint_store.integrations._lightning.staged import StagedSnapshot
from checkpoint_store.integrations._lightning.staged import snapshot as staged_snapshot
from checkpoint_store.integrations._lightning.state import (
    STATE_FILE,
    _checkpoint_metrics,
    _checkpoint_monitor,
    _stream_state,
    state_file,
    verified,
)
from checkpoint_store.registry import resolve
from checkpoint_store.state import sweep_staging_root
from checkpoint_store.state._staging import Stager, check_staging_budget

__all__ = ["_StoreIO"]

# The name the integration has always logged under, so filters set on it
# keep working now that it spans several modules.
logger = logging.getLogger("checkpoint_store.integrations._lightning")


def _split(path: Any) -> tuple[str, str]:
    """``(parent, name)`` of a Lightning path (local path or URI)."""
    text = os.fspath(path)
    if not isinstance(text, str) or not text.strip("/"):
        raise InvalidConfigError(f"checkpoint path must be a non-empty path or URI, got {path!r}")
    parent, _, name = text.rstrip("/").rpartition("/")
    if not name or name in (".", ".."):
        raise InvalidConfigError(f"checkpoint path {text!r} has no file name")
    return parent or ("/" if text.startswith("/") else "."), name


class _Locator:
    """Resolves Lightning's paths to ``(backend, path)``, one backend per
    parent directory (building an S3 client per save would be slow)."""

    def __init__(self, storage_options: Mapping[str, Any] | None, storage_filesystem: Any):
        if storage_filesystem is not None:  # refused when built, not at the first save
            check_filesystem(storage_filesystem, "storage_filesystem")
        self.storage_options = dict(storage_options) if storage_options else None
        self.storage_filesystem = storage_filesystem
        self._cache: dict[str, tuple[Backend, str]] = {}
        self._lock = threading.Lock()

    def __call__(self, path: Any) -> tuple[Backend, str]:
        parent, name = _split(path)
        with self._lock:
            hit = self._cache.get(parent)
            if hit is None:
                hit = resolve(parent, filesystem=self.storage_filesystem,
                              storage_options=self.storage_options)
                self._cache[parent] = hit
        backend, parent_path = hit
        return backend, posixpath.join(parent_path, name)



class _StoreIO:
    """The body of ``CheckpointStoreIO`` (see its docstring in lightning.py)."""

    def __init__(
        self,
        *,
        async_save: bool = False,
        max_pending_saves: int = 2,
        root: str | os.PathLike[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        storage_filesystem: Any = None,
        fsync: bool = True,
        retry: RetryPolicy | None = None,
        staging_budget: int | None = None,
    ):
        if not isinstance(async_save, bool):
            raise InvalidConfigError(f"async_save must be True or False, got {async_save!r}")
        if isinstance(max_pending_saves, bool) or not isinstance(max_pending_saves, int) \
                or max_pending_saves < 1:
            raise InvalidConfigError(
                f"max_pending_saves must be an int >= 1, got {max_pending_saves!r}")
        super().__init__()
        self.async_save = async_save
        self.max_pending_saves = max_pending_saves
        self.fsync = fsync
        self.retry = retry
        # async_save's snapshots: bounded shared-memory staging (made on first save).
        self.staging_budget = check_staging_budget(staging_budget)
        self._stager: Any = None
        #: Written into each checkpoint's internal metadata; removes refuse any
        #: checkpoint of another run. A load of a checkpoint this plugin class
        #: wrote (a resume) continues that checkpoint's run (:meth:`_continue`).
        self.run_id = uuid.uuid4().hex[:16]
        # Every run id this run answers to: its own, and those it continued.
        self._runs = {self.run_id}
        self._saved = False
        # URIs of the checkpoints loaded (the one fit() resumed from): kept, as
        # Lightning keeps the resumed-from checkpoint on local disks.
        self._resumed_from: set[str] = set()
        self._locate = _Locator(storage_options, storage_filesystem)
        self._root: str | None = None
        if root is not None:
            backend, path = self._locate(posixpath.join(os.fspath(root), "_"))
            self._root = backend.uri_for(posixpath.dirname(path))
        self._queue: _OrderedQueue | None = None
        # Parent directories already found outside every committed checkpoint.
        self._outside: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        # Sent to spawned ranks (ddp_spawn): without threads, locks or clients.
        state = dict(self.__dict__)
        state["_queue"] = None
        state["_stager"] = None
        state["_locate"] = (self._locate.storage_options, self._locate.storage_filesystem)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        options, filesystem = state.pop("_locate")
        self.__dict__.update(state)
        self._locate = _Locator(options, filesystem)

    @property
    def root(self) -> str | None:
        """URI of the directory this plugin may delete in (default: the
        directory of the first checkpoint it saved), or None before that."""
        return self._root

    def _queue_or_none(self) -> _OrderedQueue | None:
        if not self.async_save:
            return None
        if self._queue is None:
            self._queue = _OrderedQueue(self.max_pending_saves)
        return self._queue

    def _raise_pending_error(self) -> None:
        error = self._queue.take_error() if self._queue is not None else None
        if error is not None:
            raise error

    # -- save -------------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise InvalidConfigError(
                "CheckpointStoreIO takes its storage options when it is built "
                "(CheckpointStoreIO(storage_options=...)), not per save_checkpoint() call"
            )
        if not isinstance(checkpoint, Mapping):
            raise InvalidConfigError(
                "save_checkpoint takes the checkpoint dict Lightning builds (state_dict, "
                f"optimizer states, ...), got {type(checkpoint).__name__}; nothing was written"
            )
        backend, fs_path = self._locate(path)
        self._refuse_inside_checkpoint(backend, fs_path)
        uri = backend.uri_for(fs_path)
        if self._root is None:
            self._root = backend.uri_for(posixpath.dirname(fs_path))
        self._saved = True
        monitor = _checkpoint_monitor(checkpoint, _split(path)[0])
        queue = self._queue_or_none()
        if queue is None:
            self._save(checkpoint, backend, fs_path, monitor)
            return
        self._raise_pending_error()
        # The training thread goes on changing parameters and optimizer state
        # in place: the background save works on a copy taken now, staged in
        # bounded shared memory (see _lightning/staged.py).
        if self._stager is None:
            # A killed run's staged snapshots (partial state files) go first.
            sweep_staging_root()
            self._stager = Stager(self.staging_budget)
        snap: StagedSnapshot | None = None
        job: TakeBack[None] | None = None
        try:
            # From the snapshot on, inside the try: a cut between taking it
            # and queueing its save left it (every tensor, its scratch files)
            # for as long as the process lived.
            snap = staged_snapshot(checkpoint, self._stager)
            job = TakeBack(functools.partial(self._save_staged, snap, backend, fs_path,
                                             monitor))
            queue.submit("save", uri, job)
        except BaseException:
            # A signal's exception as the save was queued: nothing was
            # acknowledged. Unless the worker took the save (it then runs as
            # any other), it never runs and its snapshot (every tensor) goes
            # now rather than when the process ends.
            if snap is not None and (job is None or job.take_back()):
                snap.discard()
            raise

    def _save_staged(self, snap: StagedSnapshot, backend: Backend, fs_path: str,
                     monitor: Mapping[str, str]) -> None:
        """The background save of ``snap`` (on the queue's worker), which
        frees it whatever happens."""
        try:
            self._save(snap.materialize(), backend, fs_path, monitor)
        finally:
            snap.release()

    def _refuse_inside_checkpoint(self, backend: Backend, fs_path: str) -> None:
        """A ``.ckpt`` inside a committed checkpoint (``a.ckpt/inner.ckpt``)
        would corrupt it: refused before anything is written, once per parent
        directory (Lightning saves many checkpoints into one)."""
        parent = posixpath.dirname(fs_path)
        key = backend.uri_for(parent)
        if key in self._outside:
            return
        refuse_inside_checkpoint(backend, parent, f"the parent of {backend.uri_for(fs_path)}",
                                 retry=self.retry)
        self._outside.add(key)

    def _save(self, checkpoint: Mapping[str, Any], backend: Backend, fs_path: str,
              monitor: Mapping[str, str]) -> None:
        started = time.monotonic()
        replacing = self._clear_for_save(backend, fs_path)
        metrics = _checkpoint_metrics(checkpoint)
        internal = {
            # Lightning's step, so "newest" means what it means to the user.
            "index": int(metrics.get("step", 0)),
            "created_at": time.time(),
            "run_id": self.run_id,
            "world_size": 1,
            "metrics": metrics,
            "lightning": {"state_file": STATE_FILE, **monitor},
        }
        write = _stream_state(checkpoint, self.fsync and backend.capabilities.needs_fsync,
                              self.retry)
        writer = new_writer_id(self.run_id)
        target = replacement_dir(fs_path, writer) if replacing else fs_path
        protocol = protocol_for(backend, fsync=self.fsync, retry=self.retry)
        _retry.with_rebuild(backend, lambda: protocol.commit(
            None, None, target, internal, writer_id=writer, write=write,
        ), what=f"save {backend.uri_for(fs_path)}")
        if replacing:
            self._switch_to(backend, fs_path, target, writer)
        logger.info("committed %s in %.2f s", backend.uri_for(fs_path),
                    time.monotonic() - started)

    def _clear_for_save(self, backend: Backend, fs_path: str) -> bool:
        """Make way for a new save at ``fs_path``; True when a checkpoint there
        is to be replaced once the new one is committed beside it.

        Lightning saves to the same path again (``last.ckpt``): the new
        checkpoint is committed under a replacement sibling, then
        :meth:`_switch_to` makes it current and removes the old one, so a
        crash at any point leaves the old or the new one readable at the path
        (:mod:`._lightning_replace`). A save that died half-way (after a
        resume, training reaches the same ``epoch=..-step=..`` name again)
        left a directory of our traces whose claim would hold off this save
        for ``claim_timeout``: removed. Saves of one plugin run one at a time,
        so no live writer of ours is in there.
        """
        fs = backend.filesystem
        if has_pointer(backend, fs_path, self.retry):
            return True
        insp = None
        kind = _fsutil.info(fs, fs_path, retry=self.retry).type
        if kind == pafs.FileType.File:
            return True  # a legacy plain file
        if kind == pafs.FileType.Directory:
            insp = inspect_checkpoint(fs, fs_path, retry=self.retry)
            if insp.state == "committed":
                return True
            if insp.state != "absent":
                return False  # "invalid": the commit refuses it, saying why
        if current_dir(backend, fs_path, self.retry) != fs_path:
            return True  # only a replacement sibling is left: a switch cut short
        if insp is not None and _left_by_a_writer(insp.files or {}):
            _fsutil.delete_dir(fs, fs_path, retry=self.retry)
        return False

    def _switch_to(self, backend: Backend, fs_path: str, new: str, writer: str) -> None:
        """Make the committed ``new`` the checkpoint at ``fs_path``, then remove
        the old one. Each step leaves a complete checkpoint for readers: the
        old checkpoint at ``fs_path`` goes (uncommitted first) only while
        ``new`` is the newest committed sibling, the pointer is one atomic
        write, and the siblings it no longer names go after it."""
        fs = backend.filesystem
        if not has_pointer(backend, fs_path, self.retry):
            kind = _fsutil.info(fs, fs_path, retry=self.retry).type
            if kind == pafs.FileType.File:
                _fsutil.delete_file(fs, fs_path, retry=self.retry)
            elif kind == pafs.FileType.Directory:
                delete_checkpoint_dir(backend, fs_path, writer_id=writer, retry=self.retry)
        _fsutil.write_bytes(fs, posixpath.join(fs_path, POINTER_FILE),
                            f"{posixpath.basename(new)}\n".encode(), backend.capabilities,
                            fsync=self.fsync, retry=self.retry)
        self._drop_replacements(backend, fs_path, keep=new, writer=writer)

    def _drop_replacements(self, backend: Backend, fs_path: str, keep: str | None,
                           writer: str) -> None:
        """Remove the replacement siblings of ``fs_path`` but ``keep``: committed
        ones uncommitted first, leftovers of saves cut short as they are."""
        for path in traces(backend, fs_path, self.retry):
            _fsutil.delete_dir(backend.filesystem, path, retry=self.retry)
        for path in replacements(backend, fs_path, self.retry):
            if path == keep:
                continue
            if inspect_checkpoint(backend.filesystem, path, retry=self.retry).state \
                    == "committed":
                delete_checkpoint_dir(backend, path, writer_id=writer, retry=self.retry)
            else:
                _fsutil.delete_dir(backend.filesystem, path, retry=self.retry)

    # -- load -------------------------------------------------------------------------

    def _fsspec_for(self, dirpath: Any) -> Any | None:
        """The fsspec client of the backend this plugin saves ``dirpath``'s
        checkpoints on (built from ``storage_options``), or None where that
        backend has none (local disks, a pyarrow filesystem passed in).

        Raises:
            InvalidConfigError: ``dirpath`` names no usable location.
        """
        backend, _ = self._locate(posixpath.join(os.fspath(dirpath), "_"))
        return _client_of(backend.filesystem)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        import torch

        backend, fs_path = self._after_pending_saves(path)
        state, meta = verified(backend, fs_path, retry=self.retry)
        loaded = torch.load(state_file(state), map_location=map_location,
                            weights_only=weights_only, **kwargs)
        self._continue(backend.uri_for(fs_path), meta)
        return loaded

    def checkpoint_file(self, path: Any) -> str | io.BytesIO:
        """What ``torch.load`` and ``LightningModule.load_from_checkpoint`` take
        for the checkpoint at Lightning path ``path`` (``best_model_path``),
        verified; see :func:`checkpoint_store.integrations.lightning.checkpoint_file`.
        With ``async_save``, waits for pending saves of ``path`` first."""
        backend, fs_path = self._after_pending_saves(path)
        return state_file(verified(backend, fs_path, retry=self.retry)[0])

    def _after_pending_saves(self, path: Any) -> tuple[Backend, str]:
        """``(backend, path)`` of ``path``, once no queued save of it is pending."""
        backend, fs_path = self._locate(path)
        if self._queue is not None:
            self._queue.wait(backend.uri_for(fs_path))
            self._raise_pending_error()
        return backend, fs_path

    def _continue(self, uri: str, meta: Mapping[str, Any] | None) -> None:
        """After a load of ``uri``, a checkpoint this plugin class wrote: this
        run continues that checkpoint's run. ``fit(ckpt_path=...)`` restores
        ``ModelCheckpoint``'s top-K from it, so the checkpoints of the run
        resumed through are this run's to evict, all but ``uri`` itself when
        loaded before the first save, which Lightning promises to keep (on
        local disks it never asks to remove it); a checkpoint of a run never
        resumed through stays protected. Before the first save the run takes
        that run id on, so a later resume from any of its checkpoints
        continues the same run again, however many restarts there were."""
        run_id = (meta or {}).get("run_id")
        if not isinstance(run_id, str) or "lightning" not in (meta or {}):
            return
        self._runs.add(run_id)
        if not self._saved:  # a restart; later loads read what this run wrote
            self._resumed_from.add(uri)
            self.run_id = run_id

    # -- remove -----------------------------------------------------------------------

    def remove_checkpoint(self, path: Any) -> None:
        backend, fs_path = self._locate(path)
        queue = self._queue_or_none()
        if queue is None:
            self._remove(backend, fs_path)
            return
        self._raise_pending_error()
        queue.submit("remove", backend.uri_for(fs_path), lambda: self._remove(backend, fs_path))

    def _remove(self, backend: Backend, fs_path: str) -> None:
        uri = backend.uri_for(fs_path)
        if self._root is None or not uri.startswith(self._root.rstrip("/") + "/"):
            _refuse(f"not removing {uri}: it is outside this run's checkpoint directory "
                    f"{self._root}")
            return
        if uri in self._resumed_from:
            # What Lightning does on local disks, silently: no warning either.
            logger.info("not removing %s: this run resumed from it (Lightning keeps the "
                        "checkpoint given to fit(ckpt_path=...))", uri)
            return
        fs = backend.filesystem
        holder = current_dir(backend, fs_path, self.retry)
        kind = _fsutil.info(fs, holder, retry=self.retry).type
        if kind == pafs.FileType.NotFound and holder == fs_path:
            return
        insp = inspect_checkpoint(fs, holder, retry=self.retry) \
            if kind == pafs.FileType.Directory else None
        run_id = (insp.meta or {}).get("run_id") if insp is not None else None
        if insp is None or insp.state != "committed" or run_id not in self._runs:
            _refuse(f"not removing {uri}: this run did not write it (another run's, one this "
                    "run did not resume through, or no checkpoint of this plugin); delete it "
                    "yourself if unneeded")
            return
        writer = new_writer_id(self.run_id)
        # Uncommits first: an interrupted delete never leaves a listed checkpoint.
        delete_checkpoint_dir(backend, holder, writer_id=writer, retry=self.retry)
        if holder != fs_path:
            self._drop_replacements(backend, fs_path, keep=None, writer=writer)
            _fsutil.delete_dir(fs, fs_path, retry=self.retry)  # the pointer, last

    # -- end ----------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until every queued save and remove has run; raise the first error."""
        if self._queue is not None:
            self._queue.wait()
            self._queue.reset()
        self._raise_pending_error()

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            stager, self._stager = self._stager, None
            if stager is not None:
                stager.close()


def _left_by_a_writer(files: Mapping[str, int]) -> bool:
    """Uncommitted files holding a trace of our writers (a claim, a delete
    tombstone): what a save or delete cut short leaves. Anything else is
    somebody's data, and the commit refuses to write over it."""
    return any(is_internal_name(rel.rsplit("/", 1)[-1]) for rel in files)


def _refuse(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)

