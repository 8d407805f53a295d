"""The CLI package's shape, and the one rank key it shares with the manager."""

from __future__ import annotations

import ast
import importlib
import math
import pkgutil
import random
import warnings
from pathlib import Path

import pytest

import checkpoint_store.cli as cli
from checkpoint_store.retention import CheckpointConfig, rank_key, score_of, select_kept

ROOT = Path(cli.__file__).resolve().parents[1]


def _cli_modules() -> list[str]:
    return ["checkpoint_store.cli"] + [
        f"checkpoint_store.cli.{m.name}" for m in pkgutil.iter_modules(cli.__path__)
    ]


@pytest.mark.parametrize("name", _cli_modules())
def test_every_cli_module_says_what_it_owns_and_exports_what_exists(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__ and module.__doc__.strip()
    exported = module.__all__
    assert exported and all(hasattr(module, n) for n in exported)
    assert not [n for n in exported if n.startswith("_")]
    lines = Path(module.__file__ or "").read_text(encoding="utf-8").count("\n")
    assert lines <= 600, f"{name} has {lines} lines"


def test_no_module_outside_the_cli_reaches_for_its_private_names() -> None:
    reached = []
    for path in ROOT.rglob("*.py"):
        if path.is_relative_to(ROOT / "cli"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith("checkpoint_store.cli")):
                reached += [f"{path.name}: {a.name}" for a in node.names
                            if a.name.startswith("_")]
            if isinstance(node, ast.ImportFrom) and node.module == "checkpoint_store":
                assert "cli" not in {a.name for a in node.names}, path
    assert reached == []


def _best_by_selection(scores: list[float | None], order: str) -> int:
    config = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="m",
                              checkpoint_score_order=order, keep_latest=False)  # type: ignore[arg-type]
    records = [(i, f"checkpoint_{i:06d}", {} if s is None else {"m": s})
               for i, s in enumerate(scores)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # missing scores warn once
        kept, _ = select_kept(records, config)
    assert len(kept) == 1
    return kept[0].index


@pytest.mark.parametrize("order", ["min", "max"])
def test_rank_key_picks_what_the_manager_keeps(order: str) -> None:
    rng = random.Random(13)
    pool: list[float | None] = [None, math.nan, math.inf, -math.inf, 0.0, 1.0, 1.0, -2.5]
    for _ in range(300):
        scores = [rng.choice(pool) for _ in range(rng.randint(1, 7))]
        clean = [None if s is None else score_of({"m": s}, "m") for s in scores]
        best = max(range(len(scores)), key=lambda i: rank_key(clean[i], i, order))
        assert best == _best_by_selection(scores, order), (scores, order)


def test_rank_key_edges() -> None:
    # Numbers above missing ones in both orders; ties go to the newer index.
    assert rank_key(-math.inf, 0, "max") > rank_key(None, 9, "max")
    assert rank_key(math.inf, 0, "min") > rank_key(None, 9, "min")
    assert rank_key(1.0, 2, "min") > rank_key(1.0, 1, "min")
    assert rank_key(0.5, 0, "min") > rank_key(0.7, 5, "min")
