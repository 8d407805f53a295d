"""What a Ray restore is handed when Ray registered a checkpoint that
CommitCallback never committed (Ray Train registers first, then calls the
callback): never the uncommitted checkpoint. Real Ray checkpoint objects on
our Ray filesystem (memory, moto S3), no cluster (tests/integrations/test_ray.py
runs the same through a real TorchTrainer)."""

from __future__ import annotations

import posixpath
import uuid
import warnings

import pyarrow.fs as pafs
import pytest

pytest.importorskip("ray")
import ray.train  # noqa: E402

from checkpoint_store.errors import CheckpointNotFoundError  # noqa: E402
from checkpoint_store.integrations import ray as cs_ray  # noqa: E402


def _report(fs, run: str, name: str, epoch: int, tmp_path, *, commit: bool) -> ray.train.Checkpoint:
    """What upload_fn does on the worker, then (``commit``) what CommitCallback does."""
    src = tmp_path / f"src-{name}"
    src.mkdir()
    (src / "weights.bin").write_bytes(bytes([epoch]) * 1024)
    dest = posixpath.join(run, name)
    cs_ray._upload_rank(pafs.LocalFileSystem(), str(src), fs, dest, 0)
    if commit:
        backend, retry = cs_ray.backend_of(fs)
        internal = {"index": epoch, "metrics": {"epoch": epoch}, "experiment_name": "r",
                    "trial_name": "r", "created_at": float(epoch)}
        assert cs_ray._commit_from_markers(backend, dest, internal, 1, retry) is not None
    return ray.train.Checkpoint(path=dest, filesystem=fs)


@pytest.fixture(params=["memory", "s3"])
def ray_fs(request):
    if request.param == "memory":
        return cs_ray.ray_filesystem(f"memory://ray-restore-{uuid.uuid4().hex[:8]}")
    s3_server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    return cs_ray.ray_filesystem(f"s3://{bucket}/restore", **s3_server.storage_options("pyarrow"))


def test_uncommitted_latest_falls_back_to_newest_committed(ray_fs, tmp_path):
    fs, root = ray_fs
    run = posixpath.join(root, "run")
    _report(fs, run, "checkpoint_2026-01-01_00-00-01", 1, tmp_path, commit=True)
    second = _report(fs, run, "checkpoint_2026-01-01_00-00-02", 2, tmp_path, commit=True)
    latest = _report(fs, run, "checkpoint_2026-01-01_00-00-03", 3, tmp_path, commit=False)
    assert cs_ray.committed_checkpoint(second).path == second.path  # committed: as is
    with pytest.warns(RuntimeWarning, match="not a committed checkpoint.*resuming from"):
        got = cs_ray.committed_checkpoint(latest)
    assert got.path == second.path
    got.verify()
    assert got.internal_metadata["metrics"]["epoch"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cs_ray.committed_checkpoint(second).is_committed


def test_uncommitted_latest_without_a_committed_one_raises(ray_fs, tmp_path):
    """num_to_keep=1: Ray deleted the previous checkpoint when it registered this one."""
    fs, root = ray_fs
    latest = _report(fs, posixpath.join(root, "run"), "checkpoint_x", 1, tmp_path, commit=False)
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        cs_ray.committed_checkpoint(latest)
