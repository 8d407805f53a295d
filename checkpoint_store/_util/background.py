"""Background work yields the CPU to the training loop.

A checkpoint's durable copy (the local tier's copy to ``storage_path``, an
asynchronous upload) and the persist process of ``report(state=...)`` run
beside a training loop that often wants every core (BLAS, data loaders).
Where cores are short, the loop should go first: the copy then takes the
cycles the loop leaves, and takes them all once the loop waits (for the
GPU, on ``report()``'s backpressure, at the end of the run or after a
preemption signal, when nothing else runs). Linux does this without any
pacing of our own: a *nice* value weighs a thread's share of a contended
core (nice 10 gets about a tenth of a nice-0 thread's share) and
``SCHED_BATCH`` stops a waking thread from preempting the running one. On
Linux both are per thread and inherited by the threads it starts, so the
transfer pools an upload job creates inherit them. Nothing changes on a
machine with idle cores.

Each knob reads an environment variable (``CHECKPOINT_STORE_PERSIST_NICE``,
``CHECKPOINT_STORE_UPLOAD_NICE``; ``0`` turns it off). A process cannot
raise its priority back without privilege, so only threads and processes
that do nothing but background work call this.
"""

from __future__ import annotations

import os
import threading

__all__ = ["yield_to_training"]

#: The nice increment of background work unless its variable says otherwise.
DEFAULT_NICE = 10


def yield_to_training(variable: str, *, whole_process: bool) -> int:
    """Lower the calling thread's (or, with ``whole_process``, this
    process's) CPU priority: nice by the increment in environment
    ``variable`` (default :data:`DEFAULT_NICE`, at most 19 in all), and
    ``SCHED_BATCH`` where Linux has it. Never raises: an increment that is
    not an integer, or a platform without per-thread priorities, leaves the
    priority as it is.

    Returns:
        The increment applied (0 when none was).
    """
    try:
        step = int(os.environ.get(variable, str(DEFAULT_NICE)))
    except ValueError:
        return 0
    if step <= 0:
        return 0
    who = 0 if whole_process else threading.get_native_id()
    if not whole_process and not hasattr(os, "sched_setscheduler"):
        return 0  # not Linux: setpriority would change the whole process
    try:
        now = os.getpriority(os.PRIO_PROCESS, who)
        os.setpriority(os.PRIO_PROCESS, who, min(19, now + step))
    except (AttributeError, OSError):
        return 0
    try:
        os.sched_setscheduler(who, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass
    return step
