"""Chi-square goodness of fit with a rejection threshold derived from the sample count."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import torch

Z_1E4 = 3.719   # one-sided standard normal quantile for a false-alarm rate of 1e-4


def chi2_quantile(df: int, z: float = Z_1E4) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile with ``df`` degrees of freedom."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square(samples: list[tuple], law: dict[tuple, float], min_expected: float = 5.0) -> tuple[float, float]:
    """Pearson's statistic of ``samples`` against the exact ``law`` and its 1e-4 rejection threshold.

    Cells whose expected count is under ``min_expected`` are pooled into one
    cell, so the chi-square approximation holds.  Returns ``(statistic, threshold)``.
    """
    n = len(samples)
    counts = Counter(samples)
    assert all(k in law for k in counts), f"sampled an outcome of probability 0: {set(counts) - set(law)}"
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for k, prob in law.items():
        e = n * prob
        if e < min_expected:
            pooled_obs += counts.get(k, 0)
            pooled_exp += e
            continue
        stat += (counts.get(k, 0) - e) ** 2 / e
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-12)
        cells += 1
    return stat, chi2_quantile(max(cells - 1, 1))


def exact_law(model, prompt: list[int], sampling, length: int = 3) -> dict[tuple, float]:
    """Probability of every ``length``-token continuation of ``prompt`` under the target's processed
    distribution ``sampling`` (a SamplingConfig), from one target forward per prefix."""
    from speculant.sampling.processors import logits_to_probs
    vocab = model.config.vocab_size
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=length):
            prob = 1.0
            for i in range(length):
                logits = model.decoder(torch.tensor([prompt + list(seq[:i])]))[0, -1]
                prob *= float(logits_to_probs(logits, sampling)[seq[i]])
            out[seq] = prob
    return out


def assert_engine_follows_law(gen, prompt: list[int], sampling: dict, law: dict[tuple, float], runs: int,
                              label=None) -> None:
    """``runs`` samples (seeds ``0 .. runs-1``) of ``len(next(iter(law)))`` tokens through the engine
    (``gen.generate_blocks``: prefill and drafted rounds) follow ``law`` (:func:`chi_square` at 1e-4), and the
    drafter drafted (otherwise the premise, a drafted round, does not hold)."""
    from speculant import GenerationConfig, SamplingConfig
    from speculant.engine.stats import GenerationStats
    outs, drafted = [], 0
    for seed in range(runs):
        stats = GenerationStats()
        c = GenerationConfig(max_new_tokens=len(next(iter(law))), sampling=SamplingConfig(seed=seed, **sampling))
        outs.append(tuple(t for b in gen.generate_blocks(prompt, c, stats) for t in b))
        drafted += stats.drafted_tokens
    assert drafted > 0, label
    stat, threshold = chi_square(outs, law)
    assert stat < threshold, (label, stat, threshold)
