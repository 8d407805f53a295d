"""Asynchronous checkpoint uploads: stage locally, upload in the background.

With ``upload_mode="async"`` (on :class:`UploadConfig`, given to
``session.start(upload_config=...)``, or per ``report()``), ``report()`` does
only what must happen before the training loop may touch its files again:

1. raise the error of an earlier background upload, if one failed;
2. wait while ``max_pending_uploads`` uploads are still pending
   (backpressure: staging space and memory stay bounded);
3. *stage* the checkpoint directory (:func:`stage`): a copy by default, so
   the caller may delete or overwrite it (a ``TemporaryDirectory``) as soon
   as ``report()`` returns; a move or hard links when the caller opts in;
4. queue the upload and return.

One background thread uploads and commits the queued checkpoints in report
order, then registers each with retention, so an older checkpoint is deleted
only after a newer one is committed. It runs niced, under ``SCHED_BATCH``
(:mod:`checkpoint_store._util.background`): where cores are short the
training loop goes first. ``Session.wait()`` (and the end of the
session) waits for every queued upload and raises the first error.

The same contract as Orbax's ``AsyncCheckpointer`` (save returns after the
copy to host; ``wait_until_finished``), and as Ray Train's checkpoint upload
running outside ``train.report``.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from checkpoint_store._format.layout import STAGED_COPY_PREFIX
from checkpoint_store._util.background import yield_to_training
from checkpoint_store._util.locks import OneWorker, condition
from checkpoint_store.retention.upload_config import STAGING_MODES as STAGING_MODES
from checkpoint_store.retention.upload_config import UPLOAD_MODES as UPLOAD_MODES
from checkpoint_store.retention.upload_config import StagingMode as StagingMode
from checkpoint_store.retention.upload_config import UploadConfig as UploadConfig
from checkpoint_store.retention.upload_config import UploadMode as UploadMode
from checkpoint_store.retention.upload_config import check_max_pending as check_max_pending
from checkpoint_store.retention.upload_config import check_staging as check_staging
from checkpoint_store.retention.upload_config import check_upload_mode as check_upload_mode

# Staged copies' directory: owned by checkpoint_store.state (below session and
# integrations), re-exported here so that existing imports keep working.
from checkpoint_store.state import ENV_STAGING_DIR as ENV_STAGING_DIR
from checkpoint_store.state import scratch_dir
from checkpoint_store.state import staging_root as staging_root

logger = logging.getLogger(__name__)

# -- staging -------------------------------------------------------------------


@dataclass
class Staged:
    """A staged checkpoint directory: ``path`` (local), removed by :meth:`cleanup`;
    ``moved_from``: the directory its files were moved out of (``"move"``)."""

    path: str
    owned: bool
    moved_from: str | None = None

    def cleanup(self) -> None:
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)

    def take_back(self) -> None:
        """Its upload will not run (the report that staged it raised): the
        moved files go back where they came from, then the copy is removed.
        A name the caller has written again meanwhile keeps the caller's
        file; what cannot go back stays in a directory renamed
        ``kept-<name>`` beside :attr:`path` (logged), which no sweep of the
        staging root removes: it may hold the only copy of a user's file."""
        if self.moved_from is not None and self.owned:
            try:
                whole = _move_back(self.path, self.moved_from)
            except OSError as exc:
                logger.warning("moving the files of %s back: %s", self.moved_from, exc)
                whole = False
            if not whole:
                self._keep()
                logger.warning("could not move every file of %s back into %s; the rest "
                               "stays in %s", self.moved_from, self.moved_from, self.path)
                return
        self.cleanup()

    def _keep(self) -> None:
        """Out of the sweep's reach: renamed ``kept-<name>``, no longer ours."""
        from checkpoint_store._format.layout import KEPT_STAGED_PREFIX

        kept = os.path.join(os.path.dirname(self.path),
                            KEPT_STAGED_PREFIX + os.path.basename(self.path))
        try:
            os.rename(self.path, kept)
        except OSError as exc:
            logger.warning("could not rename %s to %s: %s", self.path, kept, exc)
            return
        self.path, self.owned = kept, False


