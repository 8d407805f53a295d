"""Scores and the pure selection (``select_kept``): lookups, NaN/inf/missing
policies, ties, order independence, bounded memory."""

from __future__ import annotations

import itertools
import math
import tracemalloc
import warnings

import pytest
from _retention_helpers import committed_names, save
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointManager,
    InvalidConfigError,
    StorageContext,
    session,
)
from checkpoint_store.retention import CheckpointRecord, score_of, select_kept
from checkpoint_store.retention.selection import Entry, Selection
from checkpoint_store.testing import strategies as cst
from checkpoint_store.testing.stateful import RetentionModel

NAN, INF = math.nan, math.inf


def _recs(values, attr="score"):
    return [(i, f"checkpoint_{i:06d}", {} if v is None else {attr: v})
            for i, v in enumerate(values)]


def _kept_values(values, cfg, attr="score"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        kept, _ = select_kept(_recs(values, attr), cfg)
    return [values[r.index] for r in kept]


# -- the issue's values, without storage --------------------------------------------------


def test_issue_values_pure():
    assert _kept_values([3, 1, 2], CheckpointConfig(1, "score", "max")) == [3, 2]
    assert _kept_values([3, 1, 2], CheckpointConfig(1, "score", "max", keep_latest=False)) == [3]
    assert _kept_values([0.1, 0.2, 0.3, 0.4, 0.5],
                        CheckpointConfig(2, "score", "min")) == [0.1, 0.2, 0.5]
    assert _kept_values([NAN, NAN, 1.0, 2.0], CheckpointConfig(2, "score", "max")) == [1.0, 2.0]


def test_every_permutation_keeps_the_same_two_best():
    cfg = CheckpointConfig(2, "score", "max", keep_latest=False)
    for perm in itertools.permutations([NAN, 0.5, 0.7, 0.6]):
        assert sorted(_kept_values(list(perm), cfg)) == [0.6, 0.7], perm
        with_latest = _kept_values(list(perm), CheckpointConfig(2, "score", "max"))
        extra = 0 if perm[-1] in (0.7, 0.6) else 1
        assert len(with_latest) == 2 + extra, perm


def test_returns_records_and_evicted_in_index_order():
    kept, evicted = select_kept(
        [CheckpointRecord(2, "c2", {"s": 1}), (0, "c0", {"s": 3}), (1, "c1", {"s": 2})],
        CheckpointConfig(1, "s", "max"),
    )
    assert [r.dir_name for r in kept] == ["c0", "c2"]
    assert [r.dir_name for r in evicted] == ["c1"]
    assert isinstance(kept[0], CheckpointRecord) and kept[0].metrics == {"s": 3}


def test_malformed_records_are_refused():
    with pytest.raises(InvalidConfigError, match="records must be"):
        select_kept([("only-two", {})], CheckpointConfig(1))
    with pytest.raises(InvalidConfigError, match="index must be an int"):
        select_kept([("0", "c0", {})], CheckpointConfig(1))
    with pytest.raises(InvalidConfigError, match="CheckpointConfig"):
        select_kept([], {"num_to_keep": 1})


# -- scores -----------------------------------------------------------------------------------


def test_literal_key_first_then_nested_path():
    assert score_of({"a/b": 1, "a": {"b": 2}}, "a/b") == 1.0
    assert score_of({"a": {"b": 2}}, "a/b") == 2.0
    assert score_of({"a": {"b": {"c": 3}}}, "a/b/c") == 3.0
    assert score_of({"a": {"x": 2}}, "a/b") is None
    assert score_of({"a": 5}, "a/b") is None
    assert score_of({"a": None}, "a") is None
    assert score_of({"a": NAN}, "a") is None
    assert score_of({"a": INF}, "a") == INF


@pytest.mark.parametrize("value", ["0.5", [1.0], True, False, {"x": 1}, b"1"])
def test_non_numeric_scores_raise(value):
    with pytest.raises(InvalidConfigError, match="'acc'.*scores must be numbers"):
        score_of({"acc": value}, "acc")


def test_numpy_scores_are_numbers():
    np = pytest.importorskip("numpy")
    assert score_of({"a": np.float32(0.5)}, "a") == 0.5
    assert score_of({"a": np.int64(3)}, "a") == 3.0
    assert score_of({"a": np.float64("nan")}, "a") is None


@pytest.mark.parametrize("backend_name", ["local", "memory"])
def test_non_numeric_score_raises_at_register_and_deletes_nothing(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(1, "acc", "max", keep_latest=False), storage)
    save(m, storage, source_dir, {"acc": 0.5})
    bad = storage.persist_checkpoint(Checkpoint(source_dir), 1, {"run_id": m.run_id})
    with pytest.raises(InvalidConfigError, match="'acc'"):
        m.register(bad, {"acc": "high"})
    assert m.kept_dir_names == ["checkpoint_000000"]
    assert "checkpoint_000000" in committed_names(storage)
    m.close()


def test_session_refuses_a_bad_score_before_uploading(tmp_path, source_dir):
    cfg = CheckpointConfig(2, "acc", "max", missing_score="raise")
    with session.start(storage_path=str(tmp_path), experiment_name="e", trial_name="t",
                       checkpoint_config=cfg) as s:
        session.report({"acc": 0.1}, checkpoint=Checkpoint.from_directory(source_dir))
        for bad in ({"acc": "high"}, {"acc": NAN}, {"loss": 1.0}):
            with pytest.raises(InvalidConfigError):
                session.report(bad, checkpoint=Checkpoint.from_directory(source_dir))
        row = session.report({"acc": 0.2}, checkpoint=Checkpoint.from_directory(source_dir))
        assert row["training_iteration"] == 2
        assert row["checkpoint_dir_name"] == "checkpoint_000001"
        assert s.manager.kept_dir_names == ["checkpoint_000000", "checkpoint_000001"]
    storage = StorageContext(str(tmp_path), "e", "t")
    assert [n for _, n in storage.checkpoint_dirs()] == ["checkpoint_000000", "checkpoint_000001"]
    assert len(storage.read_results()) == 2


# -- NaN, missing, inf, ties ---------------------------------------------------------------------


@pytest.mark.parametrize("order", ["max", "min"])
def test_nan_and_missing_are_never_best(order):
    for values in ([NAN, 5.0], [5.0, NAN], [None, 5.0], [5.0, None], [NAN, None, -INF]):
        cfg = CheckpointConfig(1, "score", order, keep_latest=False)
        kept = _kept_values(values, cfg)
        assert len(kept) == 1 and kept[0] is not None and not math.isnan(kept[0]), values


def test_infinities_rank_as_numbers():
    assert _kept_values([INF, NAN, -INF, 1.0],
                        CheckpointConfig(1, "score", "max", keep_latest=False)) == [INF]
    assert _kept_values([INF, NAN, -INF, 1.0],
                        CheckpointConfig(1, "score", "min", keep_latest=False)) == [-INF]
    # -inf in max order is still better than NaN.
    assert _kept_values([NAN, -INF], CheckpointConfig(1, "score", "max", keep_latest=False)) == [
        -INF]


def test_ties_go_to_the_newer_checkpoint():
    kept, _ = select_kept(_recs([1.0, 1.0, 1.0, 0.5]),
                          CheckpointConfig(2, "score", "max", keep_latest=False))
    assert [r.index for r in kept] == [1, 2]
    # NaN and missing tie with each other: the newest of them survives.
    with pytest.warns(RuntimeWarning, match="missing or NaN"):
        kept, _ = select_kept(_recs([NAN, None, NAN]),
                              CheckpointConfig(1, "score", "max", keep_latest=False))
    assert [r.index for r in kept] == [2]


def test_missing_policy_keep_never_evicts_missing():
    cfg = CheckpointConfig(1, "score", "max", keep_latest=False, missing_score="keep")
    kept, evicted = select_kept(_recs([NAN, 1.0, None, 2.0, 3.0]), cfg)
    assert [r.index for r in kept] == [0, 2, 4]
    assert [r.index for r in evicted] == [1, 3]


def test_missing_policy_raise():
    cfg = CheckpointConfig(1, "score", "max", missing_score="raise")
    with pytest.raises(InvalidConfigError, match="missing_score='raise'"):
        select_kept(_recs([1.0, NAN]), cfg)
    with pytest.raises(InvalidConfigError, match="missing or NaN"):
        select_kept(_recs([None]), cfg)


@pytest.mark.parametrize("backend_name", ["local"])
def test_worst_policy_warns_once_per_attribute(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(3, "score", "max"), storage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for v in [NAN, None, NAN, 1.0]:
            save(m, storage, source_dir, {} if v is None else {"score": v})
    mine = [w for w in caught if "checkpoint_score_attribute" in str(w.message)]
    assert len(mine) == 1
    assert "'score'" in str(mine[0].message)
    m.close()


# -- properties --------------------------------------------------------------------------------


@settings(max_examples=500, deadline=None)
@given(cfg=cst.checkpoint_configs(attributes=("score", None)),
       values=st.lists(cst.scores(), max_size=12), data=st.data())
def test_select_kept_matches_the_model_in_any_order(cfg, values, data):
    model = RetentionModel(cfg)
    for i, v in enumerate(values):
        model.add(i, None if v is None or math.isnan(float(v)) else float(v))
    recs = _recs(values)
    shuffled = data.draw(st.permutations(recs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        kept, evicted = select_kept(shuffled, cfg)
    assert [r.index for r in kept] == model.kept()
    assert sorted(r.index for r in kept + evicted) == list(range(len(values)))


@settings(max_examples=40, deadline=None)
@given(m=cst.metrics())
def test_score_of_never_crashes_unexpectedly(m):
    for key in list(m)[:3]:
        try:
            s = score_of(m, key)
        except InvalidConfigError:
            continue
        assert s is None or isinstance(s, float)


# -- bounded memory --------------------------------------------------------------------------------


def test_selection_memory_is_flat():
    sel = Selection(CheckpointConfig(3, "score", "max"))
    metrics = {"score": 0.0}

    def run(n, start):
        for i in range(start, start + n):
            sel.add(Entry(i, f"checkpoint_{i:06d}", float((i * 7919) % 1000), metrics))

    run(1000, 0)
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    run(20_000, 1000)
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(sel.kept) <= 4
    assert current - base < 16 * 1024, current - base


@pytest.mark.parametrize("backend_name", ["memory"])
def test_manager_state_stays_small(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(3, "score", "max"), storage)
    sizes = []
    for i in range(120):
        save(m, storage, source_dir, {"score": float((i * 37) % 101)})
        if i in (20, 119):
            sizes.append(len(storage.filesystem.open_input_stream(m.state_path).read()))
    assert len(m.kept_dir_names) <= 4 and len(committed_names(storage)) <= 4
    assert sizes[1] <= sizes[0] * 1.2
    m.close()
