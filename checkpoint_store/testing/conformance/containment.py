"""Nothing is written outside its place: a source key holding ``..`` is
refused by ``report()`` and ``to_directory()`` before the first byte, a
download into the checkpoint itself is refused, and a re-download leaves
exactly the new checkpoint."""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from checkpoint_store._format.layout import USER_METADATA
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.backends.base import Backend
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.testing.conformance._base import BackendFixtures, read_tree
from checkpoint_store.testing.servers import StorageLocation

__all__ = ["ContainmentTests"]


class ContainmentTests(BackendFixtures):
    """Reports and downloads never write outside their target."""

    # -- nothing written outside its place -----------------------------------------------

    def _plant_dotdot_key(self, backend: Backend, src: str, rel: str) -> None:
        """Write ``src/model.bin`` and the literal key ``src/<rel>`` (``rel``
        holds ``..``); skip where the store resolves ``..`` itself: there
        the key cannot exist (and writing it would land elsewhere)."""
        fs, caps = backend.filesystem, backend.capabilities
        if _fsutil.local_path(fs, src) is not None:
            pytest.skip("the local disk resolves '..': no such key can exist")
        _fsutil.write_bytes(fs, posixpath.join(src, "model.bin"), b"model", caps)
        try:
            _fsutil.write_bytes(fs, posixpath.join(src, rel), b"escape", caps)
        except Exception as exc:  # noqa: BLE001 (stores refuse it each their own way)
            pytest.skip(f"this store refuses keys with '..' ({type(exc).__name__})")
        if rel not in dict(_fsutil.walk_files(fs, src)):
            pytest.skip("this store normalises '..' in keys")

    @staticmethod
    def _keys_named(backend: Backend, root: str, name: str) -> list[str]:
        return sorted(fi.path for fi in _fsutil.list_tree(backend.filesystem, root)
                      if fi.type == pafs.FileType.File and posixpath.basename(fi.path) == name)

    def test_report_of_a_source_holding_a_dotdot_key_is_refused(
        self, storage_location: StorageLocation, backend: Backend, root: str,
    ) -> None:
        """A key ``sub/../../../escape.bin`` is a literal name on an object store,
        but a way out of the checkpoint (even of the trial) wherever it is
        joined to a path: refused before the first byte, the source unchanged."""
        from checkpoint_store import UnsafePathError, session

        rel = "sub/../../../escape.bin"
        src = posixpath.join(root, "src")
        self._plant_dotdot_key(backend, src, rel)
        source_before = dict(_fsutil.walk_files(backend.filesystem, src))
        with session.start(storage_path=storage_location.uri,
                           storage_options=dict(storage_location.storage_options),
                           experiment_name="exp", trial_name="t"):
            with pytest.raises(UnsafePathError) as err:
                session.report({"a": 1}, checkpoint=Checkpoint(src, filesystem=backend.filesystem))
        assert err.value.file == rel
        assert rel in str(err.value)
        assert self._keys_named(backend, root, "escape.bin") == [posixpath.join(src, rel)]
        assert self._keys_named(backend, root, "model.bin") == [posixpath.join(src, "model.bin")]
        assert self._context(storage_location, trial="t").checkpoint_dirs() == []
        assert dict(_fsutil.walk_files(backend.filesystem, src)) == source_before

    def test_download_of_a_dotdot_key_is_refused(
        self, backend: Backend, root: str, tmp_path: Path,
    ) -> None:
        """The same key read back: nothing is written outside the target."""
        from checkpoint_store import UnsafePathError

        rel = "sub/../../escape.bin"
        src = posixpath.join(root, "uncommitted")
        self._plant_dotdot_key(backend, src, rel)
        target = tmp_path / "a" / "out"
        with pytest.raises(UnsafePathError) as err:
            Checkpoint(src, filesystem=backend.filesystem).to_directory(target)
        assert err.value.file == rel
        assert not target.exists()
        assert [p for p in tmp_path.rglob("*") if p.name == "escape.bin"] == []

    def test_download_into_the_checkpoint_itself_is_refused(
        self, storage_location: StorageLocation, tmp_path: Path,
    ) -> None:
        """``to_directory(<the checkpoint>/restore)`` would write into the
        checkpoint and make it invalid; ``to_directory(<its trial>)`` would
        replace it. Both are refused, the checkpoint stays committed."""
        from checkpoint_store import UnsafePathError

        ctx = self._context(storage_location)
        src = self._src(tmp_path, {"w.bin": 100, "d/x.bin": 3})
        ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
        local = _fsutil.local_path(ckpt.filesystem, ckpt.path)
        if local is None:
            pytest.skip("the checkpoint is not on this machine's disk: no overlap possible")
        before = read_tree(local)
        for target in (os.path.join(local, "restore"), local, os.path.dirname(local)):
            with pytest.raises(UnsafePathError, match="choose a directory outside it"):
                ckpt.to_directory(target)
        assert read_tree(local) == before
        assert ckpt.is_committed
        ckpt.verify()
        assert [meta["index"] for _, meta in ctx.committed_checkpoints()] == [0]

    def test_re_download_leaves_exactly_the_new_checkpoint(
        self, storage_location: StorageLocation, tmp_path: Path,
    ) -> None:
        """Two checkpoints downloaded one after the other into the same
        directory, whose name is 241 characters (the lock, marker and staging
        names built from it must still fit in 255 bytes): the directory then
        holds exactly the second one's files and metadata."""
        ctx = self._context(storage_location)
        c0_src = self._src(tmp_path, {"model.pt": 10, "optimizer.pt": 20}, name="c0")
        c0 = ctx.persist_checkpoint(Checkpoint.from_directory(c0_src), 0, {})
        c0.set_metadata({"step": 100})
        c1_src = self._src(tmp_path, {"model.pt": 11}, name="c1")
        c1 = ctx.persist_checkpoint(Checkpoint.from_directory(c1_src), 1, {})
        target = tmp_path / "dl" / ("d" * 241)
        c0.to_directory(target)
        assert sorted(os.listdir(target)) == [USER_METADATA, "model.pt", "optimizer.pt"]
        c1.to_directory(target)
        assert read_tree(target) == read_tree(c1_src)
        assert all(len(n.encode()) <= 255 for n in os.listdir(tmp_path / "dl"))
