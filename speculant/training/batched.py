"""Batched sampling from the target for corpus generation (many prompts per forward).

Decoding one sequence at a time reads every weight once per token; ``B`` sequences per forward read
them once per ``B`` tokens, which is what makes a self-distillation corpus affordable on a CPU
(measured on SmolLM2-135M, 2 threads: 64 rows per step cost ~8x one row, BENCHMARKS.md).  Prompts
are left-padded; each row has its own RoPE positions and a mask that hides its padding.  This is
corpus generation only: speculative decoding itself decodes one sequence.
"""

from __future__ import annotations

import torch

from ..sampling.processors import SamplingConfig, logits_to_probs


def _mask(pad: torch.Tensor, queries: torch.Tensor, keys: int) -> torch.Tensor:
    """Bool ``[B, 1, Tq, keys]``: query slot q of row b sees key slots in ``[pad_b, q]``; a padding query
    sees itself only (keeps its activations finite)."""
    k = torch.arange(keys)[None, None, :]
    q = queries[None, :, None]
    ok = (k >= pad[:, None, None]) & (k <= q)
    return (ok | (k == q))[:, None]


@torch.inference_mode()
def sample_batch(decoder, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
                 eos: set[int], generator: torch.Generator | None = None) -> list[list[int]]:
    """Responses (token ids, EOS included when emitted, at most ``max_new_tokens``) for each prompt.

    Args:
        decoder: the target :class:`~speculant.models.llama.LlamaDecoder`.
        prompts: ``B`` non-empty lists of token ids.
        sampling: greedy when ``temperature == 0``, else the processed distribution (temperature/top-k/top-p).
    """
    b = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    pad = width - lengths
    x = torch.zeros(b, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        x[i, pad[i]:] = torch.tensor(p)
    slots = torch.arange(width)
    positions = (slots[None] - pad[:, None]).clamp_min(0)
    cache = decoder.new_cache(width + max_new_tokens, b)
    h = decoder.run_layers(decoder.embed(x), 0, decoder.num_layers, positions, _mask(pad, slots, width), cache, 0)
    logits = decoder.lm_head(decoder.final_norm(h[:, -1]))           # only the last position's logits
    out: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    for t in range(max_new_tokens):
        if sampling.greedy:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(logits_to_probs(logits, sampling), 1, generator=generator)[:, 0]
        for i in (~done).nonzero().flatten().tolist():
            tok = int(nxt[i])
            out[i].append(tok)
            if tok in eos:
                done[i] = True
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        slot = width + t
        logits = decoder(nxt[:, None], (lengths + t)[:, None], _mask(pad, torch.tensor([slot]), slot + 1),
                         cache, slot)[:, -1]
    return out
