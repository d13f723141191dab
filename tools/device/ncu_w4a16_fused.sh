#!/usr/bin/env bash
# Nsight Compute on the W4A16 kernels (issue 32): the fused norm kernel against the plain one at SmolLM2's
# qkv shape (K 576, N 960, G 32) at M = ${M:-32}, one launch each of plain / norm-fused (the 8B qkv at M = 8
# with CASES=8b); and the plain kernel alone at the 8B draft's shapes (CASES="gate_up down qkv o", M = ${ML:-1}:
# K 4096 N 28672, K 14336 N 4096, K 4096 N 6144, K 4096 N 4096). Speed of light, memory workload, warp states,
# scheduler and instruction statistics and per-SASS-instruction samples (tools/device/ncu_sass_mix.py sums the
# source pages by opcode). Reports in ${NCU_OUT:-$OUT}.
#   cd <repo> && OUT=/tmp/out bash tools/device/ncu_w4a16_fused.sh
#   cd <repo> && OUT=/tmp/out CASES="gate_up down" bash tools/device/ncu_w4a16_fused.sh
set -u
R=${NCU_OUT:-$OUT}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
cat > /tmp/ncu_w4_driver.py <<'PY'
import os, sys
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
import qspec_jax  # noqa: F401  (XLA flags)
from pallas_kernels.linear import layout as lay, mosaic_gpu as mg
from qspec_jax.bench import w4a16 as bench
k, n, m, with_fused = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "fused"
p = lay.pack_quantized(bench._gen_int4(jax.random.PRNGKey(0), k=k, n=n, g=32))
x = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.float32).astype(jnp.bfloat16)
g = jnp.ones((k,), jnp.bfloat16) * 1.1
plain = jax.jit(lambda x, p: mg.int4_matmul_mgpu(x, p))
fused = jax.jit(lambda x, p, g: mg.int4_matmul_mgpu(x, p, norm_weight=g, out_dtype=jnp.float32))
for _ in range(3):  # launches: plain, fused, plain, fused, plain, fused (plain alone: plain x 3)
    jax.block_until_ready(plain(x, p))
    if with_fused:
        jax.block_until_ready(fused(x, p, g))
print("driver done", k, n, m)
PY
for c in ${CASES:-smollm2}; do
  mode=fused count=2
  case $c in
    smollm2) k=576; n=960; m=${M:-32};; 8b) k=4096; n=6144; m=${M8:-8};;
    gate_up) k=4096; n=28672; m=${ML:-1}; mode=plain count=1;; down) k=14336; n=4096; m=${ML:-1}; mode=plain count=1;;
    qkv) k=4096; n=6144; m=${ML:-1}; mode=plain count=1;; o) k=4096; n=4096; m=${ML:-1}; mode=plain count=1;;
  esac
  name=w4a16_${c}_m$m
  timeout 240 "$NCU" --clock-control none --target-processes all -k "regex:mosaic" \
    --launch-skip 2 --launch-count $count --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    --section InstructionStats --section SourceCounters --import-source no -f -o /tmp/ncu_$name \
    python3 /tmp/ncu_w4_driver.py $k $n $m $mode > /tmp/ncu_$name.log 2>&1
  echo "== $name rc=$?"; tail -2 /tmp/ncu_$name.log
  "$NCU" -i /tmp/ncu_$name.ncu-rep --page details --print-details all > "$R/ncu_$name.txt" 2>&1
  "$NCU" -i /tmp/ncu_$name.ncu-rep --page source --print-source sass --csv > "$R/ncu_${name}_src.csv" 2>&1
  grep -E "^  [a-z_]|Duration|DRAM Throughput|Issue Slots Busy|No Eligible|Eligible Warps|Warp Cycles Per Issued" \
    "$R/ncu_$name.txt" | head -40
done
python3 tools/device/ncu_sass_mix.py "$R"/ncu_*_src.csv
gzip -f "$R"/*_src.csv 2>/dev/null
