"""A condition variable whose lock, and a worker thread whose start, a signal
handler's exception cannot lose.

``with condition:`` runs ``threading.Condition.__enter__``, a Python
function: the interpreter runs a pending signal handler right after the
lock's ``acquire`` returns inside it, and an exception from that handler
(``KeyboardInterrupt`` on Ctrl-C, the ``SystemExit`` of a program's own
SIGTERM handler) leaves ``__enter__`` with the lock held and ``__exit__``
never called: every other thread that enters the condition then blocks for
ever. A session's main thread (``report()``, the end of the session) enters
conditions that its background threads share, so a signal at that instant
hung the run until the scheduler's SIGKILL, with acknowledged saves lost.

:func:`condition` returns the lock and a condition on it; code enters the
lock (``with mutex:``, whose ``__enter__`` is the lock's own, in C: no
Python frame runs between the acquire and the ``with`` block's cleanup)
and calls ``wait``/``notify`` on the condition. ``Condition.wait`` takes
the lock back before it raises, so the ``with`` around it releases it.

The same exception can land between any two statements of the main thread,
also between queueing a job and starting the thread that runs it, or inside
``Thread.start`` itself: the job then waits for ever for a worker nobody
started, and so does whoever waits for the job. :class:`OneWorker` starts
the worker so that any such cut leaves either a worker or a start to be made
again by the next :meth:`OneWorker.ensure`, never two loops at once.

A job handed to a worker can be cut the same way: the submitter's call
raises after the job was queued, or before. :class:`TakeBack` lets the
submitter tell which under one lock: either it takes the job back (it never
runs; the submitter frees what it staged for it) or the worker took it (it
runs to its end, and the worker frees it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["OneWorker", "TakeBack", "condition"]

T = TypeVar("T")


def condition() -> tuple[threading.RLock, threading.Condition]:
    """``(mutex, cond)``: enter ``mutex``, wait on and notify ``cond``.

    The mutex is reentrant, as a ``threading.Condition()``'s own lock is."""
    mutex = threading.RLock()
    return mutex, threading.Condition(mutex)


class OneWorker:
    """At most one thread runs an owner's loop, started on demand.

    The owner keeps its work under its own mutex (from :func:`condition`) and
    calls :meth:`ensure` under it whenever work is queued, also in its waits
    (a start cut short by a signal's exception is made again there). Its
    loop begins with ``with mutex: if not slot.claim(): return`` and, in the
    critical section where it finds no work left, calls :meth:`release`
    before it returns. A thread started twice for one cut (the first start
    went through, its bookkeeping did not) finds the loop claimed and ends.

    Args:
        target: the owner's loop.
        name: the thread's name.
        daemon: as ``threading.Thread``'s.
    """

    def __init__(self, target: Callable[[], None], name: str, *, daemon: bool = False):
        self._target = target
        self._name = name
        self._daemon = daemon
        self._serving: threading.Thread | None = None
        self._launching: threading.Thread | None = None
        #: The thread started last (None before the first start).
        self.last: threading.Thread | None = None

    def ensure(self) -> None:
        """Start a thread unless one runs the loop or is about to (call it
        under the owner's mutex)."""
        for t in (self._serving, self._launching):
            if t is not None and t.is_alive():
                return
        t = threading.Thread(target=self._target, name=self._name, daemon=self._daemon)
        t.start()
        # Recorded once started: a start cut short is retried, never counted.
        self._launching = self.last = t

    def claim(self) -> bool:
        """In the new thread, under the owner's mutex: whether it runs the
        loop (False: another thread does; return at once)."""
        me = threading.current_thread()
        if self._launching is me:
            self._launching = None
        s = self._serving
        if s is not None and s is not me and s.is_alive():
            return False
        self._serving = me
        return True

    def release(self) -> None:
        """The loop ends (under the owner's mutex, where it found no work)."""
        if self._serving is threading.current_thread():
            self._serving = None

    def running_here(self) -> bool:
        """Whether the calling thread runs the loop."""
        return self._serving is threading.current_thread()


class TakeBack(Generic[T]):
    """A job a worker runs once, unless its submitter takes it back first.

    A submitter whose queueing call raised (a signal's exception can land
    before the job was queued or after) calls :meth:`take_back`: True means
    the job will never run and the submitter frees what it staged for it;
    False means a worker took it, and it runs as any other. Calling the job
    on the worker takes it first, so exactly one of the two sides owns it.

    Args:
        run: the job; its value is returned by the call that runs it.
        release: the worker's cleanup after a job it ran (:meth:`release`);
            never run for a job taken back (its submitter frees it).
    """

    def __init__(self, run: Callable[[], T], release: Callable[[], None] | None = None):
        self._run = run
        self._release = release
        self._lock = threading.Lock()
        self._taken = False
        self._ran = False

    def _take(self) -> bool:
        with self._lock:
            taken, self._taken = self._taken, True
        return not taken

    def take_back(self) -> bool:
        """True: it will not run (the caller frees what it staged)."""
        return self._take()

    def __call__(self) -> T | None:
        """Run the job, or return None at once where it was taken back."""
        if not self._take():
            return None
        self._ran = True
        return self._run()

    def release(self) -> None:
        """The worker's cleanup: ``release`` of a job it ran, else nothing."""
        if self._ran and self._release is not None:
            self._release()
