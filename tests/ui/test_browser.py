"""The page in a real browser (headless Chromium) over a local store of 2 experiments x
3 trials written by real sessions: tables, charts, a checkpoint, verify, live refresh,
escaping. Each view's screenshot is taken here (docs/ui.md shows them)."""

from __future__ import annotations

import os
import time
from decimal import ROUND_HALF_UP, Decimal
from typing import Any
from urllib.parse import quote

import pytest
from ui_helpers import LAYOUT, XSS, Store, library_answer, report_trial, wait_for

pytestmark = pytest.mark.browser


def fmt_size(n: int) -> str:
    """The page's size format (app.js fmtSize)."""
    units, v, i = ["B", "KiB", "MiB", "GiB"], float(n), 0
    while v >= 1024 and i < len(units) - 1:
        v, i = v / 1024, i + 1
    # Number.toFixed rounds the exact binary value half up; Decimal(v) is that value.
    return f"{int(v)} B" if i == 0 else (
        f"{Decimal(v).quantize(Decimal('0.1'), ROUND_HALF_UP)} {units[i]}")


def route(*parts: str) -> str:
    return "#/" + "/".join(quote(p, safe="") for p in parts)


def table_rows(driver: Any, experiment: str) -> dict[str, dict[str, str]]:
    """``{trial: {column header: cell text or title}}`` of one experiment's table."""
    return driver.execute_script("""
        const section = [...document.querySelectorAll("section.experiment")]
            .find((s) => s.dataset.experiment === arguments[0]);
        const heads = [...section.querySelectorAll("thead th")].map((th) => th.textContent);
        const out = {};
        for (const tr of section.querySelectorAll("tbody tr")) {
            // Exact values where the cell has them (sizes: "N bytes"), else the text.
            const cells = [...tr.children].map((td) => td.title || td.textContent);
            out[tr.dataset.trial] = Object.fromEntries(heads.map((h, i) => [h, cells[i]]));
        }
        return out;""", experiment)


def chart_points(driver: Any) -> dict[str, list[dict[str, Any]]]:
    """The chart's datasets as drawn: ``{"line": [{x, y}], "<kind>": [{x, y, name}]}``."""
    return driver.execute_script("""
        const out = {};
        for (const d of window.csUI.chart.data.datasets) {
            out[d.kind || "line"] = d.data.map((p) => ({x: p.x, y: p.y, name: p.name || null}));
        }
        return out;""")


def assert_no_script_ran(driver: Any) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # noqa: B018 - raises when no alert() ran
    assert driver.execute_script("return document.querySelectorAll('main img').length") == 0


def open_page(driver: Any, url: str) -> None:
    driver.get("about:blank")
    driver.get(url)


def test_experiments_table(browser: Any, local_store: Store, serve: Any, screenshot: Any) -> None:
    server = serve(local_store.uri)
    open_page(browser, server.url)
    wait_for(lambda: len(browser.find_elements("css selector", "section.experiment")) == 2,
             what="two experiment tables")
    for experiment, trials in LAYOUT.items():
        rows = table_rows(browser, experiment)
        assert sorted(rows) == sorted(trials)
        for trial, cells in rows.items():
            want = library_answer(local_store, experiment, trial)
            assert cells["reports"] == str(want["reports"])
            assert cells["checkpoints"] == str(len(want["committed"]))
            assert cells["size"] == f"{want['size']} bytes"
            assert cells["best checkpoint"] == want["best"]
            assert float(cells["best val/accuracy"]) == pytest.approx(want["best_score"], rel=1e-5)
            assert cells["status"] == "finished"
            params = trials[trial][2]
            if experiment == XSS:
                assert cells["note"] == params["note"]
            else:
                assert (float(cells["lr"]), int(cells["hidden"])) == (params["lr"],
                                                                     params["hidden"])
    # The experiment named like an HTML tag is text, its "note" param too.
    headings = [h.text for h in browser.find_elements("css selector", "section.experiment h2")]
    assert any(h.startswith(XSS) for h in headings)
    assert_no_script_ran(browser)
    # Sorting: by best score, then the other way round.
    header = next(th for th in browser.find_elements(
        "css selector", "section[data-experiment='sweep'] th") if th.text.startswith("best val"))
    header.click()
    order = lambda: [tr.get_attribute("data-trial") for tr in browser.find_elements(  # noqa: E731
        "css selector", "section[data-experiment='sweep'] tbody tr")]
    assert order() == ["lr-1.0", "lr-0.01", "lr-0.1"]
    browser.find_element("css selector", "section[data-experiment='sweep'] th.asc").click()
    assert order() == ["lr-0.1", "lr-0.01", "lr-1.0"]
    screenshot(browser, "ui-experiments")


