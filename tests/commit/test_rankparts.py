"""The rank-part protocol exists once (checkpoint_store/_commit/rankparts.py):
a multi-rank session's ranks and Ray Train's workers write the same marker
under the same include rule, and rank 0 and Ray's controller commit the same
checkpoint from the markers. Also ``Coordinator.storage_only()``, the copy
a background thread commits with."""

from __future__ import annotations

import posixpath

import pyarrow.fs as pafs
import pytest

from checkpoint_store import Checkpoint
from checkpoint_store._commit.rankparts import (
    RankDir,
    RankSource,
    merge_rank_files,
    rank_includes,
    rank_markers_present,
    read_rank_marker,
    write_rank_part,
)
from checkpoint_store._format import jsonrules as _json
from checkpoint_store._format.layout import INTERNAL_METADATA, USER_METADATA
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.errors import PermanentBackendError
from checkpoint_store.integrations.ray import _train as ray_train
from checkpoint_store.integrations.ray._filesystem import backend_of, ray_filesystem
from checkpoint_store.session import _multirank
from checkpoint_store.session._multirank import Coordinator
from checkpoint_store.testing.faults import FaultPlan, faulty_backend

ATTEMPT = "job_r0"
RAY_ONLY = {"time"}
SESSION_ONLY = {"attempt_id", "index"}


def _source(tmp_path, rank: int) -> str:
    """What one rank saved: its shards and the user metadata every rank wrote."""
    d = tmp_path / f"src{rank}"
    (d / "sub").mkdir(parents=True, exist_ok=True)
    (d / f"shard_{rank}.bin").write_bytes(bytes([rank]) * 1000)
    (d / "sub" / f"opt_{rank}.bin").write_bytes(b"o" * (10 + rank))
    (d / USER_METADATA).write_text(f'{{"by": {rank}}}')
    return str(d)


def _session_parts(trial, tmp_path, world: int = 2) -> tuple[list[Coordinator], str]:
    """Every rank of a session writes its part of index 0; returns the ranks and the target."""
    storage = trial.storage()
    storage.ensure_trial_dir()
    coords = [Coordinator(storage, r, world, attempt_id=ATTEMPT, timeout_s=5) for r in range(world)]
    final = storage.checkpoint_path(0)
    target = storage.commit_protocol.workdir(final, ATTEMPT)
    for r, c in enumerate(coords):
        source = Checkpoint.from_directory(_source(tmp_path, r))
        assert c._write_part(0, source, target, None) is None
    return coords, target


def _ray_parts(trial, tmp_path, world: int = 2) -> tuple[pafs.FileSystem, str]:
    """Every Ray Train worker writes its part, as upload_fn does."""
    fs, root = ray_filesystem(trial.uri, **trial.storage_options)
    dest = posixpath.join(root, "ray_run", "checkpoint_2026-01-01_00-00-00.000001")
    for r in range(world):
        ray_train._upload_rank(pafs.LocalFileSystem(), _source(tmp_path, r), fs, dest, r)
    return fs, dest


def _markers(backend, path: str) -> dict[int, dict]:
    part_dir = RankDir(backend, path)
    return {r: read_rank_marker(part_dir, r) for r in rank_markers_present(part_dir)}


def _without(marker: dict, keys: set[str]) -> dict:
    return {k: v for k, v in marker.items() if k not in keys}


def test_the_include_rule():
    assert rank_includes(0, USER_METADATA)
    assert not rank_includes(1, USER_METADATA)
    for rank in (0, 1):
        assert rank_includes(rank, "model.safetensors")
        assert rank_includes(rank, "sub/opt.bin")
        assert not rank_includes(rank, INTERNAL_METADATA)
        assert not rank_includes(rank, ".cs_rank-000001.json")


def test_session_ranks_and_ray_workers_write_the_same_markers(trial, tmp_path):
    _coords, target = _session_parts(trial, tmp_path)
    session_markers = _markers(trial.backend, target)
    fs, dest = _ray_parts(trial, tmp_path)
    ray_markers = _markers(backend_of(fs)[0], dest)
    assert sorted(session_markers) == sorted(ray_markers) == [0, 1]
    for r in (0, 1):
        s, y = session_markers[r], ray_markers[r]
        assert set(s) - set(y) == SESSION_ONLY and set(y) - set(s) == RAY_ONLY
        assert (s["attempt_id"], s["index"]) == (ATTEMPT, 0)
        assert isinstance(y["time"], float)
        assert _without(s, SESSION_ONLY) == _without(y, RAY_ONLY)
        assert s["ok"] is True and s["error"] is None
    # Rank 0 alone contributes the user metadata.
    paths = {r: sorted(e["path"] for e in session_markers[r]["files"]) for r in (0, 1)}
    assert paths == {0: [USER_METADATA, "shard_0.bin", "sub/opt_0.bin"],
                     1: ["shard_1.bin", "sub/opt_1.bin"]}


def test_rank0_and_rays_controller_commit_the_same_checkpoint(trial, tmp_path):
    coords, target = _session_parts(trial, tmp_path)
    storage = coords[0].storage
    final = storage.checkpoint_path(0)
    outcome, error = coords[0]._decide(0, "checkpoint_000000", target, final, {"metrics": {}})
    assert (outcome, error) == ({"ok": True}, None)
    fs, dest = _ray_parts(trial, tmp_path)
    backend, retry = backend_of(fs)
    assert ray_train._commit_from_markers(backend, dest, {"index": 0}, 2, retry) is not None

    committed = [Checkpoint._from_backend(storage.backend, final),
                 Checkpoint._from_backend(backend, dest)]
    metas = [c.internal_metadata for c in committed]
    for key in ("manifest", "ranks", "world_size"):
        assert metas[0][key] == metas[1][key], key
    assert metas[0]["ranks"] == {"0": [USER_METADATA, "shard_0.bin", "sub/opt_0.bin"],
                                 "1": ["shard_1.bin", "sub/opt_1.bin"]}
    for c in committed:
        c.verify()
    # The markers are gone on both sides once the commit marker is there.
    assert rank_markers_present(RankDir(storage.backend, final)) == []
    assert rank_markers_present(RankDir(backend, dest)) == []
    assert _json.loads(_fsutil.read_bytes(storage.filesystem, posixpath.join(
        final, USER_METADATA))) == {"by": 0}


