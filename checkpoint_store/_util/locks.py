"""A condition variable whose lock a signal handler's exception cannot leak.

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
"""

from __future__ import annotations

import threading

__all__ = ["condition"]


def condition() -> tuple[threading.RLock, threading.Condition]:
    """``(mutex, cond)``: enter ``mutex``, wait on and notify ``cond``.

    The mutex is reentrant, as a ``threading.Condition()``'s own lock is."""
    mutex = threading.RLock()
    return mutex, threading.Condition(mutex)