def test_trial_chart_marks_each_checkpoint(browser: Any, local_store: Store, serve: Any,
                                           screenshot: Any) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    server = serve(local_store.uri)
    open_page(browser, server.url + route("trial", "sweep", "lr-0.1"))
    wait_for(lambda: browser.execute_script("return !!(window.csUI.chart)"), what="the chart")
    points = chart_points(browser)
    scores = LAYOUT["sweep"]["lr-0.1"][0]
    assert [p["y"] for p in points["line"]] == scores  # one point per report
    assert [p["x"] for p in points["line"]] == [1, 2, 3, 4, 5, 6]
    want = library_answer(local_store, "sweep", "lr-0.1")
    kept = sorted(p["name"] for k in ("best", "latest", "kept") for p in points[k])
    assert kept == sorted(want["kept"]) == sorted(want["committed"])  # one marker each
    # The best two (0.74 at report 5, 0.71 at report 3) and the latest (report 6).
    assert sorted((p["x"], p["y"]) for p in points["best"]) == [(3, 0.71), (5, 0.74)]
    assert [(p["x"], p["y"]) for p in points["latest"]] == [(6, 0.60)]
    assert sorted(p["x"] for p in points["evicted"]) == [1, 2, 4]
    # A trial that reported without a checkpoint: 4 points, 3 markers.
    open_page(browser, server.url + route("trial", "sweep", "lr-0.01"))
    wait_for(lambda: browser.execute_script(
        "return window.csUI.chart && window.csUI.trial.trial === 'lr-0.01'"), what="lr-0.01")
    other = chart_points(browser)
    assert len(other["line"]) == 4
    assert sum(len(other[k]) for k in ("best", "latest", "kept", "evicted")) == 3
    # Hovering the best marker names it, with its score and size.
    open_page(browser, server.url + route("trial", "sweep", "lr-0.1"))
    wait_for(lambda: browser.execute_script(
        "return window.csUI.chart && window.csUI.trial.trial === 'lr-0.1'"), what="lr-0.1")
    canvas = browser.find_element("id", "chart")
    x, y, w, h = browser.execute_script("""
        const c = window.csUI.chart;
        const i = c.data.datasets.findIndex((d) => d.kind === "best");
        const j = c.data.datasets[i].data.findIndex((p) => p.y === 0.74);
        const el = c.getDatasetMeta(i).data[j];
        return [el.x, el.y, c.canvas.clientWidth, c.canvas.clientHeight];""")
    ActionChains(browser).move_to_element_with_offset(canvas, int(x - w / 2),
                                                      int(y - h / 2)).perform()
    label = wait_for(lambda: browser.execute_script("""
        const t = window.csUI.chart.tooltip;
        return t && t.opacity > 0 ? t.body.map((b) => b.lines.join(" ")).join(" | ") : null;"""),
        what="the tooltip")
    size = next(c["size"] for c in browser.execute_script("return window.csUI.trial.checkpoints")
                if c["name"] == "checkpoint_000004")
    assert "checkpoint_000004" in label and "0.74" in label and fmt_size(size) in label
    screenshot(browser, "ui-trial")


