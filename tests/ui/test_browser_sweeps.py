"""The page where sweeps and long runs live, in a real browser: 50 trials in one
comparison, a trial of 20,000 reports and 300 checkpoints, damaged checkpoints, names
that would break the layout, a long storage error, and the views of several metrics,
smoothing, log scale, zoom, filters, parameters against the score and CSV export."""

from __future__ import annotations

import csv
import io
import math
import os
import shutil
import tempfile
import urllib.request
from typing import Any

import pytest
from test_browser import chart_points, open_page, route
from ui_helpers import CONFIG, Store, report_trial, wait_for

from checkpoint_store import Checkpoint, CheckpointConfig, session
from checkpoint_store.ui._plot import trial_color

pytestmark = pytest.mark.browser

N_TRIALS = 50
RLO = "\u202e"


def _report_many(root: str, trial: str, n: int, every: int, num_to_keep: int = 5) -> None:
    """``n`` reports of ``acc`` (a saw-tooth) and ``loss``, a checkpoint every ``every``-th."""
    cfg = CheckpointConfig(num_to_keep=num_to_keep, checkpoint_score_attribute="acc",
                           checkpoint_score_order="max")
    src = tempfile.mkdtemp()
    try:
        with open(os.path.join(src, "m.bin"), "wb") as f:
            f.write(b"w" * 64)
        with session.start(storage_path=root, experiment_name="long", trial_name=trial,
                           checkpoint_config=cfg):
            for i in range(n):
                metrics = {"acc": (i % 997) / 997, "loss": 1.0 / (i + 1)}
                if i % every == every - 1:
                    session.report(metrics, checkpoint=Checkpoint.from_directory(src))
                else:
                    session.report(metrics)
    finally:
        shutil.rmtree(src)


@pytest.fixture(scope="module")
def sweep_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """50 trials of one experiment (params lr, opt), 4 reports each, 2 checkpoints."""
    store = Store(str(tmp_path_factory.mktemp("ui-sweep") / "results"))
    for i in range(N_TRIALS):
        scores = [0.1 + 0.01 * i, 0.2 + 0.01 * i, 0.15 + 0.01 * i, 0.3 + 0.01 * i]
        report_trial(store, "sweep50", f"t{i:03d}", scores, [True, False, False, True],
                     {"lr": 10.0 ** -(i % 5), "opt": "adam" if i % 2 else "sgd"})
    return store


@pytest.fixture(scope="module")
def long_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """One trial of 20,000 reports with 303 checkpoints (top 5 kept)."""
    store = Store(str(tmp_path_factory.mktemp("ui-long") / "results"))
    _report_many(store.uri, "run", 20_000, 66)
    return store


def _rgb(color: str) -> tuple[int, int, int]:
    color = color.lstrip("#")
    return int(color[0:2], 16), int(color[2:4], 16), int(color[4:6], 16)


def _page_colors(browser: Any) -> list[str]:
    """The line colour of each trial in the comparison, as ``#rrggbb`` (the canvas
    normalises any CSS colour)."""
    return browser.execute_script("""
        const ctx = document.createElement("canvas").getContext("2d");
        return window.csUI.chart.data.datasets.filter((d) => d.type === "line").map((d) => {
            ctx.fillStyle = d.baseColor || d.borderColor; return ctx.fillStyle; });""")


def _resources(browser: Any) -> list[dict[str, Any]]:
    return browser.execute_script("""return performance.getEntriesByType("resource").map((e) =>
        ({name: e.name, size: e.transferSize, status: e.responseStatus}));""")


