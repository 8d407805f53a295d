"""Retention policies (BestN, LatestN, EveryNSteps, EveryNSeconds, Steps, AnyOf, callables):
the issue's values on every backend, the stored form, bad input, and a property against a
brute-force oracle."""

from __future__ import annotations

import itertools
import json
import os
import posixpath

import pytest
from _retention_helpers import committed_names, save
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_store import (
    AmbiguousMetricError,
    Checkpoint,
    CheckpointConfig,
    CheckpointManager,
    InvalidConfigError,
)
from checkpoint_store.retention import (
    AnyOf,
    BestN,
    CheckpointRecord,
    EveryNSeconds,
    EveryNSteps,
    LatestN,
    PolicyCheckpoint,
    Steps,
    UnstoredPolicy,
    evaluate,
    explain_kept,
    lookup_metric,
    select_kept,
)

LOSSES = [5, 4, 6, 3, 7, 8, 2, 9, 9, 9]
ISSUE_POLICY = AnyOf(BestN(2, "loss", "min"), EveryNSteps(4))


def _step_records(losses):
    return [
        CheckpointRecord(
            step - 1, f"checkpoint_{step - 1:06d}", {"loss": loss, "training_iteration": step}
        )
        for step, loss in enumerate(losses, start=1)
    ]


def _steps(records):
    return {r.metrics["training_iteration"] for r in records}


# -- the issue's values ----------------------------------------------------------------


def test_issue_union_pure():
    kept, evicted = select_kept(_step_records(LOSSES), CheckpointConfig(policy=ISSUE_POLICY))
    assert _steps(kept) == {4, 7, 8, 10}
    assert _steps(evicted) == {1, 2, 3, 5, 6, 9}


def test_issue_union_manager_on_every_backend(make_storage, source_dir):
    storage = make_storage()
    with CheckpointManager(CheckpointConfig(policy=ISSUE_POLICY), storage) as m:
        for step, loss in enumerate(LOSSES, start=1):
            save(m, storage, source_dir, {"loss": loss, "training_iteration": step})
        kept = {m_["training_iteration"] for _, m_ in m.best_checkpoints}
        assert kept == {4, 7, 8, 10}
        assert m.best_checkpoint.path.endswith("checkpoint_000006")  # loss 2 at step 7
    assert committed_names(storage) == [f"checkpoint_{s - 1:06d}" for s in (4, 7, 8, 10)]
    # A new manager (a restart) re-evaluates the stored policy to the same set.
    with CheckpointManager(CheckpointConfig(policy=ISSUE_POLICY), make_storage()) as again:
        assert again.kept_dir_names == committed_names(storage)


def test_every_n_seconds_issue_values():
    times = [0, 1000, 3700, 3800, 7300]
    records = [
        CheckpointRecord(i, f"checkpoint_{i:06d}", {}, created_at=t) for i, t in enumerate(times)
    ]
    kept, _ = select_kept(records, CheckpointConfig(policy=EveryNSeconds(3600)))
    assert {r.created_at for r in kept} == {0, 3700, 7300}
    kept, _ = select_kept(records, CheckpointConfig(policy=EveryNSeconds(3600), keep_latest=False))
    assert {r.created_at for r in kept} == {0, 3700, 7300}  # 7300 on its own merit


def test_every_n_seconds_manager_reads_created_at(make_storage, source_dir):
    storage = make_storage()
    config = CheckpointConfig(policy=EveryNSeconds(3600), keep_latest=False)
    with CheckpointManager(config, storage) as m:
        for i, t in enumerate([0, 1000, 3700, 3800, 7300, 7400]):
            ckpt = storage.persist_checkpoint(
                Checkpoint(source_dir), i, {"metrics": {}, "run_id": m.run_id, "created_at": t}
            )
            m.register(ckpt, {})
    assert committed_names(storage) == [
        "checkpoint_000000",
        "checkpoint_000002",
        "checkpoint_000004",
    ]


def test_shorthand_is_best_n_plus_latest():
    records = _step_records(LOSSES)
    for k, keep_latest in itertools.product((1, 2, 3), (True, False)):
        short = CheckpointConfig(k, "loss", "min", keep_latest=keep_latest)
        spelled = CheckpointConfig(policy=BestN(k, "loss", "min"), keep_latest=keep_latest)
        assert select_kept(records, short) == select_kept(records, spelled)
        assert short.effective_policy() == (
            AnyOf(BestN(k, "loss", "min"), LatestN(1)) if keep_latest else BestN(k, "loss", "min")
        )


