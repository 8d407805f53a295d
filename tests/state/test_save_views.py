"""Saving a state whose tensors are views of one storage (state._tree).

Views that share no element (``t[:, 0]`` and ``t[:, 1]``, ``t[::2]`` and
``t[1::2]``, the q/k/v column blocks of one fused weight) are stored each on
its own and load bit-exact, whole and into the same views; the very same
view under two keys is stored once and loads tied; views that share some
elements but not all are refused naming both, before anything is written.
Every entry point that flattens a state: ``Checkpoint.from_state``,
``report(state=...)`` on one rank and on two, with dedup.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_store import Checkpoint, StorageContext, UploadConfig, session
from checkpoint_store.errors import UnsupportedStateError
from checkpoint_store.state import STATE_FILE, StateSlice, flatten_state
from tests.state._views import BASE, bytes_of, ident, views

MiB = 1 << 20


def _same(a: Any, b: Any) -> bool:
    """Same framework, dtype, shape and bytes."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8)))
    return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())


def _interleaved(big: bool = False) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Per case: the buffer and a state of views of it that share no element.
    ``big``: large enough (over 1 MiB a view) to be split by rows among ranks
    and cut into chunks."""
    rows = 2048 if big else 4
    t = torch.randn(rows, 3 * 256 if big else 6)
    cols = t.shape[1] // 3
    n = np.random.default_rng(0).standard_normal((rows, 6)).astype(np.float32)
    flat = torch.randn(rows * 6)
    return {
        "columns": (t, {"a": t[:, 0], "b": t[:, 1]}),
        "even-odd": (flat, {"even": flat[::2], "odd": flat[1::2]}),
        "fused-qkv": (t, {"attn": {"q": t[:, :cols], "k": t[:, cols:2 * cols],
                                   "v": t[:, 2 * cols:]}}),
        "numpy-columns": (n, {"a": n[:, 0], "b": n[:, 1], "rest": n[:, 2:]}),
        "numpy-reversed": (n, {"even": n[::-2], "odd": n[-2::-2]}),
    }


def _onto(state: Any, buf: Any, other: Any) -> Any:
    """``state``'s views of ``buf`` (their offsets and strides) taken of
    ``other``, a buffer of the same shape and dtype."""
    base = np.asarray(buf).reshape(-1)
    target = np.asarray(other).reshape(-1)

    def again(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: again(x) for k, x in v.items()}
        arr = np.asarray(v)
        at = (arr.__array_interface__["data"][0] - base.__array_interface__["data"][0])
        out = np.lib.stride_tricks.as_strided(target[at // arr.itemsize:], arr.shape,
                                              arr.strides)
        return out if isinstance(v, np.ndarray) else torch.from_numpy(out)

    return again(state)


def _zeros(buf: Any) -> Any:
    return torch.zeros_like(buf) if isinstance(buf, torch.Tensor) else np.zeros_like(buf)


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, x in tree.items()
                for k, v in _leaves(x, f"{prefix}{key}/").items()}
    return {prefix.rstrip("/"): tree}


def _check_loads(ck: Checkpoint, state: Any, buf: Any) -> None:
    """Whole: bit-exact and untied. Into the same views of a zeroed buffer:
    each returned as given, the buffer equal to ``buf`` where a view covers
    it and still zero elsewhere."""
    out = ck.load_state()
    want, got = _leaves(state), _leaves(out)
    assert got.keys() == want.keys()
    for k in want:
        assert _same(want[k], got[k]), k
    assert len({id(v) for v in got.values()}) == len(got)
    fresh, covered = _zeros(buf), _zeros(buf)
    into = _onto(state, buf, fresh)
    back = _leaves(ck.load_state(into=into))
    for k, v in _leaves(into).items():
        assert back[k] is v and _same(v, want[k]), k
    for v in _leaves(_onto(state, buf, covered)).values():
        v[...] = 1
    mask = np.asarray(covered) == 1
    assert np.array_equal(np.asarray(fresh)[mask], np.asarray(buf)[mask])
    assert not np.asarray(fresh)[~mask].any()


def _stored(ck: Checkpoint) -> dict[str, Any]:
    with open(os.path.join(ck.path, STATE_FILE)) as f:
        return json.load(f)["tensors"]


# -- one rank -------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(_interleaved()))
def test_views_that_share_no_element_are_stored_each(tmp_path, case) -> None:
    buf, state = _interleaved()[case]
    flat = flatten_state(state)
    assert flat.layout.aliases == {} and list(flat.layout.tensors) == list(_leaves(state))
    ck = Checkpoint.from_state(state, tmp_path / "ck")
    index = _stored(ck)
    assert set(index) == set(_leaves(state)) and not any("alias_of" in e for e in index.values())
    _check_loads(ck, state, buf)


def _start(root: Path, attempt: str = "a1", **kw: Any) -> Any:
    return session.start(storage_path=str(root), experiment_name="e", trial_name="t",
                         attempt_id=attempt, **kw)


@pytest.mark.parametrize("case", ["fused-qkv", "numpy-reversed"])
def test_report_saves_interleaved_views_and_they_load_back(tmp_path, case) -> None:
    buf, state = _interleaved()[case]
    with _start(tmp_path / "store") as s:
        s.report({"step": 1}, state={"model": state, "step": 1})
    [(ck, _)] = StorageContext(str(tmp_path / "store"), "e", "t").committed_checkpoints()
    out = ck.load_state()
    assert out["step"] == 1
    for k, v in _leaves(state).items():
        assert _same(v, _leaves(out["model"])[k]), k
    into = _onto(state, buf, _zeros(buf))
    ck.load_state("model", into={"model": into})
    for k, v in _leaves(into).items():
        assert _same(v, _leaves(state)[k]), k


def test_a_deduplicated_save_of_a_fused_weight_loads_bit_exact(tmp_path) -> None:
    """Views over 1 MiB each: the shard is cut into chunks and loads back."""
    buf, state = _interleaved(big=True)["fused-qkv"]
    with _start(tmp_path / "store", upload_config=UploadConfig(dedup=True)) as s:
        s.report({"step": 1}, state=state)
    chunks = tmp_path / "store" / "e" / ".cs_chunks"
    assert sum(1 for p in chunks.rglob("*") if p.is_file() and not p.name.startswith(".")) > 3
    [(ck, _)] = StorageContext(str(tmp_path / "store"), "e", "t").committed_checkpoints()
    _check_loads(ck, state, buf)


# -- tied and overlapping views ---------------------------------------------------------


def test_the_same_view_twice_stays_tied_beside_interleaved_ones(tmp_path) -> None:
    t = torch.randn(5, 4)
    state = {"a": t[:, 0], "b": t[:, 1], "a_again": t[:, 0], "rest": t[:, 2:]}
    flat = flatten_state(state)
    assert flat.layout.aliases == {"a_again": "a"}
    assert list(flat.layout.tensors) == ["a", "b", "rest"]
    ck = Checkpoint.from_state(state, tmp_path / "ck")
    assert _stored(ck)["a_again"]["alias_of"] == "a"
    out = ck.load_state()
    assert out["a_again"] is out["a"] and _same(out["a"], t[:, 0])
    assert _same(out["b"], t[:, 1]) and _same(out["rest"], t[:, 2:])


@pytest.mark.parametrize("make, pair", [
    (lambda t: {"x": t[0:2], "y": t[1:3]}, ("x", "y")),
    (lambda t: {"c0": t.view(4, 3)[:, 0], "c1": t.view(4, 3)[:, 1], "row": t.view(4, 3)[1]},
     ("c0", "row")),
    (lambda t: {"even": t[::2], "odd": t[1::2], "mid": t[4:9:4]}, ("even", "mid")),
    (lambda t: {"n0": t.numpy()[0::3], "n1": t.numpy()[1::3], "rev": t.numpy()[::-4]},
     ("n0", "rev")),
], ids=["slices", "row-across-columns", "block-across-strides", "numpy-reversed"])
def test_views_that_share_some_elements_are_refused_naming_both(tmp_path, make, pair) -> None:
    state = make(torch.arange(12.0))
    with pytest.raises(UnsupportedStateError, match="overlap in memory") as err:
        Checkpoint.from_state(state, tmp_path / "ck")
    msg = str(err.value)
    assert all(repr(k) in msg for k in pair), msg
    assert ".clone()" in msg and err.value.key in pair
    assert not (tmp_path / "ck").exists() or os.listdir(tmp_path / "ck") == []


def test_a_thousand_columns_of_one_matrix_are_stored_each(tmp_path) -> None:
    big = torch.arange(100 * 1000, dtype=torch.float32).reshape(100, 1000)
    state = {f"c{i}": big[:, i] for i in range(1000)}
    assert len(flatten_state(state).layout.tensors) == 1000
    with pytest.raises(UnsupportedStateError, match="'c7' and 'r'|'r' and 'c7'"):
        flatten_state({**state, "r": big[3, 7]})


# -- two ranks ---------------------------------------------------------------------------


@pytest.mark.parametrize("big", [False, True], ids=["small", "split-by-rows"])
def test_two_ranks_save_interleaved_views_and_tied_ones(tmp_path, ranks, big) -> None:
    """Small views are each written by one rank (by their key's hash, so
    views on one rank and on the other); large ones are split by rows, each
    rank's rows still interleaved. Tied entries that are different objects
    of the same view (what ``state_dict()`` gives for tied weights) load tied."""
    buf, fused = _interleaved(big)["fused-qkv"]
    _, cols = _interleaved(big)["columns"]
    # Keys another rank writes than the tensor they are tied to (by hash).
    state = {**fused, **cols, "tied_a": cols["a"].detach(),
             "q_tied": fused["attn"]["q"].detach(), "step": 3}

    def save(rank: int) -> None:
        with _start(tmp_path / "store", world_rank=rank, world_size=2,
                    sync_timeout_s=30) as s:
            s.report({"step": 3}, state=state)

    assert ranks(2, save) == [None, None]
    [(ck, _)] = StorageContext(str(tmp_path / "store"), "e", "t").committed_checkpoints()
    index = _stored(ck)
    assert index["tied_a"]["alias_of"] == "a" and index["q_tied"]["alias_of"] == "attn/q"
    assert not any("alias_of" in e for k, e in index.items() if "tied" not in k)
    out = ck.load_state()
    assert out["tied_a"] is out["a"] and out["q_tied"] is out["attn"]["q"]
    assert out["step"] == 3
    for k, v in _leaves({**fused, **cols}).items():
        assert _same(v, _leaves(out)[k]), k
    # Each rank loads its half of the rows into the same views of its own buffer.
    rows = buf.shape[0]

    def load(rank: int) -> bool:
        fresh = _zeros(buf)
        into = _onto(fused, buf, fresh)
        lo, hi = rows * rank // 2, rows * (rank + 1) // 2
        ck.load_state("attn", into={"attn": {k: StateSlice(v[lo:hi], (lo, 0))
                                            for k, v in into["attn"].items()}})
        return bool(torch.equal(fresh[lo:hi], buf[lo:hi]) and not fresh[:lo].any()
                    and not fresh[hi:].any())

    assert ranks(2, load) == [True, True]


# -- the save-side decision against the elements actually shared -------------------------


@st.composite
def _strided(draw: Any) -> list[np.ndarray]:
    """Every k-th element of ``BASE`` from some starts (a repeated start is
    the same view again: tied), maybe with a random view or two: long runs
    of views that interleave, most of them apart."""
    flat = BASE.reshape(-1)
    k = draw(st.integers(2, 21))
    starts = draw(st.lists(st.integers(0, k - 1), min_size=1, max_size=k + 3))
    return [flat[s::k] for s in starts] + draw(st.lists(views(BASE), max_size=2))


@settings(max_examples=300, deadline=None)
@given(vs=st.one_of(st.lists(views(BASE), min_size=2, max_size=24), _strided()),
       torch_too=st.booleans())
def test_flatten_ties_stores_or_refuses_as_the_bytes_say(vs, torch_too) -> None:
    """Refused iff two views that are not the same one share a byte; else the
    repeats of a view are aliases of its first key and every other view is
    stored on its own (more than 16 overlapping views are decided at once)."""
    if torch_too:  # torch has no negative strides: only the views it can express
        vs = [torch.from_numpy(v) if all(s >= 0 for s in v.strides) else v for v in vs]
    keys = [f"k{i:02d}" for i in range(len(vs))]
    arrays = [np.asarray(v) for v in vs]
    shares = any(ident(va) != ident(vb) and bytes_of(a) & bytes_of(b)
                 for (a, va), (b, vb) in itertools.combinations(zip(arrays, vs, strict=True), 2))
    try:
        flat = flatten_state(dict(zip(keys, vs, strict=True)))
    except UnsupportedStateError as exc:
        assert shares, str(exc)
        return
    assert not shares
    first: dict[tuple[Any, ...], str] = {}
    for k, v in zip(keys, vs, strict=True):
        first.setdefault(ident(v), k)
    want = {k: first[ident(v)] for k, v in zip(keys, vs, strict=True) if first[ident(v)] != k}
    assert flat.layout.aliases == want
    assert list(flat.layout.tensors) == [k for k in keys if k not in want]


@settings(max_examples=40, deadline=None)
@given(vs=st.lists(views(BASE), min_size=2, max_size=6))
def test_what_flatten_accepts_loads_back_bit_exact(tmp_path_factory, vs) -> None:
    base = np.random.default_rng(1).standard_normal(BASE.shape).astype(np.float32)
    # The same views of a buffer of distinct values.
    state = {f"k{i}": np.lib.stride_tricks.as_strided(
        base.reshape(-1)[(v.__array_interface__["data"][0]
                          - BASE.__array_interface__["data"][0]) // 4:], v.shape, v.strides)
        for i, v in enumerate(vs) if v.dtype == np.float32}
    try:
        flatten_state(state)
    except UnsupportedStateError:
        return
    ck = Checkpoint.from_state(state, tmp_path_factory.mktemp("ck") / "ck")
    out = ck.load_state()
    for k, v in state.items():
        assert _same(v, out[k]), k
