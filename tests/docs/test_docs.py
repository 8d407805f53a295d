"""The documentation site: it builds with ``mkdocs build --strict`` (offline), and
every code example in it, and in README.md, runs.

Conventions in docs/*.md and README.md (checked here):

* ```` ```python ```` blocks run in order, one namespace per page, in a fresh
  temporary directory that is also ``$HOME``.
* ```` ```python title="name.py" ```` blocks are written to that file instead.
* ```` ```bash ```` blocks run with ``bash -euo pipefail`` in the same directory,
  with the package's ``checkpoint-store`` and ``python`` first on ``PATH``.
* ``text``/``json``/``toml``/``yaml`` blocks are output or configuration samples.
* A block right after ``<!-- not-run: reason -->`` is skipped (installs,
  the full demo); the reason is mandatory.
* Pages naming ``s3://BUCKET`` or ``az://CONTAINER`` get a local moto S3 or
  Azurite server through the standard environment variables, with those
  buckets and containers created.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
RUNNABLE = {"python", "bash"}
SAMPLES = {"", "text", "json", "toml", "yaml", "console", "ini"}  # "": plain text

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                    re.M | re.S)
_NOT_RUN = re.compile(r"<!--\s*not-run:(?P<reason>[^>]*)-->\s*$")
_TITLE = re.compile(r'title="(?P<title>[^"]+)"')


@dataclass
class Block:
    page: str
    line: int
    lang: str
    title: str | None
    body: str
    not_run: str | None


def blocks_of(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    out = []
    for m in _FENCE.finditer(text):
        info = m.group("info").strip()
        lang = info.split()[0] if info else ""
        title = _TITLE.search(info)
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _NOT_RUN.search(before)
        indent = m.group("indent")
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line
                         for line in m.group("body").split("\n"))
        out.append(Block(page.name, text.count("\n", 0, m.start()) + 1, lang,
                         title.group("title") if title else None, body,
                         skip.group("reason").strip() if skip else None))
    return out


README = REPO / "README.md"


def _pages() -> list[Path]:
    """The site's pages, and the README (the page read first; not part of the site)."""
    return [*sorted(DOCS.glob("*.md")), README]


def _runnable_pages() -> list[Path]:
    return [p for p in _pages()
            if any(b.lang in RUNNABLE and b.not_run is None for b in blocks_of(p))]


# Pages whose example trains a small model with a framework: seconds, not milliseconds.
# ray.md starts a Ray cluster and a TorchTrainer of two workers: about 90 s here;
# preemption.md preempts and restarts a Lightning fit and a Trainer run.
# README.md runs an Optuna study of 8 trials and a torch state save (about 20 s
# here); quickstart.md two torch state runs, each starting a persist process,
# and CLI calls (about 40 s).
_SLOW_PAGES = {"hf.md", "dcp.md", "ray.md", "preemption.md", "README.md", "quickstart.md",
               "sharded-state.md"}


def _page_params() -> list:
    return [pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in _SLOW_PAGES
                         else []) for p in _runnable_pages()]


def test_every_block_is_run_or_says_why_not() -> None:
    unknown, unexplained = [], []
    for page in _pages():
        for b in blocks_of(page):
            if b.lang not in RUNNABLE | SAMPLES:
                unknown.append(f"{b.page}:{b.line} ```{b.lang}")
            if b.not_run is not None and not b.not_run:
                unexplained.append(f"{b.page}:{b.line}")
    assert not unknown, f"code blocks without a known language: {unknown}"
    assert not unexplained, f"not-run markers need a reason: {unexplained}"


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cli = (site / "cli" / "index.html").read_text(encoding="utf-8")
    for command in ("ls", "show", "best", "download", "upload", "cp", "verify", "prune", "gc",
                    "backends", "demo", "ui", "plot"):
        assert f"checkpoint-store {command}" in cli
    assert "--dry-run" in cli and "--storage-option" in cli
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert "select_kept" in api and "persist_checkpoint" in api
    # Offline: nothing in the built pages loads fonts or scripts from the internet.
    for html in site.rglob("*.html"):
        body = html.read_text(encoding="utf-8")
        assert "fonts.googleapis.com" not in body, html


def _ensure_bucket(server, name: str) -> None:
    try:
        server.create_bucket(name)
    except Exception:  # noqa: BLE001 - it exists from an earlier page
        pass


def _ensure_container(server, name: str) -> None:
    try:
        server.create_container(name)
    except Exception:  # noqa: BLE001 - it exists from an earlier page
        pass


@pytest.mark.parametrize("page", _page_params())
def test_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      request: pytest.FixtureRequest) -> None:
    blocks = [b for b in blocks_of(page) if b.lang in RUNNABLE and b.not_run is None]
    code = "\n".join(b.body for b in blocks)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    bin_dir = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ.get("PATH", ""))
    buckets = sorted(set(re.findall(r"s3://([a-z0-9][a-z0-9.\-]+)", code)))
    if buckets:
        request.getfixturevalue("s3_env")
        server = request.getfixturevalue("s3_server")
        for name in buckets:
            _ensure_bucket(server, name)
    containers = sorted(set(re.findall(r"az://([a-z0-9][a-z0-9\-]+)", code)))
    if containers:
        request.getfixturevalue("azure_env")
        server = request.getfixturevalue("azure_server")
        for name in containers:
            _ensure_container(server, name)
    # Pages may register example backends; they must not leak into later tests.
    from checkpoint_store import registry

    registered = dict(registry._code_registered)
    request.addfinalizer(lambda: (registry._code_registered.clear(),
                                  registry._code_registered.update(registered)))
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for b in blocks:
        where = f"{b.page}:{b.line}"
        if b.title is not None:
            (tmp_path / b.title).write_text(b.body, encoding="utf-8")
        elif b.lang == "python":
            exec(compile(b.body, where, "exec"), namespace)  # noqa: S102 - the docs' own code
        else:
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", b.body], cwd=tmp_path,
                                  env=dict(os.environ), capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == 0, (
                f"{where} failed ({proc.returncode}):\n{b.body}\n--- stdout\n{proc.stdout}"
                f"\n--- stderr\n{proc.stderr}")
