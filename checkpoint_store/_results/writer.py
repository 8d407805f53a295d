"""A trial's ``result.json``: writing rows without rewrites (:class:`ResultLog`).

Local disks append each row in place (one unbuffered handle). Object stores
cannot append, and rewriting the whole file per row made a report cost
O(rows): there the rows are buffered and PUT as small immutable *segments*
``<trial>/.cs_results/<first>-<last>-<token>.jsonl`` (at each checkpoint
report, at the session's end, and at least every :data:`FLUSH_INTERVAL_ENV`
seconds), and ``result.json`` is assembled once, at the session's end.

Segments are named by the ``training_iteration`` of their first and last
rows, and a trial's iterations only grow; so the rows of ``result.json``
tell which segments it already holds: a segment whose last iteration is at
most that of ``result.json``'s last row is folded. Assembly writes the new
``result.json`` first and deletes the segments after it, so a crash at any
step leaves either segments not yet folded (read from the segments) or
segments already folded (skipped), never a lost or doubled row. The layout is
documented in docs/format.md ("result.json segments").

Reading rows, listing segments and their assembly are in
:mod:`checkpoint_store._results.reader` (re-exported here); this module holds the
writer and the flush of its buffered rows when the interpreter exits.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import posixpath
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import RESULT_FILE, RESULT_SEGMENTS_DIR, result_segment_name

# Re-exported: the readers' names were imported from here before they moved.
from checkpoint_store._results.reader import Segment as Segment
from checkpoint_store._results.reader import TrialStorage, row_iteration
from checkpoint_store._results.reader import assemble_results as assemble_results
from checkpoint_store._results.reader import assembled_result_bytes as assembled_result_bytes
from checkpoint_store._results.reader import last_result_rows as last_result_rows
from checkpoint_store._results.reader import list_segments as list_segments
from checkpoint_store._results.reader import parse_result_rows as parse_result_rows
from checkpoint_store._results.reader import read_results as read_results
from checkpoint_store._results.reader import unfolded_rows as unfolded_rows
from checkpoint_store._results.reader import valid_iteration as valid_iteration
from checkpoint_store._util import fs as _fsutil

__all__ = ["FLUSH_INTERVAL_ENV", "ResultLog", "flush_interval_from_env"]

logger = logging.getLogger(__name__)

#: Seconds rows may wait in memory before they are PUT as a segment (object
#: stores; default 5): what a process killed between flushes can lose.
FLUSH_INTERVAL_ENV = "CHECKPOINT_STORE_RESULT_FLUSH_S"
_DEFAULT_FLUSH_S = 5.0
# A buffer this large is flushed at once: bounds memory and a segment's size.
_SEGMENT_MAX_BYTES = 1 << 20
# Every this many segments a writer merges its last ones into one, unless
# they hold more than _MERGE_MAX_BYTES together (then they are few enough).
_MERGE_COUNT = 64
_MERGE_MAX_BYTES = 8 << 20
# Seconds an interpreter exit waits for the last flush of buffered rows: a
# store that does not answer must not hang the exit of a finished script.
_EXIT_FLUSH_TIMEOUT_S = 10.0


# -- writing ---------------------------------------------------------------------------


def flush_interval_from_env() -> float:
    """:data:`FLUSH_INTERVAL_ENV` in seconds (default 5; a bad value warns and
    falls back to it)."""
    raw = os.environ.get(FLUSH_INTERVAL_ENV)
    if raw is None:
        return _DEFAULT_FLUSH_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value <= 0:
        logger.warning("%s=%r is not a positive number of seconds; using %s",
                       FLUSH_INTERVAL_ENV, raw, _DEFAULT_FLUSH_S)
        return _DEFAULT_FLUSH_S
    return value


# -- flush at interpreter exit ------------------------------------------------------

# Writers holding buffered rows, flushed when the interpreter exits: a script
# that ends (or calls sys.exit, or dies of an uncaught exception) without ending
# its session would otherwise lose the rows of its last flush interval. Weak: a
# writer nobody else holds is not kept alive for this.
_BUFFERING: weakref.WeakSet[ResultLog] = weakref.WeakSet()
_BUFFERING_LOCK = threading.Lock()
# Owners of work that must finish before the rows are flushed (sessions with
# background uploads: their rows name checkpoints those uploads commit). Each
# has a ``_finish_at_exit()`` that waits for it and logs, never raises.
_FINISHING: weakref.WeakSet[Any] = weakref.WeakSet()
# Held at exit (a session never ended), released after the rows are flushed,
# while the stores' clients still take work: each has a ``release()`` that
# logs, never raises. (A later finalizer would find s3fs's executor shut down.)
_RELEASING: weakref.WeakSet[Any] = weakref.WeakSet()
_exit_hook_registered = False


def _ensure_exit_hook() -> None:
    """Register :func:`_at_exit` once (caller holds ``_BUFFERING_LOCK``)."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        _register_exit_hook(_at_exit)
        _exit_hook_registered = True


