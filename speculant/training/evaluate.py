"""``speculant exit-eval``: how well early exits predict the final layer, and what that buys in decoding.

* per-layer top-1 agreement of the shared-head exit after every layer with the last layer
  (held-out response positions), and of an exit adapter at its layer (table + PNG);
* greedy self-speculative decoding with the adapter vs our AR on held-out prompts, in the same
  run: acceptance rate, tokens/s, and whether the outputs are token-identical.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..errors import SpeculantError
from .arguments import add_eval_args  # noqa: F401  (re-exported)


@torch.inference_mode()
def layer_agreement(model, records: list[dict], max_tokens: int = 2000, exit_head=None, exit_layer: int | None = None,
                    response_only: bool = True) -> dict:
    """Top-1 agreement with the last layer of the shared-head exit after each layer (and of ``exit_head``).

    Args:
        records: corpus records (see :mod:`.data`); positions counted are response positions.
        max_tokens: stop after this many positions.
        exit_head: optional callable hidden ``[..., D]`` -> logits ``[..., V]`` at ``exit_layer``.
    Returns:
        ``{"positions": N, "layers": {E: agreement} for E = 1..L-1 (exit after layer E-1), "adapter": a|None}``.
    """
    from ..runtime.executor import executor_of
    from .features import sequence_ids
    dec = executor_of(model)
    L = dec.num_layers
    agree = torch.zeros(L, dtype=torch.long)
    ad_agree, n = 0, 0
    for r in records:
        ids, first = sequence_ids(r, dec.config.max_position_embeddings)
        if not response_only:
            first = 0
        if len(ids) < 2 or first >= len(ids):
            continue
        pos = torch.arange(len(ids))
        h = dec.embed(torch.tensor([ids]))
        outs = []
        for layer in range(L):
            h = dec.run_layers(h, layer, layer + 1, pos)
            outs.append(dec.lm_head(dec.final_norm(h[0, first:])).argmax(-1))
            if exit_head is not None and layer + 1 == exit_layer:
                ad_top = exit_head(h[0, first:]).argmax(-1)
        final = outs[-1]
        for layer in range(L):
            agree[layer] += int((outs[layer] == final).sum())
        if exit_head is not None:
            ad_agree += int((ad_top == final).sum())
        n += len(final)
        if n >= max_tokens:
            break
    if n == 0:
        raise SpeculantError("no held-out response positions to evaluate")
    return {"positions": n, "layers": {layer + 1: agree[layer].item() / n for layer in range(L - 1)},
            "adapter": ad_agree / n if exit_head is not None else None, "adapter_exit_layer": exit_layer}


def plot_agreement(result: dict, path: str | Path, title: str = "") -> Path:
    """PNG: agreement vs exit layer (shared head), with the adapter as a marker."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs = sorted(int(k) for k in result["layers"])
    ys = [result["layers"][k] if k in result["layers"] else result["layers"][str(k)] for k in xs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, "o-", label="shared final norm + LM head (as shipped)")
    if result.get("adapter") is not None:
        ax.plot([result["adapter_exit_layer"]], [result["adapter"]], "r*", markersize=14,
                label=f"exit adapter at E={result['adapter_exit_layer']}")
    ax.set_xlabel("exit layer E (hidden leaving layer E-1)")
    ax.set_ylabel("top-1 agreement with the last layer")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title(title or f"Early-exit agreement, {result['positions']} held-out positions")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def speed_compare(model, prompts: list[list[int]], max_new_tokens: int, num_speculations: int | str,
                  exit_adapter: str | None, exit_layer: int | None) -> dict:
    """Greedy AR vs early-exit speculative decoding on the same prompts, interleaved in one run.

    Returns:
        totals (tokens, seconds, tokens/s per method), speedup, acceptance rate, mean accepted
        length, and ``identical`` (every output token-identical to AR).
    """
    from ..engine.generator import GenerationConfig
    from ..engine.methods import build_generator
    ar = build_generator(model, method="ar")
    ee = build_generator(model, method="early-exit", exit_adapter=exit_adapter, exit_layer=exit_layer,
                         num_speculations=num_speculations)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens)
    tot = {"ar": [0, 0.0], "ee": [0, 0.0]}
    drafted = accepted = rounds = 0
    identical = True
    per_prompt = []
    ar.generate(prompts[0], GenerationConfig(max_new_tokens=4))      # warm-up
    for p in prompts:
        a = ar.generate(p, cfg)
        e = ee.generate(p, cfg)
        same = a.token_ids == e.token_ids
        identical &= same
        tot["ar"][0] += a.stats.new_tokens
        tot["ar"][1] += a.stats.seconds
        tot["ee"][0] += e.stats.new_tokens
        tot["ee"][1] += e.stats.seconds
        drafted += e.stats.drafted_tokens
        accepted += e.stats.accepted_tokens
        rounds += e.stats.rounds
        per_prompt.append({"tokens": a.stats.new_tokens, "ar_tok_s": a.stats.tokens_per_second,
                           "ee_tok_s": e.stats.tokens_per_second, "acceptance": e.stats.acceptance_rate,
                           "identical": same})
    ar_tps = tot["ar"][0] / tot["ar"][1]
    ee_tps = tot["ee"][0] / tot["ee"][1]
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "num_speculations": num_speculations,
            "exit_layer": ee.drafter.exit_layer, "exit_adapter": exit_adapter,
            "ar_tokens": tot["ar"][0], "ar_seconds": tot["ar"][1], "ar_tokens_per_second": ar_tps,
            "ee_tokens": tot["ee"][0], "ee_seconds": tot["ee"][1], "ee_tokens_per_second": ee_tps,
            "speedup": ee_tps / ar_tps, "acceptance_rate": accepted / max(drafted, 1),
            "tokens_per_round": (tot["ee"][0] - len(prompts)) / max(rounds, 1),
            "identical": identical, "per_prompt": per_prompt}


def exit_eval_from_args(args) -> dict:
    """Run ``speculant exit-eval``.

    Raises:
        SpeculantError: bad corpus/split/adapter.
    """
    from ..models.loading import read_checkpoint
    from ..drafters.exit_adapter import load_exit_adapter
    from .data import read_corpus
    model = read_checkpoint(args.model, args.dtype)
    recs = read_corpus(args.corpus, args.split)
    head, e = (None, args.exit_layer)
    if args.exit_adapter:
        head, e = load_exit_adapter(args.exit_adapter, model, args.exit_layer)
    t0 = time.perf_counter()
    res = layer_agreement(model, recs, args.max_tokens, head, e)
    res["seconds"] = time.perf_counter() - t0
    if args.png:
        plot_agreement(res, args.png)
    if args.speed_prompts:
        k = args.num_speculations if args.num_speculations == "auto" else int(args.num_speculations)
        prompts = [r["prompt_ids"] for r in recs if r["prompt_ids"]][:args.speed_prompts]
        res["speed"] = speed_compare(model, prompts, args.max_new_tokens, k, args.exit_adapter, e)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return res
