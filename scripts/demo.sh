#!/usr/bin/env bash
# Train a digits classifier with checkpoints kept by checkpoint-store.
# Extra arguments go to `checkpoint-store demo` (e.g. --resume, --storage s3://...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh demo
exec .venv/bin/checkpoint-store demo "$@"
