"""Control files read while rewritten: the retention state, user metadata and
commit markers read torn (fault layer ``torn_reads``) are read again, never
taken for corrupt."""

from __future__ import annotations

import posixpath

import pytest
from _retention_helpers import save

from checkpoint_store import Checkpoint, CheckpointConfig, CheckpointManager, StorageContext
from checkpoint_store._browse.locations import Location
from checkpoint_store._format.layout import INTERNAL_METADATA, MANAGER_STATE, USER_METADATA
from checkpoint_store._util.inspect import inspect_checkpoint
from checkpoint_store.retention.recorded import score_attribute
from checkpoint_store.retention.statelog import load_state
from checkpoint_store.testing.faults import faulty_backend

FAST = pytest.mark.parametrize("backend_name", ["local", "memory"])


def _trial(make_storage, source_dir) -> tuple[StorageContext, str]:
    storage = make_storage()
    with CheckpointManager(CheckpointConfig(2, "score", "max"), storage) as m:
        name = save(m, storage, source_dir, {"score": 0.5})
        save(m, storage, source_dir, {"score": 0.7})
    return storage, name


def _torn(storage: StorageContext, mark: str, count: int = 2) -> StorageContext:
    backend = faulty_backend(storage.backend, torn_reads=mark, torn_read_count=count)
    return StorageContext.from_backend(backend, storage.storage_path, "exp", "t")


@FAST
def test_a_state_root_read_torn_is_not_corrupt(make_storage, source_dir):
    storage, _ = _trial(make_storage, source_dir)
    torn = _torn(storage, MANAGER_STATE)
    state, problem = load_state(torn)
    assert problem == "" and state is not None
    assert torn.filesystem.handler.injected["torn"] == 2


@FAST
def test_a_state_root_read_torn_keeps_the_recorded_metric(make_storage, source_dir):
    storage, _ = _trial(make_storage, source_dir)
    torn = _torn(storage, MANAGER_STATE)
    trial = Location(torn.backend, torn.trial_path)
    assert score_attribute(trial) == ("score", "max")


@FAST
def test_user_metadata_read_torn_is_not_corrupt(make_storage, source_dir):
    storage, name = _trial(make_storage, source_dir)
    ck = storage.checkpoint(name)
    ck.set_metadata({"note": "kept", "pad": "x" * 100})
    torn = _torn(storage, USER_METADATA)
    got = Checkpoint(posixpath.join(torn.trial_path, name), torn.filesystem).get_metadata()
    assert got["note"] == "kept"


@FAST
def test_a_commit_marker_read_torn_inspects_as_committed(make_storage, source_dir):
    storage, name = _trial(make_storage, source_dir)
    torn = _torn(storage, INTERNAL_METADATA)
    got = inspect_checkpoint(torn.filesystem, posixpath.join(torn.trial_path, name))
    assert got.state == "committed", got
