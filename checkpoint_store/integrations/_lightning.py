"""The PyTorch Lightning integration, whichever package name Lightning comes under.

Nothing here imports Lightning: :mod:`checkpoint_store.integrations.lightning`
(``lightning``) and :mod:`checkpoint_store.integrations.pytorch_lightning`
(the old ``pytorch_lightning`` name) bind these classes to their package's
``CheckpointIO`` and ``Callback`` base classes, since the Trainer checks
plugins and callbacks by ``isinstance`` against its own package.

On storage, a Lightning checkpoint path ``<dirpath>/epoch=3-step=8.ckpt``
names a directory holding the state as one file plus our two metadata files::

    <dirpath>/epoch=3-step=8.ckpt/
        checkpoint.ckpt             torch.save() of Lightning's checkpoint dict
        .internal_metadata.json     index = global_step, run_id, metrics, manifest (last)

Retention: with Lightning's ``ModelCheckpoint`` Lightning owns top-K and this
plugin only commits, indexes and verifies (it never evicts on its own); with
:class:`ReportCheckpointCallback` our session's retention owns it.
"""

from __future__ import annotations

import io
import logging
import math
import os
import posixpath
import shutil
import tempfile
import threading
import time
import uuid
import warnings
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import google_crc32c
import pyarrow.fs as pafs

from checkpoint_store import _fsutil, _retry
from checkpoint_store._commit import delete_checkpoint_dir, protocol_for
from checkpoint_store._layout import deleting_dir_name, is_internal_name, replace_dir_name
from checkpoint_store._manifest import ManifestEntry, inspect_checkpoint, verify_files
from checkpoint_store._retry import RetryPolicy
from checkpoint_store._runs import new_writer_id
from checkpoint_store.backends.base import Backend
from checkpoint_store.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    InvalidConfigError,
)
from checkpoint_store.registry import resolve

logger = logging.getLogger(__name__)

#: The file inside a checkpoint directory that holds Lightning's checkpoint dict.
STATE_FILE = "checkpoint.ckpt"

_CHUNK = 8 * 1024 * 1024


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


class _CrcWriter:
    """A binary file-like that forwards writes and keeps size and CRC32C."""

    def __init__(self, raw: Any):
        self._raw = raw
        self.size = 0
        self.crc = 0

    def write(self, data: Any) -> int:
        chunk = data if isinstance(data, bytes) else memoryview(data).cast("B").tobytes()
        self._raw.write(chunk)
        self.crc = google_crc32c.extend(self.crc, chunk)
        self.size += len(chunk)
        return len(chunk)

    def flush(self) -> None:
        flush = getattr(self._raw, "flush", None)
        if flush is not None:
            flush()


def _stream_state(
    checkpoint: Mapping[str, Any], fsync: bool, retry: RetryPolicy | None
) -> Callable[[pafs.FileSystem, str], list[ManifestEntry]]:
    """The ``write`` of :meth:`CommitProtocol.commit`: ``torch.save`` straight into
    the backend's output stream (no local copy), CRC32C computed on the way."""
    import torch

    def write_once(fs: pafs.FileSystem, directory: str) -> list[ManifestEntry]:
        path = posixpath.join(directory, STATE_FILE)
        local = _fsutil.local_path(fs, path)
        if local is not None:
            with open(local, "wb") as f:
                w = _CrcWriter(f)
                torch.save(checkpoint, w)  # type: ignore[arg-type]  # any object with write()
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            if fsync:
                _fsutil.fsync_dir(os.path.dirname(local))
        else:
            with fs.open_output_stream(path) as out:
                w = _CrcWriter(out)
                torch.save(checkpoint, w)  # type: ignore[arg-type]  # any object with write()
        return [ManifestEntry(STATE_FILE, w.size, f"{w.crc:08x}")]

    def write(fs: pafs.FileSystem, directory: str) -> list[ManifestEntry]:
        return _retry.call(lambda: write_once(fs, directory), policy=retry,
                           what=f"write {directory}/{STATE_FILE}")

    return write


