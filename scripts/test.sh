#!/usr/bin/env bash
# Install, lint, and run the whole test suite (what CI runs). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1
# NIXL's UCX backend over loopback TCP (no RDMA hardware here)
export UCX_TLS=tcp,self UCX_NET_DEVICES=lo
# the real-engine tests must run in CI, not skip
export LAMINAR_REQUIRE_REAL=1
python -m ruff check laminar_core tests benchmarks plugins
python -m pytest -q "$@"
