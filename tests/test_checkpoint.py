"""Checkpoint: construction, metadata files, download, pickling (issue: walking skeleton)."""

from __future__ import annotations

import json
import os
import pickle

import fsspec
import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint, CheckpointNotFoundError, MetadataError, StorageContext


def _write_tree(root, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def _read_tree(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root).replace(os.sep, "/")] = open(p, "rb").read()
    return out


FILES = {"model.bin": b"\x00\x01" * 1000, "sub/dir/opt.json": b'{"lr": 0.1}', "empty": b""}


@pytest.fixture
def committed(tmp_path):
    src = tmp_path / "src"
    _write_tree(src, FILES)
    ckpt = Checkpoint.from_directory(src)
    ckpt.set_metadata({"note": "hello"})
    storage = StorageContext(str(tmp_path / "store"), "exp", "trial")
    persisted = storage.persist_checkpoint(ckpt, 0, {"metrics": {"loss": 1.5}})
    return persisted


def test_from_directory_missing_path_raises(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="not an existing directory"):
        Checkpoint.from_directory(tmp_path / "nope")


def test_construct_from_path_uri_and_filesystems(tmp_path):
    assert Checkpoint(str(tmp_path)).path == str(tmp_path)
    assert Checkpoint(f"file://{tmp_path}").path == str(tmp_path)
    assert Checkpoint(tmp_path).path == str(tmp_path)  # PathLike
    c = Checkpoint("bucket/x/", filesystem=pafs.LocalFileSystem())
    # Spelled as the local disk's listings spell it: absolute, no trailing slash.
    assert c.path == os.path.abspath("bucket/x")
    m = Checkpoint("/some/dir", filesystem=fsspec.filesystem("memory"))
    assert isinstance(m.filesystem, pafs.PyFileSystem)
    assert Checkpoint("memory://a/b").uri == "memory://a/b"


def test_repr_pickle_and_fspath(committed):
    assert "local" in repr(committed) and committed.path in repr(committed)
    clone = pickle.loads(pickle.dumps(committed))
    assert clone == committed
    assert clone.internal_metadata["index"] == 0
    with pytest.raises(TypeError, match="to_directory"):
        os.fspath(committed)
    mem = Checkpoint("memory://pickled/ckpt")
    mem.set_metadata({"a": 1})
    assert pickle.loads(pickle.dumps(mem)).get_metadata() == {"a": 1}


def test_internal_metadata_fields_and_read_only(committed):
    meta = committed.internal_metadata
    assert meta["format_version"] == 1
    assert meta["index"] == 0
    assert meta["metrics"] == {"loss": 1.5}
    assert isinstance(meta["created_at"], float)
    manifest = {e["path"]: e["size"] for e in meta["manifest"]}
    assert manifest == {k: len(v) for k, v in FILES.items()}
    with pytest.raises(TypeError):
        meta["index"] = 3  # type: ignore[index]


def test_to_directory_leaves_internal_files_behind(committed, tmp_path):
    out = committed.to_directory(tmp_path / "out")
    got = _read_tree(out)
    assert {k: v for k, v in got.items() if k != ".user_metadata.json"} == FILES
    assert json.loads(got[".user_metadata.json"]) == {"note": "hello"}
    assert ".internal_metadata.json" not in got


def test_as_directory_local_yields_own_dir(committed):
    with committed.as_directory() as d:
        assert d == committed.path


def test_as_directory_remote_temp_removed_even_on_error(committed):
    mem = Checkpoint("memory://asdir/ckpt")
    storage = StorageContext("memory://asdir", "e", "t")
    remote = storage.persist_checkpoint(committed, 0, {"metrics": {}})
    seen = []
    with pytest.raises(RuntimeError):
        with remote.as_directory() as d:
            seen.append(d)
            assert _read_tree(d)["model.bin"] == FILES["model.bin"]
            raise RuntimeError("boom")
    assert not os.path.exists(seen[0])
    with remote.as_directory() as d:
        seen.append(d)
    assert not os.path.exists(seen[1])
    assert mem.get_metadata() == {}


def test_metadata_roundtrip_and_update(committed):
    committed.update_metadata({"step": 3})
    assert committed.get_metadata() == {"note": "hello", "step": 3}
    committed.set_metadata({"only": [1, 2.5, None, "x", {"deep": True}]})
    assert committed.get_metadata() == {"only": [1, 2.5, None, "x", {"deep": True}]}


@pytest.mark.parametrize(
    ("bad", "key"),
    [({"tags": {1, 2}}, "tags"), ({"blob": b"xx"}, "blob"), ({"a": {"b": object()}}, "a/b")],
)
def test_bad_metadata_refused_and_file_unchanged(committed, bad, key):
    committed.set_metadata({"keep": 1})
    path = os.path.join(committed.path, ".user_metadata.json")
    before = open(path, "rb").read()
    with pytest.raises(MetadataError, match=key):
        committed.set_metadata(bad)
    with pytest.raises(MetadataError, match=key):
        committed.update_metadata(bad)
    assert open(path, "rb").read() == before


def test_metadata_must_be_a_dict(committed):
    with pytest.raises(MetadataError, match="must be a dict"):
        committed.set_metadata([1, 2])  # type: ignore[arg-type]


def test_numpy_scalars_are_converted(committed):
    np = pytest.importorskip("numpy")
    committed.set_metadata({"acc": np.float32(0.5), "n": np.int64(3)})
    assert committed.get_metadata() == {"acc": 0.5, "n": 3}
