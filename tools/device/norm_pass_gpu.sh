#!/usr/bin/env bash
# The fused RMSNorm's producer pass and the fusion policy above 24 rows (issue 32), A/B in one device call
# (logs in $OUT):
#   1. CHECK=1: check_w4a16.py, fused part: the 8B and SmolLM2 fused kernels at M = 1, 16, 32, 64 (fresh random
#      inputs, against epilogue_reference or bitwise against unfused + residual; row invariance at M = 5, 16, 32);
#   2. check_w4a16.py fused timing (8B shapes, M = TIME_M) with BEFORE (a copy of an earlier
#      pallas_kernels/linear/mosaic_gpu.py: the one-row-at-a-time norm pass) and with this tree;
#   3. qspec-bench profile, SmolLM2 at batch 32, 8k: residual-only fusion above 24 rows off (AUTO_RESIDUAL_M = 24
#      patched in) and on (this tree);
#   4. PARTS=b8: qspec-bench profile, the 8B at batch 8, 4k (B8_PROGRAMS, default the draft step), BEFORE and this tree.
# BEFORE: the earlier kernel file, made here and carried (gitignored), e.g.
#   git show HEAD:pallas_kernels/linear/mosaic_gpu.py > tools/device/_ab/mosaic_gpu_before.py
#   device run with carry ["tools/device/_ab"]: PARTS=time,b8 bash tools/device/norm_pass_gpu.sh
# (run 4 of 2026-11-27 spliced the previous norm pass into this tree's file instead: the model now imports names the
# old file lacks.) Knobs: BEFORE (tools/device/_ab/mosaic_gpu_before.py), CHECK (0), TIME_M (1,8), FUSED_BUDGET (50),
# PARTS (time,smol; also b8), B8_PROGRAMS (draft).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
T0=$(date +%s)
K=pallas_kernels/linear/mosaic_gpu.py
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee $OUT/gpu.txt
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())" | tee -a $OUT/gpu.txt
cp $K /tmp/after_mosaic_gpu.py
if [ "${CHECK:-0}" = 1 ]; then
  timeout 260 python3 tools/device/check_w4a16.py --out $OUT \
    --skip sass,correctness,rows,diag,fused_timing,timing --fused-m 1,16,32,64 --fused-cases 8b,smollm2 2>&1 \
    | tee $OUT/check_fused.log | grep -v "^W[0-9]" | grep -v '^  \.\.\.' | tail -48
fi
case ,${PARTS:-time,smol}, in *,time,*)
  for side in before after; do
    [ $side = before ] && cp ${BEFORE:-tools/device/_ab/mosaic_gpu_before.py} $K || cp /tmp/after_mosaic_gpu.py $K
    timeout 300 python3 tools/device/check_w4a16.py --out $OUT/time_$side --skip sass,correctness,rows,diag,fused,timing \
      --fused-time-m ${TIME_M:-1,8} --fused-budget ${FUSED_BUDGET:-50} 2>&1 | tee $OUT/time_fused_$side.log \
      | grep -E "^time " 
    echo "== fused timing $side done ($(( $(date +%s) - T0 )) s)"
  done
  cp /tmp/after_mosaic_gpu.py $K;; esac
profile() {  # $1 tag, then profile flags
  local tag=$1; shift
  timeout 200 python3 -m qspec_jax.cli.bench profile "$@" --steps 8 --trials 3 --out $OUT/profile_$tag 2>&1 \
    | tee $OUT/profile_$tag.log | grep -v "^W[0-9]" | grep -E "^==|linear |attention |glue |copy |\[linear\]|error"
  echo "== profile $tag done ($(( $(date +%s) - T0 )) s)"
}
case ,${PARTS:-time,smol}, in *,smol,*)
  for side in res24 res64; do
    cp /tmp/after_mosaic_gpu.py $K
    [ $side = res24 ] && sed -i 's/^AUTO_RESIDUAL_M = MAX_FUSED_M/AUTO_RESIDUAL_M = 24/' $K
    grep -n '^AUTO_RESIDUAL_M\|^AUTO_FUSED_M' $K
    profile smol_$side --shape smollm2 --batch 32 --contexts 8192 --programs draft,ar_loop,spec_loop --verify-t 5
  done;; esac
case ,${PARTS:-time,smol}, in *,b8,*)
  for side in before after; do
    [ $side = before ] && cp ${BEFORE:-tools/device/_ab/mosaic_gpu_before.py} $K || cp /tmp/after_mosaic_gpu.py $K
    profile b8_$side --batch 8 --contexts 4096 --programs ${B8_PROGRAMS:-draft} --verify-t 5
  done;; esac
cp /tmp/after_mosaic_gpu.py $K
rm -rf $OUT/profile_*/traces
echo "== done ($(( $(date +%s) - T0 )) s)"
