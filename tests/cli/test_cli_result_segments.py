"""The command line on a trial whose last run died on an object store, leaving
rows in ``result.json`` segments (issue 19): ``cp`` copies them assembled,
``ls`` sees the trial, ``gc`` neither removes nor calls them foreign."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from cli_helpers import Store, invoke

from checkpoint_store import session
from checkpoint_store._format.layout import RESULT_SEGMENTS_DIR
from checkpoint_store._results.writer import ResultLog, list_segments


@pytest.fixture(params=["memory", "s3", "azure"])
def object_store(request: pytest.FixtureRequest) -> Store:
    if request.param == "memory":
        return Store(f"memory://cli-seg-{uuid.uuid4().hex[:10]}/store")
    loc = request.getfixturevalue(f"{request.param}_location")
    return Store(loc.uri, dict(loc.storage_options))


def _killed_run(store: Store, trial: str = "t1", earlier: int = 3, lost: int = 3) -> None:
    """``earlier`` rows of a run that ended (in result.json), then ``lost`` rows
    of a run killed after its last flush (in segments only)."""
    with session.start(storage_path=store.uri, storage_options=dict(store.options) or None,
                       experiment_name="exp", trial_name=trial) as s:
        for i in range(earlier):
            s.report({"i": i})
    log = ResultLog(store.ctx(trial=trial), flush_interval=3600)
    for i in range(earlier, earlier + lost):
        log.append({"i": i, "training_iteration": i + 1})
        if i % 2:
            log.flush()
    log.flush()


def _segments(store: Store, trial: str = "t1") -> list[str]:
    ctx = store.ctx(trial=trial)
    return [s.name for s in list_segments(ctx.filesystem, ctx.trial_path)]


def test_cp_of_a_trial_assembles_its_segments(object_store: Store, tmp_path: Any) -> None:
    _killed_run(object_store)
    assert len(_segments(object_store)) == 2
    dst = Store(str(tmp_path / "copy"))
    res = invoke(["cp", object_store.join("exp", "t1"), dst.join("exp", "t1"),
                  *object_store.opt_args()])
    assert res.exit_code == 0, res.output
    trial_dir = tmp_path / "copy" / "exp" / "t1"
    lines = (trial_dir / "result.json").read_bytes().splitlines()
    assert [json.loads(line)["i"] for line in lines] == list(range(6))
    assert not (trial_dir / RESULT_SEGMENTS_DIR).exists()
    # The source is only read: its segments stay for its next run to fold.
    assert len(_segments(object_store)) == 2


def test_a_trial_with_only_segments_is_a_trial(object_store: Store) -> None:
    """A first run killed before its end leaves no result.json: ls still sees it."""
    log = ResultLog(object_store.ctx(trial="t2"), flush_interval=3600)
    log.append({"i": 0, "training_iteration": 1})
    log.flush()
    res = invoke(["ls", object_store.join("exp"), "--json", *object_store.opt_args()])
    assert res.exit_code == 0, res.output
    assert "t2" in res.output
    assert [r["i"] for r in object_store.ctx(trial="t2").read_results()] == [0]


def test_gc_leaves_segments_alone(object_store: Store) -> None:
    _killed_run(object_store)
    before = _segments(object_store)
    res = invoke(["gc", object_store.join("exp", "t1"), "--min-age", "0", "--json",
                  *object_store.opt_args()])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["removed"] == [] and out["foreign"] == []
    assert _segments(object_store) == before
    assert [r["i"] for r in object_store.ctx().read_results()] == list(range(6))