def _to_float(value: Any) -> float | None:
    """A Python float for a number or one-element tensor, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    numel = getattr(value, "numel", None)
    if callable(numel) and numel() == 1:
        try:
            return float(value.item())
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _checkpoint_metrics(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``epoch``, ``step`` (global step) and each ``ModelCheckpoint``'s monitored
    value (its ``current_score``) from Lightning's checkpoint dict."""
    metrics: dict[str, Any] = {}
    for key, out in (("epoch", "epoch"), ("global_step", "step")):
        value = checkpoint.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            metrics[out] = value
    callbacks = checkpoint.get("callbacks")
    if isinstance(callbacks, Mapping):
        for state in callbacks.values():
            if not isinstance(state, Mapping):
                continue
            monitor = state.get("monitor")
            score = _to_float(state.get("current_score"))
            if isinstance(monitor, str) and score is not None and math.isfinite(score):
                metrics[monitor] = score
    return metrics


def _read_state(
    fs: pafs.FileSystem, path: str, expect: Mapping[str, Any] | None, keep: bool = True
) -> bytes:
    """Read a whole file (returned when ``keep``, else ``b""``); with ``expect``
    (a manifest entry) check its size and CRC32C on the way."""
    crc, size, chunks = 0, 0, []
    with fs.open_input_stream(path) as f:
        while True:
            buf = f.read(_CHUNK)
            if not buf:
                break
            crc = google_crc32c.extend(crc, buf)
            size += len(buf)
            if keep:
                chunks.append(buf)
    if expect is not None and (size != expect["size"] or f"{crc:08x}" != expect["crc32c"]):
        raise CheckpointCorruptError(
            f"{path}: {size} bytes with CRC32C {crc:08x}, the manifest says "
            f"{expect['size']} bytes with {expect['crc32c']}; the checkpoint is damaged, "
            "resume from another one", path=posixpath.dirname(path), file=STATE_FILE,
        )
    return b"".join(chunks)


