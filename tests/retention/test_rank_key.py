"""One rank order everywhere: the manager, select_kept, the CLI's ``best`` and the
web UI's best checkpoint all rank by retention.rank_key."""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_store import Checkpoint, CheckpointConfig, session
from checkpoint_store.cli import main
from checkpoint_store.retention import (
    CheckpointRecord,
    rank_key,
    score_or_none,
    select_kept,
)
from checkpoint_store.ui._model import StoreView

_scores = st.one_of(st.none(), st.just(math.nan), st.sampled_from([-1.0, 0.0, 0.5, 2.0]))


@settings(max_examples=200, deadline=None)
@given(scores=st.lists(_scores, min_size=1, max_size=12),
       order=st.sampled_from(["max", "min"]))
def test_the_best_by_rank_key_is_what_select_kept_keeps_first(scores, order) -> None:
    records = [CheckpointRecord(i, f"checkpoint_{i:06d}", {} if s is None else {"s": s})
               for i, s in enumerate(scores)]
    best = max(records, key=lambda r: rank_key(score_or_none(r.metrics, "s"), r.index, order))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # missing scores warn once
        kept, _ = select_kept(records, CheckpointConfig(1, "s", order, keep_latest=False))
    assert kept == [best]


def test_rank_key_orders_numbers_then_missing_then_newer() -> None:
    keys = sorted([(0.5, 0), (None, 1), (0.5, 2), (2.0, 3), (None, 4)],
                  key=lambda p: rank_key(p[0], p[1], "min"), reverse=True)
    assert keys == [(0.5, 2), (0.5, 0), (2.0, 3), (None, 4), (None, 1)]


@pytest.mark.parametrize("order", ["max", "min"])
def test_manager_cli_and_ui_agree_on_the_best_checkpoint(tmp_path, order) -> None:
    # Ties, a NaN and a missing score: the cases where private rank keys drifted.
    scores = [0.3, None, 0.7, math.nan, 0.7, 0.3]
    root = str(tmp_path / "runs")
    cfg = CheckpointConfig(num_to_keep=None, checkpoint_score_attribute="acc",
                           checkpoint_score_order=order)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with session.start(storage_path=root, experiment_name="e", trial_name="t",
                           checkpoint_config=cfg) as s:
            for step, score in enumerate(scores):
                d = tmp_path / f"src{step}"
                d.mkdir()
                (d / "w.bin").write_bytes(bytes([step]))
                metrics = {"step": step} if score is None else {"acc": score}
                session.report(metrics, checkpoint=Checkpoint.from_directory(str(d)))
            manager_best = s.manager.best_checkpoint
    assert manager_best is not None
    expected = "checkpoint_000004" if order == "max" else "checkpoint_000005"
    assert os.path.basename(manager_best.path) == expected

    res = CliRunner().invoke(main, ["best", os.path.join(root, "e", "t"), "--json"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert os.path.basename(json.loads(res.stdout)["uri"].rstrip("/")) == expected

    summary = StoreView(root).summary("e", "t")
    assert summary["best_checkpoint"] == expected
