"""The README's "In your code" example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_session_example_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    example = next(b for b in blocks if "session.start" in b)
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {"__name__": "readme"})
    trial = tmp_path / "results" / "exp" / "run1"
    kept = sorted(p.name for p in trial.iterdir() if p.name.startswith("checkpoint_"))
    # num_to_keep=3 by rising val_accuracy: the last three of ten reports.
    assert kept == ["checkpoint_000007", "checkpoint_000008", "checkpoint_000009"]
    assert len((trial / "result.json").read_text().splitlines()) == 10
