#!/usr/bin/env bash
# Every package builds and installs alone. laminar-core and each plugin build a wheel and an
# sdist (the wheel is built from the sdist, so a file missing from the sdist fails here); then,
# for each plugin, a fresh venv gets core's wheel plus that plugin's wheel and nothing else,
# with versions from requirements/cpu.lock, and `laminar plugins` must list the plugin from its
# own package. Run by scripts/test.sh (CI); needs the venv scripts/install.sh made.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/uv.sh
die() { echo "check_packages.sh: $*" >&2; exit 1; }
venv=${VIRTUAL_ENV:-$PWD/.venv}
uv=$venv/bin/uv
[ -x "$uv" ] || die "no uv in $venv: run scripts/install.sh first"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export UV_PYTHON_DOWNLOADS=never
# package folder -> "KIND NAME" that `laminar plugins` must list with that package
declare -A plugin=(
  [fsdp]="trainer fsdp" [megatron]="trainer megatron" [vllm]="rollout vllm"
  [sglang]="rollout sglang" [nccl]="transport nccl" [rdma]="transport rdma"
  [sandbox]="env python_sandbox"
)
t0=$SECONDS
for dir in . "${!plugin[@]}"; do
  src=$dir; [ "$dir" = . ] || src=plugins/$dir
  "$venv/bin/python" -m build --installer uv -q --outdir "$work/dist" "$src" >"$work/build.log" 2>&1 \
    || { cat "$work/build.log" >&2; die "$src does not build (python -m build $src)"; }
done
ls "$work"/dist/*.tar.gz >/dev/null
core=$(ls "$work"/dist/laminar_core-*.whl)
for dir in "${!plugin[@]}"; do
  name=laminar_${dir}
  env=$work/venv-$dir
  "$uv" venv -q --python "$venv/bin/python" "$env"
  # shellcheck disable=SC2046
  "$uv" pip install -q --python "$env/bin/python" $(torch_sources) -c requirements/cpu.lock \
    "$core" "$work"/dist/"$name"-*.whl \
    || die "core + laminar-$dir does not install alone against requirements/cpu.lock"
  listed=$("$env/bin/laminar" plugins 2>&1) || { echo "$listed" >&2; die "laminar plugins failed with only core + laminar-$dir"; }
  read -r kind pname <<<"${plugin[$dir]}"
  echo "$listed" | grep -qE "^$kind +$pname +laminar-$dir " \
    || { echo "$listed" >&2; die "laminar plugins does not list $kind $pname from laminar-$dir"; }
  rm -rf "$env"
done
echo "check_packages.sh: 8 packages built (wheel + sdist); core + each of ${#plugin[@]} plugins installs alone and is listed ($((SECONDS - t0)) s)"
