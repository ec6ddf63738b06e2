# Shared by scripts/install.sh and scripts/lock.sh (sourced, not run): the uv both use, and
# where the CPU build of torch comes from.
UV_VERSION=0.13.9
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# find-links directories pip is configured with (PIP_FIND_LINKS, pip.conf): uv does not read
# pip's configuration, so they are passed on. A machine that keeps wheels on disk (this
# project's CI machines keep the CPU torch in /opt/wheels) then needs no extra index.
torch_sources() {
  local dirs dir found=""
  dirs="${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true)"
  for dir in $dirs; do
    [ -d "$dir" ] || continue
    echo "--find-links $dir"
    compgen -G "$dir/torch-2.13.0+cpu-*.whl" >/dev/null && found=1
  done
  # elsewhere the CPU build comes from PyTorch's own index
  [ -n "$found" ] || echo "--extra-index-url $TORCH_CPU_INDEX"
  # torch+cpu lives on one index, everything else on PyPI: take each from where it is
  echo "--index-strategy unsafe-best-match"
}
