"""``prune`` and ``gc`` treat trial names literally on every backend (issue 11,
kind 2): pruning or cleaning trial ``t[x]`` never touches trial ``tx``, which
fsspec's glob reading of ``t[x]`` matches."""

from __future__ import annotations

import json
import posixpath

from cli_helpers import STAGING, Store, committed_names, get, invoke, make_trial, put

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


def _copy_by_hand(ctx, src: str, dst: str) -> None:
    """Every file under ``src`` written again under ``dst`` (a name no
    session would take), as ``cp -r`` would."""
    for rel, _ in list(_fsutil.walk_files(ctx.filesystem, src)):
        put(ctx, posixpath.join(dst, rel), get(ctx, posixpath.join(src, rel)))


def test_ls_tells_names_apart_that_differ_only_in_what_does_not_show(store: Store,
                                                                      tmp_path) -> None:
    """Trials ``t1`` and ``t1 `` printed as the same name, and a name holding
    ESC reached the terminal raw (a name on shared storage could clear the
    screen or recolour the lines after it). A cell with leading or trailing
    whitespace or a control character is now printed quoted and escaped; the
    JSON keeps every name exactly."""
    # On Azure (adlfs on Azurite) a prefix ending in a space lists as empty,
    # and a blob name holding ESC fails every listing of its container: the
    # plain names only, which must print unchanged.
    azure = store.uri.startswith(("az://", "abfs://"))
    names = ["t1", "my trial"] if azure else ["t1", "t1 ", "my trial"]
    for name in names:
        make_trial(store, tmp_path, [0.1], trial=name)
    # A session refuses a control character in a name; a hand copy does not.
    escaped = "t\x1b[2Jx"
    if not azure:
        names.append(escaped)
        src = make_trial(store, tmp_path, [0.1], trial="esc")
        _copy_by_hand(src, src.trial_path,
                      posixpath.join(posixpath.dirname(src.trial_path), escaped))
        _fsutil.delete_dir(src.filesystem, src.trial_path)
    res = invoke(["ls", store.join("exp"), *store.opt_args()])
    assert res.exit_code == 0, res.output
    assert "\x1b" not in res.stdout
    firsts = [row.split("  ")[0].rstrip() for row in res.stdout.splitlines()[1:]]
    printed = {"t1": "t1", "my trial": "my trial", "t1 ": "'t1 '", escaped: "'t\\x1b[2Jx'"}
    assert sorted(firsts) == sorted(printed[n] for n in names)
    data = json.loads(invoke(["ls", store.join("exp"), *store.opt_args(), "--json"]).stdout)
    assert sorted(t["name"] for t in data["trials"]) == sorted(names)
    # The trial's own listing names its checkpoints; one named with ESC is
    # refused, the character escaped in the message.
    if azure:
        return
    res = invoke(["ls", store.join("exp", "t1 "), *store.opt_args()])
    assert res.exit_code == 0 and "checkpoint_000000" in res.stdout, res.output
    res = invoke(["ls", store.join("exp", escaped), *store.opt_args()])
    assert res.exit_code == 2 and "\x1b" not in res.output, res.output
    assert "control character '\\x1b'" in res.output
    # A hand copy of a checkpoint under such a name is invalid: the notes of
    # ls and best name it escaped too.
    t1 = store.ctx("exp", "t1")
    _copy_by_hand(t1, posixpath.join(t1.trial_path, "checkpoint_000000"),
                  posixpath.join(t1.trial_path, "b\x1b[2Jk"))
    for args in (["ls"], ["best", "--metric", "loss", "--mode", "min"]):
        res = invoke([*args, store.join("exp", "t1"), *store.opt_args()])
        assert res.exit_code == 0, res.output
        assert "\x1b" not in res.output and repr("b\x1b[2Jk") in res.output, res.output
