#!/usr/bin/env bash
# Nsight Compute on the ws decode attention (issue 31): warp stall reasons, scheduler statistics,
# speed of light and per-SASS-instruction stall samples of one launch per case, plus the timing of
# the "noprep" diagnostic (the prep warpgroup does nothing; wrong results, timing only).
#   cd <repo> && OUT=/tmp/out bash tools/device/ncu_attention.sh
# CASES: "SHAPE:B:CONTEXT:VIEW ..." (VIEW draft -> T = 1, target -> T = 5). Reports: $OUT/ncu_*.txt,
# the SASS source pages gzipped in $OUT/ncu_src.tgz (tools/device/ncu_sass_mix.py reads them).
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
mkdir -p /tmp/ncu_src
for c in ${CASES:-llama3-8b:8:131072:draft smollm2:32:8192:draft smollm2:32:8192:target}; do
  IFS=: read -r shape b ctx view <<< "$c"
  ts=""; [ "$view" = target ] && ts=5
  name=${shape}_b${b}_${ctx}_${view}
  timeout 240 "$NCU" --clock-control none --target-processes all -k "regex:quantspec_${view}_mgpu_ws" \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section SourceCounters --import-source no -f -o /tmp/ncu_$name \
    python3 tools/device/check_attention.py --parts time --time-impls mosaic --time-shape "$shape" \
    --contexts "$ctx" --batches "$b" --time-ts "$ts" --no-torch > /tmp/ncu_$name.log 2>&1
  echo "== $name rc=$?"
  "$NCU" -i /tmp/ncu_$name.ncu-rep --page details --print-details all > "$OUT/ncu_$name.txt" 2>&1
  "$NCU" -i /tmp/ncu_$name.ncu-rep --page source --print-source sass --csv > /tmp/ncu_src/$name.csv 2>&1
  grep -E "Duration|Memory Throughput|DRAM Throughput|Issue Slots Busy|No Eligible|Active Warps Per Scheduler|Eligible Warps|Stall|Warp Cycles Per Issued" "$OUT/ncu_$name.txt" | head -40
done
tar czf "$OUT/ncu_src.tgz" -C /tmp ncu_src
[ "${NCU_TIMES:-1}" = 0 ] && exit 0  # NCU_TIMES=0: the reports only
python3 tools/device/check_attention.py --parts time --time-impls mosaic --contexts 131072 --batches 8 --time-ts "" \
  --no-torch --trace-dir /tmp/tr_np --mgpu-configs "default;ws_diag=noprep;ws_diag=stream" 2>&1 | grep "^| 8"
python3 tools/device/check_attention.py --parts time --time-impls mosaic --time-shape smollm2 --contexts 8192 \
  --batches 32 --time-ts 5 --no-torch --trace-dir /tmp/tr_np2 --mgpu-configs "default;ws_diag=noprep;ws_diag=stream" 2>&1 | grep "^| 32"
