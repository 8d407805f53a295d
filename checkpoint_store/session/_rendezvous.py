"""How the ranks of one launch attempt meet: the attempt id they share, the
torch.distributed group they talk over when there is one, and the backoff of
their polls on storage when there is none.

Used by :class:`~checkpoint_store.session._multirank.Coordinator`, from the
training thread of every rank.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any

from checkpoint_store._util.ids import torchrun_attempt
from checkpoint_store.errors import InvalidConfigError

__all__ = ["Backoff", "checked_attempt_id", "torch_group"]

_ATTEMPT_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,96}$")


class Backoff:
    """Sleeps 5 ms, doubling up to 0.5 s, until a deadline ``timeout_s`` seconds away."""

    def __init__(self, timeout_s: float):
        self.deadline = time.monotonic() + timeout_s
        self.delay = 0.005

    def sleep(self) -> bool:
        """Sleep once; False when the deadline has passed (nothing slept)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(self.delay, left))
        self.delay = min(self.delay * 2, 0.5)
        return True


def torch_group(world_rank: int, world_size: int) -> tuple[bool, Any]:
    """Whether to synchronise over torch.distributed, and on which group.

    Returns ``(False, None)`` without a process group, ``(True, None)`` for the
    default group when it is gloo (None is how torch names the default group),
    and ``(True, subgroup)`` for a gloo subgroup made here when the default
    group is another backend (NCCL), because object collectives on NCCL need a
    CUDA device.

    No reference to the default group is kept: torch frees it in
    ``destroy_process_group()`` only when nothing else holds it, and a group
    freed later, while the interpreter shuts down, aborts the process
    ("terminate called without an active exception" from gloo's threads).

    torch is never imported here: only a process that already imported it can
    have a process group.

    Raises:
        InvalidConfigError: the process group's rank or size is not the session's.
    """
    if "torch" not in sys.modules:
        return False, None
    try:
        import torch.distributed as dist
    except ImportError:
        return False, None
    if not (dist.is_available() and dist.is_initialized()):
        return False, None
    if dist.get_world_size() != world_size or dist.get_rank() != world_rank:
        raise InvalidConfigError(
            f"session rank {world_rank}/{world_size} disagrees with the torch.distributed "
            f"process group (rank {dist.get_rank()}/{dist.get_world_size()}); pass the "
            "process group's rank and size, or none at all"
        )
    if dist.get_backend() == "gloo":
        return True, None
    return True, dist.new_group(backend="gloo")


def checked_attempt_id(attempt_id: str | None, world_size: int) -> str:
    """``attempt_id``, else torchrun's rendezvous id and restart count
    (``<TORCHELASTIC_RUN_ID>-<TORCHELASTIC_RESTART_COUNT>``), checked.

    Raises:
        InvalidConfigError: neither is there, or the id is not 1-96 letters,
            digits, ``_``, ``.`` and ``-``.
    """
    if attempt_id is None:
        launch = torchrun_attempt()
        if launch is not None:
            attempt_id = re.sub(r"[^A-Za-z0-9_.\-]", "_", "-".join(launch))[:96]
    if attempt_id is None:
        raise InvalidConfigError(
            f"a session with world_size={world_size} needs a attempt id shared by all "
            "ranks of this launch and unique per launch: pass attempt_id=... to "
            "session.start(), launch with torchrun, or call "
            "torch.distributed.init_process_group() before session.start()"
        )
    if not isinstance(attempt_id, str) or not _ATTEMPT_ID_RE.match(attempt_id):
        raise InvalidConfigError(
            f"attempt_id {attempt_id!r} must be 1-96 letters, digits, '_', '.' or '-'"
        )
    return attempt_id
