"""Random views of one buffer, and the bytes each covers, by brute force:
what the tests of shared memory (on load, state._overlap; on save,
state._tree) compare their decisions with."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from hypothesis import strategies as st

#: The buffer the views are drawn from.
BASE = np.zeros((6, 7), np.float32)


def bytes_of(view: Any) -> set[int]:
    """Every byte address an array's (or a CPU tensor's) elements cover."""
    arr = np.asarray(view)
    start = arr.__array_interface__["data"][0]
    out = set()
    for idx in itertools.product(*(range(n) for n in arr.shape)):
        at = start + sum(i * s for i, s in zip(idx, arr.strides, strict=True))
        out.update(range(at, at + arr.itemsize))
    return out


def ident(view: Any) -> tuple[Any, ...]:
    """What makes two views the very same one: framework, address, shape,
    strides (bytes) and dtype."""
    arr = np.asarray(view)
    return (type(view).__module__.split(".")[0], arr.__array_interface__["data"][0],
            arr.shape, arr.strides, arr.dtype.str)


@st.composite
def views(draw: Any, base: np.ndarray) -> np.ndarray:
    """A random view of ``base``: per dimension a slice with a step, maybe
    reversed, then maybe transposed, maybe reinterpreted as bytes."""
    sl = []
    for n in base.shape:
        start = draw(st.integers(0, n - 1))
        stop = draw(st.integers(start + 1, n))
        step = draw(st.integers(1, 3))
        sl.append(slice(start, stop, step))
    v = base[tuple(sl)]
    if draw(st.booleans()):
        v = v[::-1]
    if draw(st.booleans()):
        v = v.T
    if draw(st.booleans()) and v.flags.c_contiguous:
        v = v.view(np.uint8)
    return v
