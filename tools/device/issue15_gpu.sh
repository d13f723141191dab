#!/usr/bin/env bash
# Issue 15 measurements on one GPU (SmolLM2, real text): draft-weight methods (clip / hqq / gptq,
# calibrated on the history plays) and the draft-length study (fixed gammas, BASS, planner).
# The GGUF's first half was stashed in /root/stash by an earlier call (see final_gpu.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .devcarry/whl/*.whl 2>/dev/null || exit 1
export PYTHONPATH=/tmp/site:.
cat /root/stash/gguf_a .devcarry/gguf_b > /tmp/smol.gguf || exit 1
python3 -m convert /tmp/smol.gguf /tmp/ckpt 2>&1 | tail -1
if [ -z "${SKIP_METHODS:-}" ]; then
echo "== methods ($(( $(date +%s) - T0 )) s)"
timeout ${METHODS_S:-330} python3 -m qspec_jax.bench.quality --checkpoint /tmp/ckpt --text-dir .devcarry/texts --parts methods \
  --methods ${METHODS:-clip,hqq,gptq} --method-groups 32 --out $OUT 2>&1 | tr '\r' '\n' | grep -v "it/s\]\|s/it\]\|weight/s\]\|s/weight\]\|layer/s\]\|s/layer\]" \
  | tee $OUT/methods.log | tail -12
fi
echo "== gamma ($(( $(date +%s) - T0 )) s)"
timeout ${GAMMA_S:-200} python3 -m qspec_jax.bench.gamma --checkpoint /tmp/ckpt --text-dir .devcarry/texts --out $OUT \
  --dtype bfloat16 ${GAMMA_ARGS:-} 2>&1 | tee $OUT/gamma.log | tail -30
cp docs/QUALITY.md $OUT/QUALITY.md
echo "== done ($(( $(date +%s) - T0 )) s)"
