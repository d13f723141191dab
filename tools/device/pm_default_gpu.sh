#!/usr/bin/env bash
# Issue 31 / 32, 2026-11-27 (fourth session), one call: the pair merge on by default from
# PAIR_MERGE_MIN_CTAS CTAs (mosaic_gpu_ws.pair_merge_default) checked and timed in the model, the
# PyTorch CUDA-graph decode peer in the same run, and the fused norm's error per launch shape.
#   cd <repo> && OUT=/tmp/out bash tools/device/pm_default_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 tools/device/exactness_check.py 2>&1 | grep -v "^W[0-9]" | tee $OUT/exactness.log | tail -6
echo "== exactness done ($(( $(date +%s) - T0 )) s)"
STAGES=model BATCHES=1 VARIANTS="base nopm base@32768 nopm@32768" HEAD=8 bash tools/device/sem_splits_gpu.sh
STAGES=model BATCHES=1 VARIANTS="base" PROGRAMS=ar_loop,spec_loop LIMIT=200 HEAD=30 bash tools/device/sem_splits_gpu.sh
timeout 150 python3 -m qspec_jax.bench.torch_decode --contexts 4096 --weights bf16,int4 \
  --out $OUT/torch_decode_4k.json 2>&1 | grep -v "^W[0-9]" | tail -4
echo "== torch decode done ($(( $(date +%s) - T0 )) s)"
timeout 150 python3 tools/device/w4a16_norm_gpu.py --m 1,8,16 2>&1 | grep -v "^W[0-9]" | tee $OUT/w4a16_norm.log
echo "== all done ($(( $(date +%s) - T0 )) s)"
