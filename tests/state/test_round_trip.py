"""A state tree comes back exactly as saved (docs/state.md): odd trees, every
dtype, zero-size and 0-d tensors, non-contiguous and shared tensors; and the
trees the format refuses, refused with a typed error before any write."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from safetensors import safe_open

from checkpoint_store import Checkpoint
from checkpoint_store.errors import InvalidConfigError, UnsupportedStateError
from checkpoint_store.state import (
    DTYPES,
    STATE_FILE,
    flatten_state,
    split_key,
    write_state,
)
from checkpoint_store.testing import strategies as cst


def _round_trip(tree, tmp_path, **kw):
    ck = Checkpoint.from_state(tree, tmp_path / "ck", **kw)
    return ck.load_state()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(cst.state_trees())
def test_any_state_tree_round_trips(tmp_path_factory, tree) -> None:
    d = tmp_path_factory.mktemp("s")
    back = Checkpoint.from_state(tree, d / "ck").load_state()
    assert cst.same_state(tree, back)
    # safetensors' own reader accepts every header (a key named after a name
    # the format reserves, ``__metadata__``, included).
    for shard in (f for f in os.listdir(d / "ck") if f.endswith(".safetensors")):
        with safe_open(str(d / "ck" / shard), "np") as f:
            assert f.metadata() is not None and len(list(f.keys())) >= 1


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cst.state_trees(max_leaves=6))
def test_memory_mapped_load_equals_the_saved_tree(tmp_path_factory, tree) -> None:
    d = tmp_path_factory.mktemp("m")
    back = Checkpoint.from_state(tree, d / "ck").load_state(mmap=True)
    assert cst.same_state(tree, back)


@pytest.mark.parametrize("tree", [
    {}, [], (), {"a": {}}, {"a": []}, {"a": ()}, [[[]]], {"": {"": 1}},
    {"n": None, "b": True, "i": 2**80, "f": -0.0, "nan": math.nan, "inf": -math.inf,
     "s": "ünïcødé ✓", "one": 1, "onef": 1.0},
    [1, (2, [3, {"x": (4,)}])],
    {"a/b": {"~": {"~1": 5, "/": 6}}},
], ids=repr)
def test_odd_trees_round_trip(tmp_path, tree) -> None:
    back = _round_trip(tree, tmp_path)
    assert cst.same_state(tree, back)
    # No tensor, no shard: only state.json.
    assert os.listdir(tmp_path / "ck") == [STATE_FILE]


def test_a_bare_tensor_is_a_state(tmp_path) -> None:
    t = torch.arange(5)
    back = _round_trip(t, tmp_path)
    assert cst.same_state(t, back)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_dtype_round_trips_in_torch(tmp_path, dtype) -> None:
    torch_name = DTYPES[dtype][2]
    raw = bytes(range(256))[: 6 * DTYPES[dtype][0]]
    if dtype == "BOOL":
        raw = bytes(b & 1 for b in raw)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, torch_name))
    tree = {"t": t.reshape(2, 3), "zero_d": t[0].clone(), "empty": t[:0].reshape(0, 3)}
    back = _round_trip(tree, tmp_path)
    assert cst.same_state(tree, back)
    # A plain safetensors file, whichever reader opens it.
    (shard,) = [f for f in os.listdir(tmp_path / "ck") if f.endswith(".safetensors")]
    with safe_open(str(tmp_path / "ck" / shard), "pt") as f:
        assert torch.equal(f.get_tensor("t").view(torch.uint8), tree["t"].view(torch.uint8))


@pytest.mark.parametrize("dtype", [d for d, (_, n, _) in DTYPES.items() if n])
def test_every_numpy_dtype_comes_back_as_numpy(tmp_path, dtype) -> None:
    np_name = DTYPES[dtype][1]
    a = (np.arange(6) % 2).astype(np_name).reshape(3, 2)
    tree = {"a": a, "s": a.reshape(-1)[1], "z": np.zeros((0,), np_name), "d": np.array(3, np_name)}
    back = _round_trip(tree, tmp_path)
    assert cst.same_state(tree, back)
    assert type(back["s"]) is type(a.reshape(-1)[1])  # a numpy scalar stays one


def test_bfloat16_comes_back_as_torch(tmp_path) -> None:
    t = torch.tensor([1.5, -2.0, math.inf], dtype=torch.bfloat16)
    back = _round_trip({"w": t}, tmp_path)["w"]
    assert isinstance(back, torch.Tensor) and back.dtype == torch.bfloat16
    assert torch.equal(back, t)


def test_big_endian_arrays_come_back_little_endian_with_the_same_values(tmp_path) -> None:
    a = np.arange(6, dtype=">i4")
    back = _round_trip({"a": a}, tmp_path)["a"]
    assert back.dtype == np.dtype("<i4") and (back == a).all()


def test_non_contiguous_tensors_are_stored_contiguous(tmp_path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    other = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tree = {"t": base.t(), "s": other[:, ::2], "x": torch.ones(3).expand(2, 3),
            "n": np.arange(12).reshape(3, 4)[:, 1::2]}
    back = _round_trip(tree, tmp_path)
    assert cst.same_state(tree, back)
    assert back["t"].is_contiguous() and back["t"].shape == (6, 4)


def test_tied_weights_are_stored_once_and_load_as_one_tensor(tmp_path) -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as language models do
    tree = {"emb": emb.state_dict(), "head": head.state_dict(), "again": emb.weight}
    index = write_state(tree, tmp_path / "ck")
    assert index["head/weight"]["alias_of"] == "emb/weight"
    assert index["again"]["alias_of"] == "emb/weight"
    stored = [k for k, e in index.items() if "alias_of" not in e]
    assert stored == ["emb/weight"]
    (shard,) = [f for f in os.listdir(tmp_path / "ck") if f.endswith(".safetensors")]
    assert os.path.getsize(tmp_path / "ck" / shard) < 40 * 4 + 512  # once, not three times
    back = Checkpoint.from_directory(tmp_path / "ck").load_state()
    assert back["head"]["weight"] is back["emb"]["weight"] is back["again"]
    assert torch.equal(back["emb"]["weight"], emb.weight)
    # Only the alias asked for: read from its target's bytes.
    part = Checkpoint.from_directory(tmp_path / "ck").load_state("head")
    assert torch.equal(part["head"]["weight"], emb.weight)


def test_disjoint_views_of_one_storage_are_stored_each(tmp_path) -> None:
    flat_buffer = torch.arange(10, dtype=torch.float32)
    tree = {"w": flat_buffer[:6].view(2, 3), "b": flat_buffer[6:]}
    back = _round_trip(tree, tmp_path)
    assert cst.same_state(tree, back)


@pytest.mark.parametrize("make", [
    lambda: (lambda t: {"a": t, "b": t[1:]})(torch.arange(4.0)),
    lambda: (lambda t: {"a": t, "b": t.t()})(torch.ones(2, 2)),
    lambda: (lambda a: {"a": a, "b": a[::-1]})(np.arange(4)),
    lambda: (lambda t: {"a": t, "b": t.numpy()})(torch.arange(4)),
], ids=["slice", "transpose", "numpy-reversed", "torch-and-numpy"])
def test_overlapping_views_are_refused_naming_both(tmp_path, make) -> None:
    with pytest.raises(UnsupportedStateError, match="overlap in memory") as err:
        Checkpoint.from_state(make(), tmp_path / "ck")
    assert err.value.key in ("a", "b")
    assert not (tmp_path / "ck").exists() or os.listdir(tmp_path / "ck") == []


@pytest.mark.parametrize("tree, key, match", [
    ({"a": {1.5: torch.zeros(1)}}, "a", "state key 1.5 .float. under 'a' is not a string"),
    ({(1, 2): 3}, "", "is not a string"),
    ({"a": {True: 3}}, "a", "True .bool."),
    ({"a": {None: 3}}, "a", "None .NoneType."),
    ({"a": {0: 1, "0": 2}}, "a", "both flatten to '0'"),
    ({"a": [None, {"b": {1.5}}]}, "a/1/b", "builtins.set"),
    ({"a": b"bytes"}, "a", "builtins.bytes"),
    ({"a": object()}, "a", "No pickle"),
    ({"a": np.array(["x"])}, "a", "dtype <U1"),
    ({"a": np.zeros(2, dtype=np.float128 if hasattr(np, "float128") else object)}, "a",
     "safetensors cannot store"),
    ({"a": torch.zeros(2, dtype=torch.complex128)}, "a", "torch.complex128"),
    ({"a": torch.zeros(2).to_sparse()}, "a", "only dense"),
    ({"a": torch.empty(2, device="meta")}, "a", "meta device"),
    ({"s": "\ud800"}, "s", "state value at 's' holds .* lone"),
    ({"a": {"\ud800": 1}}, "a", "state key under 'a' holds .* lone"),
], ids=["float-key", "tuple-key", "bool-key", "none-key", "int-and-str-key", "set", "bytes",
        "object", "str-array", "float128", "complex128", "sparse", "meta", "surrogate",
        "surrogate-key"])
def test_unstorable_trees_are_refused_before_any_write(tmp_path, tree, key, match) -> None:
    with pytest.raises(UnsupportedStateError, match=match) as err:
        Checkpoint.from_state(tree, tmp_path / "ck")
    assert err.value.key == key
    assert isinstance(err.value, InvalidConfigError)
    assert not (tmp_path / "ck").exists() or os.listdir(tmp_path / "ck") == []


def test_int_keys_round_trip_as_ints_like_an_optimizer_state(tmp_path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert set(sd["state"]) == {0, 1}
    back = _round_trip({"optim": sd, "ints": {-3: "x", 10**30: None}}, tmp_path)
    assert cst.same_state(back["optim"], sd)
    assert list(back["ints"]) == [-3, 10**30]
    # The keys flatten to their digits and select like any other.
    part = Checkpoint.from_directory(tmp_path / "ck").load_state("optim/state/1/exp_avg")
    assert torch.equal(part["optim"]["state"][1]["exp_avg"], sd["state"][1]["exp_avg"])
    # And an optimizer takes the state back.
    opt2 = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    opt2.load_state_dict(back["optim"])
    assert opt2.param_groups[0]["lr"] == 0.01
    assert torch.equal(opt2.state[opt2.param_groups[0]["params"][0]]["exp_avg"],
                       sd["state"][0]["exp_avg"])


def test_a_cycle_is_refused(tmp_path) -> None:
    tree: dict = {"a": []}
    tree["a"].append(tree)
    with pytest.raises(UnsupportedStateError, match="cycle"):
        Checkpoint.from_state(tree, tmp_path / "ck")


def test_a_value_reachable_twice_is_not_a_cycle(tmp_path) -> None:
    shared = {"lr": 0.1}
    tree = {"a": shared, "b": [shared, shared]}
    assert cst.same_state(_round_trip(tree, tmp_path), tree)


def test_flattened_keys_escape_slash_and_tilde() -> None:
    t = torch.zeros(1)
    flat = flatten_state({"a/b": {"~c": t}, "l": [0, {"x": np.zeros(1)}]})
    assert list(flat.layout.tensors) == ["a~1b/~0c", "l/1/x"]
    assert split_key("a~1b/~0c") == ["a/b", "~c"]
    assert split_key("~01") == ["~1"]


def test_state_json_holds_no_pickle_and_keeps_dict_order(tmp_path) -> None:
    tree = {"z": 1, "a": {"y": 2, "b": 3}}
    Checkpoint.from_state(tree, tmp_path / "ck")
    body = json.loads((tmp_path / "ck" / STATE_FILE).read_text())
    assert body["kind"] == "checkpoint_store_state" and body["format_version"] == 1
    assert list(_round_trip_dir(tmp_path / "ck")) == ["z", "a"]


def _round_trip_dir(path):
    return Checkpoint.from_directory(path).load_state()


def test_gpu_tensors_go_through_the_cpu_and_parameters_come_back_as_tensors(tmp_path) -> None:
    p = torch.nn.Parameter(torch.ones(2, 2))
    back = _round_trip({"p": p}, tmp_path)["p"]
    assert type(back) is torch.Tensor and not back.requires_grad
    assert torch.equal(back, p.detach())


def test_from_state_into_a_directory_holding_a_state_is_refused(tmp_path) -> None:
    Checkpoint.from_state({"a": torch.zeros(2)}, tmp_path / "ck")
    with pytest.raises(InvalidConfigError, match="exists there already"):
        Checkpoint.from_state({"a": torch.ones(2)}, tmp_path / "ck")
    assert torch.equal(_round_trip_dir(tmp_path / "ck")["a"], torch.zeros(2))


def test_from_state_without_a_directory_writes_a_temporary_one() -> None:
    ck = Checkpoint.from_state({"a": torch.ones(3)})
    try:
        assert os.path.isfile(os.path.join(ck.path, STATE_FILE))
        assert torch.equal(ck.load_state()["a"], torch.ones(3))
    finally:
        import shutil

        shutil.rmtree(ck.path)
