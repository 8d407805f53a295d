"""Bounded staging of a state in shared memory, drained by the persist process.

``session.report(metrics, state=tree)`` calls :meth:`Stager.stage`, which

1. walks ``tree`` (:func:`plan_state`): every tensor (a torch tensor, a numpy
   array) gets a place in a safetensors shard, every other leaf is kept as a
   JSON value; a leaf JSON cannot hold is refused before anything is copied;
2. copies each tensor, in pieces of at most :attr:`Stager.piece_bytes`, into
   the staging area, a shared-memory buffer of ``staging_budget`` bytes
   reused by every save; each piece, once copied, is handed to the persist
   process (:mod:`checkpoint_store.state._persist`), which writes it to its
   file and frees its place;
3. returns a :class:`StagedState` once the last byte is copied: from then on
   the training loop may change the tensors; what is saved is what they held
   during the copy (a snapshot).

A state that fits in the free part of the area costs one copy of its bytes
(:mod:`checkpoint_store.state._stage_copy`): a GPU tensor is copied
device-to-host straight into the area (pinned where CUDA allows, the copies
of a piece overlapped and waited for before the piece is handed on), a
non-contiguous one straight from its strides. A larger one is staged while
the persist process drains: ``stage()`` blocks only while the area is full,
for as long as the bytes that do not fit take to be written. The training
process never holds more staging memory than the budget, and no other copy
of a tensor; the persist process maps the same pages.

:meth:`StagedState.write_to` (the session's background worker) waits until
the persist process has written and closed every file, then returns the
tensor index for the manifest (name -> file, dtype, shape, byte range in the
file, CRC32C), the CRC32C of every file having been computed as it was
written, so the commit reads nothing back.

Where each limit comes from: the default budget,
:func:`default_staging_budget`, is min(2 GiB, 25 % of RAM): 2 GiB holds the
1 GiB benchmark state with room for the next save, and a quarter of RAM
leaves the training process its memory on small machines; it is measured
in ``benchmarks/bench_state.py`` (docs/benchmarks.md).
"""

from __future__ import annotations

import collections
import json
import logging
import mmap
import os
import threading
from collections.abc import Mapping
from typing import Any

from checkpoint_store._format.layout import (
    SHARED_STAGING_NAME,
    SHARED_STAGING_PREFIX,
    WRITTEN_STATE_RECORD,
)
from checkpoint_store._util.locks import condition
from checkpoint_store.errors import InvalidConfigError, PersistProcessError
from checkpoint_store.state._stage_copy import StagingCopier
from checkpoint_store.state._tree import DTYPES, FlatState

__all__ = [
    "PIECE_BYTES",
    "StagedState",
    "Stager",
    "check_staging_budget",
    "default_staging_budget",
    "plan_state",
]

GiB = 1 << 30
MiB = 1 << 20
#: The largest piece copied and written at once (smaller with a small budget).
PIECE_BYTES = 32 * MiB
_ALIGN = 64
# madvise(2): fault pages in, writable, without touching their content.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
logger = logging.getLogger(__name__)


