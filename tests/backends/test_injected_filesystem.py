"""A filesystem the user passes in carries every I/O, with URI resolution made to fail.

The spy is a ``pyarrow.fs.FileSystemHandler`` over a local folder. It is not a
``LocalFileSystem``, so none of the local-disk fast paths (plain ``open()``,
``fsync``) may apply: everything must go through the pyarrow API, and so
through the spy. Its output handles are Python objects without ``fileno()``
(like s3fs streams), so saving must not need one.
"""

from __future__ import annotations

import os
import posixpath
import threading
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.fs as pafs
import pytest

import checkpoint_store.checkpoint as checkpoint_mod
import checkpoint_store.registry as registry_mod
import checkpoint_store.storage as storage_mod
from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext, session
from checkpoint_store.testing.conformance import make_tree, read_tree


class _CountingWriter:
    """A write-only Python file object with no ``fileno()``, counting bytes."""

    def __init__(self, inner: pa.NativeFile, on_close):
        self._inner = inner
        self._on_close = on_close
        self.nbytes = 0
        self.closed = False

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        self.nbytes += n
        self._inner.write(data)
        return n

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.nbytes

    def flush(self) -> None:
        self._inner.flush()

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
            self.closed = True
            self._on_close(self.nbytes)


class SpyHandler(pafs.FileSystemHandler):
    """Maps paths under ``/`` onto ``root`` on the local disk and records each call."""

    def __init__(self, root: str):
        self.root = root.rstrip("/")
        self.inner = pafs.LocalFileSystem()
        self.calls: list[tuple[str, str]] = []
        self.writes: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def _rec(self, op: str, path: str) -> None:
        with self._lock:
            self.calls.append((op, path))

    def _in(self, path: str) -> str:
        return self.root + "/" + path.lstrip("/")

    def _out(self, path: str) -> str:
        return "/" + path[len(self.root):].lstrip("/")

    def _info(self, fi: pafs.FileInfo) -> pafs.FileInfo:
        return pafs.FileInfo(self._out(fi.path), fi.type, size=fi.size, mtime=fi.mtime)

    def __eq__(self, other):
        return other is self

    def __hash__(self):
        return id(self)

    def get_type_name(self):
        return "spy"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        for p in paths:
            self._rec("info", p)
        return [self._info(fi) for fi in self.inner.get_file_info([self._in(p) for p in paths])]

    def get_file_info_selector(self, selector):
        self._rec("list", selector.base_dir)
        sel = pafs.FileSelector(self._in(selector.base_dir), selector.allow_not_found,
                                selector.recursive)
        return [self._info(fi) for fi in self.inner.get_file_info(sel)]

    def create_dir(self, path, recursive):
        self._rec("mkdir", path)
        self.inner.create_dir(self._in(path), recursive=recursive)

    def delete_dir(self, path):
        self._rec("delete", path)
        self.inner.delete_dir(self._in(path))

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self._rec("delete", path)
        self.inner.delete_dir_contents(self._in(path), missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("not in this test")

    def delete_file(self, path):
        self._rec("delete", path)
        self.inner.delete_file(self._in(path))

    def move(self, src, dest):
        self._rec("move", src)
        self.inner.move(self._in(src), self._in(dest))

    def copy_file(self, src, dest):
        self._rec("copy", src)
        self.inner.copy_file(self._in(src), self._in(dest))

    def open_input_stream(self, path):
        self._rec("read", path)
        return self.inner.open_input_stream(self._in(path))

    def open_input_file(self, path):
        self._rec("read", path)
        return self.inner.open_input_file(self._in(path))

    def open_output_stream(self, path, metadata):
        self._rec("write", path)
        # Like an object store: a PUT needs no parent directory.
        self.inner.create_dir(posixpath.dirname(self._in(path)), recursive=True)
        native = self.inner.open_output_stream(self._in(path))

        def closed(n: int) -> None:
            with self._lock:
                self.writes.append((path, n))

        return pa.PythonFile(_CountingWriter(native, closed), mode="w")

    def open_append_stream(self, path, metadata):
        self._rec("append", path)
        return self.inner.open_append_stream(self._in(path))


@pytest.fixture
def no_uri_resolution(monkeypatch, tmp_path):
    """Any resolution of a storage location fails; only the user's local source
    directories (under ``tmp_path/src*``) may be resolved, as local paths."""
    real = registry_mod.resolve
    allowed = str(tmp_path / "src")

    def guarded(location, *, filesystem=None, storage_options=None):
        if filesystem is None and not os.fspath(location).startswith(allowed):
            raise AssertionError(f"URI resolution attempted for {location!r}")
        return real(location, filesystem=filesystem, storage_options=storage_options)

    def refuse(*args, **kwargs):
        raise AssertionError(f"filesystem built from a URI: {args!r}")

    for mod in (registry_mod, checkpoint_mod, storage_mod):
        monkeypatch.setattr(mod, "resolve", guarded)
    monkeypatch.setattr(registry_mod, "backend_for_scheme",
                        lambda scheme, *a, **k: refuse(scheme) if scheme != "file"
                        else registry_mod.__dict__["_factory_for"]("file")[0]("file://", {}))
    monkeypatch.setattr(fsspec, "filesystem", refuse)
    monkeypatch.setattr(fsspec, "url_to_fs", refuse)
    monkeypatch.setattr(fsspec.core, "url_to_fs", refuse)


def _src(tmp_path: Path, i: int) -> str:
    d = tmp_path / f"src{i}"
    make_tree(d, {"weights.bin": 1000 + i, "sub/opt.bin": 10, "user-empty.txt": 0}, seed=i)
    Checkpoint.from_directory(d).set_metadata({"epoch": i})
    return str(d)


def test_every_io_goes_through_the_injected_filesystem(tmp_path, no_uri_resolution):
    spy = SpyHandler(str(tmp_path / "spy-root"))
    fs = pafs.PyFileSystem(spy)
    storage_path = "/runs-" + tmp_path.name  # never created on the real disk
    cfg = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="acc",
                           checkpoint_score_order="max")
    accs = [0.9, 0.5, 0.7]
    with session.start(storage_path=storage_path, storage_filesystem=fs,
                       experiment_name="exp", trial_name="t", checkpoint_config=cfg,
                       config={"lr": 0.1}):
        for i, acc in enumerate(accs):
            session.report({"acc": acc}, checkpoint=Checkpoint.from_directory(_src(tmp_path, i)))
    # Restore in a new session: manager state, results and the checkpoint itself.
    with session.start(storage_path=storage_path, storage_filesystem=fs,
                       experiment_name="exp", trial_name="t", checkpoint_config=cfg):
        latest = session.get_checkpoint()
        assert latest is not None and latest.filesystem is fs
        latest.update_metadata({"note": "resumed"})
        out = latest.to_directory(str(tmp_path / "restored"))
    assert read_tree(out) == read_tree(tmp_path / "src2") | {
        ".user_metadata.json": read_tree(out)[".user_metadata.json"]}
    assert latest.get_metadata() == {"epoch": 2, "note": "resumed"}

    ctx = StorageContext(storage_path, "exp", "t", storage_filesystem=fs)
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0, 2]
    assert [r["acc"] for r in ctx.read_results()] == accs

    trial = f"{storage_path}/exp/t"
    written = {p for op, p in spy.calls if op in ("write", "append", "move")}
    for name in ("params.json", "result.json", ".checkpoint_manager.json"):
        assert any(p.endswith(f"/t/{name}") for p in written), name
    for leaf in (".internal_metadata.json", ".user_metadata.json", "weights.bin",
                 "sub/opt.bin"):
        assert any(p.endswith(f"/{leaf}") and "/checkpoint_00000" in p for p in written), leaf
    read = {p for op, p in spy.calls if op == "read"}
    assert f"{trial}/.checkpoint_manager.json" in read
    assert any(p.endswith("checkpoint_000002/weights.bin") for p in read)
    assert any(p.endswith("checkpoint_000002/.internal_metadata.json") for p in read)
    assert any(op == "list" and p == trial for op, p in spy.calls)
    deleted = [p for op, p in spy.calls if op == "delete"]
    assert any("checkpoint_000001" in p for p in deleted)

    # Nothing bypassed the spy to reach the real path, and nothing of ours is empty.
    assert not os.path.exists(storage_path)
    zero = sorted(p for p, n in spy.writes if n == 0)
    assert all(p.endswith("/user-empty.txt") for p in zero), zero
    assert sorted(os.listdir(tmp_path / "spy-root" / storage_path.lstrip("/") / "exp" / "t"))


def test_injected_fsspec_filesystem_is_used(tmp_path, no_uri_resolution):
    from fsspec.implementations.memory import MemoryFileSystem

    class PrivateMemory(MemoryFileSystem):
        store: dict = {}
        pseudo_dirs = [""]

    mem = PrivateMemory()
    ctx = StorageContext("/bucket/runs/", "exp", "t", storage_filesystem=mem)
    assert ctx.storage_path == "/bucket/runs"
    ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(_src(tmp_path, 0)), 0, {})
    assert any(k.endswith("checkpoint_000000/weights.bin") for k in PrivateMemory.store)
    assert ckpt.filesystem.handler.fs is mem
    assert read_tree(ckpt.to_directory(str(tmp_path / "o")))["weights.bin"] == (
        read_tree(tmp_path / "src0")["weights.bin"])
