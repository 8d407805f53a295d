"""A pointer file (`.cs_current`) that names no replacement of its directory
(written by hand or by another tool) is one corrupt entry, never a failure of
everything around it.

It made `ls`, `verify`, `best`, `prune`, `gc` and `cp` of its trial, its
experiment and its storage root exit 1 without looking at anything else (a
backup with `cp` copied nothing), and every later `session.start` of the trial
logged a failed cleanup.
"""

from __future__ import annotations

import json
import logging
import posixpath

from cli_helpers import Store, committed_names, invoke, make_trial, put

from checkpoint_store import session
from checkpoint_store._commit.pointer import POINTER_FILE


def _spoiled(store: Store, tmp_path) -> tuple[object, str]:
    ctx = make_trial(store, tmp_path, [0.5, 0.2, 0.4])
    put(ctx, posixpath.join(ctx.trial_path, "foo", POINTER_FILE), b"garbage\n")
    return ctx, store.join("exp", "t1")


def test_a_bad_pointer_is_named_and_the_rest_still_served(every_store, tmp_path):
    ctx, trial = _spoiled(every_store, tmp_path)
    opts = every_store.opt_args()
    good = ["checkpoint_000000", "checkpoint_000001", "checkpoint_000002"]
    res = invoke(["ls", trial, "--json", *opts])
    assert res.exit_code == 0, res.output
    listed = json.loads(res.stdout)
    assert [c["name"] for c in listed["checkpoints"]] == good
    assert [c["name"] for c in listed["corrupt"]] == ["foo"]
    assert listed["corrupt"][0]["file"] == POINTER_FILE
    for where in (trial, every_store.join("exp"), every_store.uri):
        res = invoke(["verify", where, "--json", *opts])
        assert res.exit_code == 1, res.output
        rows = {r["uri"].rsplit("/", 1)[-1]: r["ok"] for r in json.loads(res.stdout)["checkpoints"]}
        assert rows == {**dict.fromkeys(good, True), "foo": False}, rows
    res = invoke(["best", trial, "--metric", "loss", "--mode", "min", *opts])
    assert res.exit_code == 0 and res.stdout.splitlines()[0].endswith("checkpoint_000001")
    res = invoke(["gc", trial, "--min-age", "0", *opts])
    assert res.exit_code == 0, res.output
    assert "foreign" in res.output and "/foo" in res.output
    res = invoke(["prune", trial, "--keep", "1", "--metric", "loss", "--mode", "min", *opts])
    assert res.exit_code == 0, res.output
    assert committed_names(ctx) == ["checkpoint_000001", "checkpoint_000002"]
    # A backup copies every good checkpoint, then exits 1 naming the bad entry.
    dst = every_store.join("backup")
    res = invoke(["cp", every_store.uri + "/exp", dst + "/exp", *opts])
    assert res.exit_code == 1 and "/foo" in res.stderr, res.output
    res = invoke(["ls", dst + "/exp/t1", "--json", *opts])
    assert [c["name"] for c in json.loads(res.stdout)["checkpoints"]] == committed_names(ctx)


def test_session_start_cleans_up_beside_a_bad_pointer(near_store, tmp_path, caplog):
    _, _ = _spoiled(near_store, tmp_path)
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        with session.start(storage_path=near_store.uri, experiment_name="exp", trial_name="t1"):
            assert session.get_checkpoint().path.endswith("checkpoint_000002")
    assert not [r for r in caplog.records if "cleanup" in r.getMessage()], caplog.text
