"""Targets of ``load_state(into=...)`` that share memory: told apart before any read.

Two targets under different keys are *apart* when no byte of one is a byte
of the other, and *the same view* when they start at the same address with
the same shape, strides and dtype (tied weights; whether their saved values
agree is checked after the read, ``_read._check_shared_targets``). Anything
else, two views that share some bytes but not all (``t[0:2]`` and
``t[1:3]``, a tensor and its transpose, a ``StateSlice`` of a DTensor's
local shard), would leave the shared elements holding whichever key was
copied last: :func:`check_apart` refuses it with a
:class:`~checkpoint_store.errors.StateMismatchError` naming both keys,
before anything is read or changed.

The rule, exactly: each target's memory is its address space (the CPU for
numpy arrays and CPU tensors, which may alias each other through
``torch.from_numpy``; each accelerator device on its own), and its extent,
``[address of its lowest element, address of its highest element +
itemsize)``. Targets whose extents are disjoint are apart. Extents that
overlap are decided element by element: views of one buffer can interleave
without sharing an element (``t[:, 0]`` and ``t[:, 1]``; ``t[::2]`` and
``t[1::2]``), and those load as any other targets. The element test is
numpy's exact bounded solver (``numpy.shares_memory`` over the two layouts;
no memory is touched); where it gives up (layouts only ``as_strided`` makes)
the element addresses of both views inside the shared window are compared,
at most :data:`WINDOW_ELEMENTS` of each; past that the pair is refused as
if it shared memory, with a message that says so.

Cost: one sort of the n targets by address, then one pass that cuts them
into runs of chained overlapping extents: O(n log n), and a run of one (a
model's tensors, each its own allocation) costs nothing more. A run of a
few views is decided pair by pair (one solver call per pair of overlapping
extents); a longer one (the columns of a matrix, each its own target) from
all its element addresses at once, sorted (O(E log E) for E elements, at
most :data:`WINDOW_ELEMENTS`; past that pair by pair): 1,000 columns of a
1000 x 1000 matrix take about 0.08 s, 100,000 separate tensors about 0.9 s
(10 us a target, Python).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from checkpoint_store.errors import StateMismatchError
from checkpoint_store.state._placement import StateSlice, _is_dtensor

__all__ = ["WINDOW_ELEMENTS", "check_apart", "memory_of"]

#: Element addresses each view may contribute when the exact solver gives up
#: (8 bytes each): beyond this a pair with overlapping extents is refused.
WINDOW_ELEMENTS = 1 << 22

#: Effort numpy's solver may spend on one pair before the window comparison.
_MAX_WORK = 1 << 16

#: A run of more views with overlapping extents than this is decided from
#: all their element addresses at once (where at most WINDOW_ELEMENTS).
_PAIRWISE_RUN = 16


def memory_of(target: Any) -> tuple[Any, ...]:
    """What memory a load target writes: its address, shape, strides and
    dtype (two targets with equal ones are the same view, tied weights)."""
    return _ident(_local(target))


def _ident(t: Any) -> tuple[Any, ...]:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        return ("torch", t.data_ptr(), tuple(t.shape), t.stride(), str(t.dtype))
    return ("numpy", t.__array_interface__["data"][0], t.shape, t.strides, t.dtype.str)


def _local(target: Any) -> Any:
    """The tensor or array a target's bytes are copied into."""
    t = target.tensor if isinstance(target, StateSlice) else target
    return t.to_local() if _is_dtensor(t) else t


@dataclass(frozen=True)
class _Layout:
    """Where a target's elements lie: element 0 at ``start``, ``strides`` in
    bytes (numpy's may be negative), each element ``itemsize`` bytes;
    ``[lo, hi)`` the bytes from its lowest element's first to its highest's last."""

    space: str
    start: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    lo: int = 0
    hi: int = 0

    @classmethod
    def of(cls, space: str, start: int, shape: tuple[int, ...], strides: tuple[int, ...],
           itemsize: int) -> _Layout:
        spans = [(n - 1) * s for n, s in zip(shape, strides, strict=True)]
        return cls(space, start, shape, strides, itemsize,
                   start + sum(d for d in spans if d < 0),
                   start + sum(d for d in spans if d > 0) + itemsize)


