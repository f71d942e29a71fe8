"""Logits -> probability vectors: temperature, top-k, top-p.

The same processing is applied to draft and target logits at every position,
so speculative sampling reproduces sampling from the *processed* target
distribution (Leviathan et al. 2023, Sec. 2.3 "any sampling method").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import SpeculantError, check_range

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy decoding (argmax), as in vLLM (``_SAMPLING_EPS``): dividing logits by
a smaller temperature overflows fp32 (1e-39 and 1e-45 are subnormal) and the limit T -> 0 of sampling is
the argmax anyway (up to exact ties)."""


def is_greedy(temperature: float) -> bool:
    """True when ``temperature`` means greedy decoding (``< GREEDY_TEMPERATURE``, 0 included)."""
    return temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class SamplingConfig:
    """How a token is drawn from logits.

    Attributes:
        temperature: below :data:`GREEDY_TEMPERATURE` (1e-5; 0 included) greedy decoding (argmax), for
            every method; otherwise logits are divided by it.
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set whose probability reaches top_p (1 = all).
        seed: seed of the ``torch.Generator`` every random draw uses.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        check_range("temperature", self.temperature, 0.0, math.inf, high_open=True)
        check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_k < 0:
            raise SpeculantError(f"top_k={self.top_k} is out of range; allowed: 0 (off) or a positive integer")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed)
        return g


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Processed distribution ``[..., V]`` (fp32, rows sum to 1) from logits ``[..., V]``.

    Greedy configs give the one-hot vector of the argmax.
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        probs = _top_p(probs, cfg.top_p)
    return probs


NUCLEUS_CANDIDATES = 1024
"""Top-p first looks for the nucleus among this many most likely tokens (a partial sort); only when they
hold less than ``top_p`` of the mass does it sort the whole vocabulary."""


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al. 2020): keep the smallest set of most likely tokens whose mass
    reaches ``top_p``, renormalised.  ``[..., V]`` -> ``[..., V]``.

    Exact with a partial sort: once the ``k`` most likely tokens hold ``top_p`` of the mass, every token
    after them is outside the nucleus, so sorting them is enough (a full sort of a 49k vocabulary costs
    ~10x more).
    """
    k = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    sorted_p, idx = torch.topk(probs, k, dim=-1)
    if k < probs.shape[-1] and not bool((sorted_p.sum(-1) >= top_p).all()):
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    cum = sorted_p.cumsum(-1)
    kept = sorted_p.masked_fill((cum - sorted_p) >= top_p, 0.0)   # tokens after the nucleus is complete
    out = torch.zeros_like(probs).scatter_(-1, idx, kept)
    return out / out.sum(-1, keepdim=True)


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None, num_samples: int = 1) -> torch.Tensor:
    """Token ids ``[..., num_samples]`` drawn *with replacement* from ``probs`` ``[..., V]`` (need not be normalised).

    Inverse-CDF sampling with one uniform per draw and a float64 cumulative sum: token i is drawn when
    ``u * total`` falls in ``[c_{i-1}, c_i)``, an interval of length ``p_i`` (zero-probability tokens have an
    empty one).  ``torch.multinomial`` draws one exponential per vocabulary entry for a single sample
    (measured ~50x slower for a 49k vocabulary).
    """
    cdf = probs.double().cumsum(-1)
    u = torch.rand(*probs.shape[:-1], num_samples, generator=generator, dtype=torch.float64, device=probs.device)
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)
    return idx.clamp_max(probs.shape[-1] - 1)
