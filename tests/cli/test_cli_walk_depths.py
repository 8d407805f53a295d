"""A walk of a storage root never passes over trials in silence.

A location is read as an experiment when one of its directories looks like a
trial. A storage root holding one stray trial beside its experiments (a run
started with another ``storage_path``) was read so: ``cp ROOT DST`` copied the
stray trial alone and exited 0, ``verify ROOT`` checked it alone and passed,
``ls`` and the page showed it alone. A stray ``params.json`` in an experiment
directory did the same to a root. The directories a walk does not reach are
now named: ``cp`` and ``verify`` exit 1, ``ls`` warns, the page's overview
lists them under ``not_walked``, ``Experiment`` warns.
"""

from __future__ import annotations

import json
import posixpath

import pytest
from cli_helpers import Store, invoke, make_trial, put

from checkpoint_store import Experiment
from checkpoint_store.ui._model import StoreView


def _parent(store: Store) -> tuple[Store, str]:
    """The store one level up, and the root's name in it."""
    up, name = store.uri.rstrip("/").rsplit("/", 1)
    return Store(up, store.options), name


def _root_with_a_stray_trial(store: Store, tmp_path) -> None:
    make_trial(store, tmp_path, [0.5, 0.4], experiment="exp", trial="t1")
    make_trial(store, tmp_path, [0.3], experiment="exp2", trial="t2")
    up, name = _parent(store)
    make_trial(up, tmp_path, [0.9], experiment=name, trial="stray")


def test_cp_and_verify_of_a_root_name_what_a_stray_trial_hid(store: Store, tmp_path) -> None:
    _root_with_a_stray_trial(store, tmp_path)
    opts = store.opt_args()
    dst = tmp_path / "backup"
    res = invoke(["cp", store.uri, str(dst), *opts])
    assert res.exit_code == 1, res.output
    assert "/exp," in res.stderr and "/exp2;" in res.stderr and "not walked" in res.stderr
    res = invoke(["verify", store.uri, "--json", *opts])
    assert res.exit_code == 1, res.output
    assert [u.rsplit("/", 1)[1] for u in json.loads(res.stdout)["not_walked"]] == [
        "exp", "exp2"]
    res = invoke(["ls", store.uri, *opts])
    assert res.exit_code == 0, res.output
    assert "stray" in res.stdout and "/exp2;" in res.stderr


@pytest.mark.parametrize("stray", ["params.json", "result.json"])
def test_a_stray_trial_file_in_an_experiment_is_named_by_every_reader(near_store: Store,
                                                                    tmp_path,
                                                                    stray: str) -> None:
    ctx = make_trial(near_store, tmp_path, [0.5], experiment="exp", trial="t1")
    make_trial(near_store, tmp_path, [0.3], experiment="exp2", trial="t2")
    # A sweep-level file where only a trial keeps one: `exp` reads as a trial now.
    put(ctx, posixpath.join(posixpath.dirname(ctx.trial_path), stray), b'{"lr": 0.1}')
    res = invoke(["verify", near_store.uri])
    assert res.exit_code == 1, res.output
    assert "/exp2;" in res.output and "not walked" in res.output
    res = invoke(["cp", near_store.uri, str(tmp_path / "backup")])
    assert res.exit_code == 1 and "/exp2;" in res.stderr, res.output
    view = StoreView(near_store.uri, {})
    assert [u.rsplit("/", 1)[1] for u in view.overview()["not_walked"]] == ["exp2"]
    with pytest.warns(UserWarning, match="not walked"):
        Experiment(near_store.uri)