@pytest.mark.slow
def test_compare_50_trials_one_colour_and_legend_entry_each(
        browser: Any, sweep_store: Store, serve: Any, screenshot: Any) -> None:
    server = serve(sweep_store.uri)
    names = [f"t{i:03d}" for i in range(N_TRIALS)]
    open_page(browser, server.url + route("compare", "sweep50", *names))
    wait_for(lambda: browser.execute_script(
        "return window.csUI.chart && window.csUI.chart.legend.legendItems.length"), what="chart")
    legend = browser.execute_script(
        "return window.csUI.chart.legend.legendItems.map((i) => i.text)")
    assert legend == names  # one entry per trial, its name
    colors = _page_colors(browser)
    assert len(set(colors)) == N_TRIALS  # trials 000, 008, 016 no longer share one
    for i, c in enumerate(colors):  # the same colours as `checkpoint-store plot`
        assert max(abs(a - b) for a, b in zip(_rgb(c), _rgb(trial_color(i)), strict=True)) <= 2
    closest = min(math.dist(_rgb(a), _rgb(b)) for i, a in enumerate(colors)
                  for b in colors[i + 1:])
    assert closest > 25, closest
    # Markers take their trial's colour, the shape says the kind.
    stars = browser.execute_script("""return window.csUI.chart.data.datasets
        .filter((d) => d.kind === "best").map((d) => [d.trialName, d.backgroundColor]);""")
    lines = dict(browser.execute_script("""return window.csUI.chart.data.datasets
        .filter((d) => d.type === "line").map((d) => [d.trialName, d.borderColor]);"""))
    assert stars and all(lines[t] == c for t, c in stars)
    # Hovering a legend entry brings that trial forward: every other one fades.
    from selenium.webdriver.common.action_chains import ActionChains

    box = browser.execute_script("""const c = window.csUI.chart;
        const b = c.legend.legendHitBoxes[7];
        return [b.left + b.width / 2, b.top + b.height / 2, c.canvas.clientWidth,
                c.canvas.clientHeight];""")
    canvas = browser.find_element("id", "chart")
    ActionChains(browser).move_to_element_with_offset(
        canvas, int(box[0] - box[2] / 2), int(box[1] - box[3] / 2)).perform()
    wait_for(lambda: browser.execute_script("return window.csUI.highlighted") == names[7],
             what="the highlight")
    faded = browser.execute_script("""return window.csUI.chart.data.datasets
        .filter((d) => d.type === "line" && d.borderColor.startsWith("rgba(160")).length""")
    assert faded == N_TRIALS - 1
    screenshot(browser, "ui-compare-50")


def test_plot_of_20_trials_colours_each_trial_and_keeps_the_legend_outside(
        sweep_store: Store) -> None:
    pytest.importorskip("matplotlib")
    from checkpoint_store.ui._model import StoreView
    from checkpoint_store.ui._plot import figure

    view = StoreView(sweep_store.uri)
    trials = [view.trial("sweep50", f"t{i:03d}") for i in range(20)]
    fig, drawn = figure(trials, metric="val/accuracy")
    assert drawn == 20
    ax = fig.axes[0]
    line_colors = [line.get_color() for line in ax.get_lines()]
    assert len(set(line_colors)) == 20  # matplotlib's 10 would repeat
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [f"t{i:03d}" for i in range(20)]  # one entry per trial, no kinds
    fig.canvas.draw()
    legend_box = ax.get_legend().get_window_extent()
    assert legend_box.x0 >= ax.get_window_extent().x1  # beside the axes, not over the points
    from matplotlib.colors import to_hex

    # The best stars of each trial are in that trial's colour.
    stars = [c for c in ax.collections if c.get_sizes()[0] == 220]
    assert len(stars) == 20
    assert [to_hex(s.get_facecolor()[0]) for s in stars] == line_colors