def _track(log: ResultLog) -> None:
    """Have :func:`_flush_at_exit` flush ``log``; registers the exit hook once,
    at the first use (:func:`_register_exit_hook`)."""
    with _BUFFERING_LOCK:
        _BUFFERING.add(log)
        _ensure_exit_hook()


def finish_before_exit_flush(owner: Any) -> None:
    """Have the exit hook call ``owner._finish_at_exit()`` (held weakly) before
    it flushes the rows: one hook, so the order holds whichever registered first."""
    with _BUFFERING_LOCK:
        _FINISHING.add(owner)
        _ensure_exit_hook()


def release_after_exit_flush(owner: Any) -> None:
    """Have the exit hook call ``owner.release()`` (held weakly) after it
    flushed the rows (a lease: the trial is free once its rows are stored)."""
    with _BUFFERING_LOCK:
        _RELEASING.add(owner)
        _ensure_exit_hook()


def forget_at_exit(owner: Any) -> None:
    """Undo :func:`finish_before_exit_flush` / :func:`release_after_exit_flush`."""
    with _BUFFERING_LOCK:
        _FINISHING.discard(owner)
        _RELEASING.discard(owner)


def _at_exit() -> None:
    """The interpreter-exit hook: finish pending work (uploads), flush rows,
    then release what is still held (leases)."""
    with _BUFFERING_LOCK:
        owners = list(_FINISHING)
    for owner in owners:
        try:
            owner._finish_at_exit()
        except Exception as exc:  # one owner's failure must not cost the rows
            logger.error("could not finish the pending work of %r at exit: %s", owner, exc)
    _flush_at_exit()
    with _BUFFERING_LOCK:
        held = list(_RELEASING)
    for owner in held:
        try:
            owner.release()
        except Exception as exc:  # release() logs its own failures; belt and braces
            logger.warning("could not release %r at exit: %s", owner, exc)


def _register_exit_hook(hook: Callable[[], None]) -> None:
    """Run ``hook`` when the main thread ends, before ``concurrent.futures``
    stops taking work: the async clients (adlfs, gcsfs, s3fs) run their I/O
    through executors that refuse it after that, so an ``atexit`` hook is
    too late for them. The threading module's exit hooks (what
    ``concurrent.futures`` itself uses) run last-registered first, so ours,
    registered after those libraries were imported, runs before theirs;
    ``atexit`` where that hook does not exist (other interpreters)."""
    import concurrent.futures.thread  # noqa: F401  its hook first, so it runs after ours
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(hook)
        return
    try:
        register(hook)
    except RuntimeError:  # the interpreter is already shutting down
        atexit.register(hook)


def _untrack(log: ResultLog) -> None:
    with _BUFFERING_LOCK:
        _BUFFERING.discard(log)