def test_a_failed_copy_is_recorded_in_the_marker_and_returned(trial, tmp_path):
    part_dir = RankDir(trial.backend, posixpath.join(trial.root, "part"))
    gone = RankSource(pafs.LocalFileSystem(), str(tmp_path / "missing"))
    part = write_rank_part(part_dir, 1, gone, fields=lambda: {"time": 1.0})
    assert part.files == [] and part.marker_error is None
    assert isinstance(part.error, FileNotFoundError)
    marker = read_rank_marker(part_dir, 1)
    assert marker["ok"] is False and marker["files"] == [] and marker["time"] == 1.0
    assert marker["error"].startswith(type(part.error).__name__ + ": ")
    # An error already known: nothing is copied, the marker says so.
    known = write_rank_part(part_dir, 0, RankSource(pafs.LocalFileSystem(), _source(tmp_path, 0)),
                            error=RuntimeError("oom"))
    assert known.files == [] and isinstance(known.error, RuntimeError)
    assert read_rank_marker(part_dir, 0)["error"] == "RuntimeError: oom"
    assert not _fsutil.exists(trial.backend.filesystem, posixpath.join(part_dir.path,
                                                                        "shard_0.bin"))


def test_a_marker_that_cannot_be_written_is_returned_never_raised(trial, tmp_path):
    refused = faulty_backend(trial.backend, FaultPlan(permanent={"write": "access_denied"},
                                                      path_contains=".cs_rank-"))
    part_dir = RankDir(refused, posixpath.join(trial.root, "part"))
    source = RankSource(pafs.LocalFileSystem(), _source(tmp_path, 1))
    part = write_rank_part(part_dir, 1, source)
    assert part.error is None and isinstance(part.marker_error, PermanentBackendError)
    assert sorted(e["path"] for e in part.files) == ["shard_1.bin", "sub/opt_1.bin"]
    assert rank_markers_present(part_dir) == []


def test_ray_raises_the_failed_copy_after_writing_its_marker(trial, tmp_path):
    fs, root = ray_filesystem(trial.uri, **trial.storage_options)
    dest = posixpath.join(root, "ray_run", "ckpt")
    with pytest.raises(FileNotFoundError):
        ray_train._upload_rank(pafs.LocalFileSystem(), str(tmp_path / "missing"), fs, dest, 0)
    marker = _markers(backend_of(fs)[0], dest)[0]
    assert marker["ok"] is False and set(marker) == {"rank", "ok", "error", "files", "time"}


def test_merge_names_the_two_ranks_of_a_clash():
    markers = {0: {"files": [{"path": "a"}]}, 1: {"files": [{"path": "b"}, {"path": "a"}]}}
    assert merge_rank_files(markers).clash == (0, 1, "a")
    ok = merge_rank_files({1: {"files": [{"path": "b"}]}, 0: {"files": [{"path": "a"}]}})
    assert ok.clash is None and [e["path"] for e in ok.manifest] == ["a", "b"]
    assert ok.ranks == {"0": ["a"], "1": ["b"]}


# -- storage_only() -------------------------------------------------------------


def _torch_coordinators(monkeypatch, trial, world: int) -> list[Coordinator]:
    """Coordinators that believe a process group exists (any collective fails)."""
    group = object()
    monkeypatch.setattr(_multirank, "torch_group", lambda rank, size: (True, group))
    storage = trial.storage()
    storage.ensure_trial_dir()
    return [Coordinator(storage, r, world, attempt_id=ATTEMPT, timeout_s=10) for r in range(world)]


def test_storage_only_is_a_copy_that_never_uses_the_process_group(monkeypatch, trial):
    coord = _torch_coordinators(monkeypatch, trial, 2)[1]
    coord._written = {"index": 3}
    bg = coord.storage_only()
    assert bg is not coord and not bg.uses_torch and bg._group is None and bg._written is None
    for name in ("storage", "rank", "world_size", "attempt_id", "timeout_s"):
        assert getattr(bg, name) == getattr(coord, name), name
    # The original keeps its process group and its record of the last commit.
    assert coord.uses_torch and coord._group is not None and coord._written == {"index": 3}


def test_storage_only_copies_commit_through_markers_and_polls(monkeypatch, trial, tmp_path,
                                                             ranks):
    coords = [c.storage_only() for c in _torch_coordinators(monkeypatch, trial, 2)]

    def collective(*args, **kwargs):
        raise AssertionError("a storage-only coordinator used the process group")

    monkeypatch.setattr(Coordinator, "_broadcast", collective)
    monkeypatch.setattr(Coordinator, "_barrier", collective)

    def rank(r: int) -> Checkpoint:
        src = Checkpoint.from_directory(_source(tmp_path, r))
        return coords[r].commit(4, src, {"metrics": {"r": r}})

    out = ranks(2, rank, timeout=60)
    assert all(isinstance(c, Checkpoint) for c in out), out
    assert out[0].path == out[1].path
    meta = out[0].internal_metadata
    assert meta["world_size"] == 2 and meta["attempt_id"] == ATTEMPT
    assert meta["ranks"]["1"] == ["shard_1.bin", "sub/opt_1.bin"]
    out[0].verify()
