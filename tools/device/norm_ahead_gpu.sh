#!/usr/bin/env bash
# The fused norm pass further ahead of the consumers (MgpuConfig.norm_ahead 1 / 2 / 3; issue 32), timed and
# bit-compared on the GPU in one call: SmolLM2's fused kernels at M = 32 and the 8B's at M = 8 (check_w4a16.py
# time_fused: unfused + glue, fused, plain, fused_ahead2, fused_ahead3; bits of each lookahead against 1).
#   cd <repo> && OUT=/tmp/out bash tools/device/norm_ahead_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for c in smollm2:32 8b:8; do
  IFS=: read -r cases m <<< "$c"
  timeout 200 python3 tools/device/check_w4a16.py --out $OUT/$cases --skip sass,correctness,rows,diag,fused,timing \
    --fused-time-cases $cases --fused-time-m $m --fused-budget ${FUSED_BUDGET:-70} 2>&1 \
    | tee $OUT/norm_ahead_${cases}_m$m.log | grep -E "^time |^bits "
done
