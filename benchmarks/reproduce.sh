#!/usr/bin/env bash
# Reproduce the tables of BENCHMARKS.md (SmolLM2-135M, fp32, CPU).  Usage:
#   SPEC_BENCH=/path/to/spec_bench/question.jsonl OUT=bench_results bash benchmarks/reproduce.sh [a|b|sweep|c0|c1|d0|d1 ...]
# Each step writes $OUT/<step>/ (results.json, report.md, PNGs).  Sizes are kept tiny for a 2-core CPU.
set -euo pipefail
: "${SPEC_BENCH:?set SPEC_BENCH to a Spec-Bench question.jsonl}"
OUT=${OUT:-bench_results}
N=${N:-16}          # max new tokens
E=${E:-24}          # exit layer of the self-drafter / truncated draft copy
T1=${THREADS:+--threads $THREADS}   # optional torch thread count
R=${REPEATS:-1}     # timed repeats per prompt and method (Spec-Bench dev / HumanEval step)
steps=${*:-a b sweep d0 c0 d1 c1}
RSD="ar,early-exit:E=$E,K=4,specinfer:E=$E,b=2x1,rsd-c:E=$E,b=2x1,rsd-s:W=2,L=2,E=$E"
RSD+=",early-exit:E=$E,K=8,specinfer:E=$E,b=2x1x1x1,rsd-c:E=$E,b=2x1x1x1,rsd-s:W=2,L=4,E=$E"
RSD+=",early-exit:E=$E,K=16,specinfer:E=$E,b=4x1x1x1,rsd-c:E=$E,b=4x1x1x1,rsd-s:W=4,L=4,E=$E"
RSD+=",draft-model:E=$E,K=8,specinfer:b=2x1x1x1,draft=truncated:$E,rsd-c:b=2x1x1x1,draft=truncated:$E,rsd-s:W=2,L=4,draft=truncated:$E"
D="ar,hf-ar,early-exit:E=$E,K=4,rsd-s:W=2,L=4,E=$E,prompt-lookup:K=4"
for s in $steps; do
  echo "== $s $(date -u +%H:%M:%S)"
  case $s in
    a) python benchmarks/ar_vs_hf.py --dataset "$SPEC_BENCH" --categories mt_bench,qa --limit 1 \
         --max-new-tokens $N --repeats 2 --json "$OUT/a_ar_vs_hf.json" ;;
    b) speculant bench --dataset "$SPEC_BENCH" --categories mt_bench,summarization --limit 1 --max-new-tokens $N \
         --methods "ar,early-exit:E=$E,K=4,draft-model:E=$E,K=4,prompt-lookup:K=4,hf-ar,hf-early-exit:E=$E,K=4,hf-prompt-lookup:K=10,hf-assistant:E=$E,K=4" \
         --out "$OUT/b_issue3" --quiet $T1 ;;
    sweep) speculant sweep --dataset "$SPEC_BENCH" --categories mt_bench --limit 1 --max-new-tokens $N \
         --exit-layers 20,24,28 --num-speculations 2,4 --out "$OUT/sweep" --quiet $T1 ;;
    c0) speculant bench --dataset "$SPEC_BENCH" --categories mt_bench --limit 1 --max-new-tokens $N --temperature 0 \
         --methods "$RSD" --out "$OUT/c_rsd_t0" --quiet $T1 ;;
    c1) speculant bench --dataset "$SPEC_BENCH" --categories mt_bench --limit 1 --max-new-tokens $N --temperature 1.0 \
         --methods "$RSD" --out "$OUT/c_rsd_t1" --quiet $T1 ;;
    d0|d1) T=$([ $s = d0 ] && echo 0 || echo 1.0)
         speculant bench --dataset "$SPEC_BENCH" --limit 1 --max-new-tokens $N --temperature $T --methods "$D" \
           --repeats $R --out "$OUT/${s}_specbench" --quiet $T1
         speculant bench --dataset humaneval --limit 1 --max-new-tokens $N --temperature $T --methods "$D" \
           --repeats $R --out "$OUT/${s}_humaneval" --quiet $T1 ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
echo "== done $(date -u +%H:%M:%S)"
