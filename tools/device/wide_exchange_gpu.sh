#!/usr/bin/env bash
# The GPU check that gates AUTO_FUSED_M (issue 32: fused W4A16 epilogues above 24 rows), and what it buys
# SmolLM2 at batch 32, in one device call (logs in $OUT):
#   1. check_w4a16.py, fused part only: the 8B and SmolLM2 fused kernels at M = 1, 16, 32, 64 on fresh random
#      inputs against epilogue_reference (norm, SiLU·up) or bitwise against unfused + residual, and their row
#      invariance (M = 5, 16 and 32: row i of an M-row call == the row alone);
#   2. qspec-bench profile, SmolLM2 shape, batch 32, 8k: AUTO_FUSED_M as committed, then (only if step 1 passed)
#      with AUTO_FUSED_M = 64 patched into this device copy (A/B on the same machine);
#   3. SWEEP=1: the small-K stage sweep of SmolLM2's INT4 linears at M = 32 (w4a16_config_sweep.py).
# Knobs (environment): CHECK_S, PROFILE_PROGRAMS, SWEEP, SWEEP_BUDGET.
# Run from the repository root: bash tools/device/wide_exchange_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee $OUT/gpu.txt
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())" | tee -a $OUT/gpu.txt

timeout ${CHECK_S:-240} python3 tools/device/check_w4a16.py --out $OUT \
  --skip sass,correctness,rows,diag,fused_timing,timing --fused-m 1,16,32,64 --fused-cases 8b,smollm2 2>&1 \
  | tee $OUT/check_wide.log | grep -v "^W[0-9]" | grep -v '^  \.\.\.' | tail -50
echo "== check done ($(( $(date +%s) - T0 )) s)"
if grep -q "^fused" $OUT/check_wide.log && ! grep -E "^fused.*(FAIL|ERROR)" $OUT/check_wide.log; then passed=1; else passed=0; fi
echo "== wide exchange check passed: $passed"

profile() {  # $1: tag
  timeout 200 python3 -m qspec_jax.cli.bench profile --shape smollm2 --batch 32 --contexts 8192 \
    --programs ${PROFILE_PROGRAMS:-ar_bf16,draft,ar_loop,spec_loop} --verify-t 5 --steps 8 --trials 3 \
    --out $OUT/profile_$1 2>&1 | tee $OUT/profile_$1.log | grep -v "^W[0-9]" | grep -E "^==|linear |attention |glue |copy " 
  echo "== profile $1 done ($(( $(date +%s) - T0 )) s)"
}
profile auto24
if [ "$passed" = 1 ]; then
  sed -i 's/^AUTO_FUSED_M = 24\b/AUTO_FUSED_M = 64/' pallas_kernels/linear/mosaic_gpu.py
  grep -n '^AUTO_FUSED_M' pallas_kernels/linear/mosaic_gpu.py
  profile auto64
fi
if [ "${SWEEP:-1}" = 1 ]; then
  timeout $(( ${SWEEP_BUDGET:-120} + 60 )) python3 tools/device/w4a16_config_sweep.py --shapes s_qkv,s_o,s_gate_up,s_down \
    --m 32 --stages 4,6,9 --budget ${SWEEP_BUDGET:-120} 2>&1 | tee $OUT/sweep_small_k.log | grep -v "^W[0-9]" | tail -40
fi
rm -rf $OUT/profile_*/traces
echo "== done ($(( $(date +%s) - T0 )) s)"