def test_checkpoint_manifest_and_verify(browser: Any, local_store: Store, serve: Any,
                                        screenshot: Any) -> None:
    server = serve(local_store.uri)
    open_page(browser, server.url + route("trial", "sweep", "lr-1.0"))
    wait_for(lambda: browser.find_elements("css selector", "tr[data-kind='best'] a"),
             what="the checkpoints table")
    name = browser.find_elements("css selector", "tr[data-kind='best'] a")[0].text
    browser.find_elements("css selector", "tr[data-kind='best'] a")[0].click()
    wait_for(lambda: browser.find_elements("css selector", "#manifest tbody tr"), what="manifest")
    ctx = local_store.ctx("sweep", "lr-1.0")
    meta = dict(ctx.checkpoint(name).internal_metadata)
    shown = [[td.text for td in tr.find_elements("css selector", "td")]
             for tr in browser.find_elements("css selector", "#manifest tbody tr")]
    assert shown == [[e["path"], fmt_size(e["size"]), e["crc32c"]] for e in meta["manifest"]]
    assert '"note": "lr-1.0"' in browser.find_element("id", "user-metadata").text
    assert f"checkpoint-store download {ctx.uri(ctx.trial_path)}/{name}" in browser.find_element(
        "id", "snippet-shell").text
    browser.find_element("id", "verify").click()
    result = wait_for(lambda: "verify ok" in browser.find_element(
        "id", "verify-result").get_attribute("class") and browser.find_element(
        "id", "verify-result"), what="verify OK")
    assert result.text.startswith(f"OK: {len(meta['manifest'])} file(s)")
    screenshot(browser, "ui-checkpoint")
    # One flipped byte: verify names the file.
    path = os.path.join(local_store.uri, "sweep", "lr-1.0", name, "model.bin")
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        browser.find_element("id", "verify").click()
        failed = wait_for(lambda: "verify fail" in browser.find_element(
            "id", "verify-result").get_attribute("class") and browser.find_element(
            "id", "verify-result"), what="verify failure")
        assert "model.bin" in failed.text and failed.get_attribute("data-file") == "model.bin"
    finally:
        with open(path, "r+b") as f:
            f.seek(100)
            f.write(byte)


def test_chart_marker_click_opens_the_checkpoint(browser: Any, local_store: Store,
                                                 serve: Any) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    server = serve(local_store.uri)
    open_page(browser, server.url + route("trial", "sweep", "lr-0.1"))
    wait_for(lambda: browser.execute_script("return !!window.csUI.chart"), what="the chart")
    canvas = browser.find_element("id", "chart")
    x, y, w, h = browser.execute_script("""
        const c = window.csUI.chart;
        const i = c.data.datasets.findIndex((d) => d.kind === "latest");
        const el = c.getDatasetMeta(i).data[0];
        return [el.x, el.y, c.canvas.clientWidth, c.canvas.clientHeight];""")
    ActionChains(browser).move_to_element_with_offset(canvas, int(x - w / 2),
                                                      int(y - h / 2)).click().perform()
    wait_for(lambda: browser.find_elements("css selector", "#manifest tbody tr"), what="manifest")
    assert browser.find_element("css selector", "h1").text == "checkpoint_000005"


def test_report_appears_while_the_page_is_open(browser: Any, serve: Any, tmp_path: Any) -> None:
    store = Store(str(tmp_path / "live"))
    report_trial(store, "exp", "run", [0.2, 0.4], [True, True], {"lr": 0.5})
    server = serve(store.uri, refresh_s=0.5)
    open_page(browser, server.url + route("trial", "exp", "run"))
    wait_for(lambda: browser.execute_script("return !!window.csUI.chart"), what="the chart")
    assert len(chart_points(browser)["line"]) == 2
    start = time.monotonic()
    report_trial(store, "exp", "run", [0.9], [True], {"lr": 0.5})
    wait_for(lambda: len(chart_points(browser)["line"]) == 3, timeout=5.0,
             what="the new report on the chart")
    latency = time.monotonic() - start
    assert latency < 0.5 + 2.0  # one refresh interval plus the report itself and margin
    points = chart_points(browser)
    assert points["line"][-1]["y"] == 0.9
    assert [p["name"] for p in points["best"]] [-1] == "checkpoint_000002"
    assert "3 report(s)" in browser.find_element("id", "summary").text


def test_compare_overlays_trials(browser: Any, local_store: Store, serve: Any,
                                 screenshot: Any) -> None:
    server = serve(local_store.uri)
    open_page(browser, server.url)
    wait_for(lambda: browser.find_elements("css selector", "section[data-experiment='sweep'] "
                                                           "tbody input"), what="the table")
    for box in browser.find_elements("css selector", "section[data-experiment='sweep'] "
                                                     "tbody input"):
        box.click()
    browser.find_element("css selector", "section[data-experiment='sweep'] button.compare").click()
    wait_for(lambda: browser.execute_script("return !!window.csUI.chart"), what="the chart")
    lines = browser.execute_script("""return window.csUI.chart.data.datasets
        .filter((d) => d.type === "line").map((d) => [d.trialName, d.data.length]);""")
    assert sorted(lines) == sorted([t, len(v[0])] for t, v in LAYOUT["sweep"].items())
    # Each trial's best stars in that trial's colour: as set, and as painted at each
    # star's centre (where its strokes cross), never black.
    stars = browser.execute_script("""
        const c = window.csUI.chart, ctx = c.canvas.getContext("2d");
        const r = window.devicePixelRatio || 1, out = [];
        c.data.datasets.forEach((d, i) => {
            if (d.kind !== "best") return;
            const line = c.data.datasets.find(
                (l) => l.type === "line" && l.trialName === d.trialName);
            for (const p of c.getDatasetMeta(i).data) {
                const px = ctx.getImageData(Math.round(p.x * r), Math.round(p.y * r), 1, 1).data;
                out.push([d.trialName, d.borderColor, line.borderColor, [px[0], px[1], px[2]]]);
            }
        });
        return out;""")
    assert sorted({s[0] for s in stars}) == sorted(LAYOUT["sweep"])
    for trial, border, line_color, pixel in stars:
        assert border == line_color, trial
        want = [int(line_color[i:i + 2], 16) for i in (1, 3, 5)]
        assert max(abs(a - b) for a, b in zip(pixel, want, strict=True)) < 40, (trial, pixel)
    screenshot(browser, "ui-compare")


