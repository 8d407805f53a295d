"""The page over the moto S3 server in a real browser: the same answers as the
library, a chart per trial, verify naming a corrupt file, and the credentials
(given as storage options) nowhere in the page, the API responses or the logs."""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from test_browser import chart_points, open_page, route, table_rows
from ui_helpers import LAYOUT, Store, library_answer, report_trial, wait_for

# About 9 s of set-up (sessions writing to moto, a browser start): in the slow set.
pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def s3_store(s3_server: Any) -> Iterator[Store]:
    """The "sweep" experiment (3 trials) on a fresh bucket, written by real sessions."""
    bucket = s3_server.create_bucket()
    store = Store(f"s3://{bucket}/runs", s3_server.storage_options("pyarrow"))
    for trial, (scores, ckpts, params) in LAYOUT["sweep"].items():
        report_trial(store, "sweep", trial, scores, ckpts, params)
    yield store
    s3_server.delete_bucket(bucket)


def test_s3_page(browser: Any, s3_store: Store, serve: Any, s3_server: Any,
                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = s3_server.secret_access_key
    server = serve(s3_store.uri, s3_store.options)
    open_page(browser, server.url)
    wait_for(lambda: browser.find_elements("css selector", "section.experiment"), what="table")
    rows = table_rows(browser, "sweep")
    for trial, cells in rows.items():
        want = library_answer(s3_store, "sweep", trial)
        assert cells["reports"] == str(want["reports"])
        assert cells["checkpoints"] == str(len(want["committed"]))
        assert cells["size"] == f"{want['size']} bytes"
        assert cells["best checkpoint"] == want["best"]
    pages = [browser.page_source]

    open_page(browser, server.url + route("trial", "sweep", "lr-0.1"))
    wait_for(lambda: browser.execute_script("return !!window.csUI.chart"), what="the chart")
    points = chart_points(browser)
    assert len(points["line"]) == len(LAYOUT["sweep"]["lr-0.1"][0])
    assert sorted(p["x"] for p in points["best"]) == [3, 5]
    pages.append(browser.page_source)

    # Corrupt one byte of a kept checkpoint on S3 (same size): verify names the file.
    ctx = s3_store.ctx("sweep", "lr-0.1")
    path = f"{ctx.checkpoint('checkpoint_000004').path}/model.bin"
    fs = ctx.filesystem
    with fs.open_input_stream(path) as f:
        data = bytearray(f.read())
    data[10] ^= 0xFF
    with fs.open_output_stream(path) as f:
        f.write(bytes(data))
    open_page(browser, server.url + route("checkpoint", "sweep", "lr-0.1", "checkpoint_000004"))
    wait_for(lambda: browser.find_elements("css selector", "#manifest tbody tr"), what="manifest")
    browser.find_element("id", "verify").click()
    failed = wait_for(lambda: "verify fail" in browser.find_element(
        "id", "verify-result").get_attribute("class") and browser.find_element(
        "id", "verify-result"), what="verify failure")
    assert "model.bin" in failed.text
    pages.append(browser.page_source)

    api = ["api/config", "api/overview?full=1", "api/trial?experiment=sweep&trial=lr-0.1",
           "api/checkpoint?experiment=sweep&trial=lr-0.1&checkpoint=checkpoint_000004"]
    for path in api:
        with urllib.request.urlopen(server.url + path) as resp:
            body = resp.read().decode()
        assert json.loads(body) and secret not in body, path
        assert s3_server.access_key_id not in body, path
    for text in pages:
        assert secret not in text and s3_server.access_key_id not in text
    assert secret not in caplog.text and s3_server.access_key_id not in caplog.text
