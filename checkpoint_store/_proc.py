"""Whether a process on this host is still running (lease and temp-file owners)."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs on this host.

    A zombie (exited, not yet reaped by its parent, common in containers
    without an init process) counts as dead: it will never write again.
    A pid we may not signal (another user's) counts as alive.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no /proc (macOS): trust the signal check
    # The state letter follows the command name, which sits in parentheses
    # and may itself contain spaces or parentheses.
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")