def stage(src_dir: str, mode: str = "copy", *, root: str | None = None) -> Staged:
    """Make a private copy of the local directory ``src_dir`` for a background upload.

    Args:
        src_dir: the checkpoint directory the training loop wrote.
        mode: ``"copy"`` (default: the loop may change or delete ``src_dir``
            right away), ``"hardlink"`` (no bytes copied; the loop may delete
            ``src_dir`` or replace its files, but must not modify a file in
            place), ``"move"`` (the files leave ``src_dir``, which is left
            empty). Hard links and moves across filesystems fall back to a copy.
        root: parent of the staged directory (default :func:`staging_root`).

    Returns:
        The staged directory; its ``cleanup()`` removes it.

    Raises:
        CheckpointNotFoundError: ``src_dir`` is not a directory.
        UnsafePathError: a file in ``src_dir`` cannot be uploaded as it is
            (see :func:`checkpoint_store._transfer.trees.source_files`).
        StorageFullError: the staging disk is full (as a commit's copy
            says it); PermanentBackendError: another ``OSError`` of the copy
            (read-only, not writable); the partial staging directory is
            removed either way.
        SourceChangedError: a file changed while it was copied.
    """
    import pyarrow.fs as pafs

    from checkpoint_store._transfer.trees import source_files
    from checkpoint_store.errors import CheckpointNotFoundError

    check_staging(mode)
    if not os.path.isdir(src_dir):
        raise CheckpointNotFoundError(f"checkpoint directory {src_dir!r} does not exist")
    # Every name checked now, as the upload would (a symlink cycle, a name no
    # store keeps): refused in report(), not later in the background.
    files = source_files(pafs.LocalFileSystem(), src_dir)
    parent = root or staging_root()
    try:
        dst = scratch_dir(STAGED_COPY_PREFIX, root)
    except OSError as exc:
        typed = _typed(exc, f"stage a copy of {src_dir} under {parent}")
        if typed is exc:
            raise
        raise typed from exc
    staged = Staged(dst, owned=True, moved_from=src_dir if mode == "move" else None)
    try:
        if mode == "move":
            _move_contents(src_dir, dst)
        elif mode == "hardlink":
            _link_tree(src_dir, dst)
        else:
            _copy_tree(src_dir, dst, files)
    except OSError as exc:
        staged.take_back()  # a move cut short: what was moved goes back
        typed = _typed(exc, f"stage a copy of {src_dir} into {dst}")
        if typed is exc:
            raise
        raise typed from exc
    except BaseException:
        staged.take_back()
        raise
    return staged


def _typed(exc: OSError, what: str) -> BaseException:
    """A copy's ``OSError`` typed as a commit's copy types it (a full disk is
    :class:`~checkpoint_store.errors.StorageFullError`; ours unchanged)."""
    from checkpoint_store._util.retry import typed_permanent

    return typed_permanent(exc, what)


def _copy_tree(src: str, dst: str, files: list[tuple[str, int]]) -> None:
    import pyarrow.fs as pafs

    from checkpoint_store._transfer import plan as _plan
    from checkpoint_store.backends.base import LOCAL_CAPABILITIES

    local = pafs.LocalFileSystem()
    for d in sorted({os.path.dirname(rel) for rel, _ in files} - {""}):
        os.makedirs(os.path.join(dst, d), exist_ok=True)
    # The staged copy is a scratch copy: no fsync (the upload is what must be durable).
    _plan.run(local, src, local, dst, files, chunk_size=LOCAL_CAPABILITIES.chunk_size,
              concurrency=LOCAL_CAPABILITIES.concurrency, fsync=False)


def _link_tree(src: str, dst: str) -> None:
    for dirpath, _dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        target = dst if rel == "." else os.path.join(dst, rel)
        os.makedirs(target, exist_ok=True)
        for name in filenames:
            s, d = os.path.join(dirpath, name), os.path.join(target, name)
            try:
                os.link(s, d)
            except OSError:  # another filesystem, or links not supported
                shutil.copy2(s, d)


