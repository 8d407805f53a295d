"""Preemption: signals at random moments, checked after each.

The harness is checkpoint_store/testing/crash/preemption.py.

The quick runs: one SIGTERM per moment (inside a step, during a save's
staging, its upload, the local tier's durable copy, ``session.start``), to
the child alone and to its process group in turn, on local disk and on S3
(moto); and without ``preemption=``, SIGINT and SIGTERM to the process
group, with and without a handler of the program's that calls
``sys.exit``. The full run (``CS_PREEMPTION_KILLS`` SIGTERMs: 40 in the
suite, about 80 s, every moment and target; 200 by hand, about 390 s, the
run the docs quote) is marked slow.

Each run asserts no violation: the child ends by ``Preempted`` with the
configured exit status (or the no-opt-in one), within the grace period; a
committed checkpoint of a step at or after the last acknowledged one
exists, the preemption checkpoint says so in its metadata, the previous
complete checkpoint is kept, nothing partial is resumed, no persist process
outlives the child.
"""

from __future__ import annotations

import os
import time

import pytest

from checkpoint_store.testing.crash.preemption import (
    MOMENTS,
    PreemptionCrashConfig,
    PreemptionHarness,
    PreemptionReport,
)


def _config(tmp_path, **kw) -> PreemptionCrashConfig:
    kw.setdefault("storage_path", str(tmp_path / "store"))
    return PreemptionCrashConfig(work_dir=str(tmp_path / "work"), **kw)


def _assert_clean(report: PreemptionReport, kills: int, *, preempted: bool = True) -> None:
    print(report.summary())
    assert report.violations == [], report.summary()
    assert report.kills == kills, report.summary()
    assert report.killed_after_grace == 0 and report.orphans == 0, report.summary()
    assert report.acknowledged >= 1, report.summary()
    if preempted:
        # Every signal after session.start ended in a preemption checkpoint.
        assert report.outcomes["preempted"] >= kills - report.per_moment["start"], \
            report.summary()
        assert report.preemption_checkpoints == report.outcomes["preempted"], report.summary()


def test_a_sigterm_at_each_moment_on_local_disk(tmp_path):
    report = PreemptionHarness(_config(tmp_path), seed=11).run(len(MOMENTS))
    _assert_clean(report, len(MOMENTS))
    assert report.per_target == {"child": 3, "group": 2}
    assert set(report.per_moment) == set(MOMENTS)


def _s3_config(s3_location, tmp_path) -> PreemptionCrashConfig:
    return _config(tmp_path, storage_path=s3_location.uri,
                   storage_options=s3_location.storage_options, env=dict(s3_location.env),
                   preload=("s3fs", "checkpoint_store_s3"), file_size=256 * 1024)


def test_a_sigterm_during_uploads_on_s3(s3_location, tmp_path):
    """On moto a child needs ~5 s (its start, saves, the preemption commit)."""
    moments = ("upload", "tier_copy")
    report = PreemptionHarness(_s3_config(s3_location, tmp_path), seed=12).run(
        len(moments), moments=moments)
    _assert_clean(report, len(moments))


@pytest.mark.slow
def test_a_sigterm_at_each_moment_to_child_and_group_on_s3(s3_location, tmp_path):
    report = PreemptionHarness(_s3_config(s3_location, tmp_path), seed=17).run(
        2 * len(MOMENTS))
    _assert_clean(report, 2 * len(MOMENTS))


@pytest.mark.parametrize(("sig", "handler", "moment"), [
    ("SIGINT", False, "step"), ("SIGINT", True, "upload"),
    ("SIGTERM", False, "staging"), ("SIGTERM", True, "tier_copy"),
])
def test_without_opt_in_a_group_signal_keeps_the_acknowledged_saves(tmp_path, sig, handler,
                                                                     moment):
    """No ``preemption=``: a Ctrl-C or a SIGTERM to the process group (the
    program's own handler calling ``sys.exit``, or none) ends the run through
    the session's end; every acknowledged save is committed."""
    report = PreemptionHarness(_config(tmp_path), seed=13).run(
        1, opt_in=False, signals=(sig,), handlers=(handler,), targets=("group",),
        moments=(moment,))
    _assert_clean(report, 1, preempted=False)
    want = 3 if handler else 130 if sig == "SIGINT" else 143
    assert report.outcomes[f"exit_{want}"] == 1, report.summary()


