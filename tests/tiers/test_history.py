"""The local tier and the storage_path as one history of a trial: a damaged
local copy is never handed out again, and a local copy of an index another
machine's run committed since is never restored, persisted or recorded
(checkpoint_store/tiers/history.py)."""

from __future__ import annotations

import json
import os

import pytest
from _tier_helpers import make_checkpoint, read_files

from checkpoint_store import LocalTier, StorageContext, session
from checkpoint_store.errors import CheckpointCorruptError
from checkpoint_store.testing import session_internals
from checkpoint_store.tiers import TIER_STATE_FILE


def _start(durable, tier=None, **kw):
    return session.start(experiment_name="e", trial_name="t", local_tier=tier,
                         **durable.start_kwargs(), **kw)


def _flip_a_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_local_copy_that_failed_verify_is_not_handed_out_again(durable_uri, tmp_path):
    tier = LocalTier(tmp_path / "fast")
    with _start(durable_uri, tier) as s:
        for i in range(2):
            s.report({"i": i}, checkpoint=make_checkpoint(tmp_path, f"c{i}",
                                                          {"w.bin": b"%d" % i * 100}))
    with _start(durable_uri, tier) as s:
        got = s.get_checkpoint()
        assert got is not None and got.is_local
        _flip_a_byte(os.path.join(got.path, "w.bin"))
        with pytest.warns(RuntimeWarning, match="failed a read"):
            with pytest.raises(CheckpointCorruptError):
                got.verify()
        again = s.get_checkpoint()
        # The durable copy of the same index, never the damaged local one.
        assert again is not None and again.path != got.path
        assert again.uri == durable_uri.ctx().checkpoint("checkpoint_000001").uri
        again.verify()
        with again.as_directory() as d:
            assert read_files(d) == {"w.bin": b"1" * 100}
        assert [e.index for e in session_internals(s).tier.entries()] == [0]
        assert s.get_checkpoint().uri == again.uri


def test_a_local_copy_that_failed_load_state_falls_back_to_the_durable_one(tmp_path):
    np = pytest.importorskip("numpy")
    store = str(tmp_path / "durable")
    tier = LocalTier(tmp_path / "fast")
    kw = {"storage_path": store, "experiment_name": "e", "trial_name": "t", "local_tier": tier}
    with session.start(**kw) as s:
        s.report({"i": 0}, state={"w": np.arange(64, dtype=np.float32)}, upload_mode="sync")
        s.report({"i": 1}, state={"w": np.arange(64, dtype=np.float32) + 1}, upload_mode="sync")
        s.wait()
    with session.start(**kw) as s:
        got = s.get_checkpoint()
        assert got is not None and got.is_local
        tensors = [os.path.join(dp, n) for dp, _, ns in os.walk(got.path) for n in ns
                   if n.endswith(".safetensors")]
        _flip_a_byte(tensors[0])
        with pytest.warns(RuntimeWarning, match="failed a read"):
            with pytest.raises(CheckpointCorruptError):
                got.load_state()
        again = s.get_checkpoint()
        assert again is not None and again.path == os.path.join(store, "e", "t",
                                                                "checkpoint_000001")
        assert (again.load_state()["w"] == np.arange(64, dtype=np.float32) + 1).all()


