#!/usr/bin/env bash
# Install, check, lint and run the whole test suite (what CI runs: .ci/run). Extra args go to
# pytest. Runs in the active virtual environment, else in ./.venv, which scripts/install.sh
# creates without the machine's site-packages: a dependency the install forgets fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
venv=${VIRTUAL_ENV:-$PWD/.venv}
export PATH=$venv/bin:$PATH VIRTUAL_ENV=$venv
python - <<'PY'
import site, sys
# the suite must not see the machine's own packages (orjson, IPython, ... hid missing installs)
assert sys.prefix != sys.base_prefix, "not in a virtual environment"
assert not any(p.startswith(sys.base_prefix) for p in site.getsitepackages()), site.getsitepackages()
print(f"test.sh: {sys.executable} (Python {sys.version.split()[0]}), isolated venv {sys.prefix}")
PY
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1
# NIXL's UCX backend over loopback TCP (no RDMA hardware here)
export UCX_TLS=tcp,self UCX_NET_DEVICES=lo
# the real-engine tests must run in CI, not skip
export LAMINAR_REQUIRE_REAL=1
python -m ruff check laminar_core tests benchmarks plugins
python -m ruff format --check laminar_core tests benchmarks plugins
# the layers and the plugins' public-API rule ([tool.importlinter] in pyproject.toml)
lint-imports --no-cache
# the type checker, clean on core ([tool.mypy] in pyproject.toml)
python -m mypy laminar_core
# every package builds alone and installs alone (core + one plugin, against the lock)
bash scripts/check_packages.sh
python -m pytest -q "$@"
