#!/usr/bin/env bash
# Issue 37's GPU figures in one device call (one H100): wheels of this checkout (laminar-core,
# laminar-fsdp) and omegaconf in whl/ next to the repository root, figures and logs to $OUT.
#   flex vs per-trajectory SDPA (forward + backward, bf16) -> check.log   (CHECK=1)
#   $SMALL_ROWS at $SHAPE_S, $LARGE_ROWS at $SHAPE_L (trainer_engine.py --goals rows), then one
#   $LONGEST-token trajectory with checkpointing and activation offload at $SHAPE_L
# Each stage is time-boxed; each row's figures are in $OUT/*.json as soon as they exist.
set -uo pipefail
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}
SHAPE_S=${SHAPE_S:-0.5b}
SHAPE_L=${SHAPE_L:-1.5b}
SMALL_ROWS=${SMALL_ROWS:-plain,base,flex,new}
LARGE_ROWS=${LARGE_ROWS:-base,new,new+ckpt}
LONGEST=${LONGEST:-131072}
CHECK=${CHECK:-1}
EXTRA=${EXTRA:-}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=8
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee $OUT/smi.txt
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
$PY -c "import flash_attn" 2>/dev/null && echo "flash-attn present" || echo "no flash-attn"
B=benchmarks/trainer_engine.py
filter() { grep --line-buffered -v "Loading weights\|Writing model\|USDT\|_warn_once\|acc_events"; }
[ "$CHECK" = 1 ] && timeout 60 $PY $B --check-attention 2>&1 | filter | tee $OUT/check.log
timeout ${T_S:-230} $PY $B --goals --shape $SHAPE_S --rows $SMALL_ROWS --steps ${STEPS_S:-3} \
  --budget-s ${BUDGET_S:-170} --json $OUT/small.json $EXTRA 2>&1 | filter | tee $OUT/small.log
timeout ${T_L:-270} $PY $B --goals --shape $SHAPE_L --rows $LARGE_ROWS --steps 2 \
  --budget-s ${BUDGET_L:-210} --longest $LONGEST --longest-offload-only \
  --json $OUT/large.json $EXTRA 2>&1 | filter | tee $OUT/large.log
echo "exit codes: ${PIPESTATUS[*]}"