def test_a_checkpoint_damaged_after_commit_is_committed_and_invalid(
        browser: Any, serve: Any, tmp_path: Any) -> None:
    store = Store(str(tmp_path / "s"))
    cfg_keep_all = CheckpointConfig(num_to_keep=None)
    src = tmp_path / "src"
    src.mkdir()
    (src / "trainer.json").write_text("{}")
    (src / "model.bin").write_bytes(b"m" * 100)
    with session.start(storage_path=store.uri, experiment_name="e", trial_name="t",
                       checkpoint_config=cfg_keep_all):
        for acc in (0.1, 0.2, 0.3):
            session.report({"acc": acc}, checkpoint=Checkpoint.from_directory(str(src)))
    trial_dir = tmp_path / "s" / "e" / "t"
    (trial_dir / "checkpoint_000001" / "trainer.json").unlink()  # a file removed
    (trial_dir / "checkpoint_000002" / "extra.txt").write_text("x")  # a file added
    server = serve(store.uri)
    open_page(browser, server.url + route("trial", "e", "t"))
    wait_for(lambda: browser.find_elements("css selector", "#checkpoints tbody tr"), what="rows")
    kinds = {tr.get_attribute("data-checkpoint"): tr.get_attribute("data-kind")
             for tr in browser.find_elements("css selector", "#checkpoints tbody tr")}
    assert kinds == {"checkpoint_000000": "latest", "checkpoint_000001": "invalid",
                     "checkpoint_000002": "invalid"}
    summary = browser.find_element("id", "summary").text
    assert "3 committed checkpoint(s)" in summary and "2 invalid" in summary
    reason = browser.find_element(
        "css selector", "tr[data-checkpoint='checkpoint_000001']").get_attribute("title")
    assert "trainer.json" in reason
    markers = chart_points(browser)
    assert [p["name"] for p in markers["invalid"]] == ["checkpoint_000001", "checkpoint_000002"]
    assert not markers["uncommitted"]
    # The checkpoint page says the same: invalid, naming the file.
    open_page(browser, server.url + route("checkpoint", "e", "t", "checkpoint_000001"))
    wait_for(lambda: browser.find_elements("id", "kind"), what="the checkpoint page")
    assert browser.find_element("id", "kind").text == "committed, invalid"
    assert "trainer.json" in browser.find_element("css selector", "p.error").text


def test_a_poll_keeps_a_text_selection_in_the_table(browser: Any, serve: Any,
                                                    tmp_path: Any) -> None:
    store = Store(str(tmp_path / "s"))
    report_trial(store, "exp", "copy-me", [0.2], [True], {"lr": 0.5})
    report_trial(store, "exp", "other", [0.2], [True], {"lr": 0.1})
    server = serve(store.uri, refresh_s=0.3)
    open_page(browser, server.url)
    wait_for(lambda: browser.find_elements("css selector", "tr[data-trial='copy-me'] bdi"),
             what="the table")
    browser.execute_script("""
        const n = document.querySelector("tr[data-trial='copy-me'] bdi");
        window.getSelection().selectAllChildren(n);""")
    polls = browser.execute_script("return window.csUI.polls")
    report_trial(store, "exp", "other", [0.9], [True], {"lr": 0.1})  # another row changes
    wait_for(lambda: browser.find_element(
        "css selector", "tr[data-trial='other'] td:nth-child(4)").text == "2", what="refresh")
    wait_for(lambda: browser.execute_script("return window.csUI.polls") > polls + 1,
             what="more polls")
    assert browser.execute_script("return window.getSelection().toString()") == "copy-me"


def test_a_long_error_stays_on_one_line(browser: Any, serve: Any, tmp_path: Any) -> None:
    deep = tmp_path / ("a-rather-long-directory-name-" * 8) / "store"
    store = Store(str(deep))
    report_trial(store, "exp", "t", [0.2], [True], {})
    server = serve(store.uri, refresh_s=0.3)
    open_page(browser, server.url)
    wait_for(lambda: browser.find_elements("css selector", "section.experiment"), what="table")
    shutil.rmtree(deep)  # the storage breaks while the page is open
    deep.write_text("not a directory any more")
    wait_for(lambda: "stale" in browser.find_element("id", "live").get_attribute("class"),
             what="the error")
    live = browser.find_element("id", "live")
    assert len(live.get_attribute("title")) > 200  # the whole message, on hover
    header_height = browser.execute_script(
        "return document.querySelector('header').getBoundingClientRect().height")
    assert header_height < 60
    assert browser.execute_script(
        "return document.documentElement.scrollWidth <= document.documentElement.clientWidth")


