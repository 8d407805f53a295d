"""Top-K is visible when ``report()`` returns: every reader lists exactly the kept set.

With background deletes, an evicted checkpoint kept its commit marker until
the deleter thread reached it: with ``num_to_keep=1``, right after
``report()`` returned, two checkpoints listed as committed (Lightning's own
tests expect exactly one at the next epoch's start). Now retention
uncommits the evicted checkpoints before ``report()`` returns (a rename
away on local disks, a tombstone and the marker's delete elsewhere) and
deletes only their remaining files in the background
(checkpoint_store/retention/deletes.py, tiers/eviction.py).
"""

from __future__ import annotations

import json
import posixpath

import pytest
from click.testing import CliRunner

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext, TrialRunner, session
from checkpoint_store.cli import main
from checkpoint_store.session import Session
from checkpoint_store.tiers import LocalTier
from tests.retention.test_background_deletes import _gated, _source


def _committed(storage: StorageContext) -> list[str]:
    """What a fresh reader (another process) lists as committed."""
    fresh = StorageContext.from_backend(storage.backend, storage.storage_path,
                                        storage.experiment_name, storage.trial_name)
    return [posixpath.basename(c.path) for c, _ in fresh.committed_checkpoints()]


def test_report_returns_with_exactly_the_kept_set_listed(make_storage, tmp_path):
    """The handed input: num_to_keep=1, right after report() one checkpoint lists."""
    storage = make_storage()
    src = Checkpoint.from_directory(_source(tmp_path, n=12))
    s = Session(storage, CheckpointConfig(num_to_keep=1))
    try:
        for step in range(4):
            s.report({"step": step}, checkpoint=src)
            assert _committed(storage) == [f"checkpoint_{step:06d}"]
            assert s.manager.kept_dir_names == [f"checkpoint_{step:06d}"]
        s.wait(timeout=60)
    finally:
        s.close()
    assert sorted(n for _, n in storage.checkpoint_dirs()) == ["checkpoint_000003"]
    assert storage.scan().uncommitted == []


@pytest.mark.parametrize("form", ["pyarrow-local", "pyarrow-memory", "fsspec"])
def test_a_stalled_delete_never_leaves_an_evicted_checkpoint_listed(form, tmp_path):
    """Found by myself: while the deleter is stuck on an older eviction, a newer
    eviction used to wait behind it with its marker in place (two listed)."""
    storage, gate, entered = _gated(form, tmp_path)
    src = Checkpoint.from_directory(_source(tmp_path))
    s = Session(storage, CheckpointConfig(num_to_keep=1))
    try:
        s.report({"step": 0}, checkpoint=src)
        s.report({"step": 1}, checkpoint=src)
        assert entered.wait(30), "the eviction's delete never started"
        for step in (2, 3):
            s.report({"step": step}, checkpoint=src)
            assert _committed(storage) == [f"checkpoint_{step:06d}"]
        assert not gate.is_set()
        gate.set()
        s.wait(timeout=60)
        assert sorted(n for _, n in storage.checkpoint_dirs()) == ["checkpoint_000003"]
    finally:
        gate.set()
        s.close()


def test_cli_ls_lists_the_kept_set_right_after_report(tmp_path):
    """Found by myself: ``checkpoint-store ls`` while the deleter is stuck."""
    storage, gate, entered = _gated("pyarrow-local", tmp_path)
    src = Checkpoint.from_directory(_source(tmp_path))
    s = Session(storage, CheckpointConfig(num_to_keep=1))
    try:
        for step in range(3):
            s.report({"step": step}, checkpoint=src)
        assert entered.wait(30)
        res = CliRunner().invoke(main, ["ls", str(tmp_path / "runs" / "exp" / "t"), "--json"],
                                catch_exceptions=False)
        assert res.exit_code == 0, res.output
        rows = json.loads(res.stdout)["checkpoints"]
        assert [r["name"] for r in rows] == ["checkpoint_000002"]
    finally:
        gate.set()
        s.close()


def test_trial_runner_reports_leave_exactly_the_kept_set(tmp_path):
    """The trial runner reports through the session: the same holds at each step."""
    seen: list[list[str]] = []
    root = str(tmp_path / "store")

    def train(config):
        for step in range(3):
            session.report({"step": step}, checkpoint=Checkpoint.from_directory(
                _source(tmp_path / f"s{step}", n=6)))

    r = TrialRunner(train, {}, storage_path=root, experiment_name="exp", trial_name="t0",
                    checkpoint_config=CheckpointConfig(num_to_keep=1))
    reader = StorageContext(root, "exp", "t0")
    while r.step() is not None:
        seen.append([posixpath.basename(c.path) for c, _ in reader.committed_checkpoints()])
    assert seen == [[f"checkpoint_{i:06d}"] for i in range(3)]


def test_local_tier_lists_exactly_its_kept_set_after_report(tmp_path):
    """The local tier's own retention (tiers/eviction.py) uncommits at once too."""
    tier = LocalTier(tmp_path / "fast", num_to_keep=1, persist=lambda index, metrics: False)
    with session.start(experiment_name="e", trial_name="t", local_tier=tier,
                       storage_path=str(tmp_path / "durable"),
                       checkpoint_config=CheckpointConfig(num_to_keep=1)) as s:
        local = StorageContext(str(tmp_path / "fast"), "e", "t")
        for step in range(3):
            s.report({"step": step}, checkpoint=Checkpoint.from_directory(
                _source(tmp_path / f"s{step}", n=6)))
            assert [posixpath.basename(c.path) for c, _ in local.committed_checkpoints()] \
                == [f"checkpoint_{step:06d}"]
        s.wait()
    left = sorted(p.name for p in (tmp_path / "fast" / "e" / "t").iterdir()
                  if p.name.startswith(("checkpoint_", ".cs_deleting")))
    assert left == ["checkpoint_000002"]
