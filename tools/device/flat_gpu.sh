#!/usr/bin/env bash
# The draft view's balanced schedule (`MgpuConfig.ws_flat`, twelfth session) on the GPU, one stage list per call:
#   check   tools/device/check_attention.py on the draft cases with ws_flat=1 (fresh random caches, jnp reference,
#           every partial written and finite);
#   kernel  tools/device/ragged_attention.py: flat vs the default split at batch 8 / 32k, uniform and ragged rows
#           (with its own check against the reference);
#   profile `qspec-bench profile --batch 8 --contexts 32768 --ragged --programs draft,spec_loop`, QSPEC_MGPU_FLAT=0 / 1;
#   e2e     issue 31's measure with QSPEC_MGPU_FLAT=0, then 1: `qspec-bench e2e --parts batch --batch-contexts 32768 --alphas 0.9`.
#   ab      the default schedule of an earlier build against this one on one machine, kernel alone at batch 8 / 32k
#           (both views, uniform and ragged rows; base, new, base, new): BASE holds the earlier build's pallas_kernels/,
#           carried (`mkdir -p tools/device/_ab/base && git archive 178f384 pallas_kernels | tar x -C tools/device/_ab/base`,
#           carry tools/device/_ab/base).
# Added in the thirteenth session:
#   sweep   ragged_attention.py: the 8B draft at batch 8 / 32k under the default, flat on one CTA per SM and flat on
#           128 CTAs (a multiple of the 64 pairs: one segment per CTA on uniform rows), then SmolLM2 at batch 32 / 8k;
#   ringw   the balanced schedule with the ring weighted $RING_WS blocks ($QSPEC_MGPU_FLAT_RING_W), 8B batch 8 / 32k;
#   sass    mgpu_dump.py: ptxas and SASS of the default and the balanced draft kernel at batch 8;
#   smolprof `qspec-bench profile --shape smollm2 --batch 32 --contexts 8192 --ragged --programs draft`, FLAT 0 / 1.
# Added in the fourteenth session (the prep's query in registers, `ws_prep_q_regs`, tokens "+q" / "-q"):
#   qregs   ragged_attention.py with and without it: 8B batch 8 / 32k (row split and balanced, checked bitwise
#           against it off and against the reference), SmolLM2 batch 32 / 8k (draft and verify T 5), 8B batch 1 /
#           128k (row split);
#   qsass   mgpu_dump.py: ptxas and SASS of the row-split (batch 1) and the balanced (batch 8) draft kernel with it
#           (as first run, both at batch 8: both the balanced kernel).
#   live    the verify view's softmax on each column tile's live columns (`ws_live_cols`, tokens "+l" / "-l"):
#           check_attention.py (check and T-invariance, quick cases), then the verify kernel alone at 8B batch 8 / 32k;
#   livesmol the same at SmolLM2's shape, batch 32 / 8k (not yet run).
# Added in the fifteenth session (why live columns slowed the draft: ptxas C7511):
#   probe   mgpu_dump.py (ptxas of the batch-1 draft kernel: live columns, + 216 consumer registers, whole tiles
#           + 216, live unpipelined), then the draft kernel alone with each (ragged_attention.py --check-tokens) at
#           batch 1 / 128k and batch 8 / 32k. (As first run, before `_wg_keep` landed, with "--diag keep_dead"
#           and ":keep_dead" variants of the probe that became `_wg_keep`.)
#   live2   the draft's live columns as landed: kernel alone at 8B batch 8 / 32k and SmolLM2 batch 32 / 8k (whole
#           tiles, live, live unpipelined, whole unpipelined), then check_attention.py's T-invariance (balanced
#           schedule at batch 2, and the row split).
#   cd <repo> && OUT=/tmp/out STAGES="check kernel" bash tools/device/flat_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
T0=$(date +%s)
L=$OUT/logs && mkdir -p $L
stamp() { echo "== $1 ($(( $(date +%s) - T0 )) s)"; }
for stage in ${STAGES:-check kernel}; do
  case $stage in
    check)
      timeout ${CHECK_LIMIT:-180} python3 tools/device/check_attention.py --parts check --impls mosaic-ws \
        --check-config ws_flat=1 --cases "${FLAT_CASES:-llama3-8b:draft:1:none,llama3-8b:draft:5:1000,llama3-8b:draft:9:none,smollm2:draft:1:none,smollm2:draft:5:1000}" \
        2>&1 | grep -v "^W[0-9]" | tee $L/check_flat.log | grep -E "check|FAIL|rror" | tail -12
      stamp check;;
    kernel)
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --nps ${FLAT_NPS:-0,flat} --views draft \
        --layouts ${FLAT_LAYOUTS:-uniform,ragged} ${KERNEL_ARGS:-} 2>&1 | grep -v "^W[0-9]" | tee $L/ragged_flat.log | grep -v "^|"
      stamp kernel;;
    profile)
      for f in 0 1; do
        QSPEC_MGPU_FLAT=$f timeout ${PROF_LIMIT:-150} python3 -m qspec_jax.cli.bench profile --steps 8 --trials 3 \
          --batch 8 --contexts 32768 --ragged --programs ${PROF_PROGS:-draft,spec_loop} --verify-t 5 \
          --out $OUT/p_flat$f 2>&1 | grep -v "^W[0-9]" > $L/profile_b8_32k_ragged_flat$f.log
        grep -E "^==|^   (linear|attention|glue) |rror" $L/profile_b8_32k_ragged_flat$f.log; rm -rf $OUT/p_flat$f/traces
        stamp "profile flat=$f"
      done;;
    e2e)
      for f in 0 1; do
        QSPEC_MGPU_FLAT=$f timeout ${E2E_LIMIT:-200} python3 -m qspec_jax.cli.bench e2e --parts batch \
          --batch-contexts 32768 --alphas 0.9 --out $OUT/e2e_flat$f 2>&1 | grep -v "^W[0-9]" > $L/e2e_batch_flat$f.log
        grep -o '"ar_bf16_tok_s": [0-9.]*, "spec_a0.9_tok_s": [0-9.]*' $L/e2e_batch_flat$f.log; stamp "e2e flat=$f"
      done;;
    sweep)
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --nps ${SWEEP_NPS:-0,flat,flat128} \
        --views draft --layouts uniform,ragged 2>&1 | grep -v "^W[0-9]" | tee $L/sweep_8b.log | grep -v "^|"
      stamp "sweep 8b"
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
        --nps ${SMOL_NPS:-0,flat} --views draft --layouts uniform,ragged 2>&1 | grep -v "^W[0-9]" \
        | tee $L/sweep_smollm2.log | grep -v "^|"
      stamp "sweep smollm2";;
    ringw)  # the ring's weight in the balanced schedule ($QSPEC_MGPU_FLAT_RING_W), 8B draft at batch 8 / 32k
      for rw in ${RING_WS:-10 5 3}; do
        QSPEC_MGPU_FLAT_RING_W=$rw timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py \
          --nps ${RINGW_NPS:-flat} --views draft --layouts uniform,ragged 2>&1 | grep -v "^W[0-9]" \
          | tee $L/ringw_$rw.log | grep -E "check|NP"
        stamp "ringw $rw"
      done;;
    sass)  # ptxas and the SASS of the default and the balanced draft kernel at batch 8 (mgpu_dump.py)
      python3 tools/device/mgpu_dump.py $L/sass_default --cases draft:1 --batch 8 2>&1 | grep -v "^W[0-9]" \
        | tee $L/sass_default.log | grep -iE "spill|regist" | head -4
      python3 tools/device/mgpu_dump.py $L/sass_flat --cases draft:1 --batch 8 --flat 2>&1 | grep -v "^W[0-9]" \
        | tee $L/sass_flat.log | grep -iE "spill|regist" | head -4
      stamp sass;;
    smolprof)
      for f in 0 1; do
        QSPEC_MGPU_FLAT=$f timeout ${PROF_LIMIT:-150} python3 -m qspec_jax.cli.bench profile --steps 8 --trials 3 \
          --shape smollm2 --batch 32 --contexts 8192 --ragged --programs ${PROF_PROGS:-draft} --verify-t 5 \
          --out $OUT/p_smol_flat$f 2>&1 | grep -v "^W[0-9]" > $L/profile_smollm2_b32_8k_ragged_flat$f.log
        grep -E "^==|^   (linear|attention|glue) |rror" $L/profile_smollm2_b32_8k_ragged_flat$f.log
        rm -rf $OUT/p_smol_flat$f/traces; stamp "smolprof flat=$f"
      done;;
    qregs)
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --nps 0-q,0+q,flat-q,flat+q --views draft \
        --layouts uniform,ragged --check-q-regs 2>&1 | grep -v "^W[0-9]" | tee $L/qregs_8b_b8.log | grep -v "^|"
      stamp "qregs 8b b8"
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
        --nps 0-q,0+q,flat-q,flat+q --views draft,target --layouts uniform,ragged 2>&1 | grep -v "^W[0-9]" \
        | tee $L/qregs_smollm2_b32.log | grep -v "^|"
      stamp "qregs smollm2"
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --batch 1 --ctx 131072 --nps 0-q,0+q,0-q,0+q \
        --views draft --layouts uniform 2>&1 | grep -v "^W[0-9]" | tee $L/qregs_8b_b1_128k.log | grep -v "^|"
      stamp "qregs 8b b1";;
    live)  # the verify view (the draft's live columns: stages `probe`, `live2`)
      timeout ${CHECK_LIMIT:-240} python3 tools/device/check_attention.py --parts check,tinv --impls mosaic-ws --quick \
        2>&1 | grep -v "^W[0-9]" | tee $L/check_live.log | grep -E "check|tinv|FAIL|rror" | tail -14
      stamp "live check"
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --nps 0-l,0+l,0-l,0+l \
        --views target --layouts uniform,ragged 2>&1 | grep -v "^W[0-9]" | tee $L/live_8b_b8.log | grep -v "^|"
      stamp "live 8b b8";;
    livesmol)
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
        --nps 0-l,0+l --views target --layouts uniform,ragged 2>&1 | grep -v "^W[0-9]" \
        | tee $L/live_smollm2_b32.log | grep -v "^|"
      stamp "live smollm2";;
    qsass)
      for b in 1 8; do  # batch 1: the row split; batch 8: the balanced schedule (each its default there)
        QSPEC_MGPU_PREP_QREGS=1 python3 tools/device/mgpu_dump.py $L/sass_q_b$b --cases draft:1 --batch $b 2>&1 \
          | grep -v "^W[0-9]" | tee $L/sass_q_b$b.log | grep -iE "spill|regist" | head -4
      done
      stamp qsass;;
    ab)
      base=${BASE:-tools/device/_ab/base}
      [ -d "$base/pallas_kernels" ] || { echo "no $base/pallas_kernels"; continue; }
      rm -rf /tmp/ab_base && mkdir -p /tmp/ab_base && cp -r qspec_jax tools /tmp/ab_base/ \
        && cp -r $base/pallas_kernels /tmp/ab_base/  # this checkout with the earlier build's kernels
      for src in base new base new; do
        dir=$([ $src = base ] && echo /tmp/ab_base || echo $PWD)
        (cd $dir && timeout ${AB_LIMIT:-120} python3 tools/device/ragged_attention.py --nps 0 --views draft,target \
          --layouts uniform,ragged) 2>&1 | grep -v "^W[0-9]" | tee -a $L/ab_default_$src.log | grep -E "kernel"
        stamp "ab $src"
      done;;
    probe)
      for v in "1" "0" "1 --regs 216/56/24" "0 --regs 216/56/24" "1 --pipeline 0"; do
        n=$(echo "$v" | tr -cd '[:alnum:]')
        python3 tools/device/mgpu_dump.py $L/sass_probe_$n --cases draft:1 --batch 1 --live $v 2>&1 \
          | grep -v "^W[0-9]" > $L/sass_probe_$n.log
        echo "-- live $v: $(grep -ciE 'C7511' $L/sass_probe_$n.log) C7511 lines;" \
          "$(grep -iE 'registers|spill' $L/sass_probe_$n.log | head -2 | tr '\n' ' ')"
        grep -E "instructions$" -A1 $L/sass_probe_$n.log | head -2
      done
      stamp "probe sass"
      P="${PROBE_TOKENS:-0-l,0+l,0+l@216/56/24,0-l@216/56/24,0+l-p}"
      timeout ${KERNEL_LIMIT:-240} python3 tools/device/ragged_attention.py --batch 1 --ctx 131072 --nps $P \
        --views draft --layouts uniform --check-tokens 2>&1 | grep -v "^W[0-9]" \
        | tee $L/probe_b1_128k.log | grep -v "^|"
      stamp "probe b1"
      timeout ${KERNEL_LIMIT:-240} python3 tools/device/ragged_attention.py --nps ${PROBE_TOKENS8:-${P//0/flat}} \
        --views draft --layouts uniform --check-tokens 2>&1 | grep -v "^W[0-9]" \
        | tee $L/probe_b8_32k.log | grep -v "^|"
      stamp "probe b8";;
    live2)  # the draft's live columns as landed (pipelined: every accumulator register kept, `_wg_keep`)
      timeout ${KERNEL_LIMIT:-230} python3 tools/device/ragged_attention.py --nps ${LIVE2_TOKENS:-flat-l,flat+l,flat+l-p,flat-l-p} \
        --views draft --layouts uniform,ragged --check-tokens 2>&1 | grep -v "^W[0-9]" \
        | tee $L/live2_8b_b8.log | grep -v "^|"
      stamp "live2 8b b8"
      timeout ${KERNEL_LIMIT:-150} python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
        --nps ${LIVE2_SMOL_TOKENS:-flat-l,flat+l,flat+l-p} --views draft --layouts uniform,ragged 2>&1 \
        | grep -v "^W[0-9]" | tee $L/live2_smollm2_b32.log | grep -v "^|"
      stamp "live2 smollm2"
      timeout ${CHECK_LIMIT:-150} python3 tools/device/check_attention.py --parts tinv --impls mosaic-ws --quick \
        2>&1 | grep -v "^W[0-9]" | tee $L/tinv_live2.log | grep -E "tinv|FAIL|rror" | tail -10
      stamp "live2 tinv"
      timeout ${CHECK_LIMIT:-100} python3 tools/device/check_attention.py --parts tinv --impls mosaic-ws --quick \
        --check-config ws_flat=0 --cases "llama3-8b:draft:float32:none,llama3-8b:draft:bfloat16:1000" \
        2>&1 | grep -v "^W[0-9]" | tee $L/tinv_live2_row.log | grep -E "tinv|FAIL|rror" | tail -4
      stamp "live2 tinv row split";;
    *) echo "unknown stage $stage" >&2;;
  esac
done
tar czf $OUT/logs.tgz -C $OUT logs $(cd $OUT && ls -d e2e_* p_* 2>/dev/null) && rm -rf $L $OUT/e2e_* $OUT/p_*
stamp "all done"