def test_names_are_isolated_and_cut(browser: Any, serve: Any, tmp_path: Any) -> None:
    store = Store(str(tmp_path / "s"))
    long_name = "x" * 200
    for trial in (f"abc{RLO}def", long_name, "plain"):
        report_trial(store, f"exp{RLO}rtl", trial, [0.2], [True], {"note": f"n{RLO}te"})
    server = serve(store.uri)
    open_page(browser, server.url)
    wait_for(lambda: browser.find_elements("css selector", "section.experiment"), what="table")
    # The count after the experiment's name reads left to right: "3 trial(s)".
    left_of = browser.execute_script("""
        const h = document.querySelector("section.experiment h2");
        const name = h.querySelector("bdi").getBoundingClientRect();
        const count = h.querySelector(".count").getBoundingClientRect();
        return count.left >= name.right - 1;""")
    assert left_of
    assert browser.find_element("css selector", "section.experiment .count").text == "3 trial(s)"
    # The 200-character name is cut, whole on hover, and every column stays on screen.
    cell = browser.find_element("css selector", f"tr[data-trial='{long_name}'] td.name-cell bdi")
    assert cell.get_attribute("title") == long_name
    assert cell.size["width"] < 400
    assert browser.execute_script("""
        const t = document.querySelector("table.trials");
        return t.getBoundingClientRect().right <= document.documentElement.clientWidth;""")


def test_names_that_differ_in_what_does_not_show_are_told_apart(browser: Any, serve: Any,
                                                                tmp_path: Any) -> None:
    """Trials ``t1`` and ``t1 `` showed as the same name; as in the command
    line's tables, one with leading or trailing whitespace shows quoted."""
    store = Store(str(tmp_path / "s"))
    for trial in ("t1", "t1 ", " my trial"):
        report_trial(store, "exp", trial, [0.2], [True], {})
    server = serve(store.uri)
    open_page(browser, server.url)
    wait_for(lambda: len(browser.find_elements("css selector", "td.name-cell bdi")) == 3,
             what="the table")
    shown = {c.get_attribute("title"): c.get_attribute("textContent")
             for c in browser.find_elements("css selector", "td.name-cell bdi")}
    assert shown == {"t1": "t1", "t1 ": '"t1 "', " my trial": '" my trial"'}


def test_kept_checkpoints_come_first_and_evicted_ones_on_request(
        browser: Any, serve: Any, tmp_path: Any) -> None:
    root = str(tmp_path / "s")
    cfg = CheckpointConfig(num_to_keep=5, checkpoint_score_attribute="acc",
                           checkpoint_score_order="max")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.bin").write_bytes(b"w")
    with session.start(storage_path=root, experiment_name="long", trial_name="top5",
                       checkpoint_config=cfg):
        for i in range(120):  # the first 5 are the best; the latest is kept for resume
            session.report({"acc": 1 / (i + 1)},
                           checkpoint=Checkpoint.from_directory(str(tmp_path / "src")))
    server = serve(root)
    open_page(browser, server.url + route("trial", "long", "top5"))
    wait_for(lambda: browser.find_elements("css selector", "#checkpoints tbody tr"), what="rows")
    rows = browser.find_elements("css selector", "#checkpoints tbody tr")
    kinds = [r.get_attribute("data-kind") for r in rows]
    assert kinds == ["best"] * 5 + ["latest"]  # evicted rows hidden
    ranks = [r.find_elements("css selector", "td")[2].text for r in rows[:5]]
    assert ranks == ["1", "2", "3", "4", "5"]
    top = browser.execute_script("""return document.querySelector(
        "#checkpoints tbody tr").getBoundingClientRect().top + window.scrollY""")
    assert top < 1500  # right under the chart, not thousands of pixels down
    browser.find_element("id", "show-evicted").click()
    rows = browser.find_elements("css selector", "#checkpoints tbody tr")
    assert len(rows) == 120 and rows[6].get_attribute("data-kind") == "evicted"
    # Newest evicted first.
    assert rows[6].get_attribute("data-checkpoint") > rows[7].get_attribute("data-checkpoint")


