#!/usr/bin/env bash
# Issue 32, the layer loop's counter (2026-11-27, fifth session): XLA's own while-loop unrolling
# (--xla_gpu_enable_while_loop_unrolling) against none, in the fused draft step and the AR-bf16
# step (8B shape, batch 1, 4k), on one machine. With the layer loop unrolled the counter `i + 1`
# (a kernel per layer) and the kernels' layer operands become constants.
#   cd <repo> && OUT=/tmp/out bash tools/device/xla_unroll_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
F=--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_
for v in ${VARIANTS:-none FULL_UNROLL DOUBLE_BUFFER AUTO_UNROLL}; do
  flags=""
  [ $v != none ] && flags="$F$v"
  XLA_FLAGS="$flags" timeout ${LIMIT:-200} python3 -m qspec_jax.cli.bench profile --batch ${BATCH:-1} \
    --contexts ${CTX:-4096} --programs ${PROGS:-draft,ar_bf16} --verify-t 5 --steps 8 --trials 3 --out $OUT/p_$v 2>&1 \
    | grep -v "^W[0-9]" > $OUT/profile_unroll_$v.log
  echo "## $v ($flags)"
  grep -E "^==|^   (linear|attention|glue) |rror|nknown" $OUT/profile_unroll_$v.log | head -12
  rm -rf $OUT/p_$v/traces
  echo "== $v done ($(( $(date +%s) - T0 )) s)"
done
