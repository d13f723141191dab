#!/usr/bin/env bash
# The AR and QuantSpec loops (and the draft step) of this build, 8B shape with random weights, at the
# batch/context pairs the issues name, one `qspec-bench profile` per batch (2026-11-27, sixth session: the
# rows taken with the reverted norm fold measured again without it), then the GPU exactness check.
#   cd <repo> && OUT=/tmp/out bash tools/device/loops_gpu.sh
#   RUNS="1:4096,131072 8:4096,32768" PROGS=draft,ar_loop,spec_loop ...: other pairs or programs
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for run in ${RUNS:-1:4096,131072 8:4096,32768}; do
  b=${run%%:*} ctx=${run#*:}
  timeout ${LIMIT:-300} python3 -m qspec_jax.cli.bench profile --batch $b --shape ${SHAPE:-llama3-8b} --contexts $ctx \
    --programs ${PROGS:-draft,ar_loop,spec_loop} --verify-t 5 --steps 8 --trials 3 --out $OUT/p_b$b 2>&1 \
    | grep -v "^W[0-9]" > $OUT/profile_loops_b$b.log
  grep -E "^==|^   (linear|attention|glue) |rror" $OUT/profile_loops_b$b.log
  rm -rf $OUT/p_b$b/traces
  echo "== batch $b done ($(( $(date +%s) - T0 )) s)"
done
if [ -z "${NO_EXACT:-}" ]; then
  timeout ${EXACT_LIMIT:-200} python3 tools/device/exactness_check.py 2>&1 | grep -v "^W[0-9]" \
    | tee $OUT/exactness_check.log | tail -4
  echo "== exact done ($(( $(date +%s) - T0 )) s)"
fi