def test_the_checks_catch_a_wrong_exit_a_lost_save_and_an_orphan(tmp_path):
    """The checks must be able to fail: feed them what they exist to catch."""
    import json
    import signal
    import subprocess
    import sys

    from checkpoint_store import StorageContext
    from checkpoint_store._util import fs as _fsutil
    from checkpoint_store.testing.crash.preemption import _alive_persist, _Events

    cfg = _config(tmp_path)
    report = PreemptionHarness(cfg, seed=14).run(1, moments=("step",))
    _assert_clean(report, 1)
    h = PreemptionHarness(cfg)
    events = _Events(str(tmp_path / "none.jsonl"))
    events.all = [{"ev": "leave", "m": "start", "t": 0.0}]
    r = PreemptionReport()
    assert h._judge_exit(cfg, 143, signal.SIGTERM, events, r, 0.0)  # not Preempted
    events.all.append({"ev": "preempted", "step": 3, "wall": 1.0, "t": 1.0})
    assert h._judge_exit(cfg, 143, signal.SIGTERM, events, r, 0.0)  # not the configured code
    assert h._judge_exit(cfg, cfg.exit_code, signal.SIGTERM, events, r, 0.0) == []
    # The preemption checkpoint and the acknowledged saves gone: both caught.
    storage = StorageContext(cfg.storage_path, cfg.experiment_name, cfg.trial_name)
    committed = storage.committed_checkpoints()
    newest = max(committed, key=lambda cm: cm[1]["index"])
    before = {int(m["index"]): m for _, m in committed}
    _fsutil.delete_dir(storage.filesystem, newest[0].path)
    events.all[-1]["step"] = newest[1]["metrics"]["step"]
    from checkpoint_store.registry import resolve

    backend, root = resolve(cfg.storage_path)
    bad = h._check_storage(cfg, storage, backend, root, before, events, PreemptionReport())
    assert any("preemption checkpoint" in v and "not committed" in v for v in bad), bad
    lost = json.dumps({"step": 10_000, "dir": "checkpoint_009999", "kept": []}) + "\n"
    with open(cfg.log_path, "a") as log:  # acknowledged
        log.write(lost)
    bad = h._check_storage(cfg, storage, backend, root, before, events, PreemptionReport())
    assert any("older than the last acknowledged 10000" in v for v in bad), bad
    assert any("row of acknowledged step 10000 is missing" in v for v in bad), bad
    with open(cfg.durable_log_path, "a") as log:  # and to be committed on the storage_path
        log.write(lost)
    bad = h._check_storage(cfg, storage, backend, root, before, events, PreemptionReport())
    assert any("was lost" in v for v in bad), bad
    # A live persist process after its child is an orphan (killed by the check).
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             "checkpoint_store.state._persist"])
    try:
        # Until it has exec'd, its command line is still this process's (under
        # load that took longer than the check's 0.2 s: it found no orphan).
        deadline = time.monotonic() + 30
        while not _alive_persist(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        h.orphan_wait_s = 0.2
        events.all = [{"ev": "persist_pid", "pid": proc.pid, "t": 0.0}]
        r = PreemptionReport()
        assert h._check_orphans(events, r) and r.orphans == 1
        assert proc.wait(5) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _full_kills() -> int:
    return int(os.environ.get("CS_PREEMPTION_KILLS", "40"))


@pytest.mark.slow
def test_full_preemption_run(tmp_path):
    """``CS_PREEMPTION_KILLS`` SIGTERMs over every moment, to the child and to
    its group, on local disk: 40 in the suite; the issue's 200 by hand."""
    kills = _full_kills()
    report = PreemptionHarness(_config(tmp_path / "a"), seed=15).run(
        kills, stop_on_violation=False)
    _assert_clean(report, kills)


@pytest.mark.slow
def test_full_no_opt_in_run(tmp_path):
    """A tenth as many signals as ``CS_PREEMPTION_KILLS`` (at least 8)
    without ``preemption=``: SIGINT or SIGTERM to the group, with or without
    the program's handler calling ``sys.exit``. It was run by hand only
    while two defects stood: a report cut during staging left a
    ``checkpoint_N`` that the persist process made again after the report
    dropped it (tests/state/test_persist_abort.py), and a signal between
    queueing a background job and starting its worker hung the session's
    end (tests/util/test_signal_cut_workers.py)."""
    plain = max(8, _full_kills() // 10)
    report = PreemptionHarness(_config(tmp_path / "b"), seed=16).run(
        plain, opt_in=False, signals=("SIGINT", "SIGTERM"), handlers=(False, True),
        targets=("group",), moments=("step", "staging", "upload", "tier_copy"),
        stop_on_violation=False)
    _assert_clean(report, plain, preempted=False)
