"""Kills across machines and jobs (checkpoint_store/testing/crash/fleet.py).

The quick runs (26 kills, ~20 s) save a directory through the local tier,
with restarts on the first machine, a second machine whose tier goes stale,
a fresh machine and none, and two jobs on one tier path, on local disk; the
same for a state (sync, async) is marked slow (its children take ~1 s to
start). The slow full run (``CS_FLEET_KILLS`` kills over the same matrix:
120 in the suite, to keep it inside CI's time; the docs quote a run of 240
by hand) and the S3 (moto) runs are the ones the docs quote.

Each path asserts that no kind of :data:`~checkpoint_store.testing.crash.fleet.KINDS`
appears: no resume older than an acknowledged step, from a partial, foreign
or stale copy, and no redone step whose copy the restart could reach (all
wrong resumes); no acknowledged row lost, no row twice, no damaged or
foreign checkpoint listed, no tier directory shared by two jobs, no child
that failed by itself. A step redone because its only copy was out of the
restart's reach is counted (``redone_unreachable``), never a violation.
"""

from __future__ import annotations

import os

import pytest

from checkpoint_store.testing.crash.fleet import KINDS, FleetConfig, FleetHarness, FleetReport

#: Every kind a run may show; none is allowed.
ALL = KINDS

_PATHS = {  # (scenario, source, upload_mode) -> (kills, min_delay, max_delay)
    ("machines", "checkpoint", "sync"): (16, 0.05, 0.8),
    ("jobs", "checkpoint", "sync"): (10, 0.05, 0.8),
    # A state child needs ~1 s to start its persist process: slow.
    ("machines", "state", "sync"): (5, 1.0, 3.5),
    ("machines", "state", "async"): (5, 1.0, 3.5),
}


def _path_params() -> list:
    """The paths, the state ones marked slow."""
    return [pytest.param(p, marks=[pytest.mark.slow] if p[1] == "state" else [],
                         id="-".join(p)) for p in _PATHS]


def _config(tmp_path, source: str, upload_mode: str, **kw) -> FleetConfig:
    kw.setdefault("storage_paths", (str(tmp_path / "s0"), str(tmp_path / "s1")))
    return FleetConfig(tier_paths=(str(tmp_path / "tierA"), str(tmp_path / "tierB")),
                       work_dir=str(tmp_path / "work"), source=source,
                       upload_mode=upload_mode, **kw)


def _run(tmp_path, scenario: str, source: str, mode: str, kills: int, lo: float, hi: float,
         seed: int, **kw) -> FleetReport:
    report = FleetHarness(_config(tmp_path, source, mode, **kw), scenario=scenario, seed=seed,
                          min_delay=lo, max_delay=hi).run(kills)
    print(report.summary())
    for v in report.violations:
        print(v)
    return report


def _assert_ran(report: FleetReport, kills: int) -> None:
    assert report.kills >= kills, report.summary()
    assert report.acknowledged + report.reported >= 1, report.summary()
    assert report.restarts_checked >= kills // 3, report.summary()


_RUNS: dict[tuple[str, str, str], FleetReport] = {}


@pytest.fixture
def quick_run(tmp_path_factory):
    """One quick run per path (kept for the session)."""
    def get(path: tuple[str, str, str]) -> FleetReport:
        if path not in _RUNS:
            kills, lo, hi = _PATHS[path]
            _RUNS[path] = _run(tmp_path_factory.mktemp("fleet"), *path, kills, lo, hi,
                               seed=37 + list(_PATHS).index(path))
        return _RUNS[path]
    return get


@pytest.mark.parametrize("path", _path_params())
def test_no_wrong_stale_or_redone_resume_no_lost_or_twice_step_no_shared_tier(quick_run, path):
    report = quick_run(path)
    _assert_ran(report, _PATHS[path][0])
    assert report.of(*ALL) == [], report.summary()


