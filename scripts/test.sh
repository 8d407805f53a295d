#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what it needs, then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -m "not slow" -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
exec .venv/bin/python -m pytest "$@"
