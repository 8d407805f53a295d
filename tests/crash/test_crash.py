"""The crash harness: SIGKILL a saving process at random moments, check after each kill.

CI runs these (they are marked slow): 100 kills on local disk, 50 on S3 (moto).
``scripts/soak.py`` runs many more.
"""

from __future__ import annotations

import pytest

from checkpoint_store.testing.crash import CrashConfig, CrashHarness, check_trial


def _assert_clean(report, kills: int) -> None:
    assert report.violations == [], report.summary()
    assert report.kills == kills, report.summary()
    # The children made progress between kills: kills landed while saving,
    # not only during session starts (lenient: the machine may be loaded).
    assert report.newest_step >= kills // 10, report.summary()
    assert report.saves_acknowledged >= 1, report.summary()


@pytest.mark.slow
def test_hundred_kills_on_local_disk(tmp_path):
    cfg = CrashConfig(storage_path=str(tmp_path / "store"), log_path=str(tmp_path / "acks.log"))
    report = CrashHarness(cfg, seed=1, min_delay=0.02, max_delay=0.4).run(100)
    print(report.summary())
    _assert_clean(report, 100)


@pytest.mark.slow
def test_fifty_kills_on_s3(s3_location, tmp_path):
    cfg = CrashConfig(storage_path=s3_location.uri, storage_options=s3_location.storage_options,
                      env=dict(s3_location.env), log_path=str(tmp_path / "acks.log"),
                      file_size=16 * 1024, preload=("s3fs", "checkpoint_store_s3"))
    # On moto a child needs ~0.5 s to start a session and ~0.5 s per save.
    report = CrashHarness(cfg, seed=2, min_delay=0.4, max_delay=1.6).run(50)
    print(report.summary())
    _assert_clean(report, 50)


def test_checker_catches_a_lost_or_broken_checkpoint(tmp_path):
    """The checker must be able to fail: feed it the states it exists to catch."""
    import json
    import os

    from checkpoint_store import StorageContext
    from checkpoint_store._util import fs as _fsutil

    cfg = CrashConfig(storage_path=str(tmp_path / "store"), log_path=str(tmp_path / "acks.log"))
    report = CrashHarness(cfg, seed=3, min_delay=0.9, max_delay=1.0).run(1)
    assert report.violations == [] and report.saves_acknowledged >= 2, report.summary()
    with open(cfg.log_path) as f:
        ack = json.loads(f.read().splitlines()[-1])
    storage = StorageContext(cfg.storage_path, cfg.experiment_name, cfg.trial_name)
    acked = storage.checkpoint(ack["dir"])
    # Flip a byte in the last acknowledged checkpoint: it no longer verifies.
    path = os.path.join(acked.path, "data_0.bin")
    data = bytearray(open(path, "rb").read())
    data[0] ^= 1
    open(path, "wb").write(bytes(data))
    bad, _ = check_trial(cfg)
    assert any("does not verify" in v for v in bad), bad
    # Remove it and anything newer (unacknowledged saves): the acknowledged save is lost.
    for ckpt, meta in storage.committed_checkpoints():
        if meta["metrics"]["step"] >= ack["step"]:
            _fsutil.delete_dir(storage.filesystem, ckpt.path)
    _fsutil.delete_dir(storage.filesystem, acked.path)
    bad, _ = check_trial(cfg)
    assert any("was lost" in v for v in bad), bad
    # A directory we did not write shows up as foreign.
    os.makedirs(os.path.join(storage.trial_path, "checkpoint_999999"))
    open(os.path.join(storage.trial_path, "checkpoint_999999", "x.bin"), "wb").write(b"x")
    bad, _ = check_trial(cfg)
    assert any("not recognisable" in v for v in bad), bad


def test_checker_catches_a_lost_or_doubled_row(tmp_path):
    """The rows check must be able to fail: a missing acknowledged row, a row twice."""
    import os

    cfg = CrashConfig(storage_path=str(tmp_path / "store"), log_path=str(tmp_path / "acks.log"))
    report = CrashHarness(cfg, seed=4, min_delay=0.9, max_delay=1.0).run(1)
    assert report.violations == [] and report.saves_acknowledged >= 2, report.summary()
    path = os.path.join(cfg.storage_path, cfg.experiment_name, cfg.trial_name, "result.json")
    lines = open(path, "rb").read().splitlines(keepends=True)
    open(path, "wb").write(b"".join(lines + lines[-1:]))
    bad, _ = check_trial(cfg)
    assert any("strictly increasing" in v for v in bad), bad
    open(path, "wb").write(b"".join(lines[1:]))
    bad, _ = check_trial(cfg)
    assert any("is missing from result.json" in v for v in bad), bad


