#!/usr/bin/env bash
# A/B of an environment switch in the model (issue 32): `qspec-bench profile` of the 8B at 4k with VAR=0 and
# VAR=1 on the same machine, per batch. Used for QSPEC_W4A16_TUNED (the measured launch shapes) and
# QSPEC_W4A16_PDL (programmatic dependent launch of the W4A16 kernels).
#   cd <repo> && OUT=/tmp/out bash tools/device/env_ab_profile.sh QSPEC_W4A16_TUNED
#   BATCHES="1 8" PROGRAMS=draft LIMIT=150 (defaults)
set -uo pipefail
var=${1:?usage: env_ab_profile.sh VAR}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for b in ${BATCHES:-1 8}; do
  for v in 0 1; do
    tag=b${b}_${var}$v
    env "$var=$v" timeout ${LIMIT:-150} python3 -m qspec_jax.cli.bench profile --batch $b --contexts 4096 \
      --programs ${PROGRAMS:-draft} --verify-t 5 --steps 8 --trials 3 --out $OUT/profile_$tag 2>&1 \
      | tee $OUT/profile_8b_4k_$tag.log | grep -v "^W[0-9]" | grep -E "^==|linear |attention |glue |\[linear\]|error"
    echo "== $tag done ($(( $(date +%s) - T0 )) s)"
  done
done
rm -rf $OUT/profile_*/traces
