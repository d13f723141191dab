#!/usr/bin/env bash
# The draft's balanced (flat) schedule on three consumer warpgroups instead of two (twenty-second session):
# checked against the reference at the SmolLM2 and 8B shapes, timed stand-alone at SmolLM2 batch 32 / 8k and
# the 8B at batch 8 / 32k, and A/B in the model (SmolLM2 shape, batch 32, rows of 4k-8k, draft step).
#   cd <repo> && OUT=/tmp/out bash tools/device/flat3_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
T0=$(date +%s)
L=$OUT/logs && mkdir -p $L
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $L/gpu.txt
git log --oneline -1 2>/dev/null | tee -a $L/gpu.txt
timeout 200 python3 tools/device/check_attention.py --parts check --impls mosaic-ws --shapes smollm2,llama3-8b \
  --check-config "ws_consumers=3" 2>&1 | grep -v "^W[0-9]" > $L/check_flat3.log
grep -E "FAIL|rror|summary|checks|ok$" $L/check_flat3.log | tail -8; echo "== check done ($(( $(date +%s) - T0 )) s)"
for sb in "smollm2 8192 32" "llama3-8b 32768 8"; do
  set -- $sb
  timeout 200 python3 tools/device/check_attention.py --parts time --impls mosaic --time-shape $1 --contexts $2 \
    --batches $3 --mgpu-configs "ws_consumers=2;ws_consumers=3" --no-torch --time-ts 5 2>&1 | grep -v "^W[0-9]" \
    > $L/time_flat3_$1.log
  grep -E "^  time" $L/time_flat3_$1.log; echo "== time $1 done ($(( $(date +%s) - T0 )) s)"
done
for v in 2 3; do
  QSPEC_MGPU_CONSUMERS=$v timeout 200 python3 -m qspec_jax.cli.bench profile --steps 8 --trials 3 --shape smollm2 \
    --batch 32 --contexts 8192 --ragged --programs draft,spec_loop --verify-t 5 --out $OUT/p_$v 2>&1 \
    | grep -v "^W[0-9]" > $L/profile_smollm2_b32_consumers$v.log
  grep -E "^==|^   (linear|attention|glue) |rror|step|loop" $L/profile_smollm2_b32_consumers$v.log | head -20
  rm -rf $OUT/p_$v/traces; echo "== profile consumers $v done ($(( $(date +%s) - T0 )) s)"
done
tar czf $OUT/logs.tgz -C $OUT logs
