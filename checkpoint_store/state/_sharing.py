"""Which tensors of a state share memory: the very same view, or an element.

One rule for both directions. A save (``_tree.flatten_state``) stores the
very same view under two keys once (tied weights) and refuses two views
that share an element otherwise; a load (``_overlap.check_apart``) refuses
two targets that share an element without being the same view. Views of
one buffer that share no element (``t[:, 0]`` and ``t[:, 1]``; ``t[::2]``
and ``t[1::2]``; the column blocks of a fused weight) are apart in both.

The rule, exactly: each view's memory is its address space (the CPU for
numpy arrays and CPU tensors, which may alias each other through
``torch.from_numpy``; each accelerator device on its own) and its extent,
``[address of its lowest element, address of its highest element +
itemsize)``. Two views are *the same view* when they have the same
framework, address of element 0, shape, strides and dtype. Views whose
extents are disjoint are apart. Extents that overlap are decided element by
element with numpy's exact bounded solver (``numpy.shares_memory`` over the
two layouts; no memory is touched); where it gives up (layouts only
``as_strided`` makes) the element addresses of both views inside the shared
window are compared, at most :data:`WINDOW_ELEMENTS` of each; past that the
pair counts as sharing, with a reason that says so.

Cost: one cheap extent per view (no layout, no identity), one sort by
address, then one pass that cuts the views into runs of chained
overlapping extents: O(n log n), and a run of one (a model's tensors, each
its own allocation) costs nothing more. Only the views of a longer run get
an identity and a layout. A run of a few views is decided pair by pair (one
solver call per pair of overlapping extents); a longer one (the columns of
a matrix, each its own entry) from all its element addresses at once,
sorted (O(E log E) for E elements, at most :data:`WINDOW_ELEMENTS`; past
that pair by pair): 1,000 columns of a 1000 x 1000 matrix take about
0.08 s.

numpy is imported only to decide a run of overlapping extents.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PAIRWISE_RUN", "WINDOW_ELEMENTS", "Sharing", "extent", "find_sharing",
           "layout_of", "tie_key", "view_ident"]

#: Element addresses each view may contribute when the exact solver gives up
#: (8 bytes each): beyond this a pair with overlapping extents counts as sharing.
WINDOW_ELEMENTS = 1 << 22

#: Effort numpy's solver may spend on one pair before the window comparison.
_MAX_WORK = 1 << 16

#: A run of more distinct views with overlapping extents than this is decided
#: from all their element addresses at once (where at most WINDOW_ELEMENTS).
PAIRWISE_RUN = 16


def _is_torch(t: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, torch.Tensor)


def view_ident(t: Any) -> tuple[Any, ...]:
    """What makes two views the very same one: framework, address of
    element 0, shape, strides and dtype (tied weights have equal ones)."""
    if _is_torch(t):
        return ("torch", t.data_ptr(), tuple(t.shape), t.stride(), str(t.dtype))
    return ("numpy", t.__array_interface__["data"][0], t.shape, t.strides, t.dtype.str)


def tie_key(t: Any) -> Hashable:
    """What a save ties two entries of a state by (stores once, loads as one
    tensor): the very same view (:func:`view_ident`) for a tensor or array
    with elements in CPU memory, as :func:`find_sharing` groups them; else
    the object itself (``id``: one tensor reachable twice)."""
    if _is_torch(t):
        kept = t.numel() != 0 and t.device.type == "cpu"
    else:
        kept = isinstance(t, sys.modules["numpy"].ndarray) and t.size != 0
    return view_ident(t) if kept else id(t)


def extent(t: Any) -> tuple[str, int, int] | None:
    """``(space, lo, hi)``: the address space of a tensor's or array's memory
    (``"cpu"``, or the device: ``"cuda:0"``) and the bytes ``[lo, hi)`` from
    its lowest element's first to its highest element's last; None where it
    has no elements or no memory of its own (a meta tensor, a numpy scalar)."""
    if _is_torch(t):
        if t.numel() == 0 or t.device.type == "meta":
            return None
        item = t.element_size()
        start = t.data_ptr()
        span = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        space = "cpu" if t.device.type == "cpu" else str(t.device)
        return space, start, start + (span + 1) * item  # torch strides are never negative
    np = sys.modules["numpy"]
    if not isinstance(t, np.ndarray) or t.size == 0:
        return None
    lo = hi = t.__array_interface__["data"][0]
    for n, s in zip(t.shape, t.strides, strict=True):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return "cpu", lo, hi + t.itemsize


@dataclass(frozen=True)
class Layout:
    """Where a view's elements lie: element 0 at ``start``, ``strides`` in
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
           itemsize: int) -> Layout:
        spans = [(n - 1) * s for n, s in zip(shape, strides, strict=True)]
        return cls(space, start, shape, strides, itemsize,
                   start + sum(d for d in spans if d < 0),
                   start + sum(d for d in spans if d > 0) + itemsize)


def layout_of(t: Any) -> Layout | None:
    """The layout of a tensor's or array's memory, or None where it has no
    elements or no memory (a meta tensor)."""
    if _is_torch(t):
        if t.numel() == 0 or t.device.type == "meta":
            return None
        item = t.element_size()
        space = "cpu" if t.device.type == "cpu" else str(t.device)
        return Layout.of(space, t.data_ptr(), tuple(t.shape),
                         tuple(s * item for s in t.stride()), item)
    if t.size == 0:
        return None
    return Layout.of("cpu", t.__array_interface__["data"][0], tuple(t.shape),
                     tuple(t.strides), t.itemsize)


