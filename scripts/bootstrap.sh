#!/usr/bin/env bash
# Create .venv and install checkpoint-store with what the given extras need.
# Idempotent: a stamp keyed on the dependency files skips work already done.
# Usage: scripts/bootstrap.sh demo|test
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-test}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
pip_install() {
    .venv/bin/python -m pip install --disable-pip-version-check -q -c constraints.txt "$@" 2>&1 \
        | { grep -v "^WARNING: Location" || true; }
    return "${PIPESTATUS[0]}"
}
stamp_of() {
    cat constraints.txt pyproject.toml scripts/bootstrap.sh \
        $(ls plugins/*/pyproject.toml tests/plugins/*/pyproject.toml tools/package.json 2>/dev/null) \
        | sha256sum | cut -c1-16
}
# The browser tests (tests/ui) drive Debian's Chromium through its chromedriver;
# no browser is downloaded by a Python package. Checked on every run (cheap), so a
# machine that lost them gets them back even when the Python stamp is current.
ensure_browser() {
    if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
        return 0
    fi
    if [ "$(id -u)" = 0 ]; then
        echo "bootstrap: installing chromium and chromium-driver (apt) for the browser tests" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    else
        echo "bootstrap: chromium/chromedriver missing and not root: the browser tests will" \
             "skip (or fail under CI); run: sudo apt-get install chromium chromium-driver" >&2
    fi
}
if [ "$what" = test ]; then
    ensure_browser
fi
stamp=".venv/.installed-$what-$(stamp_of)"
if [ -f "$stamp" ]; then
    exit 0
fi
case "$what" in
    demo)
        pip_install -e ".[demo,tune]"
        ;;
    test)
        args=(-e ".[test,demo,tune,docs,bench,ui,lightning,torch,hf,ray]")
        for p in plugins/*/pyproject.toml tests/plugins/*/pyproject.toml; do
            [ -f "$p" ] && args+=(-e "$(dirname "$p")")
        done
        # The CPU build of torch lies on this machine's disk; a plain "torch"
        # would pull a multi-GB CUDA build. On the same command line as the
        # [lightning], [torch] and [hf] extras, so none of them pulls another torch.
        pip_install "${args[@]}" "torch==2.13.0"
        if [ -f tools/package.json ]; then
            (cd tools && npm install --no-audit --no-fund --loglevel=error >/dev/null)
        fi
        ;;
    *)
        echo "usage: scripts/bootstrap.sh demo|test" >&2
        exit 2
        ;;
esac
rm -f .venv/.installed-"$what"-*
touch "$stamp"