def _move_contents(src: str, dst: str) -> None:
    # The directory itself stays (empty): a TemporaryDirectory's cleanup
    # would otherwise fail on it.
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        try:
            os.rename(s, d)
        except OSError:
            shutil.move(s, d)


def _move_back(src: str, dst: str) -> bool:
    """Move the entries of ``src`` back into ``dst`` (made again if it was
    removed), never over an entry ``dst`` has; whether every one moved."""
    os.makedirs(dst, exist_ok=True)
    whole = True
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if os.path.lexists(d):
            whole = False
            continue
        try:
            os.rename(s, d)
        except OSError:
            shutil.move(s, d)
    return whole


# -- the background uploader --------------------------------------------------------


@dataclass
class _Job:
    run: Callable[[], Any]
    cleanup: Callable[[], None]
    what: str


class BackgroundUploader:
    """Runs upload jobs one at a time, in submission order, on a background thread.

    Args:
        max_pending: jobs queued or running at once; :meth:`reserve` blocks
            while this many are pending.

    One worker thread, started by the first :meth:`submit`, waits for the
    next job when the queue is empty (a report does not pay for a new thread
    each time) until :meth:`close` (the session's end) or the interpreter's
    exit begins (a ``threading`` exit hook, run before non-daemon threads are
    joined): from then on it ends whenever the queue is empty, so an idle
    uploader never keeps a process alive. It is not a daemon, but that alone
    does not save the uploads of a process that exits without ending its
    session: the interpreter joins non-daemon threads only after
    ``concurrent.futures`` stopped taking work, and every transfer runs on a
    thread pool. The session's exit hook (``Session._finish_at_exit``, run by
    :mod:`checkpoint_store._results.writer` before it flushes the rows) waits for them
    first.
    """

    def __init__(self, max_pending: int = 1):
        self.max_pending = check_max_pending(max_pending)
        self._mutex, self._cond = condition()  # enter _mutex, not the condition
        self._queue: collections.deque[_Job] = collections.deque()
        # Jobs a worker took and has not finished: counted by the worker
        # alone, so a signal's exception in a submitting thread cannot skew
        # what is pending (the queue's length and this).
        self._running = 0
        self._errors: list[tuple[str, BaseException]] = []
        self._worker = OneWorker(self._loop, "checkpoint-store-upload")
        self._newest_first = False
        # Whether an idle worker waits for the next job (until close() or exit).
        self._linger = _watch_exit(self)
        #: Seconds :meth:`reserve` spent waiting, summed (for benchmarks and logs).
        self.blocked_s = 0.0
        self.committed = 0
        # A forked child inherits the counters, not the worker thread.
        self.pid = os.getpid()

    @property
    def pending(self) -> int:
        """Uploads queued or running."""
        with self._mutex:
            return self._pending()

    def _pending(self) -> int:
        # Under the mutex. A job queued by a submit that a signal cut short
        # before it started the worker gets one here (any waiter calls this).
        if self._queue:
            self._worker.ensure()
        return len(self._queue) + self._running

    def take_errors(self) -> list[tuple[str, BaseException]]:
        """The errors of finished background uploads, as ``(checkpoint_dir_name,
        exception)`` in report order, each returned once."""
        with self._mutex:
            errors, self._errors = self._errors, []
        return errors

    def raise_error(self) -> None:
        """Raise the first error of a finished background upload, once.

        Later errors of the same batch are logged, not raised.
        """
        exc = first_error(self.take_errors())
        if exc is not None:
            raise exc

    def reserve(self, max_pending: int | None = None) -> float:
        """Wait until fewer than ``max_pending`` uploads are pending.

        Returns:
            Seconds spent waiting (0.0 when a slot was free).
        """
        limit = self.max_pending if max_pending is None else check_max_pending(max_pending)
        with self._mutex:
            if self._pending() < limit:
                return 0.0
            t0 = time.perf_counter()
            while self._pending() >= limit:
                self._cond.wait()
            waited = time.perf_counter() - t0
            self.blocked_s += waited
            return waited

    def prefer_newest(self) -> None:
        """From now on, run the queued jobs newest first (by ``what``, a
        ``checkpoint_NNNNNN`` name), and each job submitted later before
        them: after a preemption signal the freshest checkpoint is made
        durable first. One rank only (ranks must commit in the same order)."""
        with self._mutex:
            self._newest_first = True
            self._queue = collections.deque(
                sorted(self._queue, key=lambda job: job.what, reverse=True))

    def submit(self, run: Callable[[], Any], cleanup: Callable[[], None], what: str) -> None:
        """Queue ``run`` (then ``cleanup``, whatever happens); never blocks.

        A signal's exception may cut it anywhere: the job is then queued or
        not, and a queued one runs (:class:`~checkpoint_store._util.locks.OneWorker`)."""
        job = _Job(run, cleanup, what)
        with self._mutex:
            # An idle worker takes it. Notified first: the worker wakes only
            # once this lock is free, and a cut between the two lines then
            # leaves no job queued that nobody was told of.
            self._cond.notify_all()
            if self._newest_first:
                self._queue.appendleft(job)
            else:
                self._queue.append(job)
            # The first job, or a forked child (it has no worker thread).
            self._worker.ensure()

    def close(self) -> None:
        """Let the worker end once the queue is empty (the session ended); a
        later :meth:`submit` still runs, on a worker that does not wait."""
        with self._mutex:
            self._linger = False
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every queued upload to finish (without raising their errors).

        Returns:
            True when none is pending, False on timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._mutex:
            while self._pending():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _loop(self) -> None:
        with self._mutex:
            if not self._worker.claim():
                return
        # Background work only: where cores are short, the loop goes first.
        yield_to_training("CHECKPOINT_STORE_UPLOAD_NICE", whole_process=False)
        while True:
            with self._mutex:
                while not self._queue and self._linger:
                    self._cond.wait()
                if not self._queue:
                    self._worker.release()
                    return
                job = self._queue.popleft()
                self._running += 1
            try:
                job.run()
                ok = True
            except BaseException as exc:  # surfaced at the next report() / wait()
                ok = False
                logger.debug("background upload of %s failed", job.what, exc_info=True)
                with self._mutex:
                    self._errors.append((job.what, exc))
            finally:
                try:
                    job.cleanup()
                except Exception as exc:  # a leftover staging dir is not worth a failure
                    logger.warning("could not remove the staged copy of %s: %s", job.what, exc)
            with self._mutex:
                self._running -= 1
                if ok:
                    self.committed += 1
                self._cond.notify_all()