def default_staging_budget() -> int:
    """min(2 GiB, 25 % of physical memory), in bytes (at least 64 MiB)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 * GiB
    return max(64 * MiB, min(2 * GiB, ram // 4))


def check_staging_budget(value: Any) -> int:
    """``value`` (bytes, an int >= 1 MiB), or the default for None.

    Raises:
        InvalidConfigError: anything else.
    """
    if value is None:
        return default_staging_budget()
    if isinstance(value, bool) or not isinstance(value, int) or value < MiB:
        raise InvalidConfigError(
            f"staging_budget must be a number of bytes >= {MiB} (1 MiB), got {value!r}")
    return value


# -- the plan: the format package's flattening ------------------------------------------


def plan_state(state: Any) -> FlatState:
    """Flatten ``state`` (:func:`checkpoint_store.state.flatten_state`): its
    tensors and its picklable layout; nothing is copied.

    Raises:
        UnsupportedStateError: a key, leaf or dtype the format cannot store
            (names the flattened key); nothing is copied or written.
    """
    from checkpoint_store.state._tree import flatten_state

    return flatten_state(state)


# -- the staging area and its persist process ------------------------------------------


class Stager:
    """A staging area of ``budget`` bytes of shared memory and the persist
    process draining it; one per session (or per Lightning plugin).

    Args:
        budget: staging bytes (default :func:`default_staging_budget`).
        piece_bytes: the largest piece copied at once (default
            min(32 MiB, budget / 4)).

    Thread-safety: one thread stages at a time; :meth:`StagedState.write_to`
    may run on another.
    """

    def __init__(self, budget: int | None = None, *, piece_bytes: int | None = None):
        self.budget = check_staging_budget(budget)
        self.piece_bytes = piece_bytes or max(64 * 1024, min(PIECE_BYTES, self.budget // 4))
        self._mutex, self._cond = condition()  # enter _mutex, not the condition
        self._ring: collections.deque[tuple[int, int]] = collections.deque()
        self._head = 0
        self._fd: int | None = None
        self._area: mmap.mmap | None = None
        #: Copies tensors into the area (None until the area exists).
        self.copier: StagingCopier | None = None
        self._proc: Any = None
        self._dead: PersistProcessError | None = None
        self._states: dict[int, StagedState] = {}
        self._next_fid = 0
        self._stage_lock = threading.Lock()
        self._outbox: list[tuple[Any, ...]] = []
        #: Staging bytes in use now, and the most ever in use (for tests and benchmarks).
        self.in_use = 0
        self.peak_in_use = 0
        self.closed = False

    # -- the area --------------------------------------------------------------

    def _ensure(self) -> None:
        """The area exists and a live persist process maps it."""
        from checkpoint_store.state._persist import PersistProcess

        if self.closed:
            raise PersistProcessError("this stager is closed")
        if self._area is None:
            self._fd = _shared_fd(self.budget)
            self._area = mmap.mmap(self._fd, self.budget)
            self.copier = StagingCopier(self._area)
        if self._proc is not None and self._dead is None:
            return
        if self._proc is not None:  # a dead one: its states failed already
            self._proc.close(timeout=5)
            with self._mutex:
                self._ring.clear()
                self.in_use = 0
                self._dead = None
                self._outbox = []
        assert self._fd is not None
        self._proc = PersistProcess(self._fd, self.budget, self._on_message, self._on_exit)

    def warm(self, prefault_bytes: int = 0) -> None:
        """Make the area and the persist process ready before the first
        :meth:`stage` (called on a background thread; never blocks a stage
        for long): the process starts, and the first ``prefault_bytes`` of
        the area (at most the budget) get their pages now, so the first copy
        does not pay the page faults. Best effort: a failure is left to the
        first stage, which raises it.

        Pages are faulted with ``MADV_POPULATE_WRITE`` (Linux 5.14+), which
        leaves their content alone, so a stage may run meanwhile; without it,
        by writing one zero per page under the stage lock (before any stage).
        Where this process already uses CUDA, the whole area is pinned
        instead (under the stage lock: a first stage of GPU tensors would
        pin it), which faults every page.
        """
        with self._stage_lock:
            if self.closed:
                return
            try:
                self._ensure()
                assert self.copier is not None
                self.copier.warm()
            except Exception as exc:  # raised again by the first stage
                logger.debug("could not warm the staging area: %s", exc)
                return
            if self.copier.pinned:
                return
            area = self._area
        n = min(max(0, int(prefault_bytes)), self.budget)
        if area is None or n == 0:
            return
        try:
            area.madvise(_MADV_POPULATE_WRITE, 0, n)
            return
        except (OSError, ValueError):  # an older kernel: touch the pages
            pass
        with self._stage_lock:
            if self.closed or self._area is not area or self._next_fid:
                return  # a stage began: it faults its own pages
            page = mmap.PAGESIZE
            _np_bytes(area)[:n:page] = 0

    @property
    def persist_pid(self) -> int | None:
        """The pid of the persist process (None before the first save)."""
        return self._proc.pid if self._proc is not None else None

    def _alloc(self, n: int) -> int:
        """A place for ``n`` bytes in the area; while it is full, the pieces
        copied so far go to the persist process and this waits for it to free
        some."""
        need = (n + _ALIGN - 1) // _ALIGN * _ALIGN
        while True:
            with self._mutex:
                if self._dead is not None:
                    raise self._dead
                off = self._fit(need)
                if off is not None:
                    self._ring.append((off, need))
                    self._head = off + need
                    self.in_use += need
                    self.peak_in_use = max(self.peak_in_use, self.in_use)
                    return off
                if not self._outbox:
                    self._cond.wait(1.0)
                    continue
            self._flush()

    def _send(self, msg: tuple[Any, ...]) -> None:
        # Held back while the state still fits: the persist process starts
        # writing once the copy is done, not competing with it for a core.
        self._outbox.append(msg)

    def _flush(self) -> None:
        """Send what was held back, once every copy into it has finished (the
        process must never read a byte before its copy is done); sent even
        when that wait fails, so the process frees the pieces' places."""
        out, self._outbox = self._outbox, []
        try:
            if self.copier is not None:
                self.copier.sync()
        finally:
            if out:
                self._proc.send(out)  # one batch: one write, one wake-up

    def _fit(self, n: int) -> int | None:
        size, ring, head = self.budget, self._ring, self._head
        if n > size:
            raise AssertionError("piece larger than the staging area")
        if not ring:
            return 0
        tail = ring[0][0]
        if head > tail:
            if head + n <= size:
                return head
            return 0 if n <= tail else None
        if head < tail:
            return head if head + n <= tail else None
        return None  # head == tail with pieces in: full

    def _on_message(self, msg: tuple[Any, ...]) -> None:
        op = msg[0]
        with self._mutex:
            if op == "freed":
                off = msg[1]
                if self._ring and self._ring[0][0] == off:
                    self.in_use -= self._ring.popleft()[1]
                self._cond.notify_all()
                return
            state = self._states.get(msg[1])
        if state is None:
            return
        if op == "closed":
            state._closed(msg[2], msg[3])
        elif op == "error":
            from checkpoint_store.state._persist import error_from_facts

            state._fail(error_from_facts(msg[3] if len(msg) > 3 else None, msg[2],
                                         state.directory))

    def _on_exit(self, code: int) -> None:
        error = PersistProcessError(
            f"the persist process (pid {self._proc.pid if self._proc else '?'}) exited with "
            f"code {code} before the staged state was written"
            + (" (killed by a signal)" if code < 0 else ""))
        with self._mutex:
            if self.closed and not self._states:
                return
            self._dead = error
            states = list(self._states.values())
            self._cond.notify_all()
        for s in states:
            s._fail(error)

    # -- staging ---------------------------------------------------------------

    def stage(self, state: FlatState | Mapping[str, Any], directory: str) -> StagedState:
        """Copy the tensors of ``state`` (a tree, or :func:`plan_state`'s
        result) into the staging area and have the persist process write the
        state's files (docs/state.md) into ``directory`` (local, created if
        missing); returns once the last byte is copied, blocking while the
        area is full.

        Raises:
            UnsupportedStateError: a leaf or key of the state is refused
                (nothing copied).
            PersistProcessError: the persist process died while the area was
                full (the state is not saved).
            RuntimeError: a device-to-host copy failed (torch's error; the
                state is not saved).
        """
        flat = state if isinstance(state, FlatState) else plan_state(state)
        with self._stage_lock:
            self._ensure()
            os.makedirs(directory, exist_ok=True)
            with self._mutex:
                sid = self._next_fid
                self._next_fid += 1
                staged = StagedState(self, flat, directory, sid)
                self._states[sid] = staged
            try:
                try:
                    self._send(("open", sid, os.path.abspath(directory), flat.layout))
                    try:
                        for key, spec in flat.layout.tensors.items():
                            item = DTYPES[spec.dtype][0]
                            self._copy_tensor(sid, key, flat.values[key], item,
                                              spec.nbytes // item)
                    except BaseException:
                        # Cut short (a signal's exception included): the process
                        # writes none of it, or removes what it wrote, rather
                        # than finishing a state whose directory the caller
                        # is about to drop.
                        self._send(("abort", sid))
                        raise
                    self._send(("close", sid, False))
                finally:
                    self._flush()  # every piece copied is freed by the process
            except BaseException as exc:
                staged._fail(exc)
                raise
            return staged

    def _copy_tensor(self, sid: int, key: str, value: Any, item: int, count: int) -> None:
        """Copy ``count`` elements of ``item`` bytes in pieces of at most
        :attr:`piece_bytes`, each sent once its place is taken (the copy may
        still run: :meth:`_flush` waits for it before the process sees it)."""
        copier = self.copier
        assert copier is not None
        src = copier.source(value)
        per = max(1, self.piece_bytes // item)
        for a in range(0, count, per):
            k = min(per, count - a)
            off = self._alloc(k * item)
            try:
                copier.copy(src, a, k, off)
            finally:
                self._send(("write", sid, key, off, k * item, a * item))

    def close(self) -> None:
        """Stop the persist process (after what it was sent) and free the area."""
        with self._stage_lock:
            self.closed = True
            proc, self._proc = self._proc, None
            if proc is not None:
                proc.close()
            if self.copier is not None:
                self.copier.close()  # unpinned before the area goes
                self.copier = None
            if self._area is not None:
                try:
                    self._area.close()
                except BufferError:  # a view still exported: freed with the process
                    pass
                self._area = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _shared_fd(size: int) -> int:
    """A file descriptor of ``size`` bytes of shared memory with no name left
    anywhere (``memfd_create``, else an unlinked file on /dev/shm)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(SHARED_STAGING_NAME, os.MFD_CLOEXEC)
    else:  # pragma: no cover - not Linux
        import tempfile

        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix=SHARED_STAGING_PREFIX, dir=root)
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _np_bytes(view: Any) -> Any:
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8)


class StagedState:
    """A state copied into the staging area, being written by the persist process.

    Attributes:
        nbytes: staged tensor bytes.
        directory: the local directory its files are written into.
    """

    def __init__(self, stager: Stager, flat: FlatState, directory: str, sid: int):
        self._stager = stager
        self.layout = flat.layout
        self.directory = directory
        self.nbytes = flat.nbytes
        self._sid = sid
        self._result: tuple[dict[str, Any], list[dict[str, Any]]] | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._released = False

    def _closed(self, index: dict[str, Any], files: list[dict[str, Any]]) -> None:
        self._result = (index, files)
        self._forget()
        self._done.set()

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._forget()
        self._done.set()

    def _forget(self) -> None:
        with self._stager._mutex:
            self._stager._states.pop(self._sid, None)

    def wait(self, timeout: float | None = None) -> bool:
        """True once every file is written (or the write failed)."""
        return self._done.wait(timeout)

    def write_to(self, directory: str | None = None, *, record: bool = True) -> dict[str, Any]:
        """Wait until the persist process has written every file, then return
        the tensor index (:class:`~checkpoint_store.state.StateWriter`'s:
        ``{key: {"file", "dtype", "shape", "offsets": [begin, end),
        "crc32c", "framework"}}``). ``directory`` (default: the one given to
        :meth:`Stager.stage`) receives the files: moved there when it is
        another directory.

        With ``record``, also leaves a ``.cs_written-state.json`` record of
        every file's size and CRC32C (computed by the persist process as it
        wrote), which an in-place commit takes instead of reading the files
        again (leave it out for a directory to upload: the upload refuses
        names it reserves, and checksums as it reads).

        Raises:
            PersistProcessError: the persist process died; nothing of this
                state is complete.
            StorageFullError, PermanentBackendError: the disk the files go to
                is full, read-only or not writable (in the persist process or
                here, as the directory path raises them); any other error of
                the persist process as its type (``InvalidConfigError``, ...).
        """
        from checkpoint_store._util.retry import typed_permanent

        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        index, files = self._result
        src = self.directory
        dst = src if directory is None else directory
        try:
            if os.path.abspath(dst) != os.path.abspath(src):
                _move_files(src, dst, [f["path"] for f in files])
            if record:
                with open(os.path.join(dst, WRITTEN_STATE_RECORD), "w") as f:
                    json.dump({"files": files}, f)
        except OSError as exc:
            typed = typed_permanent(exc, f"write the state into {dst}")
            if typed is exc:
                raise
            raise typed from exc
        return index

    def release(self) -> None:
        """Forget this state (its job was dropped or failed); idempotent. The
        persist process still frees the staging of every piece already sent."""
        if not self._released:
            self._released = True
            self._forget()


def _move_files(src: str, dst: str, names: list[str]) -> None:
    import shutil

    os.makedirs(dst, exist_ok=True)
    for name in names:
        try:
            os.replace(os.path.join(src, name), os.path.join(dst, name))
        except OSError:
            shutil.move(os.path.join(src, name), os.path.join(dst, name))

