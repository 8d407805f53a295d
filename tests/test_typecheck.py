"""The package and the backend plugins stay mypy-clean (config in pyproject.toml)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The plugin packages themselves: an editable install leaves a *.egg-info folder beside each.
PLUGINS = sorted(
    str(p.parent.relative_to(ROOT)) for p in ROOT.glob("plugins/*/checkpoint_store_*/__init__.py")
)


@pytest.mark.slow  # a cold run reads torch's, Ray's and Lightning's types: about a minute
def test_mypy_clean():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (it is in the test extra)")
    assert PLUGINS, "plugins/*/checkpoint_store_* holds the plugins mypy checks"
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "checkpoint_store", *PLUGINS],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
