#!/usr/bin/env bash
# Decoding with one core kept busy by another process (BENCHMARKS.md AE): `ar`, 128 greedy tokens, tok/s as
# `--json` reports it; the thread governor (the tuned count, no SPECULANT_NUM_THREADS) against fixed 2 and 1 threads,
# alternated, three rounds idle and three with a shell loop on one core.  Not a test.  Run from a checkout with
# speculant installed:  benchmarks/busy_core.sh
set -euo pipefail
P="Write a short story about a robot who learns to paint."
run() {  # label, then env assignments
  env "${@:2}" speculant generate --json --method ar --max-new-tokens 128 --temperature 0 "$P" 2>/dev/null |
    python -c "import json,sys; print('$1', round(json.load(sys.stdin)['stats']['tokens_per_second'], 1))"
}
speculant generate --max-new-tokens 4 hi > /dev/null 2>&1       # first load (tune) untimed
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
for busy in 0 1; do
  if [ $busy = 1 ]; then (while :; do :; done) & BP=$!; sleep 1; fi
  for r in 1 2 3; do
    run "busy=$busy governor (tuned threads)" SPECULANT_NUM_THREADS=
    run "busy=$busy fixed 2 threads" SPECULANT_NUM_THREADS=2
    run "busy=$busy fixed 1 thread" SPECULANT_NUM_THREADS=1
  done
  if [ $busy = 1 ]; then kill $BP; fi
done
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
