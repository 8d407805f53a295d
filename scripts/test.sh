#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what it needs, then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -m "not slow" -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
# Worker processes (pytest-xdist), each running whole test files: most of the
# suite waits on servers, subprocesses, fsync and sleeps, so three workers keep
# two cores busy. Later arguments win: `scripts/test.sh -n 0` runs in one process.
exec .venv/bin/python -m pytest -n "${CS_TEST_WORKERS:-3}" --dist loadfile "$@"