def _layout(t: Any) -> _Layout | None:
    """The layout of a tensor's or array's memory, or None where it has no
    elements or no memory (a meta tensor)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        if t.numel() == 0 or t.device.type == "meta":
            return None
        item = t.element_size()
        space = "cpu" if t.device.type == "cpu" else str(t.device)
        return _Layout.of(space, t.data_ptr(), tuple(t.shape),
                          tuple(s * item for s in t.stride()), item)
    if t.size == 0:
        return None
    return _Layout.of("cpu", t.__array_interface__["data"][0], tuple(t.shape),
                      tuple(t.strides), t.itemsize)


def check_apart(targets: Mapping[str, Any], *, pairwise_run: int = _PAIRWISE_RUN) -> None:
    """Refuse two targets (``{flattened key: target}``, as ``_check_into``
    returns them) that share some memory without being the same view; a run
    of more than ``pairwise_run`` overlapping extents is decided at once.

    Raises:
        StateMismatchError: naming both keys; nothing was read or changed.
    """
    # One entry per distinct view: tied keys of one view are one entry here.
    views: dict[tuple[Any, ...], tuple[str, _Layout]] = {}
    for key, target in targets.items():
        local = _local(target)
        layout = _layout(local)
        if layout is not None:
            views.setdefault(_ident(local), (key, layout))
    spans = sorted(views.values(), key=lambda kv: (kv[1].space, kv[1].lo))
    # Runs of extents that overlap one another (most targets: a run of one).
    run: list[tuple[str, _Layout]] = []
    reach = 0
    for key, lay in spans:
        if run and (lay.space != run[0][1].space or lay.lo >= reach):
            _check_run(run, pairwise_run)
            run = []
        reach = max(reach, lay.hi) if run else lay.hi
        run.append((key, lay))
    _check_run(run, pairwise_run)


def _check_run(run: list[tuple[str, _Layout]], pairwise_run: int) -> None:
    """Refuse two views of a run (sorted by ``lo``, extents chained by
    overlap) that share an element. A long run (many interleaved views, the
    columns of one matrix) is decided in one pass over its element addresses
    where they are few enough; else, as a short one, pair by pair."""
    if len(run) < 2:
        return
    if len(run) > pairwise_run and _check_run_jointly(run):
        return
    open_: list[tuple[str, _Layout]] = []
    for key, lay in run:
        open_ = [o for o in open_ if o[1].hi > lay.lo]
        for other, olay in open_:
            why = _shared(olay, lay)
            if why is not None:
                raise _refusal(other, key, why)
        open_.append((key, lay))


def _check_run_jointly(run: list[tuple[str, _Layout]]) -> bool:
    """Decide a run from all its element addresses at once (False: too many,
    decide pair by pair). Sorted by address, an element shares a byte with
    an earlier one iff it starts before the furthest end seen so far."""
    import numpy as np

    lo, hi = run[0][1].lo, max(lay.hi for _, lay in run)
    starts, ends, owners = [], [], []
    total = 0
    for i, (_, lay) in enumerate(run):
        got = _starts_in(np, lay, lo, hi)
        total += 0 if got is None else got.size
        if got is None or total > WINDOW_ELEMENTS:
            return False
        starts.append(got)
        ends.append(got + lay.itemsize)
        owners.append(np.full(got.size, i, dtype=np.int64))
    s, e, w = (np.concatenate(x) for x in (starts, ends, owners))
    order = np.argsort(s, kind="stable")
    s, e, w = s[order], e[order], w[order]
    furthest = np.maximum.accumulate(e)
    clash = np.flatnonzero(s[1:] < furthest[:-1])
    if clash.size == 0:
        return True
    i = int(clash[0]) + 1
    j = int(np.argmax(e[:i]))  # the element (earlier in order) that reaches element i
    if w[i] == w[j]:  # a view whose own elements share memory: let the pairs decide
        return False
    first, second = sorted((int(w[i]), int(w[j])))
    raise _refusal(run[first][0], run[second][0], "they share elements")


def _shared(a: _Layout, b: _Layout) -> str | None:
    """Why two layouts with overlapping extents cannot both be filled (they
    share a byte, or that could not be ruled out), or None: they are apart."""
    import numpy as np

    # Typed as taking only -1 or 0, but any bound on the work is accepted.
    solve: Any = np.shares_memory
    try:
        if solve(_as_array(np, a), _as_array(np, b), max_work=_MAX_WORK):
            return "they share elements"
        return None
    except getattr(np, "exceptions", np).TooHardError:  # numpy < 1.25: np.TooHardError
        pass
    return _shared_in_window(np, a, b)


class _Interface:
    """An object numpy reads a layout from; the address is never dereferenced."""

    def __init__(self, lay: _Layout):
        self.__array_interface__ = {"data": (lay.start, False), "shape": lay.shape,
                                    "strides": lay.strides, "typestr": f"|V{lay.itemsize}",
                                    "version": 3}


def _as_array(np: Any, lay: _Layout) -> Any:
    """An array with ``lay``'s address and layout, for numpy's overlap solver
    (which reads only the layout: an accelerator's address serves as well)."""
    return np.asarray(_Interface(lay))


def _shared_in_window(np: Any, a: _Layout, b: _Layout) -> str | None:
    """The exact test the solver gave up on: the element addresses of both
    views inside the window their extents share, compared in sorted order."""
    lo, hi = max(a.lo, b.lo), min(a.hi, b.hi)
    starts = []
    for lay in (a, b):
        got = _starts_in(np, lay, lo - lay.itemsize + 1, hi)
        if got is None:
            return (f"they overlap in a way too costly to rule out element by element "
                    f"(more than {WINDOW_ELEMENTS} elements in the shared window)")
        starts.append(got)
    (sa, sb), (ia, ib) = starts, (a.itemsize, b.itemsize)
    if not len(sa) or not len(sb):
        return None
    # An element of b overlaps one of a iff the nearest a-start at or below
    # it reaches it, or the nearest b-start at or below an a-start reaches that.
    pa = np.searchsorted(sa, sb, side="right") - 1
    if bool(((pa >= 0) & (sb < sa[np.maximum(pa, 0)] + ia)).any()):
        return "they share elements"
    pb = np.searchsorted(sb, sa, side="right") - 1
    if bool(((pb >= 0) & (sa < sb[np.maximum(pb, 0)] + ib)).any()):
        return "they share elements"
    return None


def _starts_in(np: Any, lay: _Layout, lo: int, hi: int) -> Any:
    """Sorted start addresses of ``lay``'s elements in ``[lo, hi)`` (int64),
    or None past :data:`WINDOW_ELEMENTS`. The dimension of the widest stride
    is walked in blocks, only over the indexes whose elements can reach the
    window; the others are enumerated whole."""
    dims = sorted(zip(lay.shape, lay.strides, strict=True), key=lambda d: -abs(d[1]))
    (n0, s0), rest = dims[0] if dims else (1, 0), dims[1:]
    inner = np.zeros(1, dtype=np.int64)
    for n, s in rest:
        inner = (inner[None, :] + (np.arange(n, dtype=np.int64) * s)[:, None]).reshape(-1)
        if inner.size > WINDOW_ELEMENTS:
            return None
    base = lay.start + inner
    first, last = 0, n0 - 1
    if s0:  # the indexes i with base + i * s0 reaching [lo, hi) for some inner element
        a, b = (lo - int(base.max()), hi - 1 - int(base.min()))
        first, last = (-(-a // s0), b // s0) if s0 > 0 else (-(-b // s0), a // s0)
        first, last = max(first, 0), min(last, n0 - 1)
    if last < first:
        return np.zeros(0, dtype=np.int64)
    if (last - first + 1) * inner.size > 4 * WINDOW_ELEMENTS:
        return None
    step = max(1, (1 << 20) // inner.size)
    kept, count = [], 0
    for i in range(first, last + 1, step):
        idx = np.arange(i, min(i + step, last + 1), dtype=np.int64) * s0
        addr = (idx[:, None] + base[None, :]).reshape(-1)
        hit = addr[(addr >= lo) & (addr < hi)]
        count += hit.size
        if count > WINDOW_ELEMENTS:
            return None
        kept.append(hit)
    return np.sort(np.concatenate(kept))


def _refusal(first: str, second: str, why: str) -> StateMismatchError:
    return StateMismatchError(
        f"into: {first!r} and {second!r} are views of the same memory that overlap "
        f"without being the same view ({why}): filling one would overwrite part of the "
        f"other. Give each key memory of its own (.clone() one of them, for numpy "
        f".copy()), or leave one out of into= and load it separately",
        key=second, expected="memory of its own", found=f"memory shared with {first!r}")
