"""Measured step costs of self-speculative decoding and the speed-up they allow.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding",
arXiv:2211.17192), Sec. 3.1 and Theorem 3.8: with a per-token acceptance rate
``alpha`` (i.i.d. model) and ``K`` drafted tokens per round, a round emits on average

    tau(alpha, K) = (1 - alpha^(K+1)) / (1 - alpha)            tokens (Eq. 1)

and costs ``K * c_draft + c_verify`` autoregressive steps, so the expected speed-up over
autoregressive decoding is ``tau / (K * c_draft + c_verify)``.  The paper assumes
``c_verify = 1`` (memory-bound target); here both costs are *measured* on the machine in
units of one autoregressive step of our own runtime:

* ``c_draft(E)``: one early-exit draft step, layers ``< E`` over one token plus the exit head
  (LayerSkip, Elhoushi et al. 2024, Sec. 5.1);
* ``c_verify(E, K)``: one verification, layers ``< E`` over the last draft token plus layers
  ``>= E`` over ``K+1`` tokens and the LM head over ``K+1`` rows (Sec. 5.2, exit-query cache).

Inverting the formula gives the acceptance rate a drafter needs for a target speed-up
(:func:`required_acceptance`).  Engine bookkeeping (sampling, cache compaction, Python)
is not included, so real speed-ups are somewhat lower.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import SpeculantError


def expected_block_efficiency(alpha: float, num_speculations: int) -> float:
    """``tau = (1 - alpha^(K+1)) / (1 - alpha)`` tokens per round (Leviathan et al. 2023, Eq. 1).

    Raises:
        SpeculantError: ``alpha`` outside [0, 1] or ``num_speculations`` < 0.
    """
    if not 0.0 <= alpha <= 1.0:
        raise SpeculantError(f"alpha={alpha} is out of range; allowed: 0..1")
    if num_speculations < 0:
        raise SpeculantError(f"num_speculations={num_speculations} is out of range; allowed: >= 0")
    if alpha == 1.0:
        return float(num_speculations + 1)
    return (1.0 - alpha ** (num_speculations + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, num_speculations: int, c_draft: float, c_verify: float) -> float:
    """``tau(alpha, K) / (K * c_draft + c_verify)``: expected speed-up over autoregressive decoding
    (Leviathan et al. 2023, Theorem 3.8, with measured instead of assumed costs; costs in AR steps).

    Raises:
        SpeculantError: a cost that is not positive (``c_draft`` may be 0 only for free drafters).
    """
    if c_verify <= 0 or c_draft < 0:
        raise SpeculantError(f"costs c_draft={c_draft}, c_verify={c_verify} are invalid; allowed: "
                             "c_draft >= 0, c_verify > 0 (in autoregressive steps)")
    return expected_block_efficiency(alpha, num_speculations) / (num_speculations * c_draft + c_verify)


def required_acceptance(target_speedup: float, num_speculations: int, c_draft: float,
                        c_verify: float) -> float | None:
    """Smallest per-token acceptance rate ``alpha`` with ``expected_speedup >= target_speedup``
    (bisection; the speed-up is increasing in alpha).  ``None`` when even ``alpha = 1`` falls short."""
    if expected_speedup(1.0, num_speculations, c_draft, c_verify) < target_speedup:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_speedup(mid, num_speculations, c_draft, c_verify) >= target_speedup:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass
class StepCosts:
    """Median wall times of the steps of early-exit self-speculation at one context length.

    ``ar_step_s``: one autoregressive step [s]; ``draft_step_s[E]``: one draft step at exit E [s];
    ``verify_s[(E, K)]``: one verification of K drafted tokens [s].  Ratios to ``ar_step_s`` are
    the costs of :func:`expected_speedup`.
    """

    context: int
    threads: int
    ar_step_s: float
    draft_step_s: dict[int, float] = field(default_factory=dict)
    verify_s: dict[tuple[int, int], float] = field(default_factory=dict)

    def c_draft(self, exit_layer: int) -> float:
        return self.draft_step_s[exit_layer] / self.ar_step_s

    def c_verify(self, exit_layer: int, num_speculations: int) -> float:
        return self.verify_s[(exit_layer, num_speculations)] / self.ar_step_s


def timings(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(timings(fn, repeats))


@torch.no_grad()
def measure_step_costs(decoder, exit_layers: list[int], num_speculations: list[int], context: int = 256,
                       repeats: int = 9, exit_head_for: Callable[[int], Callable] | None = None,
                       seed: int = 0) -> StepCosts:
    """Time the steps of early-exit self-speculation on ``decoder`` with a KV cache of ``context`` tokens.

    Args:
        decoder: a :class:`~speculant.models.llama.LlamaDecoder`.
        exit_layers: exit layers E to time, each in ``[1, L-1]``.
        num_speculations: speculation lengths K (tokens) to time verification for, each >= 1.
        context: tokens already in the KV cache (the verified prefix).
        repeats: timed runs per step (median kept), after one warm-up run.
        exit_head_for: ``E -> callable(hidden [T, D]) -> logits`` (e.g. an exit adapter); ``None``
            uses the shared final norm and LM head.
    Returns:
        :class:`StepCosts` (seconds).
    Raises:
        SpeculantError: an exit layer or speculation length out of range, or a context that does
            not fit the model's positions.
    """
    L = decoder.num_layers
    for e in exit_layers:
        if not 1 <= e < L:
            raise SpeculantError(f"exit layer {e} is out of range; allowed: 1..{L - 1}")
    for k in num_speculations:
        if k < 1:
            raise SpeculantError(f"num_speculations={k} is out of range; allowed: >= 1")
    k_max = max(num_speculations)
    if not 1 <= context <= decoder.config.max_position_embeddings - k_max - 1:
        raise SpeculantError(f"context={context} is out of range; allowed: 1.."
                             f"{decoder.config.max_position_embeddings - k_max - 1}")
    g = torch.Generator().manual_seed(seed)
    vocab = decoder.config.vocab_size
    cache = decoder.new_cache(context + k_max + 1)
    prompt = torch.randint(0, vocab, (1, context), generator=g)
    decoder.run_layers(decoder.embed(prompt), 0, L, torch.arange(context), None, cache, 0)

    def head(e: int | None) -> Callable:
        if e is None or exit_head_for is None:
            return lambda h: decoder.lm_head(decoder.final_norm(h))
        return exit_head_for(e)

    def step(start: int, end: int, rows: int, e_head: int | None):
        ids = torch.randint(0, vocab, (1, rows), generator=g)
        pos = torch.arange(context, context + rows)
        h_fn = head(e_head)
        return lambda: h_fn(decoder.run_layers(decoder.embed(ids), start, end, pos, None, cache, context)[0]
                            ).argmax(-1)

    costs = StepCosts(context, torch.get_num_threads(), _median_time(step(0, L, 1, None), repeats))
    for e in exit_layers:
        costs.draft_step_s[e] = _median_time(step(0, e, 1, e), repeats)
        ids_last = torch.randint(0, vocab, (1, 1), generator=g)
        for k in num_speculations:
            h = torch.randn(1, k + 1, decoder.config.hidden_size, generator=g, dtype=torch.float32).to(decoder.dtype)
            pos = torch.arange(context, context + k + 1)

            def verify(h=h, pos=pos, e=e, k=k):
                decoder.run_layers(decoder.embed(ids_last), 0, e, pos[-1:], None, cache, context + k)
                out = decoder.run_layers(h, e, L, pos, None, cache, context)
                return decoder.lm_head(decoder.final_norm(out)).argmax(-1)

            costs.verify_s[(e, k)] = _median_time(verify, repeats)
    return costs