@pytest.mark.slow
def test_20000_reports_are_decimated_with_every_marker_exact(
        browser: Any, long_store: Store, serve: Any, screenshot: Any) -> None:
    from checkpoint_store.ui._model import StoreView

    server = serve(long_store.uri, refresh_s=0.3)
    open_page(browser, server.url + route("trial", "long", "run"))
    wait_for(lambda: browser.execute_script("return !!window.csUI.chart"), what="the chart")
    points = chart_points(browser)
    assert 500 <= len(points["line"]) <= 2000
    xs = [p["x"] for p in points["line"]]
    assert xs == sorted(xs) and xs[0] == 1 and xs[-1] == 20_000
    # Every checkpoint's marker, at its exact report and value.
    want = {row["checkpoint_dir_name"]: (row["training_iteration"], row["acc"])
            for row in StoreView(long_store.uri).trial("long", "run")["rows"]
            if row.get("checkpoint_dir_name")}
    shown = {p["name"]: (p["x"], p["y"]) for k in ("best", "latest", "evicted")
             for p in points[k]}
    assert shown == want and len(shown) == 303
    # The extremes of the saw-tooth survive decimation.
    ys = [p["y"] for p in points["line"]]
    assert max(ys) == 996 / 997 and min(ys) == 0.0
    # The first view (page, scripts, data) is under 1 MB.
    first = sum(r["size"] for r in _resources(browser)) + browser.execute_script(
        "return performance.getEntriesByType('navigation')[0].transferSize")
    assert first <= 1_000_000, first
    # A poll of the finished trial is a 304 of a few hundred bytes.
    polls = browser.execute_script("return window.csUI.polls")
    wait_for(lambda: browser.execute_script("return window.csUI.polls") >= polls + 2,
             what="two polls")
    trial_polls = [r for r in _resources(browser) if "/api/trial?" in r["name"]][1:]
    assert trial_polls and all(r["status"] == 304 and r["size"] <= 1024 for r in trial_polls)
    screenshot(browser, "ui-long-trial")
    # Switching the metric asks for that one series only.
    before = len(_resources(browser))
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", "metric")).select_by_value("loss")
    wait_for(lambda: browser.execute_script(
        "return window.csUI.chart.options.scales.y.title.text") == "loss", what="the switch")
    new = [r["name"] for r in _resources(browser)[before:] if "/api/" in r["name"]]
    assert [n for n in new if "series" in n] and not [n for n in new if "/api/trial" in n
                                                       and "since=" in n]


def test_marker_tooltip_and_checkpoint_page_say_why_it_is_kept(
        browser: Any, serve: Any, tmp_path: Any) -> None:
    store = Store(str(tmp_path / "s"))
    # Plotted: loss; ranked: val/accuracy (the recorded score attribute).
    report_trial(store, "exp", "t", [0.5, 0.9, 0.7, 0.6], [True] * 4, {})
    server = serve(store.uri)
    open_page(browser, server.url + route("trial", "exp", "t"))
    wait_for(lambda: browser.execute_script("return !!window.csUI.chart"), what="chart")
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", "metric")).select_by_value("loss")
    wait_for(lambda: browser.execute_script(
        "return window.csUI.chart.options.scales.y.title.text") == "loss", what="loss")
    label = browser.execute_script("""
        const c = window.csUI.chart;
        const i = c.data.datasets.findIndex((d) => d.kind === "best");
        const raw = c.data.datasets[i].data.find((p) => p.rank === 1);
        return c.options.plugins.tooltip.callbacks.label({raw, dataset: c.data.datasets[i]});""")
    assert "checkpoint_000001" in label and "score val/accuracy 0.9" in label and "rank 1" in label
    assert "loss 0.1" in label  # the plotted value too
    open_page(browser, server.url + route("checkpoint", "exp", "t", "checkpoint_000002"))
    line = wait_for(lambda: browser.find_elements("id", "retention"), what="retention")[0].text
    assert line.startswith("kept (best)") and "val/accuracy 0.7" in line
    assert "rank 2 of 3" in line  # the 3 committed: 0.9, 0.7 and the latest, 0.6


