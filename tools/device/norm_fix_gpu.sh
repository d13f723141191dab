#!/usr/bin/env bash
# 2026-11-27 (fourth session), one call: the fused norm's barrier (w4a16 _norm_finish) checked over
# launch shapes and row counts; the pair merge (now on by default from PAIR_MERGE_MIN_CTAS CTAs) on
# SmolLM2's heads (D 64, B 3: NP >= 8); the 8B draft step timed after both.
#   cd <repo> && OUT=/tmp/out bash tools/device/norm_fix_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
T0=$(date +%s)
timeout 200 python3 tools/device/w4a16_norm_gpu.py 2>&1 | grep -v "^W[0-9]" | tee $OUT/w4a16_norm.log
echo "== norm done ($(( $(date +%s) - T0 )) s)"
timeout 200 python3 tools/device/check_attention.py --parts check,tinv --quick --shapes smollm2 --impls mosaic 2>&1 \
  | grep -v "^W[0-9]" | tee $OUT/check_smollm2.log | tail -30
echo "== smollm2 attention done ($(( $(date +%s) - T0 )) s)"
STAGES=model BATCHES="1 8" VARIANTS="base" HEAD=8 bash tools/device/sem_splits_gpu.sh
echo "== all done ($(( $(date +%s) - T0 )) s)"