def _flush_at_exit(timeout: float | None = None) -> None:
    """Flush every open writer of this process, waiting at most ``timeout``
    seconds (:data:`_EXIT_FLUSH_TIMEOUT_S`) in all; failures are logged, never
    raised. A forked child skips its parent's writers: their rows are the
    parent's to write, and the same segment names would collide."""
    with _BUFFERING_LOCK:
        logs = [log for log in _BUFFERING if log._pid == os.getpid()]
    if not logs:
        return

    def flush_all() -> None:
        for log in logs:
            try:
                log.flush()
            except Exception as exc:  # one store's failure must not cost the others
                logger.warning("could not write the last rows of %s at exit (lost): %s",
                               log.uri, exc)

    # A daemon thread, so that a store that never answers is left behind.
    thread = threading.Thread(target=flush_all, name="checkpoint-store-exit-flush",
                              daemon=True)
    try:
        thread.start()
    except RuntimeError:  # an interpreter that starts no thread this late: unbounded
        flush_all()
        return
    thread.join(_EXIT_FLUSH_TIMEOUT_S if timeout is None else timeout)
    if thread.is_alive():
        logger.warning("gave up writing the last buffered result.json rows of %s after "
                       "%.0f s at exit (lost); end the session (session.end(), or "
                       "`with session.start(...)`) to write them before exiting",
                       ", ".join(log.uri for log in logs), _EXIT_FLUSH_TIMEOUT_S
                       if timeout is None else timeout)


