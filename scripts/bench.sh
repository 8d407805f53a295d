#!/usr/bin/env bash
# Benchmarks: checkpoint-store against cp, pyarrow, fsspec/s3fs/adlfs and Ray,
# side by side, on the local disk, moto (S3) and Azurite (Azure) on 127.0.0.1,
# also through a delaying proxy (10 ms round trip, 1 Gbit/s; benchmarks/latency_link.py).
# Also the cost per operation against a trial's history (benchmarks/bench_scale.py:
# N checkpoints, M result rows; the plot goes to docs/images/bench-scale.png).
# Writes docs/benchmarks.md and docs/benchmarks.json. Extra arguments go to
# benchmarks/run.py (e.g. --quick, --only local,s3-link, --shapes "4 x 256 MiB",
# --only scale --merge --scale-label after --scale-args "--max-n 10000").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
.venv/bin/python -m pip install --disable-pip-version-check -q -c constraints.txt \
    -e ".[benchmarks]" 2>&1 | { grep -v "^WARNING: Location" || true; }
export AWS_EC2_METADATA_DISABLED=true RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
exec .venv/bin/python -m benchmarks.run --no-install "$@"