def test_latest_n_steps_and_callable():
    records = _step_records(LOSSES)
    assert _steps(select_kept(records, CheckpointConfig(policy=LatestN(3)))[0]) == {8, 9, 10}
    cfg = CheckpointConfig(policy=Steps([2, 5]), keep_latest=False)
    assert _steps(select_kept(records, cfg)[0]) == {2, 5}

    def odd_indexes(cps):
        return [c.index for c in cps if c.index % 2]

    cfg = CheckpointConfig(policy=odd_indexes, keep_latest=False)
    assert _steps(select_kept(records, cfg)[0]) == {2, 4, 6, 8, 10}


def test_explain_names_the_keeping_policies():
    _, _, why = explain_kept(_step_records(LOSSES), CheckpointConfig(policy=ISSUE_POLICY))
    assert why == {
        "checkpoint_000003": ("BestN(2, 'loss', 'min')", "EveryNSteps(4)"),
        "checkpoint_000006": ("BestN(2, 'loss', 'min')",),
        "checkpoint_000007": ("EveryNSteps(4)",),
        "checkpoint_000009": ("LatestN(1)",),
    }


# -- the stored form ---------------------------------------------------------------------


def test_policy_json_round_trip():
    policy = AnyOf(
        BestN(3, "eval/loss", "min", "keep"),
        LatestN(2),
        EveryNSteps(10, "step"),
        EveryNSeconds(3600.5),
        Steps([1, 100]),
    )
    cfg = CheckpointConfig(policy=policy)
    assert CheckpointConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


def test_callable_is_stored_by_name_and_read_back_keeping_everything(make_storage, source_dir):
    def only_first(cps):
        return [min(c.index for c in cps)] if cps else []

    storage = make_storage()
    cfg = CheckpointConfig(policy=only_first, keep_latest=False)
    with CheckpointManager(cfg, storage) as m:
        for i in range(3):
            save(m, storage, source_dir, {"i": i})
    assert committed_names(storage) == ["checkpoint_000000"]
    state = json.loads(
        storage.filesystem.open_input_stream(
            posixpath.join(storage.trial_path, ".checkpoint_manager.json")
        ).read()
    )
    assert state["config"]["policy"]["type"] == "Custom"
    assert "only_first" in state["config"]["policy"]["name"]
    back = CheckpointConfig.from_json(state["config"])
    assert isinstance(back.policy, UnstoredPolicy)
    recs = [CheckpointRecord(i, f"c{i}", {}) for i in range(4)]
    assert len(select_kept(recs, back)[0]) == 4  # cannot run the rule: deletes nothing


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: EveryNSteps(0),
        lambda: EveryNSteps(-2),
        lambda: EveryNSteps(2.5),
        lambda: EveryNSeconds(-1),
        lambda: EveryNSeconds(0),
        lambda: EveryNSeconds(float("nan")),
        lambda: LatestN(0),
        lambda: BestN(0, "loss"),
        lambda: BestN(1, "loss", "down"),
        lambda: Steps([-1]),
        lambda: Steps(3),
        lambda: EveryNSteps(2, step_key=""),
        lambda: AnyOf(),
        lambda: CheckpointConfig(policy=42),
        lambda: CheckpointConfig(policy=object()),
        lambda: CheckpointConfig(policy=lambda cps: None),
        lambda: CheckpointConfig(policy=lambda cps: "0"),
        lambda: CheckpointConfig(2, policy=LatestN(1)),
    ],
)
def test_bad_policies_are_refused(make):
    with pytest.raises(InvalidConfigError):
        make()


@pytest.mark.parametrize(
    "answer",
    [
        lambda cps: [c.dir_name for c in cps],  # names, not indexes
        lambda cps: [10**6] if cps else [],  # an index it was not given
        lambda cps: None if cps else [],  # not a collection
    ],
)
def test_bad_answer_refused_before_anything_is_written(make_storage, source_dir, answer):
    from checkpoint_store import session

    storage = make_storage()
    with session.start(
        storage_path=storage.storage_path,
        storage_filesystem=storage.filesystem,
        experiment_name=storage.experiment_name,
        trial_name=storage.trial_name,
        checkpoint_config=CheckpointConfig(policy=answer),
    ):
        with pytest.raises(InvalidConfigError, match="retention policy"):
            session.report({"x": 1}, checkpoint=Checkpoint(source_dir))
    assert committed_names(storage) == []
    assert storage.checkpoint_dirs() == []


# -- lookup (Ray's rule) -----------------------------------------------------------------


def test_lookup_literal_then_flattened():
    assert lookup_metric({"nested": {"sub/attr": 5}}, "nested/sub/attr") == 5
    assert lookup_metric({"nested/sub": {"attr": 5}}, "nested/sub/attr") == 5
    assert lookup_metric({"nested": {"sub": {"attr": 5}}}, "nested/sub/attr") == 5
    assert lookup_metric({"a/b": 1, "a": {"b": 2}}, "a/b") == 1  # the literal key wins
    # The same value under two paths is no ambiguity.
    assert lookup_metric({"a": {"b/c": 3}, "a/b": {"c": 3}}, "a/b/c") == 3