def _machine_a_then_b(store: str, tmp_path, status: str) -> LocalTier:
    """Machine A (local tier) commits 0, 1 durably and 2, 3 on its tier only
    (``status``: how A's tier records them); machine B (no tier) resumes
    from 1 and commits its own checkpoint_000002."""
    tier = LocalTier(tmp_path / "fastA", persist=lambda index, row: index < 2)
    kw = {"storage_path": store, "experiment_name": "e", "trial_name": "t"}
    with session.start(**kw, local_tier=tier) as s:
        for i in range(4):
            s.report({"who": "A", "i": i},
                     checkpoint=make_checkpoint(tmp_path, f"a{i}", {"w.bin": b"A%d" % i}))
        s.wait()
    if status == "pending":  # killed before the durable copy of 2 was made
        path = tmp_path / "fastA" / "e" / "t" / TIER_STATE_FILE
        body = json.loads(path.read_text())
        for e in body["checkpoints"]:
            if e["index"] in (2, 3):
                e["durable"] = "pending"
        path.write_text(json.dumps(body))
    # Machine B: no tier; the storage_path has 0 and 1.
    ctx = StorageContext(store, "e", "t")
    assert [m["index"] for _, m in ctx.committed_checkpoints()] == [0, 1]
    with session.start(**kw) as s:
        got = s.get_checkpoint()
        assert got is not None and got.path.endswith("checkpoint_000001")
        row = s.report({"who": "B", "i": 2},
                       checkpoint=make_checkpoint(tmp_path, "b2", {"w.bin": b"B2"}))
        assert row["checkpoint_dir_name"] == "checkpoint_000002"
    return tier


@pytest.mark.parametrize("status", ["local_only", "pending"])
def test_one_index_two_machines_resumes_the_trials_copy(tmp_path, status, caplog):
    store = str(tmp_path / "durable")
    tier = _machine_a_then_b(store, tmp_path, status)
    ctx = StorageContext(store, "e", "t")
    rows_before = ctx.read_results()
    with caplog.at_level("WARNING"), session.start(
            storage_path=store, experiment_name="e", trial_name="t", local_tier=tier) as s:
        got = s.get_checkpoint()
        assert got is not None and got.path == os.path.join(store, "e", "t",
                                                            "checkpoint_000002")
        assert read_files(got.path) == {"w.bin": b"B2"}
        # A's 2 and 3 are another branch of the history: both dropped.
        assert session_internals(s).tier.entries() == []
        row = s.report({"who": "A", "i": 3},
                       checkpoint=make_checkpoint(tmp_path, "new", {"w.bin": b"A-new"}))
        assert row["checkpoint_dir_name"] == "checkpoint_000003"
        s.wait()
    assert "checkpoint_000002" in caplog.text and "not the trial's copy" in caplog.text
    assert not (tmp_path / "fastA" / "e" / "t" / "checkpoint_000002").exists()
    # The new checkpoint_000003 (local only, as persist says) replaced A's stale one.
    assert read_files(str(tmp_path / "fastA" / "e" / "t" / "checkpoint_000003")) == {
        "w.bin": b"A-new"}
    # B's copy stays the durable checkpoint_000002; A's never overwrote it.
    with ctx.checkpoint("checkpoint_000002").as_directory() as d:
        assert read_files(d) == {"w.bin": b"B2"}
    rows = ctx.read_results()
    assert rows[:len(rows_before)] == rows_before  # nothing of A's stale copy appended
    assert [(r["who"], r["checkpoint_dir_name"]) for r in rows[len(rows_before):]] == [
        ("A", "checkpoint_000003")]
    its = [r["training_iteration"] for r in rows]
    assert its == sorted(set(its))


def test_resume_from_is_not_read_when_the_local_tier_holds_the_trials_copies(tmp_path):
    """A trial whose checkpoints are all on its local tier (persist sends none)
    has checkpoints of its own: a restart with ``resume_from=`` another run's
    checkpoint resumes the tier's newest copy, not the other run's."""
    store = str(tmp_path / "durable")
    with session.start(storage_path=store, experiment_name="e", trial_name="src") as s:
        s.report({}, checkpoint=make_checkpoint(tmp_path, "o", {"w.bin": b"other"}))
    other = StorageContext(store, "e", "src").checkpoint("checkpoint_000000")
    tier = LocalTier(tmp_path / "fast", persist=lambda index, row: False)
    kw = {"storage_path": store, "experiment_name": "e", "trial_name": "t",
          "local_tier": tier, "resume_from": other}
    with session.start(**kw) as s:
        assert s.get_checkpoint().uri == other.uri  # nothing of its own yet
        s.report({}, checkpoint=make_checkpoint(tmp_path, "m", {"w.bin": b"mine"}))
    with session.start(**kw) as s:
        got = s.get_checkpoint()
        assert got is not None and got.path.startswith(str(tmp_path / "fast"))
        assert read_files(got.path) == {"w.bin": b"mine"}


