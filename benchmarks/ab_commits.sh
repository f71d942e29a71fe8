#!/usr/bin/env bash
# A/B of two checkouts of speculant with `speculant bench`, runs alternated (base, head, base, head, ...): the
# machine's drift hits both alike.  Each checkout gets its own SPECULANT_CACHE (its first load converts and tunes
# there, untimed, before the first timed run).  Not a test.
#
#   git worktree add /tmp/base <commit>
#   benchmarks/ab_commits.sh /tmp/base . OUT_DIR ROUNDS "<base bench args>" "<head bench args>"
#   SHARE_TUNE=1 benchmarks/ab_commits.sh ...     # the head reuses the base's tune and measured costs
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
  if [ $side = head ] && [ "${SHARE_TUNE:-0}" = 1 ]; then
    # the head decides from the base's measurements (tune, T-row costs, draft costs: one untimed 8-token run of
    # every method first), so that a policy change is compared on the same cost table, not on two noisy ones
    (cd "$base" && SPECULANT_CACHE="$out/cache-base" python -m speculant.cli bench $base_args --max-new-tokens 8 \
       --quiet --out "$out/warm" > /dev/null)
    mkdir -p "$out/cache-head" && rm -rf "$out/cache-head/tune" && cp -r "$out/cache-base/tune" "$out/cache-head/tune"
  fi
  (cd "$dir" && SPECULANT_CACHE="$out/cache-$side" python -m speculant.cli generate --max-new-tokens 4 "Hi" > /dev/null)
done
for r in $(seq 1 "$rounds"); do
  echo "round $r $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  run base "$base" "$base_args" "$r"
  run head "$head" "$head_args" "$r"
done
