#!/usr/bin/env bash
# Issue 32's GPU run (device tool; logs and JSON in $OUT), one call of <= 6 minutes:
#   1. tools/device/check_w4a16.py, fused part only: the four fused kernels of the 8B draft layer on
#      fresh random inputs (mma and wgmma, M = 1, 5, 16) against epilogue_reference / bitwise against
#      unfused + residual, their row invariance, then M = 1 timings against the unfused kernel plus
#      the XLA glue (and PDL, split-K in the cluster and 8-deep rings for qkv and o);
#   2. tools/device/issue32_profile.py: the draft step (8B, batch 1, 4k) unfused / fused / fused + PDL,
#      kernels by category and launches per layer, and the optimized HLO with loop_convert_fusion's body;
#      SPEC_LOOP=unfused,fused: the QuantSpec loop (gamma 4, forced acceptance 0.9) too, AR_LOOP=1 its AR base.
# Knobs (environment): CHECK_SKIP, CHECK_S, FUSED_BUDGET, VARIANTS, PROFILE_S, PROFILE_BUDGET, SPEC_LOOP, AR_LOOP, HLO.
# Run 2 of issue 32: CHECK_SKIP=sass,correctness,rows,diag,timing,fused CHECK_S=100 FUSED_BUDGET=85
#   VARIANTS=unfused,fused SPEC_LOOP=unfused,fused AR_LOOP=1 HLO=0 PROFILE_S=230 PROFILE_BUDGET=200
# Run from the repository root: bash tools/device/issue32_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee $OUT/gpu.txt
timeout ${CHECK_S:-125} python3 tools/device/check_w4a16.py --out $OUT --skip ${CHECK_SKIP:-sass,correctness,rows,diag,timing} \
  --fused-budget ${FUSED_BUDGET:-45} 2>&1 | tee $OUT/check_fused.log | grep -v "^W[0-9]" | tail -60
echo "== check done ($(( $(date +%s) - T0 )) s)"
timeout ${PROFILE_S:-205} python3 tools/device/issue32_profile.py --out $OUT --contexts ${CONTEXTS:-4096} \
  --variants ${VARIANTS:-unfused,fused,fused_pdl} --budget ${PROFILE_BUDGET:-150} --spec-loop "${SPEC_LOOP:-}" \
  --ar-loop ${AR_LOOP:-0} --hlo ${HLO:-1} 2>&1 | tee $OUT/profile.log \
  | grep -v "^W[0-9]" | tail -90
rm -rf $OUT/traces  # perfetto traces: summarized in the JSON, too large to bring back
echo "== done ($(( $(date +%s) - T0 )) s)"
