"""Fixtures for the ui tests: a real browser, stores written by real sessions, the server.

The browser is Debian's headless Chromium driven through its chromedriver
(``scripts/bootstrap.sh test`` installs both with apt; nothing is downloaded
by a Python package). It starts once per test module. Without it the browser
tests skip, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ui_helpers import Store, write_store

from checkpoint_store.ui._model import StoreView
from checkpoint_store.ui._server import Server

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
REPO = Path(__file__).resolve().parents[2]
# CHECKPOINT_STORE_UPDATE_SCREENSHOTS=1 writes the docs page's screenshots into docs/images.
DOCS_IMAGES = REPO / "docs" / "images"
CHROME_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1280,900", "--force-device-scale-factor=1",
]


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium (selenium WebDriver) for the module."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        msg = (f"{' and '.join(missing)} missing: apt-get install chromium chromium-driver "
               "(scripts/bootstrap.sh test does it as root)")
        if _in_ci():
            pytest.fail(f"{msg} (CI=true, so this fails)", pytrace=False)
        pytest.skip(msg)
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="cs-ui-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in [*CHROME_ARGS, f"--user-data-dir={profile}"]:
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def local_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """2 experiments x 3 trials on local disk, written by real sessions."""
    store = Store(str(tmp_path_factory.mktemp("ui-store") / "results"))
    write_store(store)
    return store


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    """``serve(location, options, refresh_s)`` -> a running :class:`Server`; stopped after."""
    servers: list[Server] = []

    def start(location: str, options: Any = None, refresh_s: float = 0.5) -> Server:
        server = Server(StoreView(location, options), refresh_s=refresh_s).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def screenshot(tmp_path: Path) -> Callable[[Any, str], Path]:
    """``screenshot(driver, name)``: a PNG of the window, into docs/images when updating."""

    def take(driver: Any, name: str) -> Path:
        folder = DOCS_IMAGES if os.environ.get("CHECKPOINT_STORE_UPDATE_SCREENSHOTS") else tmp_path
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.png"
        driver.save_screenshot(str(path))
        assert path.stat().st_size > 10_000, f"{path} looks empty"
        return path

    return take


@pytest.fixture(scope="module")
def page_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """ui_helpers.write_page_store: a state checkpoint and a spiky, resumed trial."""
    from ui_helpers import write_page_store

    store = Store(str(tmp_path_factory.mktemp("ui-page") / "results"))
    write_page_store(store)
    return store
