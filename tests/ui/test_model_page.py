"""The data behind issue 42's page items (no browser): a state checkpoint's tensor
table and snippet, user and auto-filled metrics, resumes on the curve, and why and
when an evicted checkpoint went."""

from __future__ import annotations

from typing import Any

from ui_helpers import SPIKY_LOSS, STATE_TENSORS, Store

from checkpoint_store.ui._model import StoreView, _resumes


def test_state_checkpoint_lists_its_tensors(page_store: Store) -> None:
    view = StoreView(page_store.uri)
    c = view.checkpoint("page", "state", "checkpoint_000000")
    rows = {t["name"]: t for t in c["tensors"]}
    assert sorted(rows) == sorted(f"model/{k}" for k in STATE_TENSORS)
    for key, shape in STATE_TENSORS.items():
        t = rows[f"model/{key}"]
        assert (t["dtype"], t["shape"]) == ("F32", list(shape))
        assert t["size"] == 4 * shape[0] * shape[1]
        assert t["file"] == "tensors-00001-of-00001.safetensors"
    # The index is the table now, not a JSON dump; the rest of the metadata stays.
    assert "tensors" not in c["internal_metadata"] and "run_id" in c["internal_metadata"]
    python = c["snippets"]["python"]
    assert ".load_state()" in python and "load_state(keys=['model/layer00.bias'])" in python
    assert "as_directory" not in python
    # A directory checkpoint keeps as_directory() and has no tensors.
    d = view.checkpoint("page", "spiky", "checkpoint_000011")
    assert d["tensors"] is None and "as_directory()" in d["snippets"]["python"]


def test_user_metrics_apart_from_auto_filled(page_store: Store) -> None:
    t = StoreView(page_store.uri).trial("page", "spiky")
    assert t["user_metrics"] == ["loss", "step"]
    assert t["auto_metrics"] == ["training_iteration", "timestamp", "time_total_s",
                                 "time_this_iter_s"]
    assert t["params"] == {"lr": 0.1, "opt": "adam"}


def test_series_marks_the_resume(page_store: Store) -> None:
    view = StoreView(page_store.uri)
    s = view.series("page", "spiky", "loss")
    assert [(r["x"], r["row"]) for r in s["resumes"]] == [(7.0, 6)]
    meta = view.checkpoint("page", "spiky", "checkpoint_000011")["internal_metadata"]
    assert s["resumes"][0]["writer"] == meta["writer_id"]
    # Any reported number is an x axis: the user's step, resumes included.
    by_step = view.series("page", "spiky", "loss", x="step")
    assert [p[0] for p in by_step["points"]] == [10.0 * i for i in range(1, 13)]
    assert [p[1] for p in by_step["points"]] == SPIKY_LOSS
    assert [r["x"] for r in by_step["resumes"]] == [70.0]


def test_resume_rules_on_rows() -> None:
    def row(it: int, ts: float, dt: float = 1.0, ck: str | None = None) -> dict[str, Any]:
        return {"training_iteration": it, "timestamp": ts, "time_this_iter_s": dt,
                "checkpoint_dir_name": ck}

    # training_iteration going back: a restart from checkpoint 2, no metadata needed.
    rows = [row(1, 1), row(2, 2), row(3, 3), row(3, 10, dt=7), row(4, 11)]
    assert _resumes(rows, {}) == [{"row": 3, "writer": None}]
    # One clock (steps equal time_this_iter_s): a step 30 s over it starts a run.
    rows = [row(1, 1), row(2, 2, ck="a"), row(3, 3), row(4, 34), row(5, 35, ck="b")]
    metas = {"a": {"writer_id": "w1"}, "b": {"writer_id": "w2"}}
    assert _resumes(rows, metas) == [{"row": 3, "writer": "w2"}]
    # Rows stamped by another clock (steps off by 0.2 s): only a change of writer
    # counts, placed at the largest step between the two checkpoints.
    rows = [row(1, 1), row(2, 2.2, ck="a"), row(3, 3.4), row(4, 34), row(5, 35.2, ck="b")]
    assert _resumes(rows, metas) == [{"row": 3, "writer": "w2"}]
    assert _resumes(rows, {"a": {"writer_id": "w1"}, "b": {"writer_id": "w1"}}) == []


def test_evicted_checkpoint_says_when_and_why(page_store: Store) -> None:
    view = StoreView(page_store.uri)
    # loss 1.0 at report 2 is kept by the best two (min) until 0.8 at report 4.
    c = view.checkpoint("page", "spiky", "checkpoint_000001")
    assert c["state"] == "evicted" and c["score"] == 1.0 and c["score_attribute"] == "loss"
    assert c["reported"]["iteration"] == 2
    assert c["evicted_at"]["iteration"] == 4 and c["evicted_at"]["by"] == "checkpoint_000003"
    assert [k["name"] for k in c["kept_instead"]] == ["checkpoint_000002", "checkpoint_000003"]
    assert "best 2 by loss (min)" in c["reason"]
    kinds = {r["name"]: r["kind"] for r in view.trial("page", "spiky")["checkpoints"]}
    assert kinds["checkpoint_000001"] == "evicted"
