"""Reading a state back (docs/state.md): partial loads by name and glob,
memory maps, filling tensors in place, checksums, and the marker's format
versions (a checkpoint without a tensor index, as earlier versions wrote,
still opens and verifies)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    InvalidConfigError,
    StateKeyError,
    StateMismatchError,
    TensorCorruptError,
)
from checkpoint_store.state import STATE_FILE, flatten_state, write_buffers, write_state
from checkpoint_store.testing import strategies as cst


def _model_state():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {f"layer{i}.{p}": torch.randn(8, 8 if p == "weight" else 1, generator=g)
                  for i in range(4) for p in ("weight", "bias")},
        "optim": {"state": {"0": {"step": torch.tensor(3.0),
                                  "exp_avg": torch.randn(8, 8, generator=g)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "step": 7,
        "np": np.arange(6, dtype=np.int16),
    }


def _commit(tmp_path, tree, index=0, **kw):
    """A committed checkpoint of ``tree`` on a local storage_path, the index in its marker."""
    src = tmp_path / f"src{index}"
    tensors = write_state(tree, src, **kw)
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial")
    return ctx.persist_checkpoint(Checkpoint.from_directory(src), index, {"tensors": tensors})


def _file_bytes(ck, key):
    e = ck.internal_metadata["tensors"][key]
    with open(os.path.join(ck.path, e["file"]), "rb") as f:
        f.seek(e["offsets"][0])
        return f.read(e["offsets"][1] - e["offsets"][0])


def test_the_marker_carries_the_index_and_format_version_2(tmp_path) -> None:
    tree = _model_state()
    ck = _commit(tmp_path, tree)
    meta = ck.internal_metadata
    assert meta["format_version"] == 2
    index = meta["tensors"]
    assert set(index) == {"model/layer0.weight", "model/layer0.bias", "model/layer1.weight",
                          "model/layer1.bias", "model/layer2.weight", "model/layer2.bias",
                          "model/layer3.weight", "model/layer3.bias",
                          "optim/state/0/step", "optim/state/0/exp_avg", "np"}
    e = index["model/layer1.weight"]
    assert set(e) == {"file", "dtype", "shape", "offsets", "crc32c", "framework"}
    assert (e["dtype"], e["shape"], e["framework"]) == ("F32", [8, 8], "torch")
    assert e["offsets"][1] - e["offsets"][0] == 256
    # The index names exactly the bytes of each tensor in its file.
    for key, t in [("model/layer1.weight", tree["model"]["layer1.weight"]),
                   ("np", tree["np"])]:
        raw = t.numpy().tobytes() if isinstance(t, torch.Tensor) else t.tobytes()
        assert _file_bytes(ck, key) == raw
    assert cst.same_state(ck.load_state(), tree)
    ck.verify()


def test_partial_loads_by_name_subtree_and_glob_return_exactly_the_saved_bytes(tmp_path) -> None:
    tree = _model_state()
    ck = _commit(tmp_path, tree)
    one = ck.load_state("model/layer2.bias")
    assert list(one) == ["model"] and list(one["model"]) == ["layer2.bias"]
    assert cst.same_state(one["model"]["layer2.bias"], tree["model"]["layer2.bias"])
    sub = ck.load_state(["model"])
    assert cst.same_state(sub, {"model": tree["model"]})
    glob = ck.load_state("model/*.weight")
    assert list(glob["model"]) == [f"layer{i}.weight" for i in range(4)]
    for k, v in glob["model"].items():
        assert cst.same_state(v, tree["model"][k])
    mixed = ck.load_state(["step", "optim/param_groups", "np"])
    assert cst.same_state(mixed, {"optim": {"param_groups": tree["optim"]["param_groups"]},
                                  "step": 7, "np": tree["np"]})


def test_a_partial_list_keeps_its_length(tmp_path) -> None:
    tree = {"layers": [torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)]}
    ck = Checkpoint.from_state(tree, tmp_path / "ck")
    back = ck.load_state("layers/1")
    assert back["layers"][0] is None and back["layers"][2] is None
    assert torch.equal(back["layers"][1], torch.ones(2))


def test_an_unknown_key_is_a_typed_error_with_suggestions(tmp_path) -> None:
    ck = _commit(tmp_path, _model_state())
    with pytest.raises(StateKeyError, match="did you mean 'model/layer1.weight'") as err:
        ck.load_state(["model", "model/layer1.weigth"])
    assert err.value.key == "model/layer1.weigth"
    assert isinstance(err.value, KeyError)
    with pytest.raises(StateKeyError):
        ck.load_state("nothing/*")


def test_a_local_partial_load_reads_only_the_asked_tensors(tmp_path, monkeypatch) -> None:
    tree = {f"t{i}": torch.full((1024,), float(i)) for i in range(10)}
    ck = Checkpoint.from_state(tree, tmp_path / "ck")
    read: list[int] = []
    real = os.preadv

    def counting(fd, buffers, offset, *a):
        n = real(fd, buffers, offset, *a)
        read.append(n)
        return n

    monkeypatch.setattr(os, "preadv", counting)
    back = ck.load_state(["t3", "t7"])
    assert sum(read) == 2 * 4096
    assert torch.equal(back["t7"], tree["t7"])


def _mapped_ranges():
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith(".safetensors"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                yield lo, hi, parts[5]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_mmap_load_is_a_memory_map_of_the_file_not_a_copy(tmp_path) -> None:
    tree = {"w": torch.randn(256, 256), "a": np.arange(4096, dtype=np.float64),
            "bf": torch.randn(64).to(torch.bfloat16)}
    ck = _commit(tmp_path, tree)
    back = ck.load_state(mmap=True)
    assert cst.same_state(back, tree)
    ranges = list(_mapped_ranges())
    for ptr, n in [(back["w"].data_ptr(), back["w"].nbytes),
                   (back["a"].__array_interface__["data"][0], back["a"].nbytes),
                   (back["bf"].data_ptr(), back["bf"].nbytes)]:
        assert any(lo <= ptr and ptr + n <= hi and path.startswith(ck.path)
                   for lo, hi, path in ranges), ptr
    # Aligned to their element size (widest first in the shard).
    assert back["w"].data_ptr() % 4 == 0 and back["a"].__array_interface__["data"][0] % 8 == 0
    # Copy-on-write: writing to the view never changes the checkpoint.
    back["w"].zero_()
    ck.verify()
    assert cst.same_state(ck.load_state(["w"])["w"], tree["w"])


def test_mmap_is_ignored_where_the_checkpoint_is_not_local(tmp_path) -> None:
    ctx = StorageContext("memory://state-mmap", "exp", "trial")
    src = tmp_path / "src"
    tensors = write_state({"a": torch.arange(4)}, src)
    ck = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {"tensors": tensors})
    assert torch.equal(ck.load_state(mmap=True)["a"], torch.arange(4))


def test_into_fills_the_tensors_in_place(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    ck = _commit(tmp_path, {"model": model.state_dict(), "epoch": 3})
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    sd = fresh.state_dict()
    ptrs = {k: v.data_ptr() for k, v in sd.items()}
    back = ck.load_state(into={"model": sd, "epoch": None})
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)
        assert back["model"][k] is sd[k] and sd[k].data_ptr() == ptrs[k]
    assert back["epoch"] == 3
    # A numpy target is filled as well; a non-contiguous one too.
    ck2 = Checkpoint.from_state({"a": np.arange(6.0).reshape(2, 3), "t": torch.arange(6.0)},
                                tmp_path / "ck2")
    target = np.zeros((3, 2)).T
    t_target = torch.zeros(12)[::2]
    ck2.load_state(into={"a": target, "t": t_target})
    assert (target == np.arange(6.0).reshape(2, 3)).all()
    assert torch.equal(t_target, torch.arange(6.0))


def test_into_fills_an_optimizer_state_with_int_keys(tmp_path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    ck = _commit(tmp_path, {"optim": opt.state_dict()})
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    model2(torch.randn(4, 3)).sum().backward()
    opt2.step()  # creates the momentum buffers to fill
    ck.load_state(into={"optim": {"state": opt2.state_dict()["state"]}})
    for p1, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(opt.state[p1]["momentum_buffer"], opt2.state[p2]["momentum_buffer"])


def test_into_with_keys_loads_only_the_intersection(tmp_path) -> None:
    ck = _commit(tmp_path, _model_state())
    w = torch.zeros(8, 8)
    b = torch.zeros(8, 1)
    back = ck.load_state("model/*.weight", into={"model": {"layer0.weight": w, "layer0.bias": b}})
    assert list(back["model"]) == ["layer0.weight"]
    assert not torch.equal(w, torch.zeros(8, 8)) and torch.equal(b, torch.zeros(8, 1))


def _read_only(array):
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("into, error, match", [
    ({"model": {"layer0.weight": torch.zeros(8, 8), "nope": torch.zeros(1)}}, StateKeyError,
     "'model/nope' is not in the saved state"),
    ({"model": {"layer0.weight": torch.zeros(8, 8, dtype=torch.float64)}}, StateMismatchError,
     "float64 \\[8, 8\\]; the saved tensor is F32 \\[8, 8\\]"),
    ({"model": {"layer0.weight": torch.zeros(8, 7)}}, StateMismatchError, "float32 \\[8, 7\\]"),
    ({"step": torch.zeros(1)}, StateMismatchError, "a JSON value"),
    ({"model": torch.zeros(1)}, StateMismatchError, "a subtree"),
    ({"model": {"layer0.weight": _read_only(np.zeros((8, 8), np.float32))}}, StateMismatchError,
     "cannot be written in place \\(a read-only array\\)"),
    ({"model": {"layer0.weight": torch.zeros(1, 1).expand(8, 8)}}, StateMismatchError,
     "share one memory location"),
], ids=["unknown", "dtype", "shape", "json-leaf", "subtree", "read-only", "expanded"])
def test_into_errors_change_nothing(tmp_path, into, error, match) -> None:
    ck = _commit(tmp_path, _model_state())
    keep = torch.zeros(8, 8)
    into = {**into}
    into.setdefault("model", {})
    if isinstance(into["model"], dict):
        into["model"] = {"layer1.weight": keep, **into["model"]}
    with pytest.raises(error, match=match):
        ck.load_state(into=into)
    assert torch.equal(keep, torch.zeros(8, 8))


def _flip_byte_of(ck, key, at=3):
    e = ck.internal_metadata["tensors"][key]
    path = os.path.join(ck.path, e["file"])
    with open(path, "r+b") as f:
        f.seek(e["offsets"][0] + at)
        b = f.read(1)
        f.seek(e["offsets"][0] + at)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("mmap", [False, True])
def test_a_flipped_byte_in_one_tensor_is_found_by_verify_and_load_state(tmp_path, mmap) -> None:
    tree = _model_state()
    ck = _commit(tmp_path, tree)
    _flip_byte_of(ck, "model/layer2.weight")
    with pytest.raises(TensorCorruptError) as err:
        ck.verify()
    assert err.value.tensor == "model/layer2.weight"
    assert err.value.file == ck.internal_metadata["tensors"]["model/layer2.weight"]["file"]
    assert isinstance(err.value.__cause__, CheckpointCorruptError)
    with pytest.raises(TensorCorruptError, match="'model/layer2.weight'") as err2:
        ck.load_state(mmap=mmap)
    assert err2.value.tensor == "model/layer2.weight"
    # Tensors that are intact still load, and into is left alone on a failure.
    assert cst.same_state(ck.load_state("model/layer1.weight")["model"]["layer1.weight"],
                          tree["model"]["layer1.weight"])
    target = torch.zeros(8, 8)
    with pytest.raises(TensorCorruptError):
        ck.load_state(into={"model": {"layer1.weight": target, "layer2.weight": torch.zeros(8, 8)}})
    assert torch.equal(target, torch.zeros(8, 8))
    # verify=False reads the damaged bytes as they are.
    ck.load_state("model/layer2.weight", verify=False)


@pytest.mark.parametrize("upload_mode", ["sync", "async"])
def test_a_state_reported_as_a_directory_gets_its_index_in_the_marker(tmp_path,
                                                                       upload_mode) -> None:
    from checkpoint_store import UploadConfig, session

    tree = {"a": torch.zeros(64), "n": 1}
    with session.start(storage_path=str(tmp_path / "store"), experiment_name="exp",
                       trial_name="t", upload_config=UploadConfig(upload_mode=upload_mode)):
        session.report({"loss": 1.0}, checkpoint=Checkpoint.from_state(tree, tmp_path / "s"))
    [(ck, meta)] = StorageContext(str(tmp_path / "store"), "exp", "t").committed_checkpoints()
    assert meta["format_version"] == 2
    assert meta["tensors"] == json.loads((tmp_path / "s" / STATE_FILE).read_text())["tensors"]
    assert cst.same_state(ck.load_state(), tree)


def test_verify_names_the_tensor_without_an_index_in_the_marker(tmp_path) -> None:
    # A marker without "tensors" (a state committed by a writer that did not
    # record it, version 1): state.json has the index.
    ck = _commit(tmp_path, {"a": torch.zeros(64), "b": torch.ones(64)})
    marker = os.path.join(ck.path, ".internal_metadata.json")
    meta = json.loads(open(marker).read())
    index = meta.pop("tensors")
    meta["format_version"] = 1
    open(marker, "w").write(json.dumps(meta))
    assert ck.internal_metadata["format_version"] == 1
    e = index["b"]
    with open(os.path.join(ck.path, e["file"]), "r+b") as f:
        f.seek(e["offsets"][0] + 10)
        f.write(b"\x7f")
    with pytest.raises(TensorCorruptError) as err:
        ck.verify()
    assert err.value.tensor == "b"
    with pytest.raises(TensorCorruptError):
        ck.load_state()
    assert torch.equal(ck.load_state("a")["a"], torch.zeros(64))


def test_a_damaged_header_is_reported_as_the_file(tmp_path) -> None:
    ck = _commit(tmp_path, {"a": torch.zeros(4)})
    e = ck.internal_metadata["tensors"]["a"]
    with open(os.path.join(ck.path, e["file"]), "r+b") as f:
        f.seek(9)
        f.write(b"X")
    with pytest.raises(CheckpointCorruptError) as err:
        ck.verify()
    assert not isinstance(err.value, TensorCorruptError) and err.value.file == e["file"]
    ck.load_state()  # the tensor's own bytes are intact


def test_a_damaged_state_json_is_found_by_load_state(tmp_path) -> None:
    ck = _commit(tmp_path, {"a": torch.zeros(4), "n": 1})
    path = os.path.join(ck.path, STATE_FILE)
    raw = bytearray(open(path, "rb").read())
    raw[raw.index(b'"value":1') + 8] = ord("2")
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CheckpointCorruptError) as err:
        ck.load_state()
    assert err.value.file == STATE_FILE


def test_a_checkpoint_without_a_state_says_so(tmp_path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.pt").write_bytes(b"x" * 10)
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial")
    ck = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
    with pytest.raises(CheckpointNotFoundError, match="holds no saved state"):
        ck.load_state()
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        Checkpoint(str(tmp_path / "nowhere")).load_state()


def test_checkpoints_of_format_version_1_still_open_and_verify(tmp_path) -> None:
    # What this release writes for a checkpoint without a state, and what
    # every earlier release wrote: version 1, no "tensors".
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(1000))
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial")
    ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {"loss": 1.0}})
    marker = tmp_path / "store" / "exp" / "trial" / "checkpoint_000000" / ".internal_metadata.json"
    meta = json.loads(marker.read_text())
    assert meta["format_version"] == 1 and "tensors" not in meta
    ck = Checkpoint(str(marker.parent))
    assert ck.is_committed
    ck.verify()
    [(found, _)] = ctx.committed_checkpoints()
    assert found == ck


def test_a_marker_of_version_2_without_an_index_is_not_a_checkpoint(tmp_path) -> None:
    ck = _commit(tmp_path, {"a": torch.zeros(2)})
    marker = os.path.join(ck.path, ".internal_metadata.json")
    meta = json.loads(open(marker).read())
    del meta["tensors"]
    open(marker, "w").write(json.dumps(meta))
    assert not ck.is_committed
    meta["format_version"] = 3  # chunks (docs/format.md): a chunk root is required
    open(marker, "w").write(json.dumps(meta))
    with pytest.raises(CheckpointCorruptError, match="'chunk_root'"):
        ck.verify()
    meta["format_version"] = 4
    open(marker, "w").write(json.dumps(meta))
    with pytest.raises(CheckpointCorruptError, match="reads versions 1, 2, 3"):
        ck.verify()


def test_an_index_in_the_marker_that_differs_from_state_json_is_corrupt(tmp_path) -> None:
    ck = _commit(tmp_path, {"a": torch.zeros(2), "b": torch.ones(2)})
    marker = os.path.join(ck.path, ".internal_metadata.json")
    meta = json.loads(open(marker).read())
    meta["tensors"]["a"]["crc32c"] = "00000000"
    open(marker, "w").write(json.dumps(meta))
    with pytest.raises(CheckpointCorruptError, match="differs"):
        ck.load_state()


def test_raw_buffers_write_a_loadable_state_without_torch(tmp_path) -> None:
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    bf = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    buffers = {"model/w": ("F32", (3, 4), memoryview(w.tobytes())),
               "model/bf": ("BF16", [2], bytes(bf.view(torch.uint8).numpy())),
               "a~1b": ("I8", (), b"\x05")}
    index = write_buffers(buffers, tmp_path / "ck", shard_bytes=16)
    # 48 bytes are over the 16 a shard holds: a file of their own; 2 + 1 share one.
    assert [index[k]["file"] for k in buffers] == [
        "tensors-00001-of-00002.safetensors", "tensors-00002-of-00002.safetensors",
        "tensors-00002-of-00002.safetensors"]
    back = Checkpoint.from_directory(tmp_path / "ck").load_state()
    assert cst.same_state(back, {"model": {"w": w, "bf": bf}, "a/b": np.array(5, np.int8)})


def test_a_checkpoint_written_by_the_release_before_states_opens_and_verifies(tmp_path) -> None:
    # tests/state/data/format_v1_checkpoint: committed by checkpoint-store before
    # the state format existed (format version 1, no "tensors"), kept byte for byte.
    import shutil

    data = os.path.join(os.path.dirname(__file__), "data", "format_v1_checkpoint")
    trial = tmp_path / "store" / "exp" / "trial"
    shutil.copytree(data, trial / "checkpoint_000000")
    ck = Checkpoint(str(trial / "checkpoint_000000"))
    assert ck.is_committed and ck.internal_metadata["format_version"] == 1
    ck.verify()
    assert ck.get_metadata() == {"note": "written by format version 1"}
    out = ck.to_directory(str(tmp_path / "out"))
    assert open(os.path.join(out, "weights.bin"), "rb").read() == bytes(range(256)) * 4
    ctx = StorageContext(str(tmp_path / "store"), "exp", "trial")
    [(found, meta)] = ctx.committed_checkpoints()
    assert found == ck and meta["metrics"] == {"loss": 0.5}
    with pytest.raises(CheckpointNotFoundError, match="holds no saved state"):
        ck.load_state()


def _walk(tree, key):
    """The entry of ``tree`` at a flattened key (components unescaped against
    the dict's own keys, list positions as ints)."""
    from checkpoint_store.state import escape_key

    node = tree
    for part in key.split("/") if key else []:
        if isinstance(node, dict):
            node = next(v for k, v in node.items() if escape_key(k) == part)
        else:
            node = node[int(part)]
    return node


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(cst.state_trees(max_leaves=12), st.data())
def test_any_subset_of_keys_loads_exactly_those_entries(tmp_path_factory, tree, data) -> None:
    from checkpoint_store.state._tree import iter_leaves

    d = tmp_path_factory.mktemp("p")
    ck = Checkpoint.from_state({"s": tree}, d / "ck")
    leaves = [k for k, _ in iter_leaves(flatten_state({"s": tree}).layout.skeleton)]
    chosen = data.draw(st.lists(st.sampled_from(leaves), unique=True, max_size=4)) if leaves \
        else []
    got = ck.load_state(chosen)
    for key in chosen:
        assert cst.same_state(_walk(got, key), _walk({"s": tree}, key)), key
    # Nothing else: every other leaf is absent, or None where a list keeps its length.
    for key in leaves:
        if key in chosen:
            continue
        try:
            value = _walk(got, key)
        except (StopIteration, IndexError, KeyError, TypeError, ValueError):
            continue
        assert value is None or isinstance(value, (dict, list, tuple)), key


def test_keys_must_be_strings(tmp_path) -> None:
    from checkpoint_store.errors import InvalidConfigError

    ck = Checkpoint.from_state({"a": torch.zeros(1)}, tmp_path / "ck")
    with pytest.raises(InvalidConfigError, match="keys must be strings"):
        ck.load_state([1])
    for bad in (1, b"a", 1.5):
        with pytest.raises(InvalidConfigError, match="a string or a list of strings"):
            ck.load_state(bad)
    for flags in ({"mmap": "yes"}, {"verify": 0}, {"mmap": None}):
        with pytest.raises(InvalidConfigError, match="must be True or False"):
            ck.load_state(**flags)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_load_state_reports_progress_in_bytes(tmp_path, where) -> None:
    """load_state(progress=): 0 first, then growing, last (total, total), the
    total the bytes of the tensors asked for; on a local disk, an object-like
    store, a partial load, a slice (read box by box) and a memory map."""
    from checkpoint_store.state import StateSlice

    tree = {"a": torch.randn(300_000), "b": torch.randn(1000, 50), "n": 3}
    write_state(tree, tmp_path / "src")
    if where == "local":
        ck = Checkpoint.from_directory(str(tmp_path / "src"))
    else:
        ctx = StorageContext(f"memory://progress-{tmp_path.name}", "e", "t")
        ck = ctx.persist_checkpoint(Checkpoint.from_directory(str(tmp_path / "src")), 0, {})
    for kwargs, total in (({}, 1_200_000 + 200_000), ({"keys": "b"}, 200_000),
                          ({"into": {"b": StateSlice(torch.empty(10, 50), (5, 0))}}, 2_000),
                          ({"mmap": True}, 1_400_000)):
        calls: list[tuple[int, int]] = []
        ck.load_state(progress=lambda d, t, _c=calls: _c.append((d, t)), **kwargs)
        assert calls[0] == (0, total) and calls[-1] == (total, total), (kwargs, calls[:3])
        assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:], strict=False)), kwargs
    with pytest.raises(InvalidConfigError, match="progress"):
        ck.load_state(progress=5)