@dataclass
class Sharing:
    """What :func:`find_sharing` found among views given in an order.

    Attributes:
        same: groups of two or more keys that are the very same view, each
            group in the order given (its first key first).
        clash: ``(first, second, why)``: two keys of views that share an
            element without being the same view (``first``'s lowest address
            not above ``second``'s) and why they count as sharing; None: no
            such pair.
    """

    same: list[list[str]] = field(default_factory=list)
    clash: tuple[str, str, str] | None = None


def find_sharing(views: Iterable[tuple[str, Any]], *,
                 pairwise_run: int = PAIRWISE_RUN) -> Sharing:
    """Tell the views ``(key, tensor or array)``, in a caller's order (tree
    order), apart (module docstring): the groups of keys that are the very
    same view, and the first pair found that shares an element without being
    the same view (the search stops there). A run of more than
    ``pairwise_run`` distinct views with overlapping extents is decided at once.
    """
    spans = []
    for i, (key, t) in enumerate(views):
        ext = extent(t)
        if ext is not None:
            spans.append((ext[0], ext[1], i, ext[2], key, t))
    spans.sort(key=lambda s: (s[0], s[1], s[2]))
    out = Sharing()
    run: list[tuple[int, str, Any]] = []
    space, reach = "", 0
    for sp, lo, i, hi, key, t in spans:
        if run and (sp != space or lo >= reach):
            if _decide_run(run, out, pairwise_run):
                return out
            run = []
        reach = max(reach, hi) if run else hi
        space = sp
        run.append((i, key, t))
    _decide_run(run, out, pairwise_run)
    return out


def _decide_run(run: list[tuple[int, str, Any]], out: Sharing, pairwise_run: int) -> bool:
    """Record the groups of one run of overlapping extents (sorted by
    ``lo``) in ``out``, and its first clash; True where there is one."""
    if len(run) < 2:
        return False
    groups: dict[tuple[Any, ...], list[tuple[int, str, Any]]] = {}
    for entry in run:
        groups.setdefault(view_ident(entry[2]), []).append(entry)
    for group in groups.values():
        if len(group) > 1:
            out.same.append([key for _, key in sorted((i, k) for i, k, _t in group)])
    distinct: list[tuple[int, str, Layout]] = []
    for group in groups.values():
        i, key, t = min(group, key=lambda e: e[0])
        lay = layout_of(t)
        assert lay is not None  # it has an extent
        distinct.append((i, key, lay))
    distinct.sort(key=lambda e: (e[2].lo, e[0]))
    out.clash = _first_shared([(key, lay) for _, key, lay in distinct], pairwise_run)
    return out.clash is not None


_Found = tuple[str, str, str]


def _first_shared(run: list[tuple[str, Layout]], pairwise_run: int) -> _Found | None:
    """Two distinct views of a run (sorted by ``lo``, extents chained by
    overlap) that share an element, or None. A long run (many interleaved
    views, the columns of one matrix) is decided in one pass over its
    element addresses where they are few enough; else pair by pair."""
    if len(run) < 2:
        return None
    if len(run) > pairwise_run:
        decided, found = _first_shared_jointly(run)
        if decided:
            return found
    open_: list[tuple[str, Layout]] = []
    for key, lay in run:
        open_ = [o for o in open_ if o[1].hi > lay.lo]
        for other, olay in open_:
            why = _shared(olay, lay)
            if why is not None:
                return other, key, why
        open_.append((key, lay))
    return None


def _first_shared_jointly(run: list[tuple[str, Layout]]) -> tuple[bool, _Found | None]:
    """Decide a run from all its element addresses at once: ``(True, a pair
    that shares an element, or None)``, or ``(False, None)`` where it cannot
    (too many addresses, or a view sharing memory with itself: decide pair
    by pair). Sorted by
    address, an element shares a byte with an earlier one iff it starts
    before the furthest end seen so far."""
    import numpy as np

    lo, hi = run[0][1].lo, max(lay.hi for _, lay in run)
    starts, ends, owners = [], [], []
    total = 0
    for n, (_, lay) in enumerate(run):
        got = _starts_in(np, lay, lo, hi)
        total += 0 if got is None else got.size
        if got is None or total > WINDOW_ELEMENTS:
            return False, None
        starts.append(got)
        ends.append(got + lay.itemsize)
        owners.append(np.full(got.size, n, dtype=np.int64))
    s, e, w = (np.concatenate(x) for x in (starts, ends, owners))
    order = np.argsort(s, kind="stable")
    s, e, w = s[order], e[order], w[order]
    furthest = np.maximum.accumulate(e)
    clash = np.flatnonzero(s[1:] < furthest[:-1])
    if clash.size == 0:
        return True, None
    i = int(clash[0]) + 1
    j = int(np.argmax(e[:i]))  # the element (earlier in order) that reaches element i
    if w[i] == w[j]:  # a view whose own elements share memory: let the pairs decide
        return False, None
    first, second = run[int(min(w[i], w[j]))][0], run[int(max(w[i], w[j]))][0]
    return True, (first, second, "they share elements")


def _shared(a: Layout, b: Layout) -> str | None:
    """Why two layouts with overlapping extents share memory (they share a
    byte, or that could not be ruled out), or None: they are apart."""
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

    def __init__(self, lay: Layout):
        self.__array_interface__ = {"data": (lay.start, False), "shape": lay.shape,
                                    "strides": lay.strides, "typestr": f"|V{lay.itemsize}",
                                    "version": 3}


def _as_array(np: Any, lay: Layout) -> Any:
    """An array with ``lay``'s address and layout, for numpy's overlap solver
    (which reads only the layout: an accelerator's address serves as well)."""
    return np.asarray(_Interface(lay))


def _shared_in_window(np: Any, a: Layout, b: Layout) -> str | None:
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


def _starts_in(np: Any, lay: Layout, lo: int, hi: int) -> Any:
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