@pytest.mark.no_deadline
def test_the_fleet_checks_catch_a_wrong_stale_and_foreign_resume(tmp_path):
    """The checks must be able to fail: feed them the records they exist to catch."""
    h = FleetHarness(_config(tmp_path, "checkpoint", "sync"), scenario="jobs")
    acked = {"ack": 5, "attempt": 2, "dir": "checkpoint_000005"}
    ok = {"resumed": 5, "attempt": 2, "job": 0, "index": 5, "uri": "u", "bytes": "ok"}
    assert h._judge_resume(0, 1, ok, acked) == []
    older = dict(ok, resumed=4, index=4)
    assert [v.kind for v in h._judge_resume(0, 1, older, acked)] == ["wrong_resume"]
    stale = dict(ok, attempt=1)
    assert [v.kind for v in h._judge_resume(0, 1, stale, acked)] == ["stale_resume"]
    foreign = dict(ok, job=1)
    assert [v.kind for v in h._judge_resume(0, 1, foreign, acked)] == ["foreign_resume"]
    partial = dict(ok, bytes="files [1] hold other bytes than its metadata names")
    assert [v.kind for v in h._judge_resume(0, 1, partial, acked)] == ["partial_resume"]
    other_durable = dict(ok, durable_copy={"step": 5, "attempt": 3, "job": 0, "uri": "d"})
    assert [v.kind for v in h._judge_resume(0, 1, other_durable, acked)] == ["stale_resume"]
    nothing = {"resumed": None}
    assert [v.kind for v in h._judge_resume(0, 1, nothing, acked)] == ["wrong_resume"]
    local = {"reported": 7, "attempt": 2, "dir": "checkpoint_000007"}
    assert [v.kind for v in h._judge_resume(0, 1, ok, acked, local)] == ["wrong_resume"]


@pytest.mark.no_deadline
def test_the_fleet_checks_tell_a_redone_step_it_could_reach_from_one_it_could_not():
    """A step saved again by attempt 3: a violation when attempt 3 could reach
    a copy of it (or newer) in the trial's history at its start, else noted."""
    judge = FleetHarness._judge_redo
    rows = [[0, 1], [1, 1], [2, 2]]

    def start(*copies, rows=rows):
        return {3: {"start": 3, "reachable": {"copies": list(copies), "rows": rows}}}

    # Only an older copy reachable: the step had to be trained again.
    assert judge(2, [3], start(["storage_path", 1, 1, 1]))[0] == "redone_unreachable"
    # Committed on the storage_path, or on its own tier and still the history's.
    assert judge(2, [3], start(["storage_path", 2, 2, 2]))[0] == "redone_step"
    assert judge(2, [3], start(["tier", 2, 2, 2]))[0] == "redone_step"
    assert judge(1, [3], start(["tier", 2, 2, 2]))[0] == "redone_step"
    # A tier copy the history branched away from (a later run went back past
    # it), or whose index the storage_path gave another save: not reachable.
    assert judge(2, [3], start(["tier", 2, 2, 2], rows=rows + [[1, 3]]))[0] == \
        "redone_unreachable"
    assert judge(2, [3], start(["tier", 2, 2, 2], ["storage_path", 1, 4, 2]))[0] == \
        "redone_unreachable"
    # What it could reach is unknown: never passed silently.
    assert judge(2, [3], {})[0] == "redone_step"


