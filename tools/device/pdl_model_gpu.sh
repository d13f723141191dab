#!/usr/bin/env bash
# Programmatic dependent launch of the W4A16 kernels in the model (issue 32): the 8B draft step at 4k,
# batch 1 and 8, with QSPEC_W4A16_PDL=0 and =1 on the same machine (`qspec-bench profile`). Since the
# fused draft layer, o -> gate_up -> down are Mosaic kernels back to back, the boundaries PDL can overlap.
#   cd <repo> && OUT=/tmp/out bash tools/device/bg.sh start pdl 'bash tools/device/pdl_model_gpu.sh'
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm --format=csv | tee $OUT/gpu.txt
for b in ${BATCHES:-1 8}; do
  for pdl in 0 1; do
    QSPEC_W4A16_PDL=$pdl timeout ${LIMIT:-200} python3 -m qspec_jax.cli.bench profile --batch $b --contexts 4096 \
      --programs ${PROGRAMS:-draft} --verify-t 5 --steps 8 --trials 3 --out $OUT/profile_b${b}_pdl$pdl 2>&1 \
      | tee $OUT/profile_8b_b${b}_4k_pdl${pdl}.log | grep -v "^W[0-9]" | grep -E "^==|linear |attention |glue |\[linear\]|error"
    echo "== b$b pdl$pdl done ($(( $(date +%s) - T0 )) s)"
  done
done
rm -rf $OUT/profile_*/traces
echo "== done ($(( $(date +%s) - T0 )) s)"
