"""A rank of a two-process torch run (gloo, CPU) that aborts in interpreter
shutdown, after its script's last statement: ``std::terminate`` ("terminate
called without an active exception"), raised when a native thread (gloo's
work, a tensor's deleter) takes the GIL after finalisation began and Python
ends that thread by unwinding it through a destructor. It is torch's
shutdown, after everything of ours has returned; docs/hf.md has what was
measured. Tests that run such ranks accept it only in that exact form, warn
with its stacks, and still check every outcome that is ours."""

from __future__ import annotations

import signal
import warnings

__all__ = ["aborted_in_shutdown"]


def aborted_in_shutdown(rank: int, returncode: int, out: str, err: str, *, done: str) -> bool:
    """Whether rank ``rank`` ended with SIGABRT from C++ ``std::terminate``
    after printing ``done`` (its last statement ran); if so, a RuntimeWarning
    carries its stderr (``-X faulthandler``: every thread's stack)."""
    aborted = (returncode == -signal.SIGABRT and done in out
               and "terminate called without an active exception" in err)
    if aborted:
        warnings.warn(f"rank {rank} aborted in interpreter shutdown after {done!r}: "
                      f"{err[-3000:]}", RuntimeWarning, stacklevel=2)
    return aborted
