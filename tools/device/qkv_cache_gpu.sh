#!/usr/bin/env bash
# Issue 32, the draft's q|k|v into the cache in one kernel (2026-11-27, fifth session), one call:
#   check   tools/device/qkv_cache_gpu.py (the kernel against its reference at the 8B heads, B 1-24; one
#           draft step of an 8B-shaped model with and without it);
#   model   `qspec-bench profile` of the draft step (8B, 4k) with QSPEC_QKV_CACHE=1 and 0 at batch 1 and 8,
#           the loops at batch 1 with both;
#   exact   tools/device/exactness_check.py (spec == AR bitwise with the new draft path).
#   cd <repo> && OUT=/tmp/out bash tools/device/qkv_cache_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
T0=$(date +%s)
stage() { [[ ",${STAGES:-check,model,exact}," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
if stage check; then
  timeout ${CHECK_LIMIT:-300} python3 tools/device/qkv_cache_gpu.py 2>&1 | grep -v "^W[0-9]" | tee $OUT/qkv_cache_check.log
  echo "== check done ($(( $(date +%s) - T0 )) s)"
fi
if stage model; then
  for item in ${ITEMS:-on_b1 off_b1 on_b8 off_b8 on_loops off_loops}; do
    flag=1; [[ $item == off_* ]] && flag=0
    b=1; progs=draft
    [[ $item == *_b8 ]] && b=8
    [[ $item == *_loops ]] && progs=ar_loop,spec_loop
    QSPEC_QKV_CACHE=$flag timeout ${LIMIT:-200} python3 -m qspec_jax.cli.bench profile --batch $b --contexts 4096 \
      --programs $progs --verify-t 5 --steps 8 --trials 3 --out $OUT/p_$item 2>&1 | grep -v "^W[0-9]" \
      > $OUT/profile_qkv_$item.log
    echo "## $item (QSPEC_QKV_CACHE=$flag)"
    grep -E "^==|^   (linear|attention|glue) |\[glue\]|\[linear\] int4 k4096 n6144|rror" $OUT/profile_qkv_$item.log | head -14
    rm -rf $OUT/p_$item/traces
    echo "== $item done ($(( $(date +%s) - T0 )) s)"
  done
fi
if stage exact; then
  timeout ${EXACT_LIMIT:-200} python3 tools/device/exactness_check.py 2>&1 | grep -v "^W[0-9]" | tee $OUT/exactness_check.log | tail -4
  echo "== exact done ($(( $(date +%s) - T0 )) s)"
fi
