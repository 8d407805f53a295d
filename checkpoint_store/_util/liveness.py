"""Whether a process on this host is still running (lease and temp-file owners).

A pid alone does not name a process: once a process dies its pid is free,
and in a container restarted by its runtime the new process often gets the
very same pid (pid 1, or the first few). So holders record an *incarnation*
as well: the process's start time in clock ticks since boot (Linux
``/proc/<pid>/stat``, field 22), plus the boot id, which together never
repeat on one host. A recorded pid whose current incarnation differs is a
dead holder, whatever now runs under that pid.
"""

from __future__ import annotations

import functools
import os


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (after the command name), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name sits in parentheses and may itself contain spaces or
    # parentheses: the fields start after the last ')'.
    return stat[stat.rfind(b")") + 2 :].split()


@functools.lru_cache(maxsize=1)
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:12]
    except OSError:
        return ""


def process_token(pid: int | None = None) -> str | None:
    """The incarnation of ``pid`` (default: this process) on this host, or None.

    Returns ``"<boot id>:<start time in clock ticks>"``, a string that no
    later process on this host can repeat, even under the same pid. None
    where the platform does not say (no ``/proc``: macOS, Windows); callers
    then fall back to the pid alone.
    """
    fields = _stat_fields(os.getpid() if pid is None else pid)
    if fields is None or len(fields) < 20:
        return None
    return f"{_boot_id()}:{fields[19].decode()}"


def start_ticks(pid: int | None = None) -> str | None:
    """Just the start-time part of :func:`process_token` (short enough for file
    names; within one boot it tells incarnations of a pid apart)."""
    token = process_token(pid)
    return token.rsplit(":", 1)[1] if token else None


def process_alive(pid: int, token: str | None = None) -> bool:
    """True while ``pid`` runs on this host, as the incarnation ``token`` if given.

    Args:
        pid: the recorded process id.
        token: the recorded :func:`process_token` (or, for names built with
            :func:`start_ticks`, just the start ticks). A live process under
            ``pid`` with another incarnation is a newcomer that reused the
            pid: the recorded holder is dead.

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
        pass  # another user's process: it exists; /proc still tells its incarnation
    fields = _stat_fields(pid)
    if fields is None:
        return True  # no /proc (macOS): trust the signal check
    if fields[0] in (b"Z", b"X"):
        return False
    if token:
        now = process_token(pid)
        if now is not None and token not in (now, now.rsplit(":", 1)[1]):
            return False
    return True


def writer_tag() -> str:
    """``<pid>_<start ticks>`` of this process (``<pid>`` without ``/proc``): what
    temporary file names record so cleanup can tell a dead writer's file."""
    ticks = start_ticks()
    return f"{os.getpid()}_{ticks}" if ticks else str(os.getpid())


def writer_tag_alive(tag: str) -> bool | None:
    """Whether the writer a :func:`writer_tag` names still runs; None when ``tag``
    is no such tag. This process counts as alive."""
    pid_text, _, ticks = tag.partition("_")
    try:
        pid = int(pid_text)
    except ValueError:
        return None
    if pid == os.getpid() and (not ticks or ticks == start_ticks()):
        return True
    return process_alive(pid, ticks or None)