class _OrderedQueue:
    """One worker thread runs saves and removes in the order they were asked for.

    Called from the training thread (``submit``, ``wait``, ``take_error``); the
    worker thread runs the jobs. After a save fails, later removes are skipped
    (the checkpoint a remove would make redundant may be the failed one), so
    the newest committed checkpoint is never removed for a save that did not
    happen. The worker ends when the queue is empty; the next submit starts one.

    The worker is joined by ``wait()`` and is not a daemon, so the interpreter
    waits for it before finalising. A daemon worker still dropping a queued
    snapshot's tensors when the process exits is killed by ``pthread_exit``
    inside torch's (noexcept) tensor destructor as it takes the GIL back,
    which aborts the process (``terminate called without an active
    exception``, SIGABRT). For the same reason each job, and the snapshot it
    holds, is released on the worker before the job is reported done.
    """

    def __init__(self, max_pending_saves: int):
        self._max = max_pending_saves
        self._cond = threading.Condition()
        self._jobs: deque[tuple[str, str, Callable[[], None]]] = deque()
        self._pending: Counter[str] = Counter()
        self._saves = 0
        self._error: BaseException | None = None
        self._save_failed = False
        self._running = False  # a worker is taking jobs
        self._thread: threading.Thread | None = None  # the last worker started

    def submit(self, kind: Literal["save", "remove"], key: str, job: Callable[[], None]) -> None:
        """Queue ``job``; a save blocks while ``max_pending_saves`` saves are queued."""
        with self._cond:
            while kind == "save" and self._saves >= self._max:
                self._cond.wait()
            self._jobs.append((kind, key, job))
            self._pending[key] += 1
            self._saves += kind == "save"
            if not self._running:
                self._running = True
                self._thread = threading.Thread(target=self._run, name="cs-lightning-io",
                                                daemon=False)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    self._running = False
                    self._cond.notify_all()
                    return
                kind, key, job = self._jobs[0]
                skip = kind == "remove" and self._save_failed
            if skip:
                logger.warning("not removing %s: an earlier checkpoint save failed", key)
            else:
                try:
                    job()
                except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                    logger.error("background checkpoint %s of %s failed: %s", kind, key, exc)
                    with self._cond:
                        self._error = self._error or exc
                        self._save_failed |= kind == "save"
            job = None  # type: ignore[assignment]  # the deque's copy goes below
            with self._cond:
                self._jobs.popleft()
                self._pending[key] -= 1
                if not self._pending[key]:
                    del self._pending[key]
                self._saves -= kind == "save"
                self._cond.notify_all()

    def wait(self, key: str | None = None) -> None:
        """Until every queued job (or every job for ``key``) has run; without
        ``key``, also until the worker thread has ended."""
        with self._cond:
            while self._pending[key] if key is not None else self._jobs:
                self._cond.wait()
            thread = self._thread if key is None else None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def take_error(self) -> BaseException | None:
        """The first error of a job since the last call (each error is raised once)."""
        with self._cond:
            error, self._error = self._error, None
            return error

    def reset(self) -> None:
        with self._cond:
            self._save_failed = False


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
        #: Written into each checkpoint's internal metadata; removes refuse any
        #: checkpoint with another run id (one this run did not write).
        self.run_id = uuid.uuid4().hex[:16]
        self._locate = _Locator(storage_options, storage_filesystem)
        self._root: str | None = None
        if root is not None:
            backend, path = self._locate(posixpath.join(os.fspath(root), "_"))
            self._root = backend.uri_for(posixpath.dirname(path))
        self._queue: _OrderedQueue | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Sent to spawned ranks (ddp_spawn): without threads, locks or clients.
        state = dict(self.__dict__)
        state["_queue"] = None
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
        backend, fs_path = self._locate(path)
        uri = backend.uri_for(fs_path)
        if self._root is None:
            self._root = backend.uri_for(posixpath.dirname(fs_path))
        queue = self._queue_or_none()
        if queue is None:
            self._save(checkpoint, backend, fs_path)
            return
        self._raise_pending_error()
        # The training thread goes on changing parameters and optimizer state
        # in place: the background save works on a copy taken now.
        snapshot = _snapshot(checkpoint)
        queue.submit("save", uri, lambda: self._save(snapshot, backend, fs_path))

    def _save(self, checkpoint: Mapping[str, Any], backend: Backend, fs_path: str) -> None:
        started = time.monotonic()
        swap = self._clear_for_save(backend, fs_path)
        metrics = _checkpoint_metrics(checkpoint)
        internal = {
            # Lightning's step, so "newest" means what it means to the user.
            "index": int(metrics.get("step", 0)),
            "created_at": time.time(),
            "run_id": self.run_id,
            "world_size": 1,
            "metrics": metrics,
            "lightning": {"state_file": STATE_FILE},
        }
        write = _stream_state(checkpoint, self.fsync and backend.capabilities.needs_fsync,
                              self.retry)
        writer = new_writer_id(self.run_id)
        parent, name = posixpath.split(fs_path)
        target = posixpath.join(parent, replace_dir_name(name, writer)) if swap else fs_path
        protocol = protocol_for(backend, fsync=self.fsync, retry=self.retry)
        _retry.with_rebuild(backend, lambda: protocol.commit(
            None, None, target, internal, writer_id=writer, write=write,
        ), what=f"save {backend.uri_for(fs_path)}")
        if swap:
            self._swap_in(backend, target, fs_path, writer)
        logger.info("committed %s in %.2f s", backend.uri_for(fs_path),
                    time.monotonic() - started)

    def _clear_for_save(self, backend: Backend, fs_path: str) -> bool:
        """Make way for a new save at ``fs_path``; True when a committed
        checkpoint there is to be swapped out once the new one is committed.

        Lightning saves to the same path again (``last.ckpt``). Where
        directories rename atomically the old checkpoint stays until the new
        one is committed beside it, then two renames swap them. Elsewhere the
        old one is uncommitted and deleted first: a crash in between leaves
        no checkpoint at that path (never a half-replaced one listed as
        committed). A save that died half-way (after a resume, training
        reaches the same ``epoch=..-step=..`` name again) left a directory of
        our traces whose claim would hold off this save for
        ``claim_timeout``: removed. Saves of one plugin run one at a time, so
        no live writer of ours is in there.
        """
        fs = backend.filesystem
        kind = _fsutil.info(fs, fs_path, retry=self.retry).type
        if kind == pafs.FileType.File:
            _fsutil.delete_file(fs, fs_path, retry=self.retry)  # a legacy plain file
            return False
        if kind != pafs.FileType.Directory:
            return False
        insp = inspect_checkpoint(fs, fs_path, retry=self.retry)
        if insp.state == "committed":
            if backend.capabilities.atomic_rename:
                return True
            delete_checkpoint_dir(backend, fs_path, writer_id=new_writer_id(self.run_id),
                                  retry=self.retry)
        elif insp.state == "absent" and _left_by_a_writer(insp.files or {}):
            _fsutil.delete_dir(fs, fs_path, retry=self.retry)
        return False

    def _swap_in(self, backend: Backend, new: str, fs_path: str, writer: str) -> None:
        """Rename the old checkpoint away and the committed ``new`` into its
        place (local disks): no moment without a committed copy but the one
        between the two renames."""
        fs = backend.filesystem
        parent, name = posixpath.split(fs_path)
        trash = posixpath.join(parent, deleting_dir_name(name, writer))
        _fsutil.move(fs, fs_path, trash, retry=self.retry)
        _fsutil.move(fs, new, fs_path, retry=self.retry)
        if self.fsync:
            parent_os = _fsutil.local_path(fs, parent)
            if parent_os is not None:
                _fsutil.fsync_dir(parent_os)
        _fsutil.delete_dir(fs, trash, retry=self.retry)

    # -- load -------------------------------------------------------------------------

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        import torch

        backend, fs_path = self._locate(path)
        if self._queue is not None:
            self._queue.wait(backend.uri_for(fs_path))
            self._raise_pending_error()
        state = verified_state(backend, fs_path, retry=self.retry)
        return torch.load(state if isinstance(state, str) else io.BytesIO(state),
                          map_location=map_location, weights_only=weights_only, **kwargs)

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
        fs = backend.filesystem
        kind = _fsutil.info(fs, fs_path, retry=self.retry).type
        if kind == pafs.FileType.NotFound:
            return
        insp = inspect_checkpoint(fs, fs_path, retry=self.retry) \
            if kind == pafs.FileType.Directory else None
        run_id = (insp.meta or {}).get("run_id") if insp is not None else None
        if insp is None or insp.state != "committed" or run_id != self.run_id:
            _refuse(f"not removing {uri}: this run did not write it (it may be the checkpoint "
                    "the run resumed from, or another run's); delete it yourself if unneeded")
            return
        # Uncommits first: an interrupted delete never leaves a listed checkpoint.
        delete_checkpoint_dir(backend, fs_path, writer_id=new_writer_id(self.run_id),
                              retry=self.retry)

    # -- end ----------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until every queued save and remove has run; raise the first error."""
        if self._queue is not None:
            self._queue.wait()
            self._queue.reset()
        self._raise_pending_error()

    def teardown(self) -> None:
        self.wait()