def _run_a_with_a_tier(durable, tmp_path):
    """Machine A reports 0..2 through its tier; 0 and 1 reach the storage_path,
    2 stays local only (``persist``)."""
    tier = LocalTier(tmp_path / "fastA", num_to_keep=3, persist=lambda index, row: index < 2)
    with _start(durable, tier) as s:
        for i in range(3):
            s.report({"who": "A", "i": i},
                     checkpoint=make_checkpoint(tmp_path, f"a{i}", {"w.bin": b"A%d" % i}))
    assert durable.committed() == [0, 1]
    return tier


def _wipe(durable) -> None:
    ctx = durable.ctx()
    ctx.filesystem.delete_dir(ctx.trial_path)  # the experiment is started over


def test_a_trial_started_over_on_its_storage_path_never_resumes_the_tier(durable_uri,
                                                                         tmp_path):
    """The trial's directory on the storage_path is deleted to run the
    experiment again from scratch, on the same machine: the local tier's
    copies are the deleted history's, so the new run starts fresh (they are
    removed from the tier) instead of resuming step 2 of the old one; so do
    the readers that open no session (HF restore_latest, Lightning resume_path)."""
    from checkpoint_store.tiers.history import trial_copies

    tier = _run_a_with_a_tier(durable_uri, tmp_path)
    _wipe(durable_uri)
    assert trial_copies(durable_uri.ctx(), tier) == []
    with _start(durable_uri, tier) as s:
        assert s.get_checkpoint() is None
        assert session_internals(s).tier.entries() == []
        row = s.report({"who": "new", "i": 0},
                       checkpoint=make_checkpoint(tmp_path, "n0", {"w.bin": b"N0"}))
        assert (row["checkpoint_dir_name"], row["training_iteration"]) == ("checkpoint_000000", 1)
    assert sorted(os.listdir(tmp_path / "fastA" / "e" / "t")) == [
        ".cs_tier.lock", ".cs_tier_holder.json", TIER_STATE_FILE, "checkpoint_000000"]
    assert [r["who"] for r in durable_uri.ctx().read_results()] == ["new"]


def test_a_trial_started_over_elsewhere_never_resumes_the_old_tier(tmp_path):
    """Started over on machine B (no tier), which got to checkpoint 0; machine
    A's tier, back, still holds the old run's 0..2 (the old 1 recorded durable):
    the restart resumes B's checkpoint 0, also through the readers that open
    no session (trial_copies: HF restore_latest, Lightning resume_path)."""
    from _tier_helpers import Durable

    from checkpoint_store.tiers.history import trial_copies

    durable = Durable("local", str(tmp_path / "durable"))
    tier = _run_a_with_a_tier(durable, tmp_path)
    _wipe(durable)
    with _start(durable) as s:
        s.report({"who": "B", "i": 0}, checkpoint=make_checkpoint(tmp_path, "b0", {"w.bin": b"B0"}))
    copies = trial_copies(durable.ctx(), tier)
    assert [(c.index, c.where) for c in copies] == [(0, "durable")]
    with _start(durable, tier) as s:
        got = s.get_checkpoint()
        assert got is not None and not got.path.startswith(str(tmp_path / "fastA"))
        assert read_files(got.path) == {"w.bin": b"B0"}
        assert session_internals(s).tier.entries() == []
        row = s.report({"who": "A", "i": 1},
                       checkpoint=make_checkpoint(tmp_path, "a-new", {"w.bin": b"A-new"}))
        assert row["checkpoint_dir_name"] == "checkpoint_000001"
    assert [r["who"] for r in durable.ctx().read_results()] == ["B", "A"]
