#!/usr/bin/env bash
# Nsight Compute on the plain W4A16 kernel at the 8B draft's large shapes (issue 32): gate_up (K 4096,
# N 28672) and down (K 14336, N 4096) at M = ${M:-1}, G 32, default launch shapes; one launch each:
# speed of light, memory workload, warp states, scheduler statistics, per-SASS-instruction stall samples.
# Question: what holds an SM at ~15.5 GB/s (H100, `w4a16_tiles_gpu.py`: the same per SM with one or two
# CTAs and one or two consumer warpgroups)?
#   cd <repo> && OUT=/tmp/out bash tools/device/ncu_w4a16_large.sh
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
cat > /tmp/ncu_w4l_driver.py <<'PY'
import os, sys
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
import qspec_jax  # noqa: F401  (XLA flags)
from pallas_kernels.linear import layout as lay, mosaic_gpu as mg
from qspec_jax.bench import w4a16 as bench
k, n, m = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
p = lay.pack_quantized(bench._gen_int4(jax.random.PRNGKey(0), k=k, n=n, g=32))
x = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.float32).astype(jnp.bfloat16)
plain = jax.jit(lambda x, p: mg.int4_matmul_mgpu(x, p))
for _ in range(3):
    jax.block_until_ready(plain(x, p))
print("driver done", k, n, m, mg.default_config(k, n, 32))
PY
for c in ${CASES:-gate_up down}; do
  case $c in gate_up) k=4096; n=28672;; down) k=14336; n=4096;; esac
  m=${M:-1}; name=w4a16_${c}_m$m
  timeout 240 "$NCU" --clock-control none --target-processes all -k "regex:mosaic" \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats --section SourceCounters --import-source no \
    -f -o /tmp/ncu_$name python3 /tmp/ncu_w4l_driver.py $k $n $m > /tmp/ncu_$name.log 2>&1
  echo "== $name rc=$?"; tail -2 /tmp/ncu_$name.log
  "$NCU" -i /tmp/ncu_$name.ncu-rep --page details --print-details all > "$OUT/ncu_$name.txt" 2>&1
  "$NCU" -i /tmp/ncu_$name.ncu-rep --page source --print-source sass --csv > "$OUT/ncu_${name}_src.csv" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Issue Slots Busy|Issued Ipc|No Eligible|Eligible Warps|Active Warps Per|Warp Cycles Per Issued|Registers Per|Block Limit|Achieved Occupancy|Stall" \
    "$OUT/ncu_$name.txt" | head -40
done
gzip -f $OUT/*_src.csv 2>/dev/null
