#!/usr/bin/env bash
# This build on the GPU at the issues' batch-1 points, plus two open questions (2026-11-28, tenth session):
#   1. how many kernels XLA makes of the target's residual add + RMSNorm by row count (norm_fusion_probe.py);
#   2. SmolLM2's 64-channel q|k|v epilogue timed in the model: `qspec-bench profile --shape smollm2` draft step
#      with QSPEC_QKV_CACHE=1 (off for 64) against all (on), batch 1 and 8 (above 24 rows it does not apply);
#   3. the 8B at batch 1: every program at 4k (verify T 5), draft / verify (T 8) / loops at 128k.
#   cd <repo> && OUT=/tmp/out bash tools/device/h200_state_gpu.sh     (STAGES="probe smol 8b" by default)
# Logs go to $OUT/logs and are packed into $OUT/logs.tgz at the end (the device returns at most 8 files).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
T0=$(date +%s)
L=$OUT/logs && mkdir -p $L
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $L/gpu.txt
python3 -c 'import jax, jaxlib; print("jax", jax.__version__, jaxlib.__version__)' | tee -a $L/gpu.txt
git log --oneline -1 2>/dev/null | tee -a $L/gpu.txt
prof() {  # tag, then qspec-bench profile arguments
  local tag=$1; shift
  timeout ${LIMIT:-200} python3 -m qspec_jax.cli.bench profile --steps 8 --trials 3 --out $OUT/p_$tag "$@" 2>&1 \
    | grep -v "^W[0-9]" > $L/profile_$tag.log
  grep -E "^==|^   (linear|attention|glue) |rror|does not fit" $L/profile_$tag.log
  rm -rf $OUT/p_$tag/traces
  echo "== $tag done ($(( $(date +%s) - T0 )) s)"
}
for stage in ${STAGES:-probe smol 8b}; do
  case $stage in
    probe)
      timeout 120 python3 tools/device/norm_fusion_probe.py --rows ${PROBE_ROWS:-1,5,8,40} 2>&1 | grep -v "^W[0-9]" \
        | tee $L/norm_fusion_probe.log
      echo "== probe done ($(( $(date +%s) - T0 )) s)";;
    smol)
      for b in ${SMOL_BATCHES:-1 8}; do
        for v in 1 all; do
          QSPEC_QKV_CACHE=$v prof smollm2_b${b}_qkv$v --shape smollm2 --batch $b --contexts 8192 \
            --programs ${SMOL_PROGS:-draft,spec_loop} --verify-t 5
        done
      done;;
    8b)
      prof 8b_b1_4k --batch 1 --contexts 4096 --programs ar_bf16,draft,verify,ar_loop,spec_loop --verify-t 5
      prof 8b_b1_128k --batch 1 --contexts 131072 --programs draft,verify,ar_loop,spec_loop --verify-t 8;;
    *) echo "unknown stage $stage" >&2;;
  esac
done
tar czf $OUT/logs.tgz -C $OUT logs $(cd $OUT && ls -d p_* 2>/dev/null) && rm -rf $L $OUT/p_*
echo "== all done ($(( $(date +%s) - T0 )) s)"
