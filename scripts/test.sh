#!/usr/bin/env bash
# Install, lint, and run the whole test suite (what CI runs). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
python -m ruff check laminar_core tests benchmarks
python -m pytest -q "$@"
