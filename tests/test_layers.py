"""The package's folders import downward only, and no module imports in a circle.

The contracts live in pyproject.toml (``[tool.importlinter]``): a layers
contract from the public faces down to the backends and the errors, and two
independence contracts between the framework adapters. ``lint-imports``
(import-linter) checks them; its report names each import that breaks one.
The cycle count walks grimp's graph of every import statement, those inside
functions and under ``if TYPE_CHECKING:`` included.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "checkpoint_store"


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the package under ``root``, with the repository's contracts."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(exe), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )


def test_every_folder_imports_only_the_folders_below_it() -> None:
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr


def test_an_upward_import_breaks_the_layers_contract_and_is_named(tmp_path: Path) -> None:
    shutil.copytree(ROOT / PACKAGE, tmp_path / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__", "static"))
    layout = tmp_path / PACKAGE / "_format" / "layout.py"
    layout.write_text(layout.read_text(encoding="utf-8")
                      + "\n\ndef _climb() -> None:\n    from checkpoint_store import session\n",
                      encoding="utf-8")
    run = _lint_imports(tmp_path)
    assert run.returncode != 0
    assert "checkpoint_store._format.layout -> checkpoint_store.session" in run.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_in_a_circle() -> None:
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    assert f"{PACKAGE}._format.layout" in graph.modules
    cycles = _cycles(graph)
    details = []
    for component in cycles:
        members = set(component)
        for importer in component:
            for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
                lines = [d["line_number"] for d in
                         graph.get_import_details(importer=importer, imported=imported)]
                details.append(f"{importer} -> {imported} (l.{lines})")
    assert not cycles, "import cycles:\n" + "\n".join(details)


def test_the_cycle_count_sees_function_level_and_type_checking_imports() -> None:
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    graph.add_import(importer=f"{PACKAGE}._format.layout", imported=f"{PACKAGE}._util.fs")
    assert [f"{PACKAGE}._format.layout", f"{PACKAGE}._util.fs"] in _cycles(graph)
    # grimp records an import inside a function (session -> the Ray adapter
    # was one) and one under TYPE_CHECKING (the result log -> storage was one).
    details = graph.get_import_details(importer=f"{PACKAGE}.session._trial_runner",
                                       imported=f"{PACKAGE}.session._api")
    assert details, "the function-level import in TrialRunner._run is in the graph"
    details = graph.get_import_details(importer=f"{PACKAGE}._results.reader",
                                       imported=f"{PACKAGE}.backends.base")
    assert details, "the TYPE_CHECKING import of the result reader is in the graph"
