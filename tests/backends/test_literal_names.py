"""Names are literal on every listing and delete, on every backend (issue 11, kind 2).

fsspec reads ``[``, ``*`` and ``?`` in a path as glob patterns in ``rm``,
``copy``, ``mv`` and ``cat``: a trial named ``t[x]`` evicting its checkpoints
deleted trial ``tx``'s, and a trial named ``t*1?`` could neither evict nor
release its lease. The conformance suite (``BackendTests``) checks the same
shapes on every backend; these are the reported inputs, by name.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext, session
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.backends.handlers import LiteralFSSpecHandler
from checkpoint_store.errors import InvalidConfigError, PermanentBackendError
from checkpoint_store.testing import StorageLocation


@pytest.fixture(params=["local", "memory", "s3", "s3fs", "azure", "azure-pyarrow", "gcs"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> StorageLocation:
    kind = request.param
    if kind == "local":
        return StorageLocation(str(tmp_path / "store"))
    if kind == "memory":
        return StorageLocation(f"memory://b{uuid.uuid4().hex[:8]}/r")
    if kind == "azure-pyarrow":
        server = request.getfixturevalue("azure_server")
        container = request.getfixturevalue("azure_container")
        return StorageLocation(f"abfs://{container}/r", server.storage_options("pyarrow"))
    return request.getfixturevalue(f"{kind}_location")


def _run(loc: StorageLocation, tmp_path: Path, experiment: str, trial: str, reports: int,
         keep: int | None) -> int | None:
    """One session: ``reports`` reports with a checkpoint each; the index
    ``get_checkpoint()`` returns at the end."""
    with session.start(storage_path=loc.uri, storage_options=dict(loc.storage_options),
                       experiment_name=experiment, trial_name=trial,
                       checkpoint_config=CheckpointConfig(num_to_keep=keep)):
        for i in range(reports):
            src = tmp_path / f"src-{uuid.uuid4().hex[:8]}"
            src.mkdir()
            (src / "model.bin").write_bytes(f"{experiment}/{trial}/{i}".encode())
            session.report({"i": i}, checkpoint=Checkpoint.from_directory(src))
        got = session.get_checkpoint()
    return None if got is None else got.internal_metadata["index"]


def _kept(loc: StorageLocation, experiment: str, trial: str) -> list[int]:
    ctx = StorageContext(loc.uri, experiment, trial,
                         storage_options=dict(loc.storage_options) or None)
    return [m["index"] for _, m in ctx.committed_checkpoints()]


def test_trial_t_star_1_question_evicts_and_restarts(location, tmp_path, request):
    if "azure-pyarrow" not in request.node.name and "azure" in request.node.name:
        # adlfs drops a trailing '?' (a URL query): refused, never mixed with trial "t*1".
        with pytest.raises(InvalidConfigError, match=r"trial_name 't\*1\?' holds '\?'"):
            _run(location, tmp_path, "e", "t*1?", 2, 1)
        return
    assert _run(location, tmp_path, "e", "t*1?", 2, 1) == 1
    assert _kept(location, "e", "t*1?") == [1]  # checkpoint_000000 is gone
    assert _run(location, tmp_path, "e", "t*1?", 1, 1) == 2  # the lease was released
    assert _kept(location, "e", "t*1?") == [2]


def test_experiment_with_brackets_evicts_and_leaves_its_neighbour(location, tmp_path):
    _run(location, tmp_path, "sweepl", "t", 2, None)  # what "sweep[lr=0.1]" matches as a glob
    assert _run(location, tmp_path, "sweep[lr=0.1]", "t", 2, 1) == 1
    assert _kept(location, "sweep[lr=0.1]", "t") == [1]
    assert _kept(location, "sweepl", "t") == [0, 1]
    assert _run(location, tmp_path, "sweep[lr=0.1]", "t", 1, 1) == 2


@pytest.mark.parametrize("engine_location", ["s3_location", "s3fs_location"])
def test_s3_trial_t_bracket_x_leaves_trial_tx_whole(engine_location, tmp_path, request):
    loc = request.getfixturevalue(engine_location)
    _run(loc, tmp_path, "e", "tx", 3, None)
    assert _run(loc, tmp_path, "e", "t[x]", 3, 1) == 2
    assert _kept(loc, "e", "tx") == [0, 1, 2]
    assert _kept(loc, "e", "t[x]") == [2]
    ctx = StorageContext(loc.uri, "e", "tx", storage_options=dict(loc.storage_options))
    for ckpt, meta in ctx.committed_checkpoints():
        out = ckpt.to_directory(str(tmp_path / f"tx-{meta['index']}"))
        assert Path(out, "model.bin").read_bytes() == f"e/tx/{meta['index']}".encode()
    assert _run(loc, tmp_path, "e", "t[x]", 1, 1) == 3
    assert _kept(loc, "e", "tx") == [0, 1, 2]


def test_downloads_of_a_pattern_named_checkpoint_read_its_own_bytes(location, tmp_path):
    """A download batches small files (fsspec's cat read names as patterns)."""
    _run(location, tmp_path, "e", "ta", 1, None)
    _run(location, tmp_path, "e", "t[ab]", 1, None)
    ctx = StorageContext(location.uri, "e", "t[ab]",
                         storage_options=dict(location.storage_options) or None)
    (ckpt, _), = ctx.committed_checkpoints()
    out = ckpt.to_directory(str(tmp_path / "out"))
    assert Path(out, "model.bin").read_bytes() == b"e/t[ab]/0"


# -- a delete that removed nothing is not a success ---------------------------------------


class _DeletesNothing(LiteralFSSpecHandler):
    """A store whose deletes report success and remove nothing (a client that
    swallows per-key errors, or one that reads the name as a pattern)."""

    def delete_dir(self, path: str) -> None:
        pass

    def delete_file(self, path: str) -> None:
        pass


@pytest.fixture
def deaf_fs() -> tuple[pafs.FileSystem, str]:
    fs = pafs.PyFileSystem(_DeletesNothing(MemoryFileSystem()))
    return fs, f"/deaf-{uuid.uuid4().hex[:8]}"


def test_a_delete_that_removes_nothing_raises(deaf_fs):
    fs, root = deaf_fs
    with fs.open_output_stream(f"{root}/d/f.bin") as out:
        out.write(b"x")
    with pytest.raises(PermanentBackendError, match="still there"):
        _fsutil.delete_file(fs, f"{root}/d/f.bin")
    with pytest.raises(PermanentBackendError, match="still there"):
        _fsutil.delete_dir(fs, f"{root}/d")
    _fsutil.delete_dir(fs, f"{root}/never-there")  # absent stays fine


def test_eviction_that_deletes_nothing_stays_pending(deaf_fs, tmp_path, caplog):
    fs, root = deaf_fs
    caplog.set_level(logging.WARNING)
    with session.start(storage_path=root, storage_filesystem=fs, experiment_name="e",
                       trial_name="t", checkpoint_config=CheckpointConfig(num_to_keep=1)):
        for i in range(2):
            src = tmp_path / f"s{i}"
            src.mkdir()
            (src / "m.bin").write_bytes(b"m")
            session.report({"i": i}, checkpoint=Checkpoint.from_directory(src))
        manager: Any = session.get_session().manager  # type: ignore[attr-defined]
        assert manager.pending_deletes == ["checkpoint_000000"]
    assert "could not delete checkpoint_000000" in caplog.text
    # Still on storage, as the state says: retried at the next report, never counted as gone.
    assert _fsutil.exists(fs, f"{root}/e/t/checkpoint_000000/m.bin")


# -- a listing racing the first write under its directory -----------------------------


class _WriterLandsMidway(MemoryFileSystem):
    """A store another process writes to: the first entry of a directory named
    ``segments`` lands right after the ``after``-th question about it was
    answered (a writer flushing its first result segment while a reader polls
    for it)."""

    after = 1
    asked = 0

    def _asked(self, path: str) -> None:
        if path.rstrip("/").endswith("/segments"):
            cls = type(self)
            cls.asked += 1
            if cls.asked == cls.after:
                self.pipe_file(f"{path.rstrip('/')}/seg-000000.jsonl", b"{}\n")

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        try:
            return super().ls(path, detail=detail, **kwargs)
        finally:
            self._asked(path)

    def info(self, path: str, **kwargs: Any) -> Any:
        try:
            return super().info(path, **kwargs)
        finally:
            self._asked(path)

    def isdir(self, path: str) -> bool:
        try:
            return super().isdir(path)
        finally:
            self._asked(path)

    def exists(self, path: str, **kwargs: Any) -> bool:
        try:
            return super().exists(path, **kwargs)
        finally:
            self._asked(path)


@pytest.mark.parametrize("after", [1, 2, 3])
def test_a_listing_racing_the_first_write_is_an_empty_directory_not_a_file(after: int) -> None:
    """Found in a full run: s3fs listed an absent ``.cs_results`` while the
    session's timer flushed its first segment; the directory was absent, then
    present, which the listing read as a file (NotADirectoryError, a
    PermanentBackendError for the reader)."""
    _WriterLandsMidway.after, _WriterLandsMidway.asked = after, 0
    fs = pafs.PyFileSystem(LiteralFSSpecHandler(_WriterLandsMidway()))
    seg = f"/race-{uuid.uuid4().hex[:8]}/segments"
    assert [fi.base_name for fi in _fsutil.list_dir(fs, seg)] in ([], ["seg-000000.jsonl"])
    if _WriterLandsMidway.asked < after:  # this listing asked fewer questions
        _WriterLandsMidway().pipe_file(f"{seg}/seg-000000.jsonl", b"{}\n")
    _WriterLandsMidway.after = 0
    assert [fi.base_name for fi in _fsutil.list_dir(fs, seg)] == ["seg-000000.jsonl"]


def test_a_listing_of_a_file_or_of_nothing_still_says_which() -> None:
    fs = pafs.PyFileSystem(LiteralFSSpecHandler(MemoryFileSystem()))
    root = f"/which-{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(f"{root}/f.bin") as out:
        out.write(b"x")
    with pytest.raises(NotADirectoryError):
        fs.get_file_info(pafs.FileSelector(f"{root}/f.bin"))
    with pytest.raises(FileNotFoundError):
        fs.get_file_info(pafs.FileSelector(f"{root}/absent"))
    assert fs.get_file_info(pafs.FileSelector(f"{root}/absent", allow_not_found=True)) == []
    fs.create_dir(f"{root}/empty")
    assert fs.get_file_info(pafs.FileSelector(f"{root}/empty")) == []