def test_names_are_text_everywhere(browser: Any, local_store: Store, serve: Any) -> None:
    server = serve(local_store.uri)
    open_page(browser, server.url + route("trial", XSS, XSS))
    wait_for(lambda: browser.execute_script("return !!window.csUI.chart"), what="the chart")
    assert browser.find_element("css selector", "h1").text == XSS
    assert XSS in browser.find_element("css selector", "nav.crumbs").text
    browser.find_element("css selector", "#checkpoints a").click()
    wait_for(lambda: browser.find_elements("css selector", "#manifest tbody tr"), what="manifest")
    assert XSS in browser.find_element("css selector", "nav.crumbs").text
    assert_no_script_ran(browser)
    # A hand-typed route outside the location shows the server's refusal, nothing else.
    open_page(browser, server.url + route("trial", "..", "etc"))
    error = wait_for(lambda: browser.find_elements("id", "error"), what="the error")[0]
    assert "single path component" in error.text
    logs = browser.get_log("browser")
    assert not [e for e in logs if "Content Security Policy" in e["message"]], logs


# -- issue 42, item 6: the page's everyday questions ------------------------------------


def test_state_checkpoint_shows_a_tensor_table(browser: Any, page_store: Store, serve: Any,
                                               screenshot: Any) -> None:
    from ui_helpers import STATE_TENSORS

    server = serve(page_store.uri)
    open_page(browser, server.url + route("checkpoint", "page", "state", "checkpoint_000000"))
    wait_for(lambda: browser.find_elements("css selector", "#tensors tbody tr"), what="tensors")
    rows = browser.execute_script("""return [...document.querySelectorAll("#tensors tbody tr")]
        .map((tr) => [...tr.children].map((td) => td.title || td.textContent));""")
    want = sorted([f"model/{k}", "F32", f"[{s[0]}, {s[1]}]", f"{4 * s[0] * s[1]} bytes",
                   "tensors-00001-of-00001.safetensors"] for k, s in STATE_TENSORS.items())
    assert sorted(rows) == want
    box = browser.find_element("id", "tensor-filter")
    box.send_keys("LAYER03")
    shown = lambda: [tr.get_attribute("data-tensor") for tr in browser.find_elements(  # noqa: E731
        "css selector", "#tensors tbody tr") if tr.is_displayed()]
    assert sorted(shown()) == ["model/layer03.bias", "model/layer03.weight"]
    assert browser.find_element("id", "tensor-count").text == "2 shown"
    python = browser.find_element("id", "snippet-python").text
    assert "checkpoint.load_state()" in python and "as_directory" not in python
    assert '"tensors"' not in browser.find_element("id", "internal-metadata").text
    # The raw index was 3,857 px tall for 24 tensors; the table and filter fit a screen more.
    box.clear()
    box.send_keys(" ")
    assert browser.execute_script("return document.body.scrollHeight") < 2600
    screenshot(browser, "ui-state-checkpoint")


