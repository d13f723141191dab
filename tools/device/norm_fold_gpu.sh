#!/usr/bin/env bash
# Issue 32, the target's glue (2026-11-27, fifth session; the fold was measured, then reverted: it moves the
# bf16 roundings away from HF's, docs/kernel_notes.md): the RMSNorm folded into the product
# (r ((x g) W), then `model.normed_product`) against the checkout it changes, in the AR-bf16 and verify
# steps and the loops (8B shape, batch 1, 4k), on one machine; then programmatic dependent launch
# in the fused draft step (QSPEC_W4A16_PDL=1: o -> gate_up -> down are now Mosaic kernels back to
# back), and the GPU exactness check of the new formula.
#   BASE=tools/device/_ab/base (a copy of HEAD's qspec_jax/ and pallas_kernels/, carried)
#   cd <repo> && OUT=/tmp/out bash tools/device/norm_fold_gpu.sh
#   ITEMS="base fold" SHAPE=smollm2 BATCH=32 CTX=8192 PROGS=ar_loop,spec_loop TAG=_smol ...: other geometries
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
ROOT=$PWD
BASE=${BASE:-tools/device/_ab/base}
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
prof() {  # tag, source dir, programs, [env ...]
  local tag=$1 src=$2 progs=$3
  shift 3
  (cd $src && env "$@" PYTHONPATH=. timeout ${LIMIT:-240} python3 -m qspec_jax.cli.bench profile --batch ${BATCH:-1} \
    --shape ${SHAPE:-llama3-8b} --contexts ${CTX:-4096} --programs $progs --verify-t 5 --steps 8 --trials 3 \
    --out $OUT/p_$tag) 2>&1 \
    | grep -v "^W[0-9]" > $OUT/profile_$tag.log
  grep -E "^==|^   (linear|attention|glue) |\[glue\]" $OUT/profile_$tag.log | head -${HEAD:-60}
  rm -rf $OUT/p_$tag/traces
  echo "== $tag done ($(( $(date +%s) - T0 )) s)"
}
for item in ${ITEMS:-base fold pdl nopdl exact}; do
  case $item in
    base) prof base${TAG:-} $BASE ${PROGS:-ar_bf16,verify,ar_loop,spec_loop} ;;
    fold) prof fold${TAG:-} $ROOT ${PROGS:-ar_bf16,verify,ar_loop,spec_loop} ;;
    pdl) prof pdl $ROOT draft QSPEC_W4A16_PDL=1 ;;
    nopdl) prof nopdl $ROOT draft ;;
    exact) PYTHONPATH=. timeout ${EXACT_LIMIT:-200} python3 tools/device/exactness_check.py 2>&1 | grep -v "^W[0-9]" \
             | tee $OUT/exactness_check.log | tail -8
           echo "== exact done ($(( $(date +%s) - T0 )) s)" ;;
  esac
done
