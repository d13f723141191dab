#!/usr/bin/env bash
# One device call for issue 31: the warp-specialized Mosaic GPU decode attention ("ws") against
# the legacy schedule on the H200. Stages run under their own time limits, so a hang or a failure
# in one leaves the others' results; everything lands in $OUT (at most 8 files come back).
#
#   cd <repo> && OUT=/tmp/out bash tools/device/attention_ws_run.sh [STAGES]
#
# STAGES: comma-separated subset of mapping,check,checkcfg,tinv,time,time8,smol,dump (default: all but checkcfg).
# CONFIGS / CONFIGS8 / CONFIGS_SMOL: the MgpuConfig variants timed at B = 1 / B = 8 / SmolLM2 B = 32;
# CHECK_CASES / TINV_CASES: check_attention.py's --cases of those stages; TS8: the B = 8 verify T's.
# Run 1 (2026-11-24) ran check/tinv of both shapes at T 1 and 5 and the first timings; these
# defaults are run 2's: the cases run 1 did not reach, kernel-alone times from a profiler trace,
# the pipeline-only diagnostic, and the ptxas report.
set -u
OUT=${OUT:-/tmp/attention_ws_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
STAGES=${1:-mapping,check,tinv,time,time8,smol,dump}
LIMITS=${LIMITS:-mapping=60,check=95,checkcfg=60,tinv=50,time=100,time8=35,smol=45,dump=60}
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
CA="python3 tools/device/check_attention.py"

# the register path's code conversion against the twin, bit for bit (both views, both lop3 forms)
stage mapping $CA --parts mapping
# correctness against the float32 reference (fresh random caches, poisoned memory): T = 9 (three
# column tiles, the tightest shared memory) and the SmolLM2 shape
stage check $CA --parts check --impls mosaic-ws --shapes llama3-8b,smollm2 \
  --cases "${CHECK_CASES:-llama3-8b:target:9:none,smollm2:draft:1:none,smollm2:target:5:1000,smollm2:target:9:none}"
# CHECK_CONFIG (e.g. stages=12): check and tinv of CHECK_CONFIG_CASES with that MgpuConfig (stage checkcfg)
stage checkcfg $CA --parts check,tinv --impls mosaic-ws --shapes llama3-8b,smollm2 --check-config "${CHECK_CONFIG:-default}" \
  --cases "${CHECK_CONFIG_CASES:-smollm2:draft:1:none,smollm2:draft:float32:none}"
# bitwise T-invariance (T = 1 row == T = 5 row)
stage tinv $CA --parts tinv --impls mosaic-ws --shapes llama3-8b,smollm2 \
  --cases "${TINV_CASES:-llama3-8b:target:bfloat16:none,llama3-8b:target:bfloat16:1000,smollm2:draft:float32:none,smollm2:target:float32:none}"
# timings at 128k (8B shape), with the kernel alone from a profiler trace; "stream" = pipeline only
stage time $CA --parts time --time-impls mosaic --contexts 131072 --batches 1 --time-ts 5 --no-torch \
  --trace-dir /tmp/ws_trace \
  --mgpu-configs "${CONFIGS:-schedule=legacy;schedule=ws;schedule=ws,stages=6;schedule=ws,ws_diag=stream}"
stage time8 $CA --parts time --time-impls mosaic --contexts 131072 --batches 8 --time-ts "${TS8-}" --no-torch \
  --trace-dir /tmp/ws_trace8 --mgpu-configs "${CONFIGS8:-schedule=ws;schedule=ws,stages=6}"
# SmolLM2 shape, batch 32 at 8k
stage smol $CA --parts time --time-impls mosaic --time-shape smollm2 --contexts 8192 --batches 32 --time-ts 5 \
  --no-torch --trace-dir /tmp/ws_trace2 --mgpu-configs "${CONFIGS_SMOL:-schedule=legacy;schedule=ws}"
# ptxas registers / spills and SASS opcode counts of the ws kernels (compiled, not run)
stage dump python3 tools/device/mgpu_dump.py /tmp/ws_dump --schedule ws --cases "${DUMP_CASES:-draft:1,target:8}" ${DUMP_CONSUMERS:+--consumers $DUMP_CONSUMERS} ${DUMP_PREPS:+--preps $DUMP_PREPS}
tar czf "$OUT/dump.tgz" -C /tmp ws_dump 2>/dev/null
echo "done $(date +%T)" >> "$OUT/run.log"
