"""Logits -> probability vectors: temperature, min-p, top-k, top-p.

The same processing is applied to draft and target logits at every position,
so speculative sampling reproduces sampling from the *processed* target
distribution (Leviathan et al. 2023, Sec. 2.3 "any sampling method").  The controls that depend on the
tokens before a position (penalties, logit bias, grammar, ``min_tokens``) are applied before this, per
position, by :mod:`speculant.sampling.controls`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..errors import SpeculantError, check_range

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy decoding (argmax), as in vLLM (``_SAMPLING_EPS``): dividing logits by
a smaller temperature overflows fp32 (1e-39 and 1e-45 are subnormal) and the limit T -> 0 of sampling is
the argmax anyway (up to exact ties)."""


_ROW_KERNELS = None
"""The installed row kernels (:func:`install_row_kernels`), or ``None``: torch's operations."""


def install_row_kernels(kernels) -> None:
    """Run the temperature softmax of :func:`logits_to_probs`, the draws of :func:`sample_categorical` and
    :func:`speculant.verification.rules.sample_residual` with ``kernels`` wherever they take the row, from now on
    in this process (``None``: torch's operations again).  The runtime installs its C ones
    (:mod:`speculant.kernels.sampling`) when it is imported: the same laws, computed in one call per row (float
    rounding may differ from torch's in the last bits).

    ``kernels`` has ``usable(t) -> bool``, ``softmax_rows(logits [..., V], temperature) -> [..., V]`` and
    ``draw(p [V], u, q=None, ids=None) -> int`` (one inverse-CDF draw of ``norm(max(0, p - q))``).
    """
    global _ROW_KERNELS
    _ROW_KERNELS = kernels


def row_kernels(t: torch.Tensor):
    """The installed row kernels if they take ``t`` as it is (else ``None``)."""
    return _ROW_KERNELS if _ROW_KERNELS is not None and t.dim() >= 1 and _ROW_KERNELS.usable(t) else None


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
        repetition_penalty: Keskar et al. 2019 as in Hugging Face's ``RepetitionPenaltyLogitsProcessor``: the
            logit of every token already in the prompt or the output is divided by it when positive,
            multiplied by it when negative (1 = off; in ``(0, inf)``).
        frequency_penalty, presence_penalty: OpenAI's definition over the *generated* tokens:
            ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` (0 = off; in [-2, 2]).
        min_p: keep the tokens whose probability (after temperature) is at least ``min_p`` times the most
            likely one's (Nguyen et al. 2024; 0 = off; in [0, 1]).
        logit_bias: token id -> bias added to its logit (OpenAI's ``logit_bias``; each bias in [-100, 100]).
    Raises:
        SpeculantError: a value out of its range (the message names it and the range).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None

    def __post_init__(self):
        check_range("temperature", self.temperature, 0.0, math.inf, high_open=True)
        check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise SpeculantError(f"top_k={self.top_k!r} is out of range; allowed: 0 (off) or a positive integer")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or \
                not -2 ** 63 <= self.seed < 2 ** 64:
            raise SpeculantError(f"seed={self.seed!r} is out of range; allowed: an integer in [-2**63, 2**64 - 1]")
        check_range("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True, high_open=True)
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_range("min_p", self.min_p, 0.0, 1.0)
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias))

    @property
    def penalized(self) -> bool:
        """True when a penalty or a logit bias is set (the logits then depend on the tokens before)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed)
        return g


def _checked_bias(bias) -> dict[int, float]:
    """``logit_bias`` as ``{int: float}``, each id a non-negative integer and each bias in [-100, 100]."""
    if not isinstance(bias, dict):
        raise SpeculantError(f"logit_bias={bias!r} is invalid; allowed: a mapping token id -> bias in [-100, 100]")
    out = {}
    for tok, b in bias.items():
        try:
            tid = int(tok) if not isinstance(tok, bool) and str(tok).strip().lstrip("-").isdigit() else None
        except (TypeError, ValueError):
            tid = None
        if tid is None or tid < 0:
            raise SpeculantError(f"logit_bias token id {tok!r} is invalid; allowed: integers >= 0")
        out[tid] = float(check_range(f"logit_bias[{tid}]", b, -100.0, 100.0))
    return out


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Processed distribution ``[..., V]`` (fp32, rows sum to 1) from logits ``[..., V]``: temperature, then
    min-p, top-k, top-p (vLLM's order).  Temperature alone is one call of the installed row kernels where they
    take ``logits`` (:func:`install_row_kernels`).

    Greedy configs give the one-hot vector of the argmax.
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    if cfg.min_p == 0.0 and not (cfg.top_k and cfg.top_k < logits.shape[-1]) and cfg.top_p >= 1.0 \
            and row_kernels(logits) is not None:
        return _ROW_KERNELS.softmax_rows(logits, cfg.temperature)  # temperature only: one C call
    logits = logits / cfg.temperature
    if cfg.min_p > 0.0:
        logits = _min_p(logits, cfg.min_p)
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        probs = _top_p(probs, cfg.top_p)
    return probs


def _min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Min-p filtering (Nguyen et al. 2024): drop the tokens whose probability is below ``min_p`` times the
    largest one's.  ``[..., V]`` tempered logits -> the same with ``-inf`` for dropped tokens."""
    probs = torch.softmax(logits, dim=-1)
    keep = probs >= min_p * probs.amax(-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


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
    """Token ids ``[..., num_samples]`` (int64) drawn *with replacement* from ``probs`` ``[..., V]`` (need not be
    normalised; a row of zeros gives ``V - 1``).

    Inverse-CDF sampling with one float64 uniform ``u`` per draw from ``generator``: token i is drawn when
    ``u * total`` falls in ``[c_{i-1}, c_i)`` of the float64 cumulative sums, an interval of length ``p_i``
    (zero-probability tokens have an empty one).  Rows the installed row kernels take (:func:`install_row_kernels`)
    are one call per draw (block sums, then one block's entries); others a float64 ``cumsum`` and
    ``searchsorted``.  ``torch.multinomial`` would draw one exponential per vocabulary entry for a single sample.
    """
    u = torch.rand(*probs.shape[:-1], num_samples, generator=generator, dtype=torch.float64, device=probs.device)
    kernels = row_kernels(probs)
    if kernels is not None:
        if u.numel() == 1:
            return torch.tensor(kernels.draw(probs.reshape(-1), float(u))).reshape(u.shape)
        rows = probs.reshape(-1, probs.shape[-1])
        draws = u.reshape(rows.shape[0], num_samples).tolist()
        return torch.tensor([[kernels.draw(row, d) for d in ds] for row, ds in zip(rows, draws)],
                            dtype=torch.long).reshape(u.shape)
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)
    return idx.clamp_max(probs.shape[-1] - 1)
