#!/usr/bin/env bash
# One GPU session's build-check-time cycle for issues 11-14 (run by the device tool, logs in $OUT).
#   PART=smollm: SmolLM2 from the GGUF (two carried halves, the first stashed in /root/stash by an
#                earlier call), fidelity of spec vs AR at batch 1/8/32 and exact-vs-inexact cost;
#   PART=8b:     W4A16 "wide" TMA view check + timing, then `qspec-bench e2e --parts 8b` with the
#                Mosaic kernels (draft linears, attention) and the faster TMA view if it checked out.
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .devcarry/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee $OUT/gpu.txt
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a $OUT/gpu.txt
if [ "${PART:-smollm}" = smollm ]; then
  cat /root/stash/gguf_a .devcarry/gguf_b > /tmp/smol.gguf || exit 1
  python3 -m convert /tmp/smol.gguf /tmp/ckpt 2>&1 | tail -1
  echo "== fidelity ($(( $(date +%s) - T0 )) s)"
  python3 -m qspec_jax.bench.fidelity --checkpoint /tmp/ckpt --text-dir .devcarry/texts --batches ${BATCHES:-1,8,32} \
    --gammas ${GAMMAS:-4} --kv int8 --out $OUT 2>&1 | tee $OUT/fidelity.log | grep -v "^\[fidelity" | tail -14
  echo "== cost ($(( $(date +%s) - T0 )) s)"
  python3 tools/device/exactness_cost.py --out $OUT --smollm-checkpoint /tmp/ckpt --text-dir .devcarry/texts \
    --parts smollm 2>&1 | tee $OUT/cost.log | tail -24
else
  if [ -z "${VIEW:-}" ]; then
  echo "== w4a16 wide check ($(( $(date +%s) - T0 )) s)"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 200 python3 tools/device/check_w4a16.py --out $OUT --skip rows,sass,timing \
    --check-groups 32 --check-m 1,5,32,64 --check-shapes qkv,o,gate_up,down,s_qkv,s_o,s_gate_up,s_down 2>&1 | tee $OUT/w4_check.log | grep -E "FAIL|diag|ERROR|wide" | tail -40
  VIEW=$(python3 - "$OUT/check_w4a16.json" <<'PY'
import json, sys, collections
try:
    res = json.load(open(sys.argv[1]))
except Exception:
    print("thread"); sys.exit()
rows = res if isinstance(res, list) else res.get("checks", [])
# Forced "cluster" configs at M > 24 fail for every view (the kernel picks "gmem" there itself).
bad = [r for r in rows if r.get("check") != "diag" and "wide" in str(r.get("config", "")) and "cluster" not in str(r.get("config", ""))
       and not str(r.get("status", "ok")).startswith("ok")]
t = collections.defaultdict(dict)
for r in rows:
    if r.get("check") == "diag" and r.get("diag") in ("full", "wide"):
        t[r["shape"]][r["diag"]] = r["us"]
wins = [v["wide"] < v["full"] for v in t.values() if "wide" in v and "full" in v]
print("wide" if wins and all(wins) and not bad else "thread")
PY
)
  fi
  echo "== TMA view for the e2e run: $VIEW"
  export QSPEC_W4A16_TMA_VIEW=$VIEW
  echo "== e2e 8b ($(( $(date +%s) - T0 )) s)"
  python3 -m qspec_jax.bench.e2e --parts 8b --out $OUT --contexts ${CONTEXTS:-4096,32768,131072} --gammas 4,7 \
    --loop-contexts ${LOOP_CONTEXTS:-131072} --alphas 0.9 --dense-mosaic --steps 8 --trials 3 2>&1 | tee $OUT/e2e.log | tail -30
fi
echo "== done ($(( $(date +%s) - T0 )) s)"