def _left_by_a_writer(files: Mapping[str, int]) -> bool:
    """Uncommitted files holding a trace of our writers (a claim, a delete
    tombstone): what a save or delete cut short leaves. Anything else is
    somebody's data, and the commit refuses to write over it."""
    return any(is_internal_name(rel.rsplit("/", 1)[-1]) for rel in files)


def _refuse(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _snapshot(checkpoint: dict[str, Any]) -> dict[str, Any]:
    import torch
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().clone())


def verified_state(backend: Backend, fs_path: str, *, retry: RetryPolicy | None = None,
                   keep: bool = True) -> str | bytes:
    """The state of a committed checkpoint directory (every file checked
    against its manifest) or of a plain legacy ``.ckpt`` file (unchecked).

    Returns:
        On the local disk, the state file's OS path (checked by one streaming
        read; ``torch.load`` reads it again, from the page cache). Elsewhere
        its bytes, checked as they arrived (``b""`` unless ``keep``).

    Raises:
        CheckpointNotFoundError: nothing at the path, or a directory that is not
            a committed checkpoint (an interrupted save).
        CheckpointCorruptError: a file does not match the manifest.
    """
    fs = backend.filesystem
    uri = backend.uri_for(fs_path)
    kind = _fsutil.info(fs, fs_path, retry=retry).type
    if kind == pafs.FileType.NotFound:
        raise CheckpointNotFoundError(f"checkpoint {uri} does not exist")
    if kind == pafs.FileType.File:
        local = _fsutil.local_path(fs, fs_path)
        if local is not None:
            return local
        return _retry.call(lambda: _read_state(fs, fs_path, None, keep), policy=retry,
                           what=f"read {uri}")
    insp = inspect_checkpoint(fs, fs_path, retry=retry)
    if insp.state == "invalid":
        raise CheckpointCorruptError(f"checkpoint {uri} is corrupt: {insp.reason}",
                                     path=fs_path, file=insp.file)
    if insp.state != "committed":
        raise CheckpointNotFoundError(
            f"{uri} is not a committed checkpoint (no commit marker): a save that did not "
            "finish. Resume from another one (checkpoint_store.integrations.lightning."
            "resume_path finds the newest complete one)"
        )
    assert insp.meta is not None
    manifest = insp.meta["manifest"]
    state_file = (insp.meta.get("lightning") or {}).get("state_file", STATE_FILE)
    entry = next((e for e in manifest if e["path"] == state_file), None)
    if entry is None:
        raise CheckpointCorruptError(f"checkpoint {uri} has no {state_file} in its manifest",
                                     path=fs_path, file=state_file)
    others = [e for e in manifest if e is not entry]
    if others:
        verify_files(fs, fs_path, others, retry=retry)
    path = posixpath.join(fs_path, state_file)
    local = _fsutil.local_path(fs, path)
    data = _retry.call(lambda: _read_state(fs, path, entry, keep and local is None),
                       policy=retry, what=f"read {uri}")
    return local if local is not None else data


