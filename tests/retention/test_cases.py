"""The retention cases of issues 2 and 5, with the right values given, on local,
memory and S3 storage."""

from __future__ import annotations

import itertools
import math
import posixpath
import warnings

import pytest
from _retention_helpers import committed_names, save, scores_of

from checkpoint_store import CheckpointConfig, CheckpointManager, InvalidConfigError

NAN = math.nan


def _run(make_storage, source_dir, cfg, values, attr="score"):
    storage = make_storage()
    m = CheckpointManager(cfg, storage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for v in values:
            save(m, storage, source_dir, {attr: v})
    return m, storage


def _kept_values(m, attr="score"):
    return scores_of(m, attr)


def _name(ckpt):
    return posixpath.basename(ckpt.path)


def test_k1_max_keeps_best_and_latest(make_storage, source_dir):
    m, storage = _run(make_storage, source_dir,
                      CheckpointConfig(1, "score", "max"), [3, 1, 2])
    assert _kept_values(m) == [3, 2]
    assert committed_names(storage) == m.kept_dir_names
    m.close()


def test_k1_max_without_keep_latest_keeps_exactly_k(make_storage, source_dir):
    m, storage = _run(make_storage, source_dir,
                      CheckpointConfig(1, "score", "max", keep_latest=False), [3, 1, 2])
    assert _kept_values(m) == [3]
    assert committed_names(storage) == m.kept_dir_names
    # The latest was evicted: it is never handed out.
    assert _name(m.latest_checkpoint) == m.kept_dir_names[0]
    m.close()


def test_k2_max_nan_goes_first(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(2, "score", "max"), storage)
    evictions = []
    with pytest.warns(RuntimeWarning, match="missing or NaN"):
        for v in [NAN, 0.5, 0.7, 0.6]:
            name = save(m, storage, source_dir, {"score": v})
            evictions.append((name, set(committed_names(storage))))
    assert _kept_values(m) == [0.7, 0.6]
    # The first checkpoint to go is the NaN one (index 0), at the third report.
    assert "checkpoint_000000" not in evictions[2][1]
    assert {"checkpoint_000001", "checkpoint_000002"} <= evictions[2][1]
    m.close()


def test_k2_max_every_permutation_keeps_the_same_two_best(make_storage, source_dir, backend_name):
    values = [NAN, 0.5, 0.7, 0.6]
    perms = list(itertools.permutations(values))
    if backend_name == "s3":
        perms = perms[::12]  # 2 of 24 orders (all 24 run locally and in test_select)
    for i, perm in enumerate(perms):
        storage = make_storage(trial=f"perm{i}")
        m = CheckpointManager(CheckpointConfig(2, "score", "max"), storage)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for v in perm:
                save(m, storage, source_dir, {"score": v})
        best_two = [met["score"] for _, met in m.best_checkpoints[:2]]
        assert best_two == [0.7, 0.6], perm
        kept = _kept_values(m)
        # Only the latest may be added to the two best.
        last = perm[-1]
        extra = [] if last in (0.7, 0.6) else [last]
        assert sorted(map(str, kept)) == sorted(map(str, [0.7, 0.6, *extra])), perm
        assert committed_names(storage) == m.kept_dir_names
        m.close()


def test_k2_min_worsening_scores_keep_latest(make_storage, source_dir):
    m, storage = _run(make_storage, source_dir, CheckpointConfig(2, "score", "min"),
                      [0.1, 0.2, 0.3, 0.4, 0.5])
    assert _kept_values(m) == [0.1, 0.2, 0.5]
    assert committed_names(storage) == m.kept_dir_names
    assert m.best_checkpoint is not None
    assert m.best_checkpoints[0][1]["score"] == 0.1
    m.close()


def test_training_iteration_numeric_order(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(10, "training_iteration", "max"), storage)
    for step in range(9000, 11000, 100):
        save(m, storage, source_dir, {"training_iteration": step})
    assert scores_of(m, "training_iteration") == list(range(10000, 11000, 100))
    assert len(committed_names(storage)) == 10
    m.close()


def test_recency_continues_after_restart(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(3), storage)
    for i in range(1, 6):
        save(m, storage, source_dir, {"n": i})
    m.close()
    storage2 = make_storage()
    m2 = CheckpointManager(CheckpointConfig(3), storage2)
    assert scores_of(m2, "n") == [3, 4, 5]
    for i in (6, 7):
        save(m2, storage2, source_dir, {"n": i})
    assert scores_of(m2, "n") == [5, 6, 7]
    # Numbering continued: 7 checkpoints have indices 0..6.
    assert m2.kept_dir_names == ["checkpoint_000004", "checkpoint_000005", "checkpoint_000006"]
    assert committed_names(storage2) == m2.kept_dir_names
    m2.close()


def test_pre_restart_scores_still_count(make_storage, source_dir):
    cfg = CheckpointConfig(2, "score", "max")
    storage = make_storage()
    m = CheckpointManager(cfg, storage)
    for v in [0.9, 0.1, 0.2]:
        save(m, storage, source_dir, {"score": v})
    m.close()
    storage2 = make_storage()
    m2 = CheckpointManager(cfg, storage2)
    for v in [0.3, 0.4]:
        save(m2, storage2, source_dir, {"score": v})
    # 0.9 from before the restart is still the best (Composer forgot it).
    assert _kept_values(m2) == [0.9, 0.4]
    assert m2.best_checkpoints[0][1]["score"] == 0.9
    assert committed_names(storage2) == m2.kept_dir_names
    m2.close()


# -- issue 2's retention cases -------------------------------------------------------


def test_k1_best_and_latest_both_exist_then_better_replaces(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(1, "score", "max"), storage)
    for v in [0.9, 0.5]:
        save(m, storage, source_dir, {"score": v})
    assert m.best_checkpoints[0][1]["score"] == 0.9
    assert _name(m.best_checkpoint) == "checkpoint_000000"
    assert _name(m.latest_checkpoint) == "checkpoint_000001"
    assert m.best_checkpoint.is_committed and m.latest_checkpoint.is_committed
    save(m, storage, source_dir, {"score": 0.7})
    assert _kept_values(m) == [0.9, 0.7]
    assert committed_names(storage) == ["checkpoint_000000", "checkpoint_000002"]
    m.close()


def test_k2_two_nans_then_numbers(make_storage, source_dir):
    m, storage = _run(make_storage, source_dir, CheckpointConfig(2, "score", "max"),
                      [NAN, NAN, 1.0, 2.0])
    assert _kept_values(m) == [1.0, 2.0]
    assert m.best_checkpoints[0][1]["score"] == 2.0
    assert committed_names(storage) == m.kept_dir_names
    m.close()


def test_nested_eval_loss_min(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(1, "eval/loss", "min"), storage)
    for x in [3, 1, 2]:
        save(m, storage, source_dir, {"eval": {"loss": x}})
    assert [met["eval"]["loss"] for _, met in m.best_checkpoints] == [1, 2]
    assert m.best_checkpoints[0][1]["eval"]["loss"] == 1
    assert _name(m.latest_checkpoint) == "checkpoint_000002"
    assert committed_names(storage) == ["checkpoint_000001", "checkpoint_000002"]
    m.close()


def test_literal_slash_key_wins_over_nested(make_storage, source_dir):
    storage = make_storage()
    m = CheckpointManager(CheckpointConfig(1, "ptl/val_acc", "max", keep_latest=False), storage)
    # The literal key says 0.2 then 0.9; the nested path says the opposite.
    save(m, storage, source_dir, {"ptl/val_acc": 0.2, "ptl": {"val_acc": 0.99}})
    save(m, storage, source_dir, {"ptl/val_acc": 0.9, "ptl": {"val_acc": 0.01}})
    assert m.kept_dir_names == ["checkpoint_000001"]
    m.close()


def test_num_to_keep_none_keeps_all(make_storage, source_dir):
    m, storage = _run(make_storage, source_dir, CheckpointConfig(None, "score", "min"),
                      [5, 4, NAN, 3, 9])
    assert len(m.kept_dir_names) == 5
    assert committed_names(storage) == m.kept_dir_names
    # Best first: 3; the NaN last.
    ranked = [met["score"] for _, met in m.best_checkpoints]
    assert ranked[:4] == [3, 4, 5, 9] and math.isnan(ranked[4])
    m.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_to_keep": 0},
        {"num_to_keep": -1},
        {"num_to_keep": 2.5},
        {"num_to_keep": True},
        {"num_to_keep": "3"},
        {"checkpoint_score_attribute": ""},
        {"checkpoint_score_attribute": 3},
        {"checkpoint_score_order": "maximum"},
        {"keep_latest": 1},
        {"missing_score": "ignore"},
    ],
)
def test_bad_config_raises(kwargs):
    with pytest.raises(InvalidConfigError) as info:
        CheckpointConfig(**kwargs)
    # The message names the field.
    assert next(iter(kwargs)) in str(info.value)
