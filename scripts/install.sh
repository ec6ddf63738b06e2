#!/usr/bin/env bash
# Install laminar-core (and its test tools) into the current Python environment.
# torch is pinned first: the CPU build 2.13.0 satisfies laminar-core's torch requirement, so
# no dependency pulls a multi-GB CUDA build afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --disable-pip-version-check -q "torch==2.13.0"
python -m pip install --disable-pip-version-check -q -e ".[test]"
