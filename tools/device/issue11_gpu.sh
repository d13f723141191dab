#!/usr/bin/env bash
# Issue 11 on one GPU: fidelity of speculative vs autoregressive decoding on SmolLM2 (real text,
# batch 1/8/32) and what exact verification costs (8B-shape passes, SmolLM2 tokens/s).
# Inputs carried in .devcarry/: the GGUF in two parts (the first stashed in /root/stash by an
# earlier call on the same machine: the whole file exceeds one call's 64 MiB), the gguf wheel,
# the plays, and `snap/` (the code under test; first on PYTHONPATH).
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .devcarry/whl/*.whl || exit 1
export PYTHONPATH=.devcarry/snap:/tmp/site:.
cat /root/stash/gguf_a .devcarry/gguf_b > /tmp/smol.gguf || exit 1
ls -la /tmp/smol.gguf
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee $OUT/gpu.txt
python3 -m convert /tmp/smol.gguf /tmp/ckpt --draft-weights int4 2>&1 | tail -1
echo "== fidelity ($(( $(date +%s) - T0 )) s)"
python3 -m qspec_jax.bench.fidelity --checkpoint /tmp/ckpt --text-dir .devcarry/texts --batches ${BATCHES:-1,8,32} \
  --gammas 4 --kv int8 --out $OUT 2>&1 | tee $OUT/fidelity.log | grep -v "^\[fidelity" | tail -12
echo "== cost ($(( $(date +%s) - T0 )) s)"
python3 tools/device/exactness_cost.py --out $OUT --smollm-checkpoint /tmp/ckpt --text-dir .devcarry/texts \
  --contexts ${CONTEXTS:-4096,131072} 2>&1 | tee $OUT/cost.log | tail -20
echo "== done ($(( $(date +%s) - T0 )) s)"