# -- finding a checkpoint to resume from ----------------------------------------------


def _pick(
    candidates: Sequence[tuple[Any, Mapping[str, Any]]], monitor: str | None, mode: str,
) -> list[Any]:
    """Candidates in preference order: newest first (index, then created_at),
    or with ``monitor`` best first (missing or NaN scores last, ties: newer)."""
    def newness(meta: Mapping[str, Any]) -> tuple[int, float]:
        return meta.get("index", 0), float(meta.get("created_at", 0.0))

    if monitor is None:
        return [c for c, _ in sorted(candidates, key=lambda cm: newness(cm[1]), reverse=True)]
    if mode not in ("min", "max"):
        raise InvalidConfigError(f"mode must be 'min' or 'max', got {mode!r}")
    from checkpoint_store.retention import rank_key

    def key(cm: tuple[Any, Mapping[str, Any]]) -> tuple[int, float, tuple[int, float]]:
        score = _to_float((cm[1].get("metrics") or {}).get(monitor))
        if score is not None and math.isnan(score):
            score = None
        return rank_key(score, newness(cm[1]), mode)

    return [c for c, _ in sorted(candidates, key=key, reverse=True)]


def _first_verified(checkpoints: list[Any], describe: Callable[[Any], str],
                    verify: Callable[[Any], object]) -> Any | None:
    for c in checkpoints:
        try:
            verify(c)
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
            warnings.warn(f"skipping checkpoint {describe(c)}: it does not verify ({exc})",
                          RuntimeWarning, stacklevel=3)
            continue
        return c
    return None


