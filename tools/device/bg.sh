#!/usr/bin/env bash
# Run a device job that may outlast one ten-minute call: started once under setsid (it survives the
# call's end while the machine stays warm), waited on by this call and, if need be, by later ones.
#
#   bash tools/device/bg.sh start NAME 'COMMAND'   # copy the checkout, start COMMAND there, wait
#   bash tools/device/bg.sh wait NAME              # wait again for the job started earlier
#
# COMMAND runs in /tmp/bg/NAME/src (a copy of the checkout, so a later call's fresh tree does not
# disturb it) with OUT=/tmp/bg/NAME/out; its stdout/stderr go to out/job.log. Each call waits up to
# WAIT seconds (default 540), then copies out/ as $OUT/NAME.tgz and job.log to $OUT and prints the
# end of job.log and FINISHED rc=N or STILL RUNNING. The machine goes back 30 s after a call ends, and the job with
# it: call `wait` at once after a STILL RUNNING (a `wait` that finds no job says so and exits 3).
set -uo pipefail
mode=$1 name=$2
dir=/tmp/bg/$name
if [ "$mode" = start ]; then
  rm -rf "$dir" && mkdir -p "$dir/out"
  cp -r . "$dir/src" 2>/dev/null
  setsid nohup bash -c "cd $dir/src && export OUT=$dir/out PYTHONUNBUFFERED=1 PYTHONPATH=\${PYTHONPATH:-.}; \
    ( $3 ) > $dir/out/job.log 2>&1; echo \$? > $dir/RC" > /dev/null 2>&1 < /dev/null &
elif [ "$mode" != wait ]; then
  echo "bg.sh: mode must be start or wait, got '$mode'" >&2; exit 2
elif [ ! -d "$dir" ]; then  # a fresh machine: the warm one went back (30-s idle release) and took the job with it
  echo "bg.sh: no job '$name' on this machine ($dir missing): the machine was released since its start; start it again" >&2
  exit 3
fi
end=$(( $(date +%s) + ${WAIT:-540} ))
while [ ! -f "$dir/RC" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 3; done
tar czf "${OUT:-/tmp}/$name.tgz" -C "$dir" out 2>/dev/null
cp "$dir/out/job.log" "${OUT:-/tmp}/" 2>/dev/null
tail -n "${TAIL:-80}" "$dir/out/job.log" 2>/dev/null
[ -f "$dir/RC" ] && echo "FINISHED rc=$(cat "$dir/RC")" || echo "STILL RUNNING"
