#!/usr/bin/env bash
# The target's residual add + RMSNorm kernel on the GPU (2026-11-28): check and stand-alone time
# (add_norm_gpu.py), then `qspec-bench profile` of the 8B at 4k with QSPEC_ADD_NORM=0 (XLA's norms) and 1
# (the kernel) on the same machine, then the GPU exactness check (speculative == autoregressive, bitwise).
#   cd <repo> && OUT=/tmp/out bash tools/device/add_norm_gpu.sh      (STAGES="check model exact")
# Logs go to $OUT/logs, packed into $OUT/logs.tgz at the end.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
T0=$(date +%s)
L=$OUT/logs && mkdir -p $L
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $L/gpu.txt
for stage in ${STAGES:-check model exact}; do
  case $stage in
    check)
      timeout ${CHECK_LIMIT:-240} python3 tools/device/add_norm_gpu.py ${CHECK_ARGS:-} 2>&1 | grep -v "^W[0-9]" | tee $L/add_norm_check.log
      echo "== check done ($(( $(date +%s) - T0 )) s)";;
    model)
      for run in ${RUNS:-"1:ar_bf16,verify,ar_loop,spec_loop" "8:ar_bf16,verify"}; do
        b=${run%%:*} progs=${run#*:}
        for v in 0 1; do
          QSPEC_ADD_NORM=$v timeout ${LIMIT:-200} python3 -m qspec_jax.cli.bench profile --batch $b --contexts 4096 \
            --programs $progs --verify-t 5 --steps 8 --trials 3 --out $OUT/p_b${b}_$v 2>&1 | grep -v "^W[0-9]" \
            > $L/profile_8b_b${b}_4k_add_norm$v.log
          echo "## batch $b, QSPEC_ADD_NORM=$v"
          grep -E "^==|^   (linear|attention|glue) |rror" $L/profile_8b_b${b}_4k_add_norm$v.log
          rm -rf $OUT/p_b${b}_$v/traces
        done
      done
      echo "== model done ($(( $(date +%s) - T0 )) s)";;
    exact)
      timeout ${EXACT_LIMIT:-240} python3 tools/device/exactness_check.py 2>&1 | grep -v "^W[0-9]" \
        | tee $L/exactness_check.log | tail -4
      echo "== exact done ($(( $(date +%s) - T0 )) s)";;
    *) echo "unknown stage $stage" >&2;;
  esac
done
tar czf $OUT/logs.tgz -C $OUT logs $(cd $OUT && ls -d p_* 2>/dev/null) && rm -rf $L $OUT/p_*
echo "== all done ($(( $(date +%s) - T0 )) s)"
