"""The suite's own scheduling (tests/conftest.py): under pytest-xdist, a test
of tests/crash runs while no other test runs, unless it is marked
``no_deadline``; consecutive exclusive tests of one worker hold the machine
from the first to the last, and the other tests still run side by side.

A real pytest run in three worker processes over a tree laid out like this
one, whose tests record when they ran."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CONFTEST = os.path.join(os.path.dirname(__file__), "conftest.py")

_RECORD = '''
import fcntl, os, time
def record(kind, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    line = f"{os.environ['PYTEST_XDIST_WORKER']} {kind} {start} {time.monotonic()}\\n"
    with open(os.environ["CS_LOCK_LOG"], "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line)
'''


def test_exclusive_tests_run_alone_in_one_block_and_the_rest_side_by_side(tmp_path):
    root = tmp_path / "tree"
    (root / "tests" / "crash").mkdir(parents=True)
    (root / "tests" / "conftest.py").write_text(textwrap.dedent(f'''
        import importlib.util
        _spec = importlib.util.spec_from_file_location("_cs_conftest", {CONFTEST!r})
        _mod = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_mod)
        pytest_collection_modifyitems = _mod.pytest_collection_modifyitems
        pytest_runtest_protocol = _mod.pytest_runtest_protocol
    '''))
    (root / "tests" / "record.py").write_text(_RECORD)
    (root / "tests" / "crash" / "test_kills.py").write_text(textwrap.dedent('''
        import pytest
        from record import record

        @pytest.mark.parametrize("i", range(3))
        def test_kill(i):
            record("exclusive", 0.4)

        @pytest.mark.no_deadline
        def test_fixed_line():
            record("no_deadline", 0.1)
    '''))
    # Collected before and after tests/crash, so that they are still running
    # when its tests' turn comes, whatever order the workers take files in.
    for where in ("a_before", "z_after"):
        (root / "tests" / where).mkdir()
        for n in range(4):
            (root / "tests" / where / f"test_{where}{n}.py").write_text(textwrap.dedent('''
                import pytest
                from record import record

                @pytest.mark.parametrize("i", range(8))
                def test_shared(i):
                    record("shared", 0.2)
            '''))
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    exclusive\n    no_deadline\n")
    log = tmp_path / "ran.log"
    env = {**os.environ, "CS_LOCK_LOG": str(log),
           "PYTHONPATH": str(root / "tests")}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "3", "--dist", "loadfile", str(root / "tests")],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = [(w, kind, float(a), float(b))
            for w, kind, a, b in (line.split() for line in log.read_text().splitlines())]
    assert sorted(k for _, k, _, _ in runs).count("exclusive") == 3 and len(runs) == 68

    exclusive = [r for r in runs if r[1] == "exclusive"]
    block = (min(r[2] for r in exclusive), max(r[3] for r in exclusive))
    others = [r for r in runs if r[1] != "exclusive"]
    for w, kind, a, b in others:  # nothing ran inside the exclusive block
        assert b <= block[0] or a >= block[1], (w, kind, a, b, block)

    def overlap(r, s):
        return r[2] < s[3] and s[2] < r[3]

    shared = [r for r in runs if r[1] == "shared"]
    assert any(overlap(r, s) for r in shared for s in shared if r[0] != s[0]), \
        "the shared tests ran one at a time"
