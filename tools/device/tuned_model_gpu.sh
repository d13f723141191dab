#!/usr/bin/env bash
# The measured launch shapes (pallas_kernels.linear.mosaic_gpu.TUNED_SHAPES) in the model (issue 32): the 8B
# draft step at 4k, batch 1 and 8, with QSPEC_W4A16_TUNED=0 (the cost model's shapes) and =1 on the same machine.
#   cd <repo> && OUT=/tmp/out bash tools/device/tuned_model_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for b in ${BATCHES:-1 8}; do
  for tuned in 0 1; do
    QSPEC_W4A16_TUNED=$tuned timeout ${LIMIT:-150} python3 -m qspec_jax.cli.bench profile --batch $b --contexts 4096 \
      --programs ${PROGRAMS:-draft} --verify-t 5 --steps 8 --trials 3 --out $OUT/profile_b${b}_tuned$tuned 2>&1 \
      | tee $OUT/profile_8b_b${b}_4k_tuned${tuned}.log | grep -v "^W[0-9]" | grep -E "^==|linear |glue |\[linear\]|error"
    echo "== b$b tuned$tuned done ($(( $(date +%s) - T0 )) s)"
  done
done
rm -rf $OUT/profile_*/traces
