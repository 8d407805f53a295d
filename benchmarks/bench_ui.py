"""The web page on a long run, in headless Chromium: a trial of 20,000 reports and 303
checkpoints, and a comparison of 50 trials.

Measured, each against the page's earlier way of loading the same trial in the same
run (every ``result.json`` row in one answer, ``api/trial?since=0``):

- the trial page ready (chart drawn) after navigation, median of 5, and the same
  with a new server for each load (the trial read for the first time);
- a metric switch (the new chart drawn), median of 5;
- bytes of the first view (page, scripts, data), from the browser's resource timing;
- the server's first read of the trial without a browser (config, trial, the default
  metric's series through Flask's test client), in new processes, median of 5;
- server CPU and bytes of a poll while nothing changed (an ``If-None-Match`` poll
  answered 304), median over 200 requests through Flask's test client.

Run: ``.venv/bin/python -m benchmarks.bench_ui`` (needs the ``ui`` extra, selenium,
and Debian's chromium and chromium-driver, as ``scripts/test.sh`` installs them).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from checkpoint_store import Checkpoint, CheckpointConfig, session
from checkpoint_store.ui._model import StoreView
from checkpoint_store.ui._server import Server, create_app

CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--disable-background-networking", "--disable-dev-shm-usage",
               "--window-size=1280,900"]


def write_trial(root: str, reports: int = 20_000, every: int = 66) -> None:
    cfg = CheckpointConfig(num_to_keep=5, checkpoint_score_attribute="acc",
                           checkpoint_score_order="max")
    src = tempfile.mkdtemp()
    with open(os.path.join(src, "m.bin"), "wb") as f:
        f.write(b"w" * 64)
    with session.start(storage_path=root, experiment_name="long", trial_name="run",
                       checkpoint_config=cfg):
        for i in range(reports):
            metrics = {"acc": (i % 997) / 997, "loss": 1.0 / (i + 1), "lr": 1e-3}
            ckpt = Checkpoint.from_directory(src) if i % every == every - 1 else None
            session.report(metrics, checkpoint=ckpt)
    shutil.rmtree(src)


def _browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in [*CHROME_ARGS, f"--user-data-dir={tempfile.mkdtemp()}"]:
        options.add_argument(arg)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def _wait(driver: Any, script: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if driver.execute_script(script):
            return
        time.sleep(0.005)
    raise TimeoutError(script)


def page_ready(driver: Any, url: str, reps: int = 5) -> tuple[float, float]:
    """(the first load, with the server reading result.json; the median of ``reps``)."""
    times = []
    for _ in range(reps):
        driver.get("about:blank")
        start = time.perf_counter()
        driver.get(url)
        _wait(driver, "return !!(window.csUI && window.csUI.chart && "
                      "window.csUI.chart.data.datasets[0].data.length)")
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times)


def metric_switch(driver: Any, reps: int = 5) -> float:
    """Milliseconds from the select's change to the new chart, measured in the page."""
    times = []
    for i in range(reps):
        metric = ("loss", "acc")[i % 2]
        times.append(driver.execute_async_script("""
            const [metric, done] = arguments;
            const sel = document.getElementById("metric");
            window.csUI.etags = {};  // no answer held: the series is built and sent
            const t0 = performance.now();
            sel.value = metric; sel.dispatchEvent(new Event("change"));
            (function wait() {
              const c = window.csUI.chart;
              if (c && c.options.scales.y.title.text === metric) done(performance.now() - t0);
              else requestAnimationFrame(wait);
            })();""", metric))
    return statistics.median(times) / 1000


def first_view_bytes(driver: Any) -> int:
    return driver.execute_script("""
        return performance.getEntriesByType("resource").reduce((a, e) => a + e.transferSize, 0)
            + performance.getEntriesByType("navigation")[0].transferSize;""")


