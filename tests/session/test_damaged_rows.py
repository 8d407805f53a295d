"""Step continuity past a damaged ``result.json`` row.

The counters a restart continues from came from the last rows only: with the
last row's ``training_iteration`` damaged and the newest checkpoint reported
at iteration 2, the next report was numbered 2 again. A checkpoint's internal
metadata holds the row it was reported with, so ``session.start`` also
continues after the newest committed checkpoint's counters
(session/_context.py ``checkpoint_counters``).
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

import pytest

from checkpoint_store import Checkpoint, StorageContext, TrialRunner, session
from checkpoint_store._format.layout import RESULT_FILE, RESULT_SEGMENTS_DIR
from checkpoint_store._util import fs as _fsutil
from tests.stores import Store, make_store


@pytest.fixture(params=["local", "memory", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Any) -> Store:
    return make_store(request.param, request, tmp_path)


def _ckpt(tmp_path: Any, i: int) -> Checkpoint:
    d = tmp_path / "src" / str(i)
    d.mkdir(parents=True, exist_ok=True)
    (d / "w.bin").write_bytes(bytes([i]) * 32)
    return Checkpoint.from_directory(str(d))


def _start(store: Store):
    return session.start(storage_path=store.uri, storage_options=store.options or None,
                         experiment_name="exp", trial_name="t")


def _two_reports(store: Store, tmp_path: Any) -> list[dict[str, Any]]:
    with _start(store) as s:
        return [s.report({"loss": 1.0}, checkpoint=_ckpt(tmp_path, 0)),
                s.report({"loss": 0.5}, checkpoint=_ckpt(tmp_path, 1))]


def _rewrite_last_row(store: Store, edit: Any) -> None:
    """Rewrite ``result.json``'s last line with ``edit(line) -> line`` (the
    segments folded into it are removed, as after a clean end)."""
    ctx = store.ctx("exp", "t")
    path = posixpath.join(ctx.trial_path, RESULT_FILE)
    lines = _fsutil.read_bytes(ctx.filesystem, path).decode().rstrip("\n").split("\n")
    lines[-1] = edit(lines[-1])
    with ctx.filesystem.open_output_stream(path) as f:
        f.write(("\n".join(lines) + "\n").encode())
    seg = posixpath.join(ctx.trial_path, RESULT_SEGMENTS_DIR)
    if _fsutil.exists(ctx.filesystem, seg):
        _fsutil.delete_dir(ctx.filesystem, seg)


def _set(field: str, value: Any):
    def edit(line: str) -> str:
        row = json.loads(line)
        row[field] = value
        return json.dumps(row)
    return edit


def test_a_damaged_last_iteration_does_not_repeat_a_step(root, tmp_path):
    """The handed input: last row's training_iteration damaged, newest checkpoint
    reported at iteration 2: the next report is iteration 3."""
    first = _two_reports(root, tmp_path)
    assert [r["training_iteration"] for r in first] == [1, 2]
    _rewrite_last_row(root, _set("training_iteration", "abc"))
    with pytest.warns(RuntimeWarning, match="not a count"), _start(root) as s:
        row = s.report({"loss": 0.2})
    assert row["training_iteration"] == 3


def test_a_damaged_last_time_total_does_not_go_back_in_time(root, tmp_path):
    """Found by myself: the last row's time_total_s damaged (a string): the
    clock continues after the newest checkpoint's, not an earlier row's."""
    first = _two_reports(root, tmp_path)
    _rewrite_last_row(root, _set("time_total_s", "n/a"))
    with _start(root) as s:
        row = s.report({"loss": 0.2})
    assert row["training_iteration"] == 3
    assert row["time_total_s"] >= first[1]["time_total_s"]


def test_a_torn_last_row_does_not_repeat_a_step(tmp_path):
    """Found by myself: the last row cut mid-line (not JSON any more)."""
    store = make_store("local", None, tmp_path)  # type: ignore[arg-type]
    _two_reports(store, tmp_path)
    _rewrite_last_row(store, lambda line: line[: len(line) // 2])
    with _start(store) as s:
        assert s.report({"loss": 0.2})["training_iteration"] == 3


def test_the_trial_runner_continues_after_the_newest_checkpoint(tmp_path):
    """The trial runner starts its session the same way."""
    store = make_store("local", None, tmp_path)  # type: ignore[arg-type]
    _two_reports(store, tmp_path)
    _rewrite_last_row(store, _set("training_iteration", -7))

    def train(config):
        session.report({"loss": 0.1})

    r = TrialRunner(train, {}, storage_path=store.uri, experiment_name="exp", trial_name="t")
    with pytest.warns(RuntimeWarning, match="not a count"):
        assert r.step()["training_iteration"] == 3
    assert r.step() is None
    rows = StorageContext(store.uri, "exp", "t").read_results()
    assert [row["training_iteration"] for row in rows][-1] == 3