def test_trial_page_params_metrics_x_axis_outliers_resumes(
        browser: Any, page_store: Store, serve: Any, screenshot: Any) -> None:
    from selenium.webdriver.support.ui import Select
    from ui_helpers import SPIKY_LOSS

    server = serve(page_store.uri)
    open_page(browser, server.url + route("trial", "page", "spiky"))
    wait_for(lambda: browser.execute_script(
        "return window.csUI.chart && window.csUI.trial.trial === 'spiky'"), what="the chart")
    # The run's parameters.
    params = {tr.get_attribute("data-param"): tr.find_element("css selector", "td").text
              for tr in browser.find_elements("css selector", "#params tr")}
    assert params == {"lr": "0.1", "opt": "adam"}
    # The user's metrics first, the auto-filled keys in their own group.
    groups = browser.execute_script("""return [...document.querySelectorAll("#metric optgroup")]
        .map((g) => [g.label, [...g.children].map((o) => o.value)]);""")
    assert groups == [["your metrics", ["loss", "step"]],
                      ["auto-filled", ["training_iteration", "timestamp", "time_total_s",
                                       "time_this_iter_s"]]]
    # One early spike (50) does not flatten the curve: the y axis ends near 1.
    y_max = lambda: browser.execute_script("return window.csUI.chart.scales.y.max")  # noqa: E731
    assert 0.9 < y_max() < 2
    assert [p["y"] for p in chart_points(browser)["line"]] == SPIKY_LOSS  # every point kept
    # The spike's report stays on the x axis (its line leaves the top), the ticks round.
    assert browser.execute_script("return window.csUI.chart.scales.x.min") == 1
    ticks = browser.execute_script("return window.csUI.chart.scales.y.ticks.map((t) => t.value)")
    assert all(round(t, 6) == round(t, 1) for t in ticks), ticks
    # The resume after report 6: a dashed purple line at x = 7, drawn on the canvas.
    resumes = "return window.csUI.chart.data.datasets.flatMap((d) => d.resumes || [])"
    assert browser.execute_script(resumes) == [7]
    purple = browser.execute_script("""
        const c = window.csUI.chart, x = Math.round(c.scales.x.getPixelForValue(7));
        const ctx = c.canvas.getContext("2d"), r = window.devicePixelRatio || 1;
        const data = ctx.getImageData(x * r - 1, c.chartArea.top * r,
                                      3, (c.chartArea.bottom - c.chartArea.top) * r).data;
        let n = 0;
        for (let i = 0; i < data.length; i += 4)
            if (Math.abs(data[i] - 0x6a) < 30 && Math.abs(data[i + 1] - 0x3d) < 30
                && Math.abs(data[i + 2] - 0x9a) < 30) n++;
        return n;""")
    assert purple > 50
    screenshot(browser, "ui-trial-outliers-resume")
    # The toggle shows every point again.
    browser.find_element("id", "robust-y").click()
    wait_for(lambda: y_max() >= 50, what="the full y range")
    browser.find_element("id", "robust-y").click()
    wait_for(lambda: y_max() < 2, what="the robust y range again")
    # Any reported number as the x axis: the user's step.
    Select(browser.find_element("id", "xaxis")).select_by_value("step")
    wait_for(lambda: [p["x"] for p in chart_points(browser)["line"]] == [
        10 * i for i in range(1, 13)], what="the curve over step")
    assert browser.execute_script(resumes) == [70]
    assert browser.execute_script("return window.csUI.chart.options.scales.x.title.text") == "step"
    Select(browser.find_element("id", "xaxis")).select_by_value("training_iteration")
    # Kinds are worded once: the best, then the other one kept by score.
    labels = {tr.get_attribute("data-checkpoint"): tr.find_element("css selector", ".badge").text
              for tr in browser.find_elements("css selector", "#checkpoints tbody tr")}
    assert labels == {"checkpoint_000011": "kept (best), latest",
                      "checkpoint_000010": "kept (top 2)"}


def test_evicted_checkpoint_page_says_when_and_why(browser: Any, page_store: Store,
                                                   serve: Any) -> None:
    server = serve(page_store.uri)
    open_page(browser, server.url + route("trial", "page", "spiky"))
    wait_for(lambda: browser.find_elements("id", "show-evicted"), what="the table")
    browser.find_element("id", "show-evicted").click()
    browser.find_element("css selector", "tr[data-checkpoint='checkpoint_000001'] a").click()
    text = wait_for(lambda: browser.find_element("id", "evicted").text, what="the eviction")
    assert "report 2" in text and "loss 1" in text
    assert "evicted after report 4" in text and "checkpoint_000003 was reported" in text
    assert "best 2 by loss (min)" in browser.find_element("id", "evicted-reason").text
    kept = [a.text for a in browser.find_elements("css selector", "#kept-instead a")]
    assert kept == ["checkpoint_000002", "checkpoint_000003"]
    browser.find_element("id", "back").click()
    wait_for(lambda: browser.execute_script(
        "return window.csUI.view === 'trial' && !!window.csUI.chart"), what="back at the trial")