def poll_cost(view: StoreView, path: str, n: int = 200) -> tuple[float, int]:
    """(median server CPU seconds, bytes) of ``path`` polled with its own ETag."""
    client = create_app(view).test_client()
    first = client.get(path, headers={"Host": "127.0.0.1"})
    etag = first.headers.get("ETag")
    headers = {"Host": "127.0.0.1", **({"If-None-Match": etag} if etag else {})}
    cpu, size = [], 0
    for _ in range(n):
        t = time.thread_time()
        resp = client.get(path, headers=headers)
        cpu.append(time.thread_time() - t)
        size = len(resp.get_data()) + sum(len(k) + len(v) + 4 for k, v in resp.headers.items())
    return statistics.median(cpu), size


def first_read(root: str) -> float:
    """Seconds the server takes to answer what the trial page asks for first (its
    config, the trial, the series of its default metric) when it has not read the
    trial before: a new :class:`StoreView`, requests through Flask's test client."""
    client = create_app(StoreView(root)).test_client()
    headers = {"Host": "127.0.0.1"}
    start = time.perf_counter()
    client.get("/api/config", headers=headers)
    trial = client.get("/api/trial?experiment=long&trial=run", headers=headers).get_json()
    metric = trial["metric"] if trial["metric"] in trial["metrics"] else trial["user_metrics"][0]
    series = client.get(f"/api/series?experiment=long&trial=run&metric={metric}"
                        "&x=training_iteration", headers=headers)
    assert series.status_code == 200 and series.get_json()["total"] == trial["total_rows"]
    return time.perf_counter() - start


def first_reads(root: str, reps: int = 5) -> list[float]:
    """:func:`first_read` in ``reps`` new processes, one after another (each a fresh
    server: no module, cache or allocator state of an earlier read)."""
    import subprocess
    import sys

    code = ("import sys; from benchmarks.bench_ui import first_read; "
            "print(first_read(sys.argv[1]))")
    out = []
    for _ in range(reps):
        done = subprocess.run([sys.executable, "-c", code, root], check=True,
                              capture_output=True, text=True)
        out.append(float(done.stdout.split()[-1]))
    return out


def main() -> None:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    root = tempfile.mkdtemp(prefix="cs-bench-ui-")
    try:
        t = time.perf_counter()
        write_trial(root)
        print(f"store: 20,000 reports, 303 checkpoints in {time.perf_counter() - t:.1f} s")
        reads = first_reads(root)
        view = StoreView(root)
        server = Server(view).start()
        driver = _browser()
        try:
            url = server.url + "#/trial/long/run"
            page_ready(driver, url, reps=1)  # the browser's own first start, not counted
            # A server that has not read the trial yet (result.json parsed whole,
            # every checkpoint inspected): a new one for each of 5 loads.
            colds = []
            for _ in range(5):
                fresh = Server(StoreView(root)).start()
                try:
                    colds.append(page_ready(driver, fresh.url + "#/trial/long/run", reps=1)[0])
                finally:
                    fresh.stop()
            cold = statistics.median(colds)
            _, ready = page_ready(driver, url)
            first = first_view_bytes(driver)
            switch = metric_switch(driver)
        finally:
            driver.quit()
            server.stop()
        poll_cpu, poll_bytes = poll_cost(view, "/api/trial?experiment=long&trial=run")
        old_cpu, old_bytes = poll_cost(view, "/api/trial?experiment=long&trial=run&since=0", 20)
        rows = [
            ("trial page ready, server reading the trial first, median of 5",
             f"{cold:.3f} s", "<= 0.5 s"),
            ("server's first read (config, trial, series), median of 5 processes",
             f"{statistics.median(reads):.3f} s", ""),
            ("trial page ready after navigation, median of 5", f"{ready:.3f} s", "<= 0.5 s"),
            ("metric switch", f"{switch * 1000:.0f} ms", "<= 100 ms"),
            ("first view transferred", f"{first / 1e6:.2f} MB", "<= 1 MB"),
            ("poll, nothing changed: server CPU", f"{poll_cpu * 1000:.2f} ms", "<= 5 ms"),
            ("poll, nothing changed: bytes", f"{poll_bytes} B", "<= 1 KB"),
            ("baseline: every row in one answer (CPU)", f"{old_cpu * 1000:.0f} ms", ""),
            ("baseline: every row in one answer (bytes)", f"{old_bytes / 1e6:.2f} MB", ""),
        ]
        print("| measure | value | target |\n|---|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