def test_compare_refreshes_while_the_sweep_runs(browser: Any, serve: Any,
                                                tmp_path: Any) -> None:
    store = Store(str(tmp_path / "s"))
    report_trial(store, "exp", "a", [0.2, 0.3], [True, True], {})
    report_trial(store, "exp", "b", [0.1], [True], {})
    server = serve(store.uri, refresh_s=0.3)
    open_page(browser, server.url + route("compare", "exp", "a", "b"))
    wait_for(lambda: browser.execute_script("return !!window.csUI.chart"), what="chart")
    report_trial(store, "exp", "b", [0.5, 0.6], [True, True], {})
    wait_for(lambda: dict(browser.execute_script("""return window.csUI.chart.data.datasets
        .filter((d) => d.type === "line").map((d) => [d.trialName, d.data.length]);"""))
        == {"a": 2, "b": 3}, what="b's new reports")


def test_a_folder_of_stores_points_one_level_down(browser: Any, serve: Any,
                                                  tmp_path: Any) -> None:
    for store in ("runs", "tune"):
        report_trial(Store(str(tmp_path / "bucket" / store)), "exp", "t", [0.2], [True], {})
    server = serve(str(tmp_path / "bucket"))
    open_page(browser, server.url)
    hint = wait_for(lambda: browser.find_elements("id", "stores-below"), what="hint")[0].text
    assert "bucket/runs" in hint and "bucket/tune" in hint


def test_several_metrics_smoothing_log_scale_and_zoom(browser: Any, serve: Any,
                                                      tmp_path: Any) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select

    root = str(tmp_path / "s")
    _report_many(root, "m", 400, 50)
    server = serve(root)
    open_page(browser, server.url + route("trial", "long", "m"))
    wait_for(lambda: browser.execute_script("return !!window.csUI.chart"), what="chart")
    Select(browser.find_element("id", "add-panel")).select_by_value("loss")
    wait_for(lambda: browser.execute_script("return window.csUI.charts.length") == 2,
             what="a second panel")
    titles = browser.execute_script(
        "return window.csUI.charts.map((c) => c.options.scales.y.title.text)")
    assert titles == ["acc", "loss"]
    # Smoothing: TensorBoard's debiased moving average over the line.
    browser.execute_script("""const s = document.getElementById("smoothing");
        s.value = 0.9; s.dispatchEvent(new Event("change"));""")
    wait_for(lambda: browser.execute_script("""return window.csUI.chart.data.datasets
        .some((d) => d.kind === "smoothed")"""), what="the smoothed line")
    raw, smooth = browser.execute_script("""const d = window.csUI.chart.data.datasets;
        return [d.find((x) => x.type === "line" && !x.kind).data.map((p) => p.y),
                d.find((x) => x.kind === "smoothed").data.map((p) => p.y)];""")
    last, want = 0.0, []
    for n, y in enumerate(raw, 1):
        last = last * 0.9 + 0.1 * y
        want.append(last / (1 - 0.9 ** n))
    assert smooth == pytest.approx(want)
    browser.find_element("id", "log-scale").click()
    wait_for(lambda: browser.execute_script(
        "return window.csUI.charts.every((c) => c.options.scales.y.type === 'logarithmic')"),
        what="log scale")
    # Drag across the first chart: both panels zoom to that range, fetched anew.
    canvas = browser.find_element("id", "chart")
    w = canvas.size["width"]
    before = len(_resources(browser))
    ActionChains(browser).move_to_element_with_offset(canvas, int(-w * 0.2), 0).click_and_hold() \
        .move_by_offset(int(w * 0.2), 0).release().perform()
    wait_for(lambda: browser.execute_script("return !!window.csUI.zoom"), what="the zoom")
    lo, hi = browser.execute_script("return window.csUI.zoom")
    assert 0 < lo < hi < 400
    wait_for(lambda: browser.execute_script(
        "return window.csUI.charts.every((c) => c.options.scales.x.min === window.csUI.zoom[0])"),
        what="both panels zoomed")
    assert any("x_min=" in r["name"] for r in _resources(browser)[before:])
    browser.find_element("id", "reset-zoom").click()
    wait_for(lambda: browser.execute_script("return window.csUI.zoom") is None, what="zoom out")


