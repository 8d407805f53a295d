"""Targets of ``load_state(into=...)`` that share memory: told apart before any read.

Two targets under different keys are *apart* when they share no element,
and *the same view* when they start at the same address with the same
shape, strides and dtype (tied weights; whether their saved values agree is
checked after the read, ``_read._check_shared_targets``). Anything else,
two views that share some elements but not all (``t[0:2]`` and ``t[1:3]``,
a tensor and its transpose, a ``StateSlice`` of a DTensor's local shard),
would leave the shared elements holding whichever key was copied last:
:func:`check_apart` refuses it with a
:class:`~checkpoint_store.errors.StateMismatchError` naming both keys,
before anything is read or changed. Views of one buffer that interleave
without sharing an element (``t[:, 0]`` and ``t[:, 1]``; ``t[::2]`` and
``t[1::2]``) load as any other targets.

What "shares an element" means, and what deciding it costs, is
:mod:`checkpoint_store.state._sharing`: the same rule a save applies to the
tensors of a state (100,000 separate targets take about 0.4 s, 4 us a
target, Python).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from checkpoint_store.errors import StateMismatchError
from checkpoint_store.state._placement import StateSlice, _is_dtensor
from checkpoint_store.state._sharing import PAIRWISE_RUN, find_sharing, view_ident

__all__ = ["check_apart", "memory_of"]


def memory_of(target: Any) -> tuple[Any, ...]:
    """What memory a load target writes: its address, shape, strides and
    dtype (two targets with equal ones are the same view, tied weights)."""
    return view_ident(_local(target))


def _local(target: Any) -> Any:
    """The tensor or array a target's bytes are copied into."""
    t = target.tensor if isinstance(target, StateSlice) else target
    return t.to_local() if _is_dtensor(t) else t


def check_apart(targets: Mapping[str, Any], *, pairwise_run: int = PAIRWISE_RUN) -> None:
    """Refuse two targets (``{flattened key: target}``, as ``_check_into``
    returns them) that share some memory without being the same view; a run
    of more than ``pairwise_run`` overlapping extents is decided at once.

    Raises:
        StateMismatchError: naming both keys; nothing was read or changed.
    """
    found = find_sharing(((key, _local(target)) for key, target in targets.items()),
                         pairwise_run=pairwise_run).clash
    if found is not None:
        raise _refusal(*found)


def _refusal(first: str, second: str, why: str) -> StateMismatchError:
    return StateMismatchError(
        f"into: {first!r} and {second!r} are views of the same memory that overlap "
        f"without being the same view ({why}): filling one would overwrite part of the "
        f"other. Give each key memory of its own (.clone() one of them, for numpy "
        f".copy()), or leave one out of into= and load it separately",
        key=second, expected="memory of its own", found=f"memory shared with {first!r}")
