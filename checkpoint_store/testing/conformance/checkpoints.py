"""Checkpoints on the backend: byte-identical round trips, commit and
visibility, conflicts, deletes, incremental reports, sessions that keep the
best and resume, concurrent readers, and no empty or marker objects of ours
on a store without directories."""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from checkpoint_store._format.layout import (
    INTERNAL_METADATA,
    MANAGER_STATE,
    PARAMS_FILE,
    RESULT_FILE,
)
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.backends.base import Backend
from checkpoint_store.checkpoint import Checkpoint
from checkpoint_store.errors import CheckpointConflictError
from checkpoint_store.storage import StorageContext
from checkpoint_store.testing.conformance._base import BackendFixtures, read_tree
from checkpoint_store.testing.servers import StorageLocation

__all__ = ["CheckpointTests"]


class CheckpointTests(BackendFixtures):
    """Checkpoints and sessions on the backend, read and written through the public API."""

    def test_directory_round_trip(self, storage_location: StorageLocation,
                                  tmp_path: Path) -> None:
        src = self._src(tmp_path)
        expected = read_tree(src)
        ctx = self._context(storage_location)
        ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {"metrics": {"x": 1}})
        assert ckpt.is_committed
        manifest = {e["path"]: e["size"] for e in ckpt.internal_metadata["manifest"]}
        assert manifest == {rel: len(data) for rel, data in expected.items()}
        out = ckpt.to_directory(str(tmp_path / "out"))
        assert read_tree(out) == expected
        # The same checkpoint again, from nothing but its URI and the options.
        again = Checkpoint(ckpt.uri, storage_options=dict(storage_location.storage_options))
        assert again.path == ckpt.path
        assert read_tree(again.to_directory(str(tmp_path / "out2"))) == expected

    def test_checkpoint_pickles(self, storage_location: StorageLocation,
                                tmp_path: Path) -> None:
        """A Checkpoint crosses process boundaries (multiprocessing, Ray) by pickle."""
        import pickle

        src = self._src(tmp_path, {"a.bin": 1000})
        ckpt = self._context(storage_location).persist_checkpoint(
            Checkpoint.from_directory(src), 0, {"metrics": {"m": 1}}
        )
        clone = pickle.loads(pickle.dumps(ckpt))
        assert clone == ckpt and clone.uri == ckpt.uri
        assert clone.internal_metadata["metrics"] == {"m": 1}
        assert read_tree(clone.to_directory(str(tmp_path / "o"))) == read_tree(src)

    def test_special_names_in_storage_path(self, storage_location: StorageLocation,
                                           tmp_path: Path) -> None:
        odd = storage_location.join("a dir", self._storable("100% #1 ünï 名"))
        ctx = self._context(odd)
        ckpt = ctx.persist_checkpoint(
            Checkpoint.from_directory(self._src(tmp_path, {self._storable("f g#%.txt"): 10})),
            0, {}
        )
        assert ckpt.uri == self._base_uri(odd) + "/exp/trial/checkpoint_000000"
        again = Checkpoint(ckpt.uri, storage_options=dict(storage_location.storage_options))
        assert read_tree(again.to_directory(str(tmp_path / "out"))) == read_tree(
            ckpt.to_directory(str(tmp_path / "out-direct"))
        )
        assert [c.path for c, _ in self._context(odd).committed_checkpoints()] == [ckpt.path]

    def test_trailing_slash_and_join(self, storage_location: StorageLocation) -> None:
        plain = self._context(storage_location)
        slashed = self._context(storage_location, uri=storage_location.uri + "/")
        assert plain.trial_path == slashed.trial_path
        uri = plain.uri(plain.trial_path)
        assert uri == self._base_uri(storage_location) + "/exp/trial"
        scheme, _, rest = uri.partition("://")
        assert scheme and rest
        assert "//" not in rest.lstrip("/")

    def test_only_committed_checkpoints_are_visible(self, storage_location: StorageLocation,
                                                    backend: Backend, tmp_path: Path) -> None:
        ctx = self._context(storage_location)
        src = self._src(tmp_path, {"w.bin": 100})
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
        # A writer that died before its commit marker: data files, no internal metadata.
        torn = ctx.checkpoint_path(1)
        _fsutil.write_bytes(backend.filesystem, posixpath.join(torn, "w.bin"), b"partial",
                            backend.capabilities)
        assert [i for i, _ in ctx.checkpoint_dirs()] == [0, 1]
        committed = ctx.committed_checkpoints()
        assert [meta["index"] for _, meta in committed] == [0]
        assert not ctx.checkpoint("checkpoint_000001").is_committed
        ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(src), 2, {})
        assert read_tree(ckpt.to_directory(str(tmp_path / "o"))) == read_tree(src)
        assert [meta["index"] for _, meta in ctx.committed_checkpoints()] == [0, 2]

    def test_commit_twice_conflicts(self, storage_location: StorageLocation,
                                    tmp_path: Path) -> None:
        ctx = self._context(storage_location)
        first = self._src(tmp_path, {"a.bin": 10}, name="first")
        ctx.persist_checkpoint(Checkpoint.from_directory(first), 3, {})
        with pytest.raises(CheckpointConflictError):
            ctx.persist_checkpoint(
                Checkpoint.from_directory(self._src(tmp_path, {"b.bin": 20}, name="second")),
                3, {},
            )
        out = ctx.checkpoint("checkpoint_000003").to_directory(str(tmp_path / "o"))
        assert read_tree(out) == read_tree(first)

    def test_delete_checkpoint(self, storage_location: StorageLocation,
                               tmp_path: Path) -> None:
        ctx = self._context(storage_location)
        src = self._src(tmp_path, {"a.bin": 10, "d/b.bin": 5})
        for i in range(2):
            ctx.persist_checkpoint(Checkpoint.from_directory(src), i, {})
        ctx.delete_checkpoint("checkpoint_000000")
        ctx.delete_checkpoint("checkpoint_000000")
        assert [meta["index"] for _, meta in ctx.committed_checkpoints()] == [1]
        assert [i for i, _ in ctx.checkpoint_dirs()] == [1]

    def test_incremental_report_is_self_contained(self, storage_location: StorageLocation,
                                                  tmp_path: Path) -> None:
        # Report twice; between the reports one file changes keeping its size
        # and one grows. Where the store copies server-side, the unchanged
        # files come from checkpoint 0; either way checkpoint 1 holds the new
        # bytes and still verifies once checkpoint 0 is deleted.
        ctx = self._context(storage_location)
        src = self._src(tmp_path, {"same.bin": 70_000, "d/changed.bin": 4096, "grows.bin": 10})
        ctx.persist_checkpoint(Checkpoint.from_directory(src), 0, {})
        with open(os.path.join(src, "d", "changed.bin"), "r+b") as f:
            old = f.read(1)
            f.seek(0)
            f.write(bytes([old[0] ^ 0xFF]))  # same size, another CRC32C
        with open(os.path.join(src, "grows.bin"), "ab") as f:
            f.write(b"more")
        expected = read_tree(src)
        second = ctx.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
        ctx.delete_checkpoint("checkpoint_000000")
        second.verify()
        assert read_tree(second.to_directory(str(tmp_path / "o"))) == expected
        plain = StorageContext(storage_location.uri, "exp", "full",
                               storage_options=dict(storage_location.storage_options),
                               incremental=False, max_concurrency=2, memory_budget=2**21)
        full = plain.persist_checkpoint(Checkpoint.from_directory(src), 1, {})
        assert full.internal_metadata["manifest"] == second.internal_metadata["manifest"]

    def test_session_keeps_best_and_resumes(self, storage_location: StorageLocation,
                                            tmp_path: Path) -> None:
        from checkpoint_store import CheckpointConfig, session

        opts = dict(storage_location.storage_options)
        cfg = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="acc",
                               checkpoint_score_order="max")
        accs = [0.5, 0.9, 0.7]
        with session.start(storage_path=storage_location.uri, storage_options=opts,
                           experiment_name="exp", trial_name="t", checkpoint_config=cfg):
            assert session.get_checkpoint() is None
            for i, acc in enumerate(accs):
                src = self._src(tmp_path, {"step.txt": i + 1}, name=f"s{i}")
                session.report({"acc": acc}, checkpoint=Checkpoint.from_directory(src))
        ctx = self._context(storage_location, trial="t")
        kept = [meta["index"] for _, meta in ctx.committed_checkpoints()]
        assert kept == [1, 2]  # the best (0.9) and the latest
        assert [row["acc"] for row in ctx.read_results()] == accs
        with session.start(storage_path=storage_location.uri, storage_options=opts,
                           experiment_name="exp", trial_name="t", checkpoint_config=cfg):
            resumed = session.get_checkpoint()
            assert resumed is not None
            assert resumed.internal_metadata["index"] == 2

    def test_rows_of_a_killed_run_are_read_once_and_folded(
        self, storage_location: StorageLocation
    ) -> None:
        """Rows a run flushed before it died (segments on stores without append)
        are all read, once; the next session continues after them and its end
        leaves one ``result.json`` holding every row (docs/format.md)."""
        from checkpoint_store import session
        from checkpoint_store._results.writer import ResultLog, list_segments

        ctx = self._context(storage_location, trial="killed")
        log = ResultLog(ctx, flush_interval=3600)
        for i in range(5):
            log.append({"i": i, "training_iteration": i + 1})
            if i in (1, 4):
                log.flush()  # then the process "dies": no close, no assembly
        assert [r["i"] for r in ctx.read_results()] == list(range(5))
        with session.start(storage_path=storage_location.uri,
                           storage_options=dict(storage_location.storage_options),
                           experiment_name="exp", trial_name="killed") as s:
            assert s.report({"i": 5})["training_iteration"] == 6
        assert [r["i"] for r in ctx.read_results()] == list(range(6))
        assert list_segments(ctx.filesystem, ctx.trial_path) == []

    # -- readers ------------------------------------------------------------------------

    def test_concurrent_readers_each_get_the_right_bytes(
        self, storage_location: StorageLocation, tmp_path: Path
    ) -> None:
        """Threads reading one committed checkpoint at once (its metadata, its
        files, downloads into one directory) each see exactly what was written."""
        src = self._src(tmp_path, {"a.bin": 70_000, "b/c.bin": 3000, "d.txt": 11})
        expected = read_tree(src)
        ckpt = self._context(storage_location).persist_checkpoint(
            Checkpoint.from_directory(src), 0, {"metrics": {"m": 1}}
        )
        fs = ckpt.filesystem
        want_meta = ckpt.internal_metadata
        assert want_meta["index"] == 0
        threads = 8
        start = threading.Barrier(threads)
        out = str(tmp_path / "same-dir")

        def reader(k: int) -> None:
            start.wait()
            for _ in range(5):
                assert ckpt.internal_metadata == want_meta
                assert ckpt.is_committed
                rel = sorted(expected)[k % len(expected)]
                assert _fsutil.read_bytes(fs, posixpath.join(ckpt.path, rel)) == expected[rel]
                with fs.open_input_file(posixpath.join(ckpt.path, "a.bin")) as f:
                    assert f.read_at(100, 1000 + k) == expected["a.bin"][1000 + k:1100 + k]
            if k % 2 == 0:
                assert read_tree(ckpt.to_directory(out)) == expected

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(reader, range(threads)))
        assert read_tree(out) == expected

    def test_no_zero_byte_or_marker_objects_of_ours(
        self, storage_location: StorageLocation, backend: Backend,
        raw_objects: Callable[[], Mapping[str, int]] | None, tmp_path: Path,
    ) -> None:
        if raw_objects is None or backend.capabilities.directories:
            pytest.skip("needs raw_objects on a store without real directories")
        from checkpoint_store import CheckpointConfig, session

        spec = {"w.bin": 64, "empty-by-user.txt": 0}
        cfg = CheckpointConfig(num_to_keep=1)
        with session.start(storage_path=storage_location.uri,
                           storage_options=dict(storage_location.storage_options),
                           experiment_name="exp", trial_name="t", checkpoint_config=cfg,
                           config={"lr": 0.1}):
            for i in range(3):
                src = self._src(tmp_path, spec, name=f"s{i}")
                session.report({"i": i}, checkpoint=Checkpoint.from_directory(src))
        objects = dict(raw_objects())
        assert objects, "raw_objects() listed nothing after a session wrote checkpoints"
        markers = [k for k in objects if k.endswith("/")]
        assert markers == [], f"directory-marker objects: {markers}"
        zero = sorted(k for k, size in objects.items() if size == 0)
        assert all(k.endswith("/empty-by-user.txt") for k in zero), (
            f"zero-byte objects not written by the user: {zero}"
        )
        ours = [k for k in objects if posixpath.basename(k) in (
            INTERNAL_METADATA, RESULT_FILE, PARAMS_FILE, MANAGER_STATE)]
        assert ours and all(objects[k] > 0 for k in ours)