@pytest.mark.no_deadline
@pytest.mark.parametrize("num_to_keep", [2, None])
def test_a_crash_at_every_step_of_the_retention_state_leaves_it_whole(tmp_path, num_to_keep):
    """Every mutating call of 8 reports (uploads, commits, log records, snapshot
    chunks and roots, deletes of folded parts and of evicted checkpoints) is a
    crash point; the next manager must find a whole state each time."""
    from checkpoint_store.testing.crash import sweep_state_crashes

    report = sweep_state_crashes(str(tmp_path), reports=8, num_to_keep=num_to_keep)
    assert report.violations == [], "\n".join(report.violations)
    assert report.points >= 8 * 4  # at least the commits and records of every report


@pytest.mark.slow
@pytest.mark.no_deadline
@pytest.mark.parametrize("num_to_keep", [3, None])
def test_a_crash_at_every_step_of_thirty_reports(tmp_path, num_to_keep):
    from checkpoint_store.testing.crash import sweep_state_crashes

    report = sweep_state_crashes(str(tmp_path), reports=30, num_to_keep=num_to_keep,
                                 compact_every=4, chunk_entries=3, fanout=2)
    assert report.violations == [], "\n".join(report.violations)


# -- the lease ----------------------------------------------------------------------------


@pytest.mark.parametrize("stale", ["expired", "dead", None])
def test_a_crash_at_every_step_of_the_lease_leaves_one_holder_at_most(tmp_path, stale):
    """Every mutating call of a lease's life (the storage clock's probe, taking
    over an expired lease or a dead holder's, two renewals, the release) is a
    crash point: the next writer takes the trial once the dead holder's lease
    expires and not before, never alongside a live holder, and nothing but the
    lease file is ever touched."""
    from checkpoint_store._format.layout import CLOCK_PROBE_PREFIX, LEASE_FILE
    from checkpoint_store.testing.crash import sweep_lease_crashes

    report = sweep_lease_crashes(str(tmp_path), stale=stale)
    assert report.violations == [], "\n".join(report.violations)
    assert report.points == len(report.crashed_before) + 1  # the last run ran through
    ops = [c.split()[0] for c in report.crashed_before if c.endswith("/" + LEASE_FILE)]
    # The lease's write at acquire and at each of two renewals, then its delete.
    assert ops == ["open_output_stream"] * 3 + ["delete_file"], report.crashed_before
    # Judging another holder's unexpired-looking lease reads the storage's clock.
    probes = [c for c in report.crashed_before if CLOCK_PROBE_PREFIX in c]
    assert bool(probes) == (stale == "expired"), report.crashed_before


def test_the_lease_sweep_catches_a_takeover_of_a_live_lease(tmp_path, monkeypatch):
    """The checks can fail: a lease that takes every other holder for dead lets
    two writers hold the trial, and the sweep says so."""
    from checkpoint_store.retention.lease import Lease
    from checkpoint_store.testing.crash import sweep_lease_crashes

    monkeypatch.setattr(Lease, "_seconds_left", lambda self, cur, mtime: None)
    report = sweep_lease_crashes(str(tmp_path), stale=None)
    assert any("two live holders" in v for v in report.violations), report.violations
    assert any("third writer took the lease" in v for v in report.violations)


def test_the_lease_sweep_catches_a_release_that_deletes_another_holders_lease(
        tmp_path, monkeypatch):
    from checkpoint_store._util import fs as _fsutil
    from checkpoint_store.retention.lease import Lease
    from checkpoint_store.testing.crash import sweep_lease_crashes

    def careless_release(self):  # deletes without checking whose lease it is
        self.stop_renewing()
        _fsutil.delete_file(self._storage.filesystem, self.path)

    monkeypatch.setattr(Lease, "release", careless_release)
    monkeypatch.setattr(Lease, "_seconds_left", lambda self, cur, mtime: None)
    report = sweep_lease_crashes(str(tmp_path), stale="expired")
    assert report.violations, "a careless lease went unnoticed"


