#!/usr/bin/env bash
# A/B of two checkouts of speculant with `speculant bench`, runs alternated (base, head, base, head, ...): the
# machine's drift hits both alike.  Each checkout gets its own SPECULANT_CACHE (its first load converts and tunes
# there, untimed, before the first timed run).  Not a test.
#
#   git worktree add /tmp/base <commit>
#   benchmarks/ab_commits.sh /tmp/base . OUT_DIR ROUNDS "<base bench args>" "<head bench args>"
#
# Each run writes OUT_DIR/{base,head}-<round>/report.md and results.json; compare the ratios to `ar` of each run
# (`python benchmarks/tables.py` style) or the mean tok/s per method across rounds.
set -euo pipefail
base=$(cd "$1" && pwd); head=$(cd "$2" && pwd); out=$3; rounds=$4; base_args=$5; head_args=$6
mkdir -p "$out"
out=$(cd "$out" && pwd)
run() {   # side dir args round
  (cd "$2" && SPECULANT_CACHE="$out/cache-$1" python -m speculant.cli bench $3 --quiet --out "$out/$1-$4")
}
for side in base head; do          # first loads: convert, tune, pack (untimed)
  dir=$([ $side = base ] && echo "$base" || echo "$head")
  (cd "$dir" && SPECULANT_CACHE="$out/cache-$side" python -m speculant.cli generate --max-new-tokens 4 "Hi" > /dev/null)
done
for r in $(seq 1 "$rounds"); do
  echo "round $r $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  run base "$base" "$base_args" "$r"
  run head "$head" "$head_args" "$r"
done
