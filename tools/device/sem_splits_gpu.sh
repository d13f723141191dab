#!/usr/bin/env bash
# Issue 32 / 31 on the GPU, one staged call (2026-11-27, third session):
#   sem    the W4A16 "sem" split-K sum against the XLA sum and the cluster sum, bit for bit, and timed
#          (tools/device/w4a16_sem_gpu.py) for the 8B draft's linears;
#   attn   the quantized attention with its split merge at short contexts against its CTAs per (row, KV head)
#          (num_splits; the cost model's default_ctas ignores the merge's XLA kernels);
#   hlo    the optimized HLO of the fused 8B draft step at 4k (tools/device/issue32_profile.py), to name its glue;
#   model  `qspec-bench profile` of the 8B draft step under candidate TUNED_SHAPES tables, attention split
#          counts and split merges (tools/device/tuned_table_run.py, QSPEC_MGPU_MERGE), all on this machine.
#          VARIANTS="tag[@context] ..." (tags below), BATCHES="1 8".
#   cd <repo> && OUT=/tmp/out STAGES=sem,attn,model bash tools/device/sem_splits_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
T0=$(date +%s)
stage() { [[ ",${STAGES:-sem,attn,model}," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
H=H100
[ -n "$(grep H200 $OUT/gpu.txt)" ] && H=H200
if stage sem; then
  timeout ${SEM_LIMIT:-240} python3 tools/device/w4a16_sem_gpu.py --m 1,8 --shapes ${SEM_SHAPES:-qkv,o,down,gate_up} 2>&1 \
    | grep -v "^W[0-9]" | tee $OUT/w4a16_sem.log
  echo "== sem done ($(( $(date +%s) - T0 )) s)"
fi
if stage attn; then
  timeout ${ATTN_LIMIT:-200} python3 tools/device/check_attention.py --parts time --time-impls mosaic --no-torch \
    --mgpu-configs "${ATTN_CONFIGS:-default;num_splits=2;num_splits=4;num_splits=6;num_splits=8}" \
    --contexts ${ATTN_CONTEXTS:-4096,8192,16384} --batches ${ATTN_BATCHES:-1} --time-ts 5 --trace-dir /tmp/attn_tr 2>&1 \
    | grep -v "^W[0-9]" | tee $OUT/attn_splits.log | grep -E "^\||time "
  rm -rf /tmp/attn_tr
  echo "== attn done ($(( $(date +%s) - T0 )) s)"
fi
if stage hlo; then
  timeout ${HLO_LIMIT:-150} python3 tools/device/issue32_profile.py --out $OUT/hlo --variants fused --contexts 4096 \
    --steps 4 --trials 2 --budget 100 2>&1 | grep -v "^W[0-9]" | tail -30
  rm -rf $OUT/hlo/*trace* 2>/dev/null
  echo "== hlo done ($(( $(date +%s) - T0 )) s)"
fi
if stage model; then
  D=$H:14336,4096,32 O=$H:4096,4096,32 Q=$H:4096,6144,32 G=$H:4096,28672,32
  SEM3="--set $D=2,256,4,sem --set $O=2,256,8,sem --set $Q=2,128,8,sem"
  # tag: [environment] [tuned_table_run.py arguments]
  declare -A V=([base]="" [sem3]="$SEM3" [sem3_a4]="$SEM3 --attn-splits draft=4"
                [sem3_a8]="$SEM3 --attn-splits draft=8" [sem3_gu]="$SEM3 --set $G=2,256,2,sem"
                [a6]="--attn-splits draft=6" [a8]="--attn-splits draft=8" [a10]="--attn-splits draft=10"
                [global]="QSPEC_MGPU_MERGE=global" [pairwise]="QSPEC_MGPU_MERGE=pairwise"
                [a8_global]="QSPEC_MGPU_MERGE=global --attn-splits draft=8"
                [a8_pairwise]="QSPEC_MGPU_MERGE=pairwise --attn-splits draft=8"
                [pm]="--attn-config ws_pair_merge=1" [pm_a8]="--attn-config ws_pair_merge=1 --attn-splits draft=8"
                [nopm]="--attn-config ws_pair_merge=0")
  for item in ${VARIANTS:-base sem3 sem3_a4 sem3_a8}; do
    tag=${item%@*} ctx=4096
    [[ $item == *@* ]] && ctx=${item#*@}
    envs=() args=()
    for w in ${V[$tag]}; do [[ $w == QSPEC_*=* ]] && envs+=("$w") || args+=("$w"); done
    for b in ${BATCHES:-1}; do
      name=${tag}_b${b}_$ctx
      [ "${PROGRAMS:-draft}" != draft ] && name=${name}_${PROGRAMS//,/_}
      env "${envs[@]}" timeout ${LIMIT:-120} python3 tools/device/tuned_table_run.py "${args[@]}" -- profile \
        --batch $b --contexts $ctx --programs ${PROGRAMS:-draft} --verify-t 5 --steps 8 --trials 3 \
        --out $OUT/profile_$name 2>&1 | tee $OUT/profile_8b_$name.log | grep -v "^W[0-9]" \
        | grep -E "^==|attention |glue |\[attention\]|\[glue\]|error|Error" | head -${HEAD:-16}
      echo "== $name done ($(( $(date +%s) - T0 )) s)"
    done
  done
  rm -rf $OUT/profile_*/traces
fi
