"""Decode and prefill rates of our ``ar`` on one model, as llama.cpp's ``llama-bench -p 512 -n 128`` reports them.

Not a test.  The model is loaded once; after a warm-up round, each round decodes 128 greedy tokens from a short
prompt (decode rate = (new tokens - 1) / (wall - time to first token) [tokens/s]) and prefills a raw prompt of
``--prompt-tokens`` tokens taken from ``--text-file`` (rate = tokens / time to first token [tokens/s]).

    python benchmarks/prefill_decode.py --model gemma3-270m --text-file ../shared/data/spec_bench/dev.jsonl
"""

from __future__ import annotations

import argparse
import statistics

import speculant
from speculant import GenerationConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text-file", required=True, help="any text file long enough for the prefill prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = speculant.load_model(args.model, threads=args.threads)
    gen = speculant.build_generator(model, method="ar")
    tok = model.tokenizer
    with open(args.text_file) as f:
        long_ids = tok.encode(f.read(), add_special_tokens=False)[:args.prompt_tokens]
    if len(long_ids) < args.prompt_tokens:
        raise SystemExit(f"--text-file has {len(long_ids)} tokens; --prompt-tokens={args.prompt_tokens} needs more")
    short = tok.encode("Write a short story about a robot.", add_special_tokens=True)
    decode, prefill = [], []
    for r in range(args.rounds + 1):                   # round 0 warms up
        s = gen.generate(short, GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)).stats
        p = gen.generate(long_ids, GenerationConfig(max_new_tokens=1, ignore_eos=True)).stats
        if r:
            decode.append((s.new_tokens - 1) / (s.seconds - s.time_to_first_token_s))
            prefill.append(len(long_ids) / p.time_to_first_token_s)
    print(f"{args.model}: weights {model.weights}, fused {model.fused}, threads {args.threads}")
    for name, xs in ((f"decode (tg{args.new_tokens})", decode), (f"prefill (pp{args.prompt_tokens})", prefill)):
        print(f"{name} tok/s: {', '.join(f'{x:.1f}' for x in xs)}; median {statistics.median(xs):.1f}")


if __name__ == "__main__":
    main()
