"""``ls`` of a trial or an experiment costs the same at any number of checkpoints
(issue 19): the retention state names the checkpoints and one listing finds
what it does not; ``--long`` reads each one's metadata for sizes and file counts.

Requests are counted on moto S3 (and memory) behind a counting handler, with
the command run in-process as a user runs it. A trial's retention state is a
snapshot plus up to ``COMPACT_EVERY`` small records, so the sizes compared are
one compaction period apart: the same number of records to read.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from cli_helpers import Store, invoke, write_tree

from checkpoint_store import Checkpoint, session
from checkpoint_store._browse.locations import Location, resolve_location
from checkpoint_store.cli import best, inspection
from checkpoint_store.retention.statelog import COMPACT_EVERY
from checkpoint_store.testing.faults import FaultInjectingHandler, faulty_backend


@pytest.fixture(params=["memory", pytest.param("s3", marks=pytest.mark.slow)])
def store(request: pytest.FixtureRequest) -> Store:
    if request.param == "memory":
        return Store(f"memory://ls-cost-{uuid.uuid4().hex[:10]}/store")
    loc = request.getfixturevalue("s3_location")
    return Store(loc.uri, dict(loc.storage_options))


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[FaultInjectingHandler]]:
    """Every location ``ls`` resolves goes through a counting handler, kept here."""
    handlers: list[FaultInjectingHandler] = []

    def resolve(text: str, options: Any, **kwargs: Any) -> Location:
        loc = resolve_location(text, options, **kwargs)
        backend = faulty_backend(loc.backend)
        handlers.append(backend.filesystem.handler)
        return Location(backend, loc.path)

    monkeypatch.setattr(inspection, "resolve_location", resolve)
    yield handlers


def _requests(handlers: list[FaultInjectingHandler], args: list[str]) -> tuple[int, Any]:
    handlers.clear()
    res = invoke(args)
    assert res.exit_code == 0, res.output
    return sum(sum(h.calls.values()) for h in handlers), res


def _trial(store: Store, tmp_path: Any, trial: str, n: int, experiment: str = "exp") -> list[int]:
    """``n`` checkpoints reported through a session (keep-all); their sizes."""
    sizes = []
    with session.start(storage_path=store.uri, storage_options=dict(store.options) or None,
                       experiment_name=experiment, trial_name=trial) as s:
        for i in range(n):
            src = write_tree(str(tmp_path / f"{experiment}-{trial}-{i}"),
                             {"model.bin": b"m" * (100 + i), "opt/state.bin": b"o" * i})
            s.report({"loss": 1.0 / (i + 1), "epoch": i},
                     checkpoint=Checkpoint.from_directory(src))
            sizes.append(100 + 2 * i)
    return sizes


def test_ls_of_a_trial_costs_the_same_at_any_number_of_checkpoints(
    store: Store, tmp_path: Any, counted: list[FaultInjectingHandler]
) -> None:
    small, large = 1, 1 + COMPACT_EVERY
    _trial(store, tmp_path, "small", small)
    sizes = _trial(store, tmp_path, "large", large)
    opts = store.opt_args()

    n_small, _ = _requests(counted, ["ls", store.join("exp", "small"), *opts, "--json",
                                     "--metric", "loss"])
    n_large, res = _requests(counted, ["ls", store.join("exp", "large"), *opts, "--json",
                                       "--metric", "loss"])
    assert n_small == n_large, (n_small, n_large)
    rows = json.loads(res.stdout)["checkpoints"]
    assert [r["index"] for r in rows] == list(range(large))
    assert [r["score"] for r in rows] == [1.0 / (i + 1) for i in range(large)]
    assert all(r["created_at"] for r in rows) and "size" not in rows[0]

    # The table: no SIZE column, the score of --metric.
    _, res = _requests(counted, ["ls", store.join("exp", "large"), *opts,
                                 "--metric", "epoch"])
    lines = res.stdout.strip().splitlines()
    assert lines[0].split() == ["INDEX", "CHECKPOINT", "CREATED", "(UTC)", "SCORE", "(epoch)"]
    assert [line.split()[-1] for line in lines[1:]] == [str(i) for i in range(large)]

    # --long shows what ls showed before: sizes and file counts, read per checkpoint.
    n_long, res = _requests(counted, ["ls", store.join("exp", "large"), *opts, "--json",
                                      "--long"])
    rows = json.loads(res.stdout)["checkpoints"]
    assert [(r["size"], r["files"]) for r in rows] == [(s, 2) for s in sizes]
    assert n_long >= n_large + large  # at least one more request per checkpoint
    _, res = _requests(counted, ["ls", store.join("exp", "large"), *opts, "-l"])
    lines = res.stdout.strip().splitlines()
    assert lines[0].split()[:5] == ["INDEX", "CHECKPOINT", "CREATED", "(UTC)", "SIZE"]
    assert [line.split()[-3:-1] for line in lines[1:]] == [[str(s), "B"] for s in sizes]


def test_ls_of_an_experiment_reads_no_checkpoint_of_its_trials(
    store: Store, tmp_path: Any, counted: list[FaultInjectingHandler]
) -> None:
    for exp, n in (("few", 1), ("many", 1 + COMPACT_EVERY)):
        _trial(store, tmp_path, "a", 1, experiment=exp)
        _trial(store, tmp_path, "b", n, experiment=exp)
    opts = store.opt_args()
    few, _ = _requests(counted, ["ls", store.join("few"), *opts, "--json"])
    many, res = _requests(counted, ["ls", store.join("many"), *opts, "--json"])
    assert few == many, (few, many)
    trials = {t["name"]: t for t in json.loads(res.stdout)["trials"]}
    assert {n: (t["checkpoints"], t["latest_index"]) for n, t in trials.items()} == {
        "a": (1, 0), "b": (1 + COMPACT_EVERY, COMPACT_EVERY)}
    assert "size" not in trials["a"]
    _, res = _requests(counted, ["ls", store.join("many"), *opts])
    assert res.stdout.splitlines()[0].split()[-3:] == ["LATEST", "CREATED", "(UTC)"]

    _, res = _requests(counted, ["ls", store.join("many"), *opts, "--json", "--long"])
    trials = {t["name"]: t for t in json.loads(res.stdout)["trials"]}
    assert trials["b"]["size"] == sum(100 + 2 * i for i in range(1 + COMPACT_EVERY))
    _, res = _requests(counted, ["ls", store.join("many"), *opts, "--long"])
    assert res.stdout.splitlines()[0].split()[-1] == "SIZE"


def test_ls_without_long_lists_a_checkpoint_the_state_does_not_name(
    store: Store, tmp_path: Any, counted: list[FaultInjectingHandler]
) -> None:
    """A checkpoint committed after the last state record (here by ``upload``)
    is found by the listing, and a directory without a commit marker is not
    listed: the short listing shows the committed ones, not the state's view."""
    _trial(store, tmp_path, "t1", 3)
    opts, trial = store.opt_args(), store.join("exp", "t1")
    src = write_tree(str(tmp_path / "up"), {"w.bin": b"w" * 7})
    assert invoke(["upload", src, trial, *opts]).exit_code == 0
    ctx = store.ctx("exp", "t1")  # and a write interrupted before its commit marker
    ctx.filesystem.create_dir(f"{ctx.trial_path}/checkpoint_000009/sub", recursive=True)
    with ctx.filesystem.open_output_stream(f"{ctx.trial_path}/checkpoint_000009/x") as f:
        f.write(b"partial")

    _, res = _requests(counted, ["ls", trial, *opts, "--json"])
    data = json.loads(res.stdout)
    assert [r["name"] for r in data["checkpoints"]] == [f"checkpoint_{i:06d}" for i in range(4)]
    assert data["uncommitted"] == 1


