"""A preempted trial and its preemption checkpoint on the page (issue 39).

Written through the real API: a session started with ``preemption=``, a
SIGTERM sent to this process (its handler runs in the main thread, where the
test runs), then the report that commits the preemption checkpoint and raises
:class:`~checkpoint_store.errors.Preempted`. The model's answers first, then
the page in headless Chromium: the status and its reason, resumable from the
newest checkpoint, the "preemption (SIGTERM)" badge in the checkpoints table,
the chart's tooltip and the checkpoint page.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from typing import Any
from urllib.parse import quote

import pytest
from ui_helpers import CONFIG, Store, wait_for

from checkpoint_store import Checkpoint, PreemptionConfig, session
from checkpoint_store.errors import Preempted
from checkpoint_store.ui._model import StoreView

# An earlier test in this process may have left a SIGTERM handler of its own
# (ray.init installs one): the signal must reach the session's.
pytestmark = pytest.mark.usefixtures("fresh_signal_handlers")

PREEMPTED = "checkpoint_000001"


def _report(score: float, i: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "model.bin"), "wb") as f:
            f.write(b"w" * (100 + i))
        session.report({"val": {"accuracy": score}}, checkpoint=Checkpoint.from_directory(tmp))


def _write(store: Store) -> None:
    """``exp/pre``: two reports, the second after a SIGTERM; ``exp/done``: ended on its own."""
    with pytest.raises(Preempted), session.start(
            storage_path=store.uri, experiment_name="exp", trial_name="pre",
            checkpoint_config=CONFIG,
            preemption=PreemptionConfig(signals=("SIGTERM",), grace_period_s=30.0)):
        _report(0.5, 0)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not session.reached_preemption() and time.monotonic() < deadline:
            time.sleep(0.01)
        _report(0.6, 1)
    with session.start(storage_path=store.uri, experiment_name="exp", trial_name="done",
                       checkpoint_config=CONFIG):
        _report(0.7, 0)


@pytest.fixture(scope="module")
def preempted_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    store = Store(str(tmp_path_factory.mktemp("ui-preempted") / "results"))
    _write(store)
    return store


def test_the_model_shows_the_preempted_trial_and_its_preemption_checkpoint(
        preempted_store: Store) -> None:
    view = StoreView(preempted_store.uri)
    rows = {t["trial"]: t for t in view.overview()["experiments"][0]["trials"]}
    pre, done = rows["pre"], rows["done"]
    assert pre["status"] == "preempted"
    assert pre["error"].startswith("SIGTERM received at ")
    assert pre["stop"]["status"] == "preempted" and pre["stop"]["reason"] == pre["error"]
    assert (done["status"], done["error"], done["stop"]) == ("finished", None, None)
    trial = view.trial("exp", "pre")
    marks = {c["name"]: c["preemption"] for c in trial["checkpoints"]}
    assert marks["checkpoint_000000"] is None
    assert marks[PREEMPTED]["signal"] == "SIGTERM"
    assert marks[PREEMPTED]["grace_period_s"] == 30.0
    ckpt = view.checkpoint("exp", "pre", PREEMPTED)
    assert ckpt["preemption"] == marks[PREEMPTED]
    assert ckpt["is_latest"] and ckpt["internal_metadata"]["preemption"]["signal"] == "SIGTERM"
    assert view.checkpoint("exp", "pre", "checkpoint_000000")["preemption"] is None


@pytest.mark.browser
def test_the_page_shows_the_preempted_trial_and_its_preemption_checkpoint(
        browser: Any, preempted_store: Store, serve: Any) -> None:
    server = serve(preempted_store.uri)
    browser.get("about:blank")
    browser.get(server.url)
    wait_for(lambda: browser.find_elements("css selector", "section.experiment tbody tr"),
             what="the experiments table")
    badge = browser.find_element("css selector", "tr[data-trial='pre'] .badge.status-preempted")
    assert badge.text == "preempted"
    assert badge.get_attribute("title").startswith("SIGTERM received at ")
    assert badge.get_attribute("title").endswith("; resumable")
    assert browser.find_element("css selector", "tr[data-trial='done'] .badge").text == "finished"
    # The status filter offers "preempted" and keeps that trial only.
    browser.find_element("css selector", "#status-filter option[value='preempted']").click()
    wait_for(lambda: [tr.get_attribute("data-trial") for tr in browser.find_elements(
        "css selector", "section.experiment tbody tr")] == ["pre"], what="the filter")

    # The trial: the reason line, resumable from the preemption checkpoint.
    browser.get(server.url + "#/trial/exp/pre")
    wait_for(lambda: browser.execute_script(
        "return !!(window.csUI.chart && window.csUI.trial.trial === 'pre')"), what="the trial")
    summary = browser.find_element("id", "summary")
    assert summary.find_element("css selector", ".badge").text == "preempted"
    assert browser.find_element("id", "reason").text.startswith(
        "(preempted: SIGTERM received at ")
    resumable = browser.find_element("id", "resumable")
    assert resumable.text == f"resumable from {PREEMPTED};"
    assert resumable.find_element("css selector", "a").get_attribute("href").endswith(
        "#/checkpoint/exp/pre/" + quote(PREEMPTED))
    marks = {tr.get_attribute("data-checkpoint"): [b.text for b in tr.find_elements(
        "css selector", ".badge.preemption")]
        for tr in browser.find_elements("css selector", "#checkpoints tbody tr")}
    assert marks == {"checkpoint_000000": [], PREEMPTED: ["preemption (SIGTERM)"]}
    # The chart's marker carries it to its tooltip.
    points = browser.execute_script("""
        const out = {};
        for (const d of window.csUI.chart.data.datasets) {
            for (const p of d.data) if (p.name) out[p.name] = p.preemption;
        }
        return out;""")
    assert points["checkpoint_000000"] is None and points[PREEMPTED]["signal"] == "SIGTERM"

    # The checkpoint page: why it exists.
    browser.find_element("css selector", f"tr[data-checkpoint='{PREEMPTED}'] a").click()
    wait_for(lambda: browser.find_elements("id", "preemption"), what="the checkpoint page")
    assert browser.find_element("id", "preemption").text == "preemption (SIGTERM)"
    assert "committed on SIGTERM at " in browser.find_element("id", "retention").text
    assert '"signal": "SIGTERM"' in browser.find_element("id", "internal-metadata").text


def test_the_plot_rings_the_preemption_checkpoint(preempted_store: Store) -> None:
    pytest.importorskip("matplotlib")
    from checkpoint_store.ui._plot import PREEMPTION, figure

    view = StoreView(preempted_store.uri)
    fig, drawn = figure([view.trial("exp", "pre")], metric="val/accuracy")
    assert drawn == 1
    (ax,) = fig.axes
    rings = [c for c in ax.collections if c.get_label() == PREEMPTION["label"]]
    assert len(rings) == 1
    # At report 2 (the one after the signal), with its score.
    assert rings[0].get_offsets().tolist() == [[2.0, 0.6]]
    assert PREEMPTION["label"] in [t.get_text() for t in ax.get_legend().get_texts()]
    fig, _ = figure([view.trial("exp", "done")], metric="val/accuracy")
    assert not [c for c in fig.axes[0].collections if c.get_label() == PREEMPTION["label"]]
