"""The page in a real browser: a trial with a local tier shows on which tiers each
checkpoint is committed, and a checkpoint still only on the local tier as such."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote

import pytest
from ui_helpers import wait_for

from checkpoint_store import Checkpoint, LocalTier, session

pytestmark = pytest.mark.browser


def _rows(driver: Any) -> dict[str, dict[str, str]]:
    return driver.execute_script("""
        const table = document.getElementById("checkpoints");
        if (!table) return {};
        const heads = [...table.querySelectorAll("thead th")].map((th) => th.textContent);
        const out = {};
        for (const tr of table.querySelectorAll("tbody tr")) {
            const cells = [...tr.children].map((td) => td.textContent);
            out[tr.dataset.checkpoint] = Object.fromEntries(heads.map((h, i) => [h, cells[i]]));
        }
        return out;""")


def test_the_checkpoints_table_has_a_tiers_column(browser: Any, serve: Any, tmp_path: Any
                                                  ) -> None:
    root = str(tmp_path / "durable")
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(os.urandom(1000))
    with session.start(storage_path=root, experiment_name="exp", trial_name="t1",
                       local_tier=LocalTier(str(tmp_path / "fast"), num_to_keep=1)) as s:
        for step in range(3):
            s.report({"loss": 1.0 / (step + 1)},
                     checkpoint=Checkpoint.from_directory(str(src)))
        s.wait()
    server = serve(root)
    browser.get("about:blank")
    browser.get(server.url + "#/" + "/".join(quote(p, safe="") for p in ("trial", "exp", "t1")))
    rows = wait_for(lambda: (r := _rows(browser)) and len(r) == 3 and r, what="three rows")
    assert rows["checkpoint_000002"]["tiers"] == "durable, local"
    assert rows["checkpoint_000000"]["tiers"] == "durable"
