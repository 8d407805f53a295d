"""``load_state(into=...)`` with targets that share memory (checkpoint_store.state._overlap).

Two targets that overlap without being the same view are refused before
anything is read or changed; views that interleave without sharing an
element, and tied weights (the very same view), load as before.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_store import Checkpoint, session
from checkpoint_store.errors import StateMismatchError
from checkpoint_store.state import STATE_FILE, StateSlice, load_state, write_state
from checkpoint_store.state._overlap import check_apart
from checkpoint_store.state._sharing import _shared, _shared_in_window, layout_of
from tests.state._views import BASE, bytes_of, views


def _saved() -> dict[str, Any]:
    """Distinct values under every key, so a fill under the wrong key shows."""
    return {
        "a": torch.arange(4.0) + 1, "b": torch.arange(4.0) + 11,
        "p": torch.arange(2.0) + 21, "q": torch.arange(2.0) + 31,
        "m": torch.arange(9.0).reshape(3, 3) + 41, "mt": torch.arange(9.0).reshape(3, 3) + 51,
        "na": np.arange(3, dtype=np.float32) + 61, "nb": np.arange(3, dtype=np.float32) + 71,
        "w": torch.arange(12.0).reshape(4, 3) + 81,
    }


@pytest.fixture
def saved(tmp_path) -> Checkpoint:
    return Checkpoint.from_state(_saved(), tmp_path / "ck")


def _overlapping() -> dict[str, tuple[dict[str, Any], list[Any]]]:
    """Per case: ``into`` whose two targets partly overlap, and its buffers."""
    t, n, m = torch.zeros(6), np.zeros(8, np.float32), torch.zeros(3, 3)
    cases = {
        # The reported input: StateSlices of t[0:2] and t[1:3].
        "slices": ({"a": StateSlice(t[0:2], (0,)), "b": StateSlice(t[1:3], (2,))}, [t]),
        "views": ({"p": t[0:2], "q": t[1:3]}, [t]),
        "numpy-views": ({"na": n[0:3], "nb": n[2:5]}, [n]),
        "transposed": ({"m": m, "mt": m.T}, [m]),
        "slice-and-view": ({"a": StateSlice(t[0:2], (0,)), "q": t[1:3]}, [t]),
        "numpy-and-torch": ({"na": n[0:3], "p": torch.from_numpy(n)[2:4]}, [n]),
        "strided": ({"a": StateSlice(t[0::2], (0,)), "p": t[2:4]}, [t]),
    }
    return cases


@pytest.mark.parametrize("case", list(_overlapping()))
def test_targets_that_partly_overlap_are_refused_before_anything_changes(saved, case) -> None:
    into, buffers = _overlapping()[case]
    # Every tensor byte flipped: a read would fail its checksum. The refusal
    # comes first, before the load has even planned a read (no progress).
    with open(os.path.join(saved.path, STATE_FILE)) as f:
        index = json.load(f)["tensors"]
    for e in index.values():
        with open(os.path.join(saved.path, e["file"]), "r+b") as f:
            f.seek(e["offsets"][0])
            f.write(bytes(255 - x for x in f.read(e["offsets"][1] - e["offsets"][0])))
    calls: list[tuple[int, int]] = []
    with pytest.raises(StateMismatchError, match="overlap without being the same view") as exc:
        saved.load_state(into=into, progress=lambda done, total: calls.append((done, total)))
    assert calls == []
    first, second = sorted(into)
    assert repr(first) in str(exc.value) and repr(second) in str(exc.value)
    assert ".clone()" in str(exc.value) and exc.value.key in into
    for b in buffers:
        assert not b.any(), "a target changed"


def test_only_the_targets_a_load_fills_are_compared(saved) -> None:
    """With keys=, a target not selected is not filled: no conflict."""
    t = torch.zeros(6)
    saved.load_state("p", into={"p": t[0:2], "q": t[1:3]})
    assert torch.equal(t, torch.tensor([21.0, 22, 0, 0, 0, 0]))


def test_views_that_interleave_without_sharing_load_bit_exact(saved) -> None:
    want = _saved()
    t, w, n = torch.zeros(8), torch.zeros(4, 2), np.zeros((3, 2), np.float32)
    cols = torch.zeros(4, 6)
    saved.load_state(into={
        "a": t[0::2], "b": t[1::2],  # t[::2] and t[1::2]
        "p": w[:2, 0], "q": w[:2, 1],  # t[:, 0] and t[:, 1]
        "na": n[:, 0], "nb": n[:, 1],  # numpy columns
        "w": StateSlice(cols[:, 0:3], (0, 0)), "m": StateSlice(cols[:3, 3:6], (0, 0)),
    })
    assert torch.equal(t[0::2], want["a"]) and torch.equal(t[1::2], want["b"])
    assert torch.equal(w[:2, 0], want["p"]) and torch.equal(w[:2, 1], want["q"])
    assert not w[2:].any()
    assert np.array_equal(n[:, 0], want["na"]) and np.array_equal(n[:, 1], want["nb"])
    assert torch.equal(cols[:, :3], want["w"]) and torch.equal(cols[:3, 3:], want["m"])


def test_the_same_view_under_two_keys_is_still_tied_weights(tmp_path) -> None:
    """Identical views (same address, shape, strides, dtype) are tied weights:
    refused only where the saved values differ, not as an overlap."""
    a = torch.randn(4, 3)
    ck = Checkpoint.from_state({"x": a, "y": a.clone(), "z": torch.randn(4, 3)}, tmp_path / "ck")
    t = torch.zeros(4, 3)
    out = ck.load_state(into={"x": t, "y": t[:, :]})
    assert torch.equal(t, a) and out["x"] is t
    with pytest.raises(StateMismatchError, match="same tensor"):
        ck.load_state(into={"x": t, "z": t[:]})


def test_a_chunked_state_refuses_and_loads_the_same(tmp_path) -> None:
    from checkpoint_store.testing.chunked import write_chunked_state_checkpoint

    state = {"u": np.arange(6, dtype=np.float32), "v": np.arange(6, dtype=np.float32) + 10}
    ck = Checkpoint(str(tmp_path / "exp" / "t" / "checkpoint_000000"))
    write_chunked_state_checkpoint(ck.filesystem, ck.path, state, chunk_bytes=16)
    buf = np.zeros(12, np.float32)
    with pytest.raises(StateMismatchError, match="'u' and 'v'"):
        ck.load_state(into={"u": buf[0:6], "v": buf[5:11]})
    assert not buf.any()
    ck.load_state(into={"u": buf[0::2], "v": buf[1::2]})
    assert np.array_equal(buf[0::2], state["u"]) and np.array_equal(buf[1::2], state["v"])


def test_a_resumed_session_refuses_overlapping_targets(tmp_path) -> None:
    def start(attempt: str) -> Any:
        return session.start(storage_path=str(tmp_path / "store"), experiment_name="e",
                             trial_name="t", attempt_id=attempt)

    with start("a1") as s:
        s.report({"step": 1}, state={"model": {"w": torch.ones(2, 3), "b": torch.ones(3) * 2}})
    with start("a2") as s:
        ck = s.get_checkpoint()
        assert ck is not None
        buf = torch.zeros(3, 3)
        with pytest.raises(StateMismatchError, match="'model/b' and 'model/w'|'model/w' and "
                                                     "'model/b'"):
            ck.load_state(into={"model": {"w": buf[0:2], "b": buf[1]}})
        assert not buf.any()
        ck.load_state(into={"model": {"w": buf[0:2], "b": buf[2]}})
        assert torch.equal(buf, torch.tensor([[1.0] * 3, [1.0] * 3, [2.0] * 3]))


def test_a_state_loaded_on_one_rank_with_load_state_itself(tmp_path) -> None:
    """The state-level entry point (what Checkpoint.load_state calls)."""
    root = str(tmp_path / "s")
    write_state({"a": torch.arange(4.0), "b": torch.arange(4.0)}, root)
    t = torch.zeros(5)
    with pytest.raises(StateMismatchError, match="'a' and 'b'"):
        load_state(pafs.LocalFileSystem(), root, into={"a": t[0:4], "b": t[1:5]})
    assert not t.any()


# -- the element test against brute force ------------------------------------------


@settings(max_examples=300, deadline=None)
@given(a=views(BASE), b=views(BASE))
def test_the_element_test_matches_the_bytes_shared(a, b) -> None:
    """Refused iff the two views share a byte and are not the same view; the
    window comparison (used where numpy's solver gives up) agrees."""
    shared = bool(bytes_of(a) & bytes_of(b))
    same = (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype)
    refused = True
    try:
        check_apart({"x": a, "y": b})
        refused = False
    except StateMismatchError:
        pass
    assert refused == (shared and not same)
    la, lb = layout_of(a), layout_of(b)
    assert la is not None and lb is not None
    assert (_shared(la, lb) is not None) == shared
    assert (_shared_in_window(np, la, lb) is not None) == shared


@settings(max_examples=200, deadline=None)
@given(views=st.lists(views(BASE), min_size=2, max_size=6), jointly=st.booleans())
def test_several_views_are_refused_iff_two_share_a_byte(views, jointly) -> None:
    """Over several views at once, decided pair by pair or from all element
    addresses together (a long run of interleaved views): refused iff two
    views that are not the same one share a byte."""
    def ident(v: np.ndarray) -> tuple[Any, ...]:
        return (v.__array_interface__["data"][0], v.shape, v.strides, v.dtype.str)

    expected = any(ident(a) != ident(b) and bytes_of(a) & bytes_of(b)
                   for a, b in itertools.combinations(views, 2))
    refused = True
    try:
        check_apart({f"k{i}": v for i, v in enumerate(views)}, pairwise_run=1 if jointly else 99)
        refused = False
    except StateMismatchError:
        pass
    assert refused == expected


def test_many_interleaved_columns_are_decided_at_once() -> None:
    """The columns of one matrix, each its own target: one run of 1000
    overlapping extents, apart; one row added shares an element with each."""
    big = torch.zeros(1000, 1000)
    cols = {f"c{i}": StateSlice(big[:, i], (0,)) for i in range(1000)}
    check_apart(cols)
    with pytest.raises(StateMismatchError, match="'c0' and 'r'|'r' and 'c0'"):
        check_apart({**cols, "r": big[0]})