class ResultLog:
    """Writes a trial's rows (one writer per trial: the session holding its lease).

    Local disks append in place through one unbuffered handle kept open until
    :meth:`close`; each row is one ``write`` call, so a killed process loses at
    most the row being written. Object stores buffer the rows and PUT them as
    one segment per :meth:`flush`: called by the session at each checkpoint
    report, by a timer at most ``flush_interval`` seconds after a row was
    buffered, when the buffer reaches 1 MiB, by :meth:`close`, which then
    assembles ``result.json``, and at interpreter exit for a writer never
    closed (a script that ends, calls ``sys.exit`` or dies of an uncaught
    exception without ending its session; waiting at most 10 s). A process
    killed between flushes (SIGKILL, ``os._exit``, a lost machine) loses the
    rows of the last ``flush_interval`` seconds; a segment is whole or absent.

    Thread-safety: :meth:`append` and :meth:`flush` may be called from any
    thread; flushes are serialised, and an append never waits for a PUT.

    Args:
        storage: the trial.
        flush_interval: seconds (default :func:`flush_interval_from_env`).
    """

    def __init__(self, storage: TrialStorage, *, flush_interval: float | None = None):
        self._storage = storage
        self._path = posixpath.join(storage.trial_path, RESULT_FILE)
        self._local = _fsutil.local_path(storage.filesystem, self._path)
        self._handle: Any = None
        self._interval = flush_interval if flush_interval is not None else flush_interval_from_env()
        self._token = uuid.uuid4().hex[:8]
        self._pid = os.getpid()
        self._seq = 0  # segments written (names)
        # Segments written since the last merge: (path, span, bytes).
        self._written: list[tuple[str, tuple[int, int], bytes]] = []
        self._written_bytes = 0
        self._buf_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._lines: list[bytes] = []
        self._span: tuple[int, int] | None = None  # first and last iteration buffered
        self._size = 0
        self._timer: threading.Timer | None = None
        self._last = 0  # iteration of the last row appended (names rows without one)
        if self._local is not None and os.path.isdir(
                os.path.join(os.path.dirname(self._local), RESULT_SEGMENTS_DIR)):
            # Segments on a local disk came with a copy of an object-store trial:
            # fold them before appending, or appended rows would hide them.
            assemble_results(storage)

    @property
    def uri(self) -> str:
        """The trial's ``result.json``, as a URI (for messages)."""
        return self._storage.uri(self._path)

    @property
    def buffered(self) -> int:
        """Rows waiting for the next flush (always 0 on local disks)."""
        with self._buf_lock:
            return len(self._lines)

    def _open_local(self, path: str) -> Any:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handle = open(path, "ab", buffering=0)
        # A row torn by an earlier crash has no newline: end it, so the next
        # row starts a line of its own instead of being glued to the torn one.
        if handle.tell() > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    handle.write(b"\n")
        return handle

    def append(self, row: Mapping[str, Any]) -> None:
        """Write ``row`` (local disks) or buffer it for the next flush."""
        line = _json.dumps_line(row)
        if self._local is not None:
            if self._handle is None:
                self._handle = self._open_local(self._local)
            self._handle.write(line)
            return
        it = row_iteration(row)
        full = False
        with self._buf_lock:
            it = self._last if it is None else it
            self._last = it
            self._lines.append(line)
            self._size += len(line)
            self._span = (self._span[0] if self._span else it, it)
            full = self._size >= _SEGMENT_MAX_BYTES
            first = self._timer is None  # the first row since the last flush
            if not full and first:
                timer = threading.Timer(self._interval, self._flush_on_timer)
                timer.daemon = True
                timer.start()
                # Recorded once started: a signal's exception before this line
                # leaves no timer counted that never runs (rows then waited
                # for a full segment or the session's end).
                self._timer = timer
        if first:
            _track(self)
        if full:
            self.flush()

    def _flush_on_timer(self) -> None:
        try:
            self.flush()
        except Exception as exc:  # kept buffered: the next flush tries again
            logger.warning("could not write the rows of %s yet (kept in memory, retried at "
                           "the next flush): %s", self._storage.uri(self._path), exc)

    def flush(self) -> None:
        """PUT the buffered rows as one segment (nothing on local disks or when
        none is buffered). On failure the rows stay buffered.

        Raises:
            TransientBackendError, PermanentBackendError: the PUT failed.
        """
        if self._local is not None:
            return
        with self._flush_lock:
            with self._buf_lock:
                lines, span = self._lines, self._span
                self._lines, self._span, self._size = [], None, 0
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            if not lines or span is None:
                return
            data = b"".join(lines)
            try:
                path = self._put_segment(span, data)
            except BaseException:
                with self._buf_lock:  # in front of rows appended meanwhile
                    self._lines = lines + self._lines
                    self._size += len(data)
                    self._span = (span[0], self._span[1] if self._span else span[1])
                raise
            self._note_written(path, span, data)

    def _put_segment(self, span: tuple[int, int], data: bytes) -> str:
        # A sequence number in the token: no two segments of a writer share a
        # name, even with equal spans (rows without an iteration).
        self._seq += 1
        name = result_segment_name(span[0], span[1], f"{self._token}{self._seq:08x}")
        path = posixpath.join(self._storage.trial_path, RESULT_SEGMENTS_DIR, name)
        _fsutil.write_bytes(self._storage.filesystem, path, data,
                            self._storage.backend.capabilities,
                            fsync=self._storage.fsync, retry=self._storage.retry)
        return path

    def _note_written(self, path: str, span: tuple[int, int], data: bytes) -> None:
        """Merge every :data:`_MERGE_COUNT` small segments into one (then delete
        them), so that a long run leaves a few hundred segments a day to list
        and assemble, not one per flush. A crash between the merged PUT and the
        deletes leaves segments the merged one covers: readers skip them."""
        self._written.append((path, span, data))
        self._written_bytes += len(data)
        if self._written_bytes > _MERGE_MAX_BYTES:
            self._written, self._written_bytes = [], 0  # segments this big are few
            return
        if len(self._written) < _MERGE_COUNT:
            return
        merged = (self._written[0][1][0], self._written[-1][1][1])
        small, self._written, self._written_bytes = self._written, [], 0
        try:
            self._put_segment(merged, b"".join(d for _, _, d in small))
            for old, _, _ in small:
                _fsutil.delete_file(self._storage.filesystem, old, retry=self._storage.retry)
        except Exception as exc:  # the small segments still hold the rows
            logger.warning("could not merge the result.json segments of %s: %s",
                           self._storage.uri(self._path), exc)

    def close(self) -> None:
        """Flush and assemble ``result.json`` (object stores), or close the local
        handle; a later :meth:`append` starts again.

        Raises:
            TransientBackendError, PermanentBackendError: the last flush failed
                (those rows are lost) or the assembly did (the rows stay in
                their segments, where readers find them).
        """
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._local is None:
            self.flush()
            _untrack(self)
            assemble_results(self._storage)