def test_the_fleet_checks_catch_a_lost_row_a_damaged_copy_and_a_foreign_one(tmp_path):
    """Storage checks on a real run, then on the states they exist to catch."""
    import json
    import shutil

    report = _run(tmp_path, "machines", "checkpoint", "sync", 2, 0.6, 0.8, seed=1,
                  machine_weights=(0.0, 0.0, 0.0, 1.0))
    assert report.violations == [] and report.acknowledged >= 2, report.summary()
    h = FleetHarness(_config(tmp_path, "checkpoint", "sync"), scenario="machines")
    trial = tmp_path / "s0" / "default" / "default"
    # A row lost: drop the last acknowledged step's row.
    log = [json.loads(x) for x in open(tmp_path / "work" / "job0.log").read().splitlines()]
    last = [r for r in log if "ack" in r][-1]
    rows = open(trial / "result.json").read().splitlines(keepends=True)
    kept = [r for r in rows if json.loads(r).get("step") != last["ack"]]
    open(trial / "result.json", "w").write("".join(kept + [kept[-1]]))
    kinds = {v.kind for v in h.check_job(0, 1)}
    assert {"lost_ack", "duplicate_row"} <= kinds, kinds
    open(trial / "result.json", "w").write("".join(rows))
    # A damaged committed copy; another job's copy in this storage_path.
    names = sorted(p for p in os.listdir(trial) if p.startswith("checkpoint_"))
    path = trial / names[-1] / "part_0.bin"
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    assert "partial_checkpoint" in {v.kind for v in h.check_job(0, 2)}
    shutil.copytree(trial, tmp_path / "s1" / "default" / "default")
    h1 = FleetHarness(_config(tmp_path, "checkpoint", "sync"), scenario="jobs")
    assert "foreign_checkpoint" in {v.kind for v in h1.check_job(1, 3)}


def _full_kills() -> int:
    return int(os.environ.get("CS_FLEET_KILLS", "120"))


@pytest.mark.slow
def test_full_fleet_run_on_local_disk(tmp_path):
    """``CS_FLEET_KILLS`` kills (default 120; 240 by hand) over every path, local disk."""
    total = _full_kills()
    weights = {"machines-checkpoint-sync": 0.4, "machines-state-sync": 0.15,
               "machines-state-async": 0.15, "jobs-checkpoint-sync": 0.3}
    reports = []
    for n, (key, (_, lo, hi)) in enumerate(_PATHS.items()):
        kills = max(4, round(total * weights["-".join(key)]))
        if key[1] == "state":  # a state child needs ~1 s (more on a loaded machine) to start
            lo, hi = 1.0, 5.0
        reports.append(_run(tmp_path / "-".join(key), *key, kills, lo, hi, seed=370 + n))
    print("\n".join(r.summary() for r in reports))
    assert sum(r.kills for r in reports) >= total
    assert [v for r in reports for v in r.of(*ALL)] == []


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["machines", "jobs"])
def test_fleet_kills_on_s3(s3_location, tmp_path, scenario):
    """The same against S3 (moto): slower starts, so longer delays."""
    uri = s3_location.uri.rstrip("/")
    kills = int(os.environ.get("CS_FLEET_S3_KILLS", "8"))
    # A child on moto needs ~1-2 s (more on a loaded machine) before its first save.
    # A report is followed by wait() and acknowledged with odds wait_odds (0.3,
    # drawn from a generator seeded by job and attempt): on a loaded machine a
    # child makes one or two reports before its kill, and a run can end with
    # none acknowledged (the ack checks then had nothing to check). Such a run
    # is checked in full and followed by one on fresh paths that waits more
    # often (0.6, then 1.0).
    acknowledged = 0
    for run, wait_odds in enumerate((0.3, 0.6, 1.0)):
        (tmp_path / f"run{run}").mkdir()
        report = _run(tmp_path / f"run{run}", scenario, "checkpoint", "sync", kills, 2.0, 5.0,
                      seed=3 + run, wait_odds=wait_odds,
                      storage_paths=(f"{uri}/run{run}/fleet0", f"{uri}/run{run}/fleet1"),
                      storage_options=s3_location.storage_options, env=dict(s3_location.env),
                      preload=("s3fs", "checkpoint_store_s3"))
        _assert_ran(report, kills)
        assert report.of(*ALL) == [], report.summary()
        acknowledged += report.acknowledged
        if acknowledged:
            break
    assert acknowledged >= 1, report.summary()
