"""Refusing to act behind a running job's back: the live lease of a trial.

Shared by the command line (``prune``, ``gc``, writes into a trial) and the
demo (before removing a previous demo trial). The liveness rule itself is
the managers' own (:func:`checkpoint_store.retention.live_lease`).
"""

from __future__ import annotations

from checkpoint_store._browse.locations import Location, storage_context
from checkpoint_store._browse.output import fmt_time
from checkpoint_store.errors import TrialInUseError

__all__ = ["refuse_if_live"]


def refuse_if_live(trial: Location, force: bool | None, what: str) -> None:
    """Refuse to ``what`` a trial whose checkpoint manager holds a live lease.

    A running session renews ``<trial>/.cs_manager_lease.json``; deleting
    behind its back would fight its own retention, and writing a checkpoint
    into it would take the index its next report writes. The liveness rule is
    the managers' own (:func:`checkpoint_store.retention.live_lease`).

    Args:
        force: True skips the check; None means the command has no ``--force``
            (writes into a live trial are never safe), and the message offers none.

    Raises:
        TrialInUseError: a live lease, unless ``force``.
    """
    from checkpoint_store.retention import live_lease

    if force:
        return
    ctx = storage_context(trial, strict=False)
    lease = live_lease(ctx) if ctx is not None else None
    if lease is None:
        return
    if "holder" in lease:
        who = f"host {lease.get('host')!r}, pid {lease.get('pid')}; lease renewed until"
    else:  # a lease file that does not read as one: being rewritten, or cut short
        who = "its lease file is unreadable, counted as live until"
    raise TrialInUseError(
        f"a running job manages {trial.uri} ({who} {fmt_time(lease['expires_at'])} UTC): "
        f"refusing to {what} behind its back; let it finish"
        + (", or pass --force if that job is gone" if force is not None else
           " (or, if that job is gone, wait for its lease to expire)")
    )