def test_lookup_ambiguity_names_both_paths():
    with pytest.raises(AmbiguousMetricError) as err:
        lookup_metric({"a": {"b/c": 1}, "a/b": {"c": 2}}, "a/b/c")
    assert "metrics['a']['b/c']" in str(err.value)
    assert "metrics['a/b']['c']" in str(err.value)
    with pytest.raises(InvalidConfigError):  # a report under such metrics is refused
        select_kept(
            [(0, "c0", {"a": {"b": {"c": 1}}, "a/b": {"c": 2}})], CheckpointConfig(1, "a/b/c")
        )


# -- property: a brute-force oracle ------------------------------------------------------


def _oracle(policy_parts, keep_latest, cps):
    """Straight from the definitions, one rule at a time."""
    by_step = {c.index: c.metrics["training_iteration"] for c in cps}
    keep = set()
    for kind, arg in policy_parts:
        if kind == "best":
            scored = sorted(cps, key=lambda c: (c.metrics["loss"], -c.index))
            keep |= {c.index for c in scored[:arg]}
        elif kind == "latest":
            keep |= set(sorted(by_step)[-arg:])
        elif kind == "every":
            keep |= {i for i, s in by_step.items() if s % arg == 0}
        elif kind == "steps":
            keep |= {i for i, s in by_step.items() if s in arg}
        elif kind == "seconds":
            last = None
            for c in sorted(cps, key=lambda c: c.index):
                if last is None or c.created_at >= last + arg:
                    keep.add(c.index)
                    last = c.created_at
    if keep_latest and cps:
        keep.add(max(by_step))
    return keep


_PART = st.one_of(
    st.tuples(st.just("best"), st.integers(1, 4)),
    st.tuples(st.just("latest"), st.integers(1, 3)),
    st.tuples(st.just("every"), st.integers(1, 5)),
    st.tuples(st.just("steps"), st.frozensets(st.integers(1, 12), max_size=4)),
    st.tuples(st.just("seconds"), st.integers(1, 50)),
)


def _policy(kind, arg):
    return {
        "best": lambda: BestN(arg, "loss", "min"),
        "latest": lambda: LatestN(arg),
        "every": lambda: EveryNSteps(arg),
        "steps": lambda: Steps(sorted(arg)),
        "seconds": lambda: EveryNSeconds(arg),
    }[kind]()


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, database=None)
@given(
    parts=st.lists(_PART, min_size=1, max_size=4),
    keep_latest=st.booleans(),
    losses=st.lists(st.integers(0, 5), min_size=0, max_size=12),
    gaps=st.lists(st.integers(0, 30), min_size=12, max_size=12),
    data=st.data(),
)
def test_policies_match_oracle_in_any_order(parts, keep_latest, losses, gaps, data):
    times = list(itertools.accumulate(gaps))
    cps = [
        PolicyCheckpoint(
            i, f"checkpoint_{i:06d}", {"loss": loss, "training_iteration": i + 1}, float(times[i])
        )
        for i, loss in enumerate(losses)
    ]
    config = CheckpointConfig(
        policy=AnyOf(*(_policy(k, a) for k, a in parts)), keep_latest=keep_latest
    )
    want = _oracle(parts, keep_latest, cps)
    shuffled = data.draw(st.permutations(cps))
    records = [CheckpointRecord(c.index, c.dir_name, c.metrics, c.created_at) for c in shuffled]
    kept, evicted = select_kept(records, config)
    assert {r.index for r in kept} == want
    assert set(evaluate(config.effective_policy(), shuffled)) == want
    assert {r.index for r in kept} | {r.index for r in evicted} == {c.index for c in cps}
    if keep_latest and cps:
        assert len(cps) - 1 in want
    # The manager's incremental form, registering in index order, agrees.
    from checkpoint_store.retention.selection import Entry, Selection

    sel = Selection(config)
    for c in cps:
        sel.add(Entry(c.index, c.dir_name, None, c.metrics, c.created_at))
    assert {e.index for e in sel.ordered()} == want
    if all(kind != "seconds" for kind, _ in parts):
        # Every other shipped policy never takes back an eviction: any order agrees.
        sel = Selection(config)
        for c in shuffled:
            sel.add(Entry(c.index, c.dir_name, None, c.metrics, c.created_at))
        assert {e.index for e in sel.ordered()} == want


def test_nothing_left_in_cwd():
    assert not os.path.exists("checkpoint_000000")
