#!/usr/bin/env bash
# The measurements of BENCHMARKS.md section R (runtime, draft head, server), in order, on an otherwise idle machine.
#
#   DEV=/path/to/spec_bench/dev.jsonl OUT=runs/runtime bash benchmarks/run_runtime.sh [STEP ...]
#
# Steps (default: all, in this order): held tune block t0 today t1 ee load soak loadtime.
# `today` runs the same greedy prompts on an older checkout (TODAY_SRC=<its directory>, e.g. a git worktree of
# 3b6345b, the runtime before issue 10) with its own cache, for the "no method slower than before" comparison.
# Needs the llamacpp extra (pip install -e ".[llamacpp]") for the llama.cpp rows.
set -euo pipefail
: "${DEV:?set DEV to a Spec-Bench question.jsonl}"
OUT=${OUT:-runs/runtime}
B=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT" && cd "$OUT"
HELD=$PWD/heldout_specbench.jsonl
step() { echo "== $1 $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"; }
for s in ${*:-held tune block t0 today t1 ee load soak loadtime}; do
  step "$s"
  case $s in
    held) python "$B/heldout_spec_bench.py" "$DEV" "$HELD" --humaneval ;;
    tune) speculant tune > tune.md 2> tune.err; cat tune.md ;;
    block) python "$B/block_cost.py" --weights fp32,bf16,int8,int4 --repeats 7 > block_cost.md 2> block.err; cat block_cost.md ;;
    t0) speculant bench --dataset "$HELD" --limit 1 --max-new-tokens 128 --temperature 0 --quiet --out t0 --methods \
"ar,ar:rt=fp32-eager,hf-ar,llamacpp,llamacpp-lookup,prompt-lookup:K=3,prompt-lookup:K=3,rt=fp32-eager,eagle:K=3,eagle:K=auto,eagle:K=3,rt=fp32-eager,eagle:K=6,rsd-c:b=2x1x1,head=default,rsd-s:W=2,L=3,head=default,specinfer:b=2x1x1,head=default,early-exit:E=8,K=3,early-exit:E=8,K=3,rt=fp32-eager,rsd-s:W=2,L=3,E=8"
        python "$B/draft_head_table.py" t0 ;;
    today) SPECULANT_CACHE=$PWD/today_cache PYTHONPATH=${TODAY_SRC:?set TODAY_SRC for the today step} \
        python -m speculant.cli bench --dataset "$HELD" --limit 1 --max-new-tokens 128 --temperature 0 --quiet --out today \
        --methods "ar,hf-ar,prompt-lookup:K=3,early-exit:E=8,K=3,rsd-s:W=2,L=3,E=8"
        python "$B/draft_head_table.py" today ;;
    t1) speculant bench --dataset "$HELD" --limit 1 --max-new-tokens 128 --temperature 1.0 --quiet --out t1 --methods \
"ar,hf-ar,llamacpp,prompt-lookup:K=3,eagle:K=3,eagle:K=auto,eagle:K=6,rsd-c:b=2x1x1,head=default,rsd-s:W=2,L=3,head=default,specinfer:b=2x1x1,head=default,early-exit:E=8,K=3"
        python "$B/draft_head_table.py" t1 ;;
    ee) python "$B/early_exit_cost.py" --exit-layers 2,4,8,12,16,24 --ks 1,2,3,4 --repeats 9 > early_exit_cost.md 2> ee.err
        cat early_exit_cost.md ;;
    load) python "$B/load_test.py" --model smollm2-135m --server ar --server "eagle --num-speculations 3" \
            --concurrency 1,4,8,16 --requests 3 --max-tokens 64 --out load.json ;;
    soak) python "$B/load_test.py" --model smollm2-135m --server "eagle --num-speculations 3" --concurrency 8 --soak 300 \
            --max-tokens 64 --out soak.json ;;
    loadtime) python "$B/load_time.py" --cold 1 --warm 3 > load_time.md 2> loadtime.err; cat load_time.md ;;
    *) echo "unknown step $s; allowed: held tune block t0 today t1 ee load soak loadtime" >&2; exit 2 ;;
  esac
done
step done
