#!/usr/bin/env bash
# Issue 30 on the GPU: the prefill check, then `qspec-bench e2e --parts prefill`, started once under setsid
# (it can outlast one device call) and waited on by every call; logs and JSON in /tmp/pf, copied to $OUT.
#   STAGE=start (default): install the carried wheels, start the run, wait up to WAIT seconds.
#   STAGE=wait:            wait up to WAIT more seconds for the run started earlier on this machine.
# BENCH_ARGS: extra arguments of the bench (default: the contexts and an 8192 chunk).
# CHECK: the command run first (default: the prefill check; `true` skips it), log check.log.
# POST: a command run after the bench (default: none), log post.log; files it writes under
#   /tmp/pf/post come back too.
set -uo pipefail
export PYTHONUNBUFFERED=1
[ "${STAGE:-start}" = start ] && rm -rf /tmp/pf
mkdir -p /tmp/pf
if [ "${STAGE:-start}" = start ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .devcarry/whl/*.whl || exit 1
  cp -r . /tmp/pf/src 2>/dev/null
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > /tmp/pf/gpu.txt
  setsid nohup bash -c "cd /tmp/pf/src && export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 && \
    python3 -c 'import jax; print(jax.__version__, jax.devices())' && \
    ${CHECK:-python3 tools/device/prefill_check.py} > /tmp/pf/check.log 2>&1; \
    python3 -m qspec_jax.cli.bench e2e --parts prefill --out /tmp/pf/bench --doc /tmp/pf/BENCHMARKS.md \
      ${BENCH_ARGS:---prefill-contexts 8192,32768,131072 --prefill-chunks 8192 --trials 2} > /tmp/pf/bench.log 2>&1; \
    ${POST:-true} > /tmp/pf/post.log 2>&1; \
    echo done > /tmp/pf/DONE" > /tmp/pf/run.log 2>&1 < /dev/null &
fi
end=$(( $(date +%s) + ${WAIT:-540} ))
while [ ! -f /tmp/pf/DONE ] && [ $(date +%s) -lt $end ]; do sleep 5; done
cp /tmp/pf/*.log /tmp/pf/gpu.txt $OUT/ 2>/dev/null
[ -f /tmp/pf/BENCHMARKS.md ] && cp /tmp/pf/BENCHMARKS.md $OUT/
[ -f /tmp/pf/bench/e2e.json ] && cp /tmp/pf/bench/e2e.json $OUT/
[ -d /tmp/pf/post ] && cp -r /tmp/pf/post $OUT/ && rm -rf $OUT/post/*/traces $OUT/post/traces
echo "== check"; grep -v "^W[0-9]" /tmp/pf/check.log 2>/dev/null | tail -60
echo "== bench"; grep -v "^\[e2e" /tmp/pf/bench.log 2>/dev/null | tail -40
echo "== post"; grep -v "^W[0-9]" /tmp/pf/post.log 2>/dev/null | tail -60
[ -f /tmp/pf/DONE ] && echo FINISHED || echo STILL RUNNING