@pytest.fixture
def call_log(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> str:
    """Every call of a command on its locations, logged as ``(method, path)``."""
    from checkpoint_store.testing.faults import FaultPlan

    log = tmp_path / "calls"
    log.mkdir()

    def resolve(text: str, options: Any, **kwargs: Any) -> Location:
        loc = resolve_location(text, options, **kwargs)
        return Location(faulty_backend(loc.backend, FaultPlan(call_log=str(log))), loc.path)

    for module in (inspection, best):  # ls, show ...; best
        monkeypatch.setattr(module, "resolve_location", resolve)
    return str(log)


@pytest.mark.parametrize("command", [["best", "--metric", "loss", "--mode", "min"], ["ls"]])
def test_a_trial_is_listed_once_per_command(
    store: Store, tmp_path: Any, call_log: str, command: list[str]
) -> None:
    """Telling a trial from other directories needs no listing when it holds a
    retention state, and the restore's listing serves the search for
    checkpoints under other names: a trial of 100,000 checkpoints is listed
    once, not three times."""
    from checkpoint_store.testing.faults import read_call_log

    _trial(store, tmp_path, "t", 3)
    trial = store.join("exp", "t")
    res = invoke([command[0], trial, *command[1:], *store.opt_args(), "--json"])
    assert res.exit_code == 0, res.output
    calls = [c for per_pid in read_call_log(call_log).values() for c in per_pid]
    listings = [p.rstrip("/") for m, p in calls if m == "get_file_info_selector"]
    trial_path = resolve_location(trial, store.options).path.rstrip("/")
    assert listings.count(trial_path) == 1, listings
    if command[0] == "best":
        assert json.loads(res.stdout)["index"] == 2  # the lowest loss: the newest
