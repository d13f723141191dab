#!/usr/bin/env bash
# One device call for issue 31: the warp-specialized Mosaic GPU decode attention ("ws") against
# the legacy schedule on the H200. Stages run under their own time limits, so a hang or a failure
# in one leaves the others' results; everything lands in $OUT (at most 8 files come back).
#
#   cd <repo> && OUT=/tmp/out bash tools/device/attention_ws_run.sh [STAGES]
#
# STAGES: comma-separated subset of dump,check,tinv,time,smol (default: all, in that order).
set -u
OUT=${OUT:-/tmp/attention_ws_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
STAGES=${1:-dump,check,tinv,time,smol}
LIMITS=${LIMITS:-dump=55,check=90,tinv=65,time=145,smol=40}
limit() { echo "$LIMITS" | tr ',' '\n' | sed -n "s/^$1=//p"; }

stage() {
  local name=$1; shift
  case ",$STAGES," in *",$name,"*) ;; *) return 0 ;; esac
  local lim; lim=$(limit "$name")
  echo "=== $name (limit ${lim}s) $(date +%T)" | tee -a "$OUT/run.log"
  timeout "$lim" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "^  File\|^    \|Warning\|warn(" "$OUT/$name.log" | tail -n 60 >> "$OUT/run.log"
  echo "=== $name rc=$rc $(date +%T)" | tee -a "$OUT/run.log"
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv >> "$OUT/run.log" 2>&1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" >> "$OUT/run.log" 2>&1

# ptxas registers / spills and SASS opcode counts of the ws kernels (compiled, not run)
stage dump python3 tools/device/mgpu_dump.py /tmp/ws_dump --schedule ws --cases draft:1,target:5,target:8
tar czf "$OUT/dump.tgz" -C /tmp ws_dump 2>/dev/null

# correctness against the float32 reference (fresh random caches, poisoned memory), both shapes
stage check python3 tools/device/check_attention.py --parts check --impls mosaic-ws --quick \
  --shapes llama3-8b,smollm2
# bitwise T-invariance (T = 1 row == T = 5 row), float32 and bfloat16 queries
stage tinv python3 tools/device/check_attention.py --parts tinv --impls mosaic-ws --shapes llama3-8b
# timings, legacy vs ws, 8B shape at 128k, batch 1 and 8, draft T=1 and verify T=5, T=8
stage time python3 tools/device/check_attention.py --parts time --time-impls mosaic \
  --mgpu-configs "schedule=legacy;schedule=ws" --contexts 131072 --batches 1,8 --time-ts 5,8 --no-torch
# SmolLM2 shape, batch 32 at 8k
stage smol python3 tools/device/check_attention.py --parts time --time-impls mosaic --time-shape smollm2 \
  --mgpu-configs "schedule=legacy;schedule=ws" --contexts 8192 --batches 32 --time-ts 5 --no-torch
echo "done $(date +%T)" >> "$OUT/run.log"
