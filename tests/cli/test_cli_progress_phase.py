"""Issue 42, item 5: the CLI's progress bar names the step after the last
byte (the commit) and shows the mean rate, not one burst's."""

from __future__ import annotations

import os
from typing import Any

import pytest
from cli_helpers import invoke, write_tree


def test_cli_bar_names_the_commit_step_and_a_mean_rate(tmp_path: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from checkpoint_store.cli import progress as _cli_progress

    assert _cli_progress.mean_rate(10_000_000, 0.01) is None  # one burst: no rate yet
    assert _cli_progress.mean_rate(10_000_000, 2.0) == 5_000_000
    monkeypatch.setattr(_cli_progress, "_stdout_is_terminal", lambda: True)
    phases: list[str] = []
    real = _cli_progress.Progress

    class Spy(real):  # type: ignore[misc, valid-type]
        def advance(self, n: int) -> None:
            super().advance(n)
            phases.append(self.phase)

    monkeypatch.setattr(_cli_progress, "Progress", Spy)
    src = write_tree(str(tmp_path / "m"), {"a.bin": os.urandom(200_000)})
    res = invoke(["upload", src, str(tmp_path / "s" / "e" / "t")])
    assert res.exit_code == 0, res.output
    assert phases[-1] == "committing" and phases[0] == "transfer" or phases == ["committing"]
    assert "committing" in res.stderr