def resume_path(
    dirpath: str | os.PathLike[str],
    *,
    monitor: str | None = None,
    mode: Literal["min", "max"] = "min",
    storage_options: Mapping[str, Any] | None = None,
    storage_filesystem: Any = None,
) -> str | None:
    """The ``ckpt_path`` to give ``trainer.fit`` to resume from ``dirpath``.

    Lists the committed checkpoint directories that :class:`CheckpointStoreIO`
    wrote in ``dirpath`` (``ModelCheckpoint(dirpath=...)``) and returns the
    newest (highest ``global_step``, then latest commit) whose files verify
    (size and CRC32C). A directory without a commit marker (a save cut short)
    is never a candidate; one that fails verification is skipped with a
    warning. Lightning's own ``ckpt_path="last"`` goes by names and
    modification times instead.

    Args:
        dirpath: the checkpoint directory (local path or URI).
        monitor: pick the best by this metric (recorded at save from each
            ``ModelCheckpoint``'s monitored value) instead of the newest.
        mode: ``"min"`` or ``"max"`` for ``monitor``.
        storage_options, storage_filesystem: as for :class:`CheckpointStoreIO`.

    Returns:
        ``dirpath`` joined with the chosen directory's name (load it with
        ``CheckpointStoreIO``), or None when there is no committed checkpoint.

    Raises:
        InvalidConfigError: a bad ``mode`` or location.
    """
    backend, root = resolve(dirpath, filesystem=storage_filesystem,
                            storage_options=storage_options)
    fs = backend.filesystem
    found: list[tuple[str, Mapping[str, Any]]] = []
    for fi in _fsutil.list_dir(fs, root):
        name = posixpath.basename(fi.path.rstrip("/"))
        if fi.type != pafs.FileType.Directory or name.startswith("."):
            continue
        insp = inspect_checkpoint(fs, posixpath.join(root, name))
        if insp.state == "committed" and insp.meta is not None:
            found.append((name, insp.meta))
    chosen = _first_verified(
        _pick(found, monitor, mode), lambda n: backend.uri_for(posixpath.join(root, n)),
        lambda n: verified_state(backend, posixpath.join(root, n), keep=False),
    )
    if chosen is None:
        return None
    base = os.fspath(dirpath)
    return f"{base.rstrip('/')}/{chosen}" if "://" in base else os.path.join(base, chosen)


# -- callback mode --------------------------------------------------------------------


