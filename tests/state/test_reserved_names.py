"""Names the safetensors format reserves, in a state (issue 37 item 5).

A shard's header maps tensor names to their dtype, shape and offsets, and
one name, ``__metadata__``, to the header's own metadata. A state whose
flattened key is ``__metadata__`` must still round-trip exactly and leave
shards that safetensors' own readers open.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from checkpoint_store import Checkpoint, session
from checkpoint_store.state import header_name, key_of_header_name, split_key, write_buffers
from checkpoint_store.testing import strategies as cst

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file as load_numpy  # noqa: E402
from safetensors.torch import load_file as load_torch  # noqa: E402


def _shards(directory: str) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory)
                  if f.endswith(".safetensors"))


def _check_shards(directory: str, tree_tensors: dict[str, object], fmt: str) -> None:
    """Every shard opens with ``safe_open`` (its metadata intact) and loads
    with ``load_file``; together they hold every tensor, each under
    :func:`header_name` of its flattened key, with the saved bytes."""
    seen = {}
    for path in _shards(directory):
        with safe_open(path, "pt") as f:
            assert f.metadata() == {"format": fmt}
            for name in f.keys():
                seen[key_of_header_name(name)] = f.get_tensor(name)
        loaded = load_torch(path) if fmt == "pt" else load_numpy(path)
        assert set(loaded) <= {header_name(k) for k in tree_tensors}
    assert set(seen) == set(tree_tensors)
    for key, want in tree_tensors.items():
        got = seen[key]
        want_t = want if isinstance(want, torch.Tensor) else torch.from_numpy(np.asarray(want))
        assert torch.equal(got, want_t), key


def test_a_state_key_named_metadata_round_trips_through_report(tmp_path) -> None:
    """The issue's input: report(state={"__metadata__": ...}) used to replace
    the header's metadata entry, so no safetensors reader opened the shard."""
    state = {"__metadata__": torch.arange(6, dtype=torch.float32).reshape(2, 3),
             "w": torch.ones(4), "step": 3}
    with session.start(storage_path=str(tmp_path / "s"), experiment_name="e",
                       trial_name="t") as s:
        s.report({"loss": 1.0}, state=state)
        s.wait()
        ckpt = s.get_checkpoint()
    assert ckpt is not None
    ckpt.verify()
    back = ckpt.load_state()
    assert cst.same_state(back, state)
    assert list(back) == ["__metadata__", "w", "step"]
    assert cst.same_state(ckpt.load_state(keys="__metadata__"),
                          {"__metadata__": state["__metadata__"]})
    # The index keeps the flattened key itself; only the header escapes it.
    assert "__metadata__" in ckpt.internal_metadata["tensors"]
    local = ckpt.to_directory(tmp_path / "copy")
    _check_shards(local, {"__metadata__": state["__metadata__"], "w": state["w"]}, "pt")


def test_metadata_and_its_escaped_spelling_are_two_tensors(tmp_path) -> None:
    """Found by ourselves: a key spelled like the escaped name
    (``~2__metadata__``) flattens to ``~02__metadata__`` and stays apart from
    ``__metadata__``, also with one tensor per shard."""
    state = {"__metadata__": torch.zeros(2), "~2__metadata__": torch.ones(3),
             "sub": {"__metadata__": torch.full((1,), 7.0)}}
    ckpt = Checkpoint.from_state(state, tmp_path / "d", shard_bytes=1)
    assert len(_shards(str(tmp_path / "d"))) == 3
    assert cst.same_state(ckpt.load_state(), state)
    _check_shards(str(tmp_path / "d"), {"__metadata__": state["__metadata__"],
                                        "~02__metadata__": state["~2__metadata__"],
                                        "sub/__metadata__": state["sub"]["__metadata__"]},
                  "pt")


def test_raw_buffers_named_metadata_make_a_valid_numpy_shard(tmp_path) -> None:
    """Found by ourselves: the raw-bytes writer (what the persist process
    uses, no torch) goes through the same header names."""
    a = np.arange(5, dtype=np.int32)
    index = write_buffers({"__metadata__": ("I32", (5,), a.tobytes())}, tmp_path / "d")
    (path,) = _shards(str(tmp_path / "d"))
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "np"}
    assert header["~2__metadata__"]["data_offsets"] == [0, 20]
    assert (load_numpy(path)["~2__metadata__"] == a).all()
    assert index["__metadata__"]["shape"] == [5]
    back = Checkpoint.from_directory(tmp_path / "d").load_state()
    assert (back["__metadata__"] == a).all()


@pytest.mark.parametrize("key, canonical", [("a~2", "a~02"), ("x~", "x~0"),
                                            ("~2__metadata__", "~02__metadata__"),
                                            ("m/~3/w", "m/~03/w")])
def test_raw_keys_that_are_no_flattened_keys_are_refused(tmp_path, key, canonical) -> None:
    """Found by ourselves: write_buffers takes flattened keys; one with a bare
    ``~`` loaded under another key than it was written with (``keys=`` did
    not find it), and ``~2__metadata__`` next to ``__metadata__`` gave a
    header with one name twice, which safetensors refused. Refused now,
    naming the key to use, before anything is written."""
    from checkpoint_store import UnsupportedStateError

    a = np.arange(3, dtype=np.int32).tobytes()
    with pytest.raises(UnsupportedStateError, match=f"did you mean '{canonical}'") as err:
        write_buffers({"__metadata__": ("I32", (3,), a), key: ("I32", (3,), a)},
                      tmp_path / "d")
    assert err.value.key == key
    assert not (tmp_path / "d").exists() or os.listdir(tmp_path / "d") == []
    # The key it names is the one that round-trips.
    write_buffers({canonical: ("I32", (3,), a)}, tmp_path / "ok")
    node = Checkpoint.from_directory(tmp_path / "ok").load_state(keys=canonical)
    for part in split_key(canonical):
        node = node[part]
    assert (node == np.arange(3, dtype=np.int32)).all()


def test_keys_spelled_like_the_formats_own_fields_round_trip(tmp_path) -> None:
    """Found by ourselves (checked, no change needed): ``state.json``'s node
    fields (``dict``, ``tensor``, ``value``, ...), its top-level fields and
    the index's fields as state keys, at the root and nested, come back as
    they went in, and every shard opens with safetensors."""
    names = ["dict", "list", "tuple", "tensor", "value", "kind", "format_version", "tree",
             "tensors", "file", "offsets", "crc32c", "alias_of", "scalar", "framework"]
    state = {n: {"tensor": torch.full((2,), float(i)), "value": [n, {"dict": None}]}
             for i, n in enumerate(names)}
    state["value"] = torch.zeros(1)  # a tensor where the skeleton has a JSON leaf field
    ckpt = Checkpoint.from_state(state, tmp_path / "d", shard_bytes=8)
    assert cst.same_state(ckpt.load_state(), state)
    assert cst.same_state(ckpt.load_state(keys="tensor/tensor"),
                          {"tensor": {"tensor": state["tensor"]["tensor"]}})
    for path in _shards(str(tmp_path / "d")):
        load_torch(path)
