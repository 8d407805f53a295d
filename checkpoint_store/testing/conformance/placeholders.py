"""What other tools leave on storage: directory placeholders (an empty
``dir/`` object, an Azure folder blob) and objects named like a directory
beside its prefix. None of them is a file of a checkpoint: a committed
checkpoint stays committed, verifies, downloads, resumes and is evicted
with them in place (docs/format.md, "What other tools leave")."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from pathlib import Path

import pytest

from checkpoint_store._format.layout import MANAGER_STATE
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.backends.base import Backend
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.registry import resolve
from checkpoint_store.testing.conformance._base import BackendFixtures, read_tree
from checkpoint_store.testing.servers import StorageLocation

__all__ = ["PlaceholderTests"]

_TREE = {"w.bin": 100, "nested/deeper/o.pt": 10, "nested/z.bin": 0}


class PlaceholderTests(BackendFixtures):
    """Placeholders and stray objects written behind the backend's back
    (fixtures ``raw_placeholder`` and ``raw_object``)."""

    def _session(self, loc: StorageLocation, tmp_path: Path, reports: int,
                 name: str) -> int | None:
        """``reports`` reports (keep 1) in trial ``exp/t``; the index
        ``get_checkpoint()`` returned at the start."""
        from checkpoint_store import CheckpointConfig, session

        with session.start(storage_path=loc.uri, storage_options=dict(loc.storage_options),
                           experiment_name="exp", trial_name="t",
                           checkpoint_config=CheckpointConfig(num_to_keep=1)):
            got = session.get_checkpoint()
            index = None if got is None else got.internal_metadata["index"]
            for i in range(reports):
                src = self._src(tmp_path, _TREE, name=f"{name}{i}")
                session.report({"i": i}, checkpoint=Checkpoint.from_directory(src))
        return index

    def _check_whole(self, loc: StorageLocation, tmp_path: Path, expected: dict[str, bytes]
                     ) -> None:
        """Checkpoint 0 of ``exp/t`` lists as committed, verifies, downloads
        ``expected``, resumes, and is evicted by the next report."""
        ctx = self._context(loc, trial="t")
        committed = ctx.committed_checkpoints()
        assert [meta["index"] for _, meta in committed] == [0]
        ckpt = committed[0][0]
        ckpt.verify()
        assert read_tree(ckpt.to_directory(str(tmp_path / "out"))) == expected
        again = Checkpoint(ckpt.uri, storage_options=dict(loc.storage_options))
        assert read_tree(again.to_directory(str(tmp_path / "out-uri"))) == expected
        # A restart with its retention state lost rebuilds it from the listing.
        _fsutil.delete_file(ctx.filesystem, posixpath.join(ctx.trial_path, MANAGER_STATE))
        assert self._session(loc, tmp_path, 1, "next") == 0
        assert [i for i, _ in ctx.checkpoint_dirs()] == [1]  # 0 evicted, markers and all
        gone = ctx.filesystem.get_file_info(ctx.checkpoint_path(0))
        assert gone.type == _fsutil.pafs.FileType.NotFound

    def test_directory_placeholders_leave_a_checkpoint_whole(
        self, storage_location: StorageLocation, raw_placeholder: Callable[[str], None] | None,
        tmp_path: Path,
    ) -> None:
        if raw_placeholder is None:
            pytest.skip("needs raw_placeholder")
        self._session(storage_location, tmp_path, 1, "s")
        ctx = self._context(storage_location, trial="t")
        ckpt = ctx.checkpoint_path(0)
        experiment = posixpath.dirname(ctx.trial_path)
        for path in (posixpath.join(ckpt, "x"), posixpath.join(ckpt, "nested"),
                     posixpath.join(ckpt, "nested", "deeper"), ckpt, ctx.trial_path, experiment):
            raw_placeholder(path)
        expected = read_tree(self._src(tmp_path, _TREE, name="expected"))
        self._check_whole(storage_location, tmp_path, expected)

    def test_placeholders_in_a_source_tree_are_no_files(
        self, storage_location: StorageLocation, raw_placeholder: Callable[[str], None] | None,
        tmp_path: Path,
    ) -> None:
        """A directory on the store (not a checkpoint of ours) with placeholders
        in it downloads and uploads as its files alone."""
        if raw_placeholder is None:
            pytest.skip("needs raw_placeholder")
        source = storage_location.join("source")
        backend, root = resolve(source.uri, storage_options=dict(source.storage_options))
        expected = {"w.bin": b"weights", "nested/o.pt": b"opt"}
        for rel, data in expected.items():
            _fsutil.write_bytes(backend.filesystem, posixpath.join(root, rel), data,
                                backend.capabilities)
        for rel in ("", "empty", "nested", "nested/deeper"):
            raw_placeholder(posixpath.join(root, rel) if rel else root)
        given = Checkpoint(source.uri, storage_options=dict(source.storage_options))
        assert read_tree(given.to_directory(str(tmp_path / "out"))) == expected
        ckpt = self._context(storage_location).persist_checkpoint(given, 0, {})
        assert sorted(e["path"] for e in ckpt.internal_metadata["manifest"]) == sorted(expected)
        ckpt.verify()
        assert read_tree(ckpt.to_directory(str(tmp_path / "out2"))) == expected

    def test_object_beside_a_prefix_of_its_name_is_ignored(
        self, storage_location: StorageLocation, backend: Backend,
        raw_object: Callable[[str, bytes], None] | None, tmp_path: Path,
    ) -> None:
        """An object ``checkpoint_000000`` beside the prefix ``checkpoint_000000/``
        (and ``nested`` beside ``nested/``) is the directory's own marker:
        never a file, gone with the directory."""
        if raw_object is None:
            pytest.skip("needs raw_object")
        self._session(storage_location, tmp_path, 1, "s")
        ctx = self._context(storage_location, trial="t")
        ckpt = ctx.checkpoint_path(0)
        raw_object(ckpt, b"stray bytes")
        raw_object(posixpath.join(ckpt, "nested"), b"")
        assert _fsutil.is_dir(backend.filesystem, ckpt)
        expected = read_tree(self._src(tmp_path, _TREE, name="expected"))
        self._check_whole(storage_location, tmp_path, expected)
