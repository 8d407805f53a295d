"""Live refresh of a run on an object store (issue 19): its rows are in
``result.json`` segments until the session ends; a poll reads only the new
segments, and the assembly at the end neither drops nor doubles a row."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from checkpoint_store import session
from checkpoint_store._results.writer import FLUSH_INTERVAL_ENV
from checkpoint_store.testing import session_internals
from checkpoint_store.ui._model import StoreView


@pytest.fixture(params=["memory", "s3"])
def root(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any] | None]:
    if request.param == "memory":
        return f"memory://ui-seg-{uuid.uuid4().hex[:10]}/store", None
    loc = request.getfixturevalue("s3_location")
    return loc.uri, dict(loc.storage_options)


def test_polls_follow_segments_then_the_assembled_file(root, monkeypatch) -> None:
    monkeypatch.setenv(FLUSH_INTERVAL_ENV, "3600")
    uri, opts = root
    with session.start(storage_path=uri, storage_options=opts, experiment_name="exp",
                       trial_name="t") as s:
        for i in range(3):
            s.report({"acc": i / 10})
        session_internals(s).results.flush()
        view = StoreView(uri, opts)
        first = view.trial("exp", "t")
        assert [r["acc"] for r in first["rows"]] == [0.0, 0.1, 0.2]
        cache = view._caches[("exp", "t")]
        assert len(cache.segments) == 1 and cache.file_rows == []
        s.report({"acc": 0.3})
        session_internals(s).results.flush()
        grown = view.trial("exp", "t", since=3)
        assert [r["acc"] for r in grown["rows"]] == [0.3] and grown["total_rows"] == 4
        assert len(cache.segments) == 2
    after = view.trial("exp", "t", since=4)
    assert after["rows"] == [] and after["total_rows"] == 4
    assert cache.segments == {} and len(cache.file_rows) == 4
    assert [r["training_iteration"] for r in view.trial("exp", "t", full=True)["rows"]] == [
        1, 2, 3, 4]
