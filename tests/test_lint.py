"""The tree stays ruff-clean (rules in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the test extra)")
    proc = subprocess.run(
        [ruff, "check", "checkpoint_store", "plugins", "tests", "benchmarks"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _session_reaches() -> tuple[list[str], list[str]]:
    """``(parameters typed as the session's Any, reaches of session._x outside
    the module that owns the Session)`` in the package."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    owner = root / "checkpoint_store" / "session" / "_session.py"
    untyped, reaches = [], []
    for path in sorted((root / "checkpoint_store").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(root)
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and node.arg in ("session", "sess"):
                ann = node.annotation
                if ann is None or (isinstance(ann, ast.Name) and ann.id == "Any") or (
                        isinstance(ann, ast.Constant) and ann.value == "Any"):
                    untyped.append(f"{rel}:{node.lineno} {node.arg}")
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in ("session", "sess") and node.attr.startswith("_")
                    and not node.attr.startswith("__") and path != owner):
                reaches.append(f"{rel}:{node.lineno} {node.value.id}.{node.attr}")
    return untyped, reaches


def test_no_function_takes_the_session_as_any_nor_reaches_into_it() -> None:
    untyped, reaches = _session_reaches()
    assert untyped == [], "type the parameter (or pass the part it needs): " + ", ".join(untyped)
    assert reaches == [], "go through a method of the owner: " + ", ".join(reaches)
