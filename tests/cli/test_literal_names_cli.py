"""``prune`` and ``gc`` treat trial names literally on every backend (issue 11,
kind 2): pruning or cleaning trial ``t[x]`` never touches trial ``tx``, which
fsspec's glob reading of ``t[x]`` matches."""

from __future__ import annotations

import json
import posixpath

from cli_helpers import STAGING, Store, committed_names, invoke, make_trial

from checkpoint_store._util import fs as _fsutil


def test_prune_of_a_bracketed_trial_keeps_its_neighbour(store: Store, tmp_path) -> None:
    tx = make_trial(store, tmp_path, [0.3, 0.2, 0.1], trial="tx")
    bracketed = make_trial(store, tmp_path, [0.5, 0.4, 0.6], trial="t[x]")
    res = invoke(["prune", store.join("exp", "t[x]"), *store.opt_args(), "--keep", "1",
                  "--metric", "loss", "--mode", "min", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [d["index"] for d in data["deleted"]] == [0]
    assert committed_names(bracketed) == ["checkpoint_000001", "checkpoint_000002"]
    assert committed_names(tx) == [f"checkpoint_{i:06d}" for i in range(3)]
    assert [n for _, n in tx.checkpoint_dirs()] == [f"checkpoint_{i:06d}" for i in range(3)]


def test_gc_of_a_starred_trial_removes_only_its_own_leftovers(store: Store, tmp_path) -> None:
    neighbour = make_trial(store, tmp_path, [0.1], trial="ta", staging=True)
    starred = make_trial(store, tmp_path, [0.1], trial="t*", staging=True)
    res = invoke(["gc", store.join("exp", "t*"), *store.opt_args(), "--min-age", "0", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["removed"] == [STAGING]
    assert not _fsutil.exists(starred.filesystem, posixpath.join(starred.trial_path, STAGING))
    assert _fsutil.exists(neighbour.filesystem,
                          posixpath.join(neighbour.trial_path, STAGING, "model.bin"))
    assert committed_names(neighbour) == committed_names(starred) == ["checkpoint_000000"]