_LINGERING: weakref.WeakSet[BackgroundUploader] = weakref.WeakSet()
_LINGERING_LOCK = threading.Lock()
_exit_hook_registered = False


def _watch_exit(uploader: BackgroundUploader) -> bool:
    """Whether ``uploader``'s worker may wait for jobs while idle: only where
    an exit hook runs before the interpreter joins non-daemon threads
    (``threading``'s own, what ``concurrent.futures`` uses), which then lets
    it end; registered once."""
    global _exit_hook_registered
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return False
    with _LINGERING_LOCK:
        if not _exit_hook_registered:
            try:
                register(_stop_lingering)
            except RuntimeError:  # the interpreter is already shutting down
                return False
            _exit_hook_registered = True
        _LINGERING.add(uploader)
    return True


def _stop_lingering() -> None:
    with _LINGERING_LOCK:
        uploaders = list(_LINGERING)
    for up in uploaders:
        up.close()


def first_error(errors: list[tuple[str, BaseException]]) -> BaseException | None:
    """The first of ``errors`` (from :meth:`BackgroundUploader.take_errors`), noted as a
    background upload's; the others are logged. None when there is none."""
    if not errors:
        return None
    what, exc = errors[0]
    for other_what, other in errors[1:]:
        logger.error("background upload of %s also failed: %r", other_what, other)
    note = (f"raised in the background while committing {what} (an upload with "
            "upload_mode='async', or a local tier's commit or durable copy); that copy of "
            "the checkpoint was not committed")
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    return exc