@pytest.mark.slow
@pytest.mark.parametrize("upload_mode", ["async", "sync"])
def test_kills_of_a_process_saving_state_from_memory(tmp_path, upload_mode):
    """report(state=...), a state four times the staging budget: kills land in
    the copy into staging, in the persist process's writes and in the commit;
    no partial state is ever committed and the next run resumes the newest."""
    cfg = CrashConfig(storage_path=str(tmp_path / "store"), log_path=str(tmp_path / "acks.log"),
                      source="state", upload_mode=upload_mode, files=4, file_size=1 << 20,
                      staging_budget=1 << 20)
    # A child needs ~0.5 s to start its session and persist process.
    report = CrashHarness(cfg, seed=4, min_delay=0.3, max_delay=1.5).run(25)
    print(report.summary())
    _assert_clean(report, 25)


def test_kills_of_the_persist_process_never_commit_a_partial_state(tmp_path):
    """SIGKILL of the persist process at random moments of a save: that save
    fails with PersistProcessError (raised, never a hang), nothing partial is
    committed, and the next session resumes the newest complete checkpoint."""
    import json
    import os
    import random
    import signal
    import threading

    import numpy as np

    from checkpoint_store import UploadConfig, session
    from checkpoint_store.errors import PersistProcessError
    from checkpoint_store.testing import session_internals
    from checkpoint_store.testing.crash._child import payload

    cfg = CrashConfig(storage_path=str(tmp_path / "store"), log_path=str(tmp_path / "acks.log"),
                      source="state", files=4, file_size=1 << 20)
    rng = random.Random(5)
    failures = 0
    # Six kills, then more (twelve in all at most) until one has landed inside
    # a save: a kill between two saves, while the persist process is idle,
    # goes unnoticed (the next save starts a new process), and on a loaded
    # machine a third to a half of the kills land there.
    for kill in range(12):
        if kill >= 6 and failures:
            break
        kw = dict(storage_path=cfg.storage_path, experiment_name=cfg.experiment_name,
                  trial_name=cfg.trial_name,
                  upload_config=UploadConfig(staging_budget=1 << 20))
        try:
            with session.start(**kw) as s:
                latest = s.get_checkpoint()
                step = int(latest.internal_metadata["metrics"]["step"]) + 1 if latest else 0

                def save(step: int, **kw) -> None:
                    state = {"files": {str(i): np.frombuffer(payload(step, i, cfg.file_size),
                                                             dtype=np.uint8)
                                       for i in range(cfg.files)}, "step": step}
                    row = s.report({"step": step}, state=state, **kw)
                    s.wait()
                    with open(cfg.log_path, "a") as log:
                        log.write(json.dumps({"step": step, "dir": row["checkpoint_dir_name"],
                                              "kept": s.manager.kept_dir_names}) + "\n")

                save(step, upload_mode="sync")  # starts the persist process
                step += 1
                pid = session_internals(s).stager.persist_pid
                timer = threading.Timer(rng.uniform(0.0, 0.3),
                                        lambda p=pid: os.kill(p, signal.SIGKILL))
                timer.start()
                for _ in range(20):
                    save(step)
                    step += 1
                timer.cancel()
        except PersistProcessError:
            failures += 1
        bad, newest = check_trial(cfg)
        assert bad == [], (kill, bad)
        assert newest >= kill
    # And one kill that cannot miss a save, whatever the load: the persist
    # process is stopped (SIGSTOP), a save of 4 MiB through a 1 MiB staging
    # budget waits for it to drain, and it is killed then.
    with session.start(storage_path=cfg.storage_path, experiment_name=cfg.experiment_name,
                       trial_name=cfg.trial_name,
                       upload_config=UploadConfig(staging_budget=1 << 20)) as s:
        step = int(s.get_checkpoint().internal_metadata["metrics"]["step"]) + 1

        def state_of(step: int) -> dict:
            return {"files": {str(i): np.frombuffer(payload(step, i, cfg.file_size),
                                                    dtype=np.uint8)
                              for i in range(cfg.files)}, "step": step}

        s.report({"step": step}, state=state_of(step), upload_mode="sync")  # starts it
        pid = session_internals(s).stager.persist_pid
        os.kill(pid, signal.SIGSTOP)
        raised: list[BaseException] = []

        def blocked_save() -> None:
            try:
                s.report({"step": step + 1}, state=state_of(step + 1))
                s.wait()
            except BaseException as exc:  # the assertion below looks at it
                raised.append(exc)

        saver = threading.Thread(target=blocked_save)
        saver.start()
        saver.join(0.5)
        os.kill(pid, signal.SIGKILL)
        saver.join(60)
        assert not saver.is_alive()
        # A kill during a save failed that save (PersistProcessError, no hang).
        assert len(raised) == 1 and isinstance(raised[0], PersistProcessError), raised
    bad, _newest = check_trial(cfg)
    assert bad == [], bad
