"""Every crash point of a commit and of a delete, one at a time (deterministic).

The SIGKILL harness (tests/crash) hits random moments; this walks every
mutating storage call of one commit and one delete, "dies" right before it
(a ``SimulatedCrash`` from the fault-injecting filesystem: no cleanup code
runs, as in a killed process), and checks what is left.
"""

from __future__ import annotations

import pytest
from _commit_helpers import make_source, read_tree

from checkpoint_store import Checkpoint, StorageContext
from checkpoint_store._util import fs as _fsutil
from checkpoint_store.testing.faults import FaultPlan, SimulatedCrash, faulty_backend


def _writes_of(trial, action) -> int:
    backend = faulty_backend(trial.backend, FaultPlan())
    action(StorageContext.from_backend(backend, trial.root, "exp", "trial"))
    return backend.filesystem.handler.writes


def _check(trial, tmp_path, expected: dict[str, str]) -> None:
    """Only whole checkpoints are visible; cleanup (a new run) leaves nothing else."""
    later = StorageContext.from_backend(trial.backend, trial.root, "exp", "trial",
                                        run_id="next_run")
    found = later.scan()
    assert found.foreign == [], found
    committed = {c.path.rsplit("/", 1)[-1]: c for c, _ in later.committed_checkpoints()}
    for name, ckpt in committed.items():
        ckpt.verify()
        assert read_tree(later.filesystem, ckpt.path) == read_tree(
            _fsutil.pafs.LocalFileSystem(), expected[name])
    later.remove_uncommitted()
    after = later.scan()
    assert after.uncommitted == [] and after.foreign == []
    assert sorted(after.committed) == sorted(committed)


def test_every_crash_point_of_a_commit(any_trial, tmp_path):
    storage = any_trial.storage()
    storage.ensure_trial_dir()
    src0 = make_source(tmp_path / "src0", 0)
    storage.persist_checkpoint(Checkpoint.from_directory(src0), 0, {"metrics": {}})
    expected = {"checkpoint_000000": src0}
    probe = make_source(tmp_path / "probe", 99)
    total = _writes_of(any_trial, lambda st: st.persist_checkpoint(
        Checkpoint.from_directory(probe), 999, {"metrics": {}}))
    any_trial.storage().delete_checkpoint("checkpoint_000999")
    assert total >= 4
    for n in range(total + 1):
        index = n + 1
        src = make_source(tmp_path / f"src{index}", index)
        dying = StorageContext.from_backend(
            faulty_backend(any_trial.backend, FaultPlan(crash_after_writes=n)),
            any_trial.root, "exp", "trial")
        try:
            dying.persist_checkpoint(Checkpoint.from_directory(src), index, {"metrics": {}})
            crashed = False
        except SimulatedCrash:
            crashed = True
        assert crashed == (n < total), (n, total)
        expected[f"checkpoint_{index:06d}"] = src
        _check(any_trial, tmp_path, expected)
        # The checkpoint before is never touched by a crash of the next one.
        assert "checkpoint_000000" in any_trial.storage().scan().committed


@pytest.mark.parametrize("victim", [0, 1])
def test_every_crash_point_of_a_delete(any_trial, tmp_path, victim):
    storage = any_trial.storage()
    storage.ensure_trial_dir()
    expected = {f"checkpoint_{i:06d}": make_source(tmp_path / f"s{i}", i) for i in range(2)}

    def commit(name: str) -> None:
        if name in storage.scan().committed:
            return
        storage.persist_checkpoint(Checkpoint.from_directory(expected[name]),
                                   int(name.split("_")[1]), {"metrics": {}})

    for name in expected:
        commit(name)
    name = f"checkpoint_{victim:06d}"
    total = _writes_of(any_trial, lambda st: st.delete_checkpoint(name))
    assert total >= 1
    for n in range(total + 1):
        commit(name)
        dying = StorageContext.from_backend(
            faulty_backend(any_trial.backend, FaultPlan(crash_after_writes=n)),
            any_trial.root, "exp", "trial")
        try:
            dying.delete_checkpoint(name)
            crashed = False
        except SimulatedCrash:
            crashed = True
        assert crashed == (n < total), (n, total)
        # Whole or gone, never half; what a cut-short delete leaves is ours.
        _check(any_trial, tmp_path, expected)
        other = f"checkpoint_{1 - victim:06d}"
        assert other in any_trial.storage().scan().committed
