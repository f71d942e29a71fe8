"""Logits processors that read the tokens before a position: logit bias, repetition, frequency and presence
penalties.  Pure functions of the logits and the token counts of each row's own prefix.

Sources:
    * repetition penalty: Keskar et al. 2019 (CTRL), Eq. 2, as Hugging Face's
      ``RepetitionPenaltyLogitsProcessor`` applies it (divide a positive logit, multiply a negative one).
    * frequency / presence penalties: OpenAI's API reference ("Parameter details"):
      ``mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence``, ``c[j]`` counting token j in the
      generated tokens.
    * logit bias: OpenAI's ``logit_bias`` (added to the logits before sampling).
Order (vLLM's sampler): bias, then the repetition penalty, then frequency and presence.
"""

from __future__ import annotations

import torch

from .processors import SamplingConfig


def bias_vector(bias: dict[int, float] | None, vocab_size: int) -> torch.Tensor | None:
    """The dense bias ``[V]`` (fp32) of a ``logit_bias`` mapping; ids outside the vocabulary are ignored
    (the caller validates them against the model); ``None`` when there is none."""
    if not bias:
        return None
    vec = torch.zeros(vocab_size)
    for tok, b in bias.items():
        if tok < vocab_size:
            vec[tok] = b
    return vec


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_context: torch.Tensor, cfg: SamplingConfig,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """Penalised logits ``[R, V]`` (fp32, a new tensor).

    Args:
        logits: ``[R, V]`` raw logits, one row per position.
        counts: ``[R, V]`` fp32: how often each token occurs in the *generated* tokens before the row's position.
        in_context: ``[R, V]`` bool: the token occurs in the prompt or the generated tokens before the position.
        bias: ``[V]`` from :func:`bias_vector`, or ``None``.
    Every operation is elementwise, so a row gets the same bits whatever other rows share the call.
    """
    out = logits.float().clone()
    if bias is not None:
        out = out + bias
    rp = cfg.repetition_penalty
    if rp != 1.0:
        out = torch.where(in_context, torch.where(out > 0, out / rp, out * rp), out)
    if cfg.frequency_penalty != 0.0:
        out = out - cfg.frequency_penalty * counts
    if cfg.presence_penalty != 0.0:
        out = out - cfg.presence_penalty * (counts > 0).float()
    return out