class _ReportCallback:
    """The body of ``ReportCheckpointCallback`` (see its docstring in lightning.py)."""

    def __init__(
        self,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        num_to_keep: int | None = None,
        *,
        storage_path: str | os.PathLike[str] | None = None,
        experiment_name: str = "default",
        trial_name: str = "default",
        storage_options: Mapping[str, Any] | None = None,
        storage_filesystem: Any = None,
    ):
        from checkpoint_store.retention import CheckpointConfig

        super().__init__()
        if mode not in ("min", "max"):
            raise InvalidConfigError(f"mode must be 'min' or 'max', got {mode!r}")
        self.monitor = monitor
        self.mode = mode
        self.num_to_keep = num_to_keep
        self._storage = None
        if storage_path is None:
            if monitor is not None or num_to_keep is not None:
                raise InvalidConfigError(
                    "without storage_path the callback reports into the active session, whose "
                    "checkpoint_config decides retention: pass monitor/num_to_keep to "
                    "session.start(checkpoint_config=...), or give storage_path here"
                )
            self._config = None
        else:
            # Validates now, in the main process, before any rank starts.
            self._config = CheckpointConfig(
                num_to_keep=num_to_keep, checkpoint_score_attribute=monitor,
                checkpoint_score_order=mode,
            )
            self._storage = dict(
                storage_path=storage_path, experiment_name=experiment_name,
                trial_name=trial_name, storage_options=storage_options,
                storage_filesystem=storage_filesystem,
            )
        self._active: Any = None
        self._session: Any = None
        self.stopped_by_session = False

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_active"] = state["_session"] = None
        return state

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        from checkpoint_store import session

        if isinstance(trainer.strategy.checkpoint_io, _StoreIO):
            raise InvalidConfigError(
                "ReportCheckpointCallback saves through the trainer into a temporary local "
                "file and reports it; it cannot be combined with CheckpointStoreIO. Use one: "
                "the callback (our retention), or CheckpointStoreIO with ModelCheckpoint"
            )
        if self._storage is None:
            self._session = session.get_session()
            return
        self._active = session.start(
            **self._storage, checkpoint_config=self._config,
            world_rank=trainer.global_rank, world_size=trainer.world_size,
            local_rank=trainer.local_rank,
        )
        self._session = self._active.session

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking or self._session is None:
            return
        from checkpoint_store.checkpoint import Checkpoint
        from checkpoint_store.session import TrialStopped

        metrics = {k: v for k, v in ((str(k), _to_float(v))
                                     for k, v in trainer.callback_metrics.items())
                   if v is not None}
        metrics.update(epoch=trainer.current_epoch, step=trainer.global_step)
        tmp = tempfile.mkdtemp(prefix="cs-lightning-")
        try:
            state = os.path.join(tmp, STATE_FILE)
            trainer.save_checkpoint(state)  # every rank: sharded strategies gather here
            ckpt = Checkpoint.from_directory(tmp) if os.path.exists(state) else None
            try:
                self._session.report(metrics, checkpoint=ckpt)
            except TrialStopped:
                # The row and its checkpoint are in; end fit() cleanly.
                self.stopped_by_session = True
                trainer.should_stop = True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        active, self._active, self._session = self._active, None, None
        if active is not None:
            active.end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning skips teardown hooks when fit() raises: end the session
        # here, or its lease and this thread's session would outlive the run.
        active, self._active, self._session = self._active, None, None
        if active is not None:
            try:
                active.end(exception)  # recorded in the trial's error.txt
            except Exception as exc:  # noqa: BLE001 - the run's own error comes first
                logger.warning("ending the session after %r failed: %s", exception, exc)

    def resume_path(
        self, local_dir: str | os.PathLike[str] | None = None, *, best: bool = False
    ) -> str | None:
        """Download the newest (or, with ``best``, the best by ``monitor``)
        committed checkpoint that verifies and return its local ``.ckpt`` file
        for ``trainer.fit(ckpt_path=...)``; None when the trial has none.

        Call it before ``fit``, on every rank (each downloads its own copy).
        ``local_dir`` (default: a new temporary directory, left for the caller
        to remove) receives the files.
        """
        from checkpoint_store.storage import StorageContext

        if self._storage is None:
            from checkpoint_store import session

            storage = session.get_context().storage
        else:
            s = self._storage
            storage = StorageContext(
                s["storage_path"], s["experiment_name"], s["trial_name"],
                storage_filesystem=s["storage_filesystem"], storage_options=s["storage_options"],
            )
        if best and self.monitor is None:
            raise InvalidConfigError("resume_path(best=True) needs monitor= on the callback")
        committed = storage.committed_checkpoints()
        order = _pick(committed, self.monitor if best else None, self.mode)
        chosen = _first_verified(order, lambda c: c.uri, lambda c: c.verify())
        if chosen is None:
            return None
        target = chosen.to_directory(local_dir if local_dir is not None else
                                     tempfile.mkdtemp(prefix="cs-lightning-resume-"))
        return os.path.join(target, STATE_FILE)
