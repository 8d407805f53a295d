"""``ls`` and ``show`` of a preempted trial and its preemption checkpoint (issue 39).

The trial is written through the real API: a session started with
``preemption=``, a SIGTERM sent to this process (the handler runs in the main
thread, where pytest runs the test), and the report after it, which commits
a preemption checkpoint and raises :class:`~checkpoint_store.errors.Preempted`.
On local disk and S3 (moto).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest
from cli_helpers import Store, invoke, write_tree

from checkpoint_store import Checkpoint, PreemptionConfig, session
from checkpoint_store.errors import Preempted

# An earlier test in this process may have left a SIGTERM handler of its own
# (ray.init installs one): the signal must reach the session's.
pytestmark = pytest.mark.usefixtures("fresh_signal_handlers")


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "store"))
    loc = request.getfixturevalue("s3_location")
    return Store(loc.uri, dict(loc.storage_options))


def _checkpoint(tmp_path: Any, i: int) -> Checkpoint:
    return Checkpoint.from_directory(write_tree(str(tmp_path / f"src-{i}"),
                                                {"model.bin": b"m" * (10 + i)}))


def preempted_trial(store: Store, tmp_path: Any, trial: str = "pre") -> None:
    """Two checkpoints, the second reported after a SIGTERM: a preemption checkpoint."""
    with pytest.raises(Preempted) as caught, session.start(
            storage_path=store.uri, storage_options=dict(store.options) or None,
            experiment_name="exp", trial_name=trial,
            preemption=PreemptionConfig(signals=("SIGTERM",), grace_period_s=30.0)):
        session.report({"loss": 0.5}, checkpoint=_checkpoint(tmp_path, 0))
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not session.reached_preemption() and time.monotonic() < deadline:
            time.sleep(0.01)
        session.report({"loss": 0.4}, checkpoint=_checkpoint(tmp_path, 1))
    assert caught.value.signal == "SIGTERM" and caught.value.code == 128 + signal.SIGTERM


def _ok(args: list[str]) -> Any:
    res = invoke(args)
    assert res.exit_code == 0, res.output
    return res


def test_ls_and_show_mark_the_preempted_trial_and_its_preemption_checkpoint(
        store: Store, tmp_path: Any) -> None:
    preempted_trial(store, tmp_path)
    with session.start(storage_path=store.uri, storage_options=dict(store.options) or None,
                       experiment_name="exp", trial_name="done"):
        session.report({"loss": 0.3}, checkpoint=_checkpoint(tmp_path, 2))
    opts = store.opt_args()

    # The experiment: a STATUS per trial, the preempted one with its reason.
    data = json.loads(_ok(["ls", store.join("exp"), *opts, "--json"]).stdout)
    trials = {t["name"]: t for t in data["trials"]}
    assert trials["pre"]["status"] == "preempted"
    assert trials["pre"]["reason"].startswith("SIGTERM received at ")
    assert (trials["done"]["status"], trials["done"]["reason"]) == ("finished", None)
    res = _ok(["ls", store.join("exp"), *opts])
    lines = res.stdout.splitlines()
    assert lines[0].split()[:3] == ["TRIAL", "STATUS", "METRIC"]
    assert {line.split()[0]: line.split()[1] for line in lines[1:]} == {
        "pre": "preempted", "done": "finished"}
    assert "pre was preempted: SIGTERM received at" in res.stderr
    assert "resumable" in res.stderr

    # The trial: its status and stop, and the checkpoint committed on the signal.
    trial = store.join("exp", "pre")
    for extra in ([], ["--long"]):
        data = json.loads(_ok(["ls", trial, *opts, "--json", *extra]).stdout)
        assert data["status"] == "preempted"
        assert data["stop"]["status"] == "preempted"
        assert data["stop"]["reason"] == trials["pre"]["reason"]
        assert data["error"] is None
        first, second = data["checkpoints"]
        assert first["preemption"] is None
        assert second["name"] == "checkpoint_000001"
        assert second["preemption"]["signal"] == "SIGTERM"
        assert second["preemption"]["grace_period_s"] == 30.0
        assert second["created_at"] - 30 < second["preemption"]["signalled_at"] \
            <= second["created_at"]
    res = _ok(["ls", trial, *opts])
    lines = res.stdout.splitlines()
    assert lines[0].split()[-1] == "NOTE"
    assert lines[1].split()[-1] == "-"
    assert lines[2].endswith("preemption (SIGTERM)")
    assert ("the trial's last run was preempted: SIGTERM received at" in res.stderr
            and "resumable: a new run resumes from checkpoint_000001" in res.stderr)
    # A trial ended otherwise shows no NOTE column and no stop.
    done = json.loads(_ok(["ls", store.join("exp", "done"), *opts, "--json"]).stdout)
    assert (done["status"], done["stop"]) == ("finished", None)
    assert done["checkpoints"][0]["preemption"] is None
    assert "NOTE" not in _ok(["ls", store.join("exp", "done"), *opts]).stdout

    # show: the preemption record, in text and JSON.
    shown = json.loads(_ok(["show", f"{trial}/checkpoint_000001", *opts, "--json"]).stdout)
    assert shown["preemption"] == second["preemption"]
    assert shown["internal_metadata"]["preemption"]["signal"] == "SIGTERM"
    text = _ok(["show", f"{trial}/checkpoint_000001", *opts]).stdout
    line = next(x for x in text.splitlines() if x.startswith("preemption "))
    assert "SIGTERM at " in line and "grace 30 s" in line
    plain = json.loads(_ok(["show", f"{trial}/checkpoint_000000", *opts, "--json"]).stdout)
    assert plain["preemption"] is None
    assert "preemption" not in _ok(["show", f"{trial}/checkpoint_000000", *opts]).stdout


def test_a_preempted_trial_resumes_from_its_preemption_checkpoint(
        store: Store, tmp_path: Any) -> None:
    """What ``ls`` calls resumable is: the next run starts from the preemption
    checkpoint, and once it ends on its own the trial is finished again."""
    preempted_trial(store, tmp_path)
    opts, trial = store.opt_args(), store.join("exp", "pre")
    with session.start(storage_path=store.uri, storage_options=dict(store.options) or None,
                       experiment_name="exp", trial_name="pre"):
        resumed = session.get_checkpoint()
        assert resumed is not None and resumed.path.rstrip("/").endswith("checkpoint_000001")
        session.report({"loss": 0.2}, checkpoint=_checkpoint(tmp_path, 3))
    data = json.loads(_ok(["ls", trial, *opts, "--json"]).stdout)
    assert (data["status"], data["stop"]) == ("finished", None)
    # The preemption checkpoint stays marked; a listing without --long reads
    # only the retention state, which does not record it.
    long = json.loads(_ok(["ls", trial, *opts, "--json", "--long"]).stdout)
    assert [c["preemption"] is not None for c in long["checkpoints"]] == [False, True, False]
    res = _ok(["ls", store.join("exp"), *opts])
    assert res.stdout.splitlines()[1].split()[:2] == ["pre", "finished"]
    assert "preempted" not in res.stderr