def test_filter_group_parameters_view_and_csv(browser: Any, sweep_store: Store,
                                              serve: Any, screenshot: Any) -> None:
    server = serve(sweep_store.uri)
    open_page(browser, server.url)
    wait_for(lambda: browser.find_elements("id", "filter"), what="toolbar")
    shown = lambda: [tr.get_attribute("data-trial") for tr in browser.find_elements(  # noqa: E731
        "css selector", "section[data-experiment='sweep50'] tbody tr[data-trial]")]
    assert len(shown()) == N_TRIALS
    browser.find_element("id", "filter").send_keys("opt=adam t00")
    wait_for(lambda: shown() == ["t001", "t003", "t005", "t007", "t009"], what="filtered")
    browser.find_element("id", "filter").clear()
    browser.execute_script("""const f = document.getElementById("filter");
        f.value = ""; f.dispatchEvent(new Event("input"));""")
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", "group-by")).select_by_value("opt")
    groups = wait_for(lambda: [g.text for g in browser.find_elements(
        "css selector", "section[data-experiment='sweep50'] tr.group")], what="groups")
    # Per group: the best of the best scores and its trial, their mean, the statuses.
    assert groups == ["opt = adam (25) · best val/accuracy 0.79 (t049), mean 0.55 · 25 finished",
                      "opt = sgd (25) · best val/accuracy 0.78 (t048), mean 0.54 · 25 finished"]
    screenshot(browser, "ui-experiments-grouped")
    # Parameters against the best score: one point per trial.
    browser.find_element("css selector", "section[data-experiment='sweep50'] a.params-link").click()
    wait_for(lambda: browser.execute_script("return !!window.csUI.chart"), what="the scatter")
    Select(browser.find_element("id", "param")).select_by_value("lr")
    pts = browser.execute_script(
        "return window.csUI.chart.data.datasets[0].data.map((p) => [p.trial, p.x, p.y])")
    assert len(pts) == N_TRIALS
    assert all(x == 10.0 ** -(int(t[1:]) % 5) for t, x, _ in pts)
    assert all(y == pytest.approx(0.3 + 0.01 * int(t[1:])) for t, _, y in pts)
    assert browser.execute_script("return window.csUI.chart.options.scales.x.type") == \
        "logarithmic"
    screenshot(browser, "ui-params")
    # CSV: a trial's rows, and the sweep's best rows.
    with urllib.request.urlopen(server.url + "api/csv?experiment=sweep50&trial=t007") as resp:
        assert resp.headers["Content-Type"].startswith("text/csv")
        rows = list(csv.DictReader(io.StringIO(resp.read().decode())))
    assert [float(r["val/accuracy"]) for r in rows] == pytest.approx([0.17, 0.27, 0.22, 0.37])
    with urllib.request.urlopen(server.url + "api/csv?experiment=sweep50") as resp:
        best = list(csv.DictReader(io.StringIO(resp.read().decode())))
    assert len(best) == N_TRIALS
    row = next(r for r in best if r["trial"] == "t007")
    assert row["best_checkpoint"] == "checkpoint_000001" and row["param/opt"] == "adam"
    assert float(row["best_score"]) == pytest.approx(0.37)
    assert CONFIG.num_to_keep == 2
