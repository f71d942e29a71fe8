"""``n`` samples of one prompt that share its prefill.

One target forward runs over the prompt (:meth:`~speculant.drafters.base.Drafter.prefill`); each sample then
starts from a copy of the KV cache and drafter state it left, picks its own first token from the shared
last-position logits with its own ``torch.Generator``, and decodes on its own.  Every sample is what a
separate :meth:`~speculant.engine.generator.SpeculativeGenerator.generate` call with its seed gives.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch

from ..drafters.base import DecodingState, Drafter
from ..errors import SpeculantError
from ..runtime.executor import executor_of
from .rounds import first_token, new_state, run_prefill
from .stats import GenerationStats

MAX_N = 128
"""Largest number of samples per call."""


def sample_seed(seed: int, i: int) -> int:
    """The seed of sample ``i``: ``(seed + i) mod 2**64`` (sample 0 keeps the request's seed)."""
    return (seed + i) % 2 ** 64


class SharedPrefill:
    """The state after one forward over a prompt, to start any number of generations from.

    Args:
        target, drafter: the generator's target executor and drafter.
        prompt_ids: the (checked) prompt.
        cache_length: slots of the KV cache [tokens] (each sample's copy has as many).
    """

    @torch.inference_mode()
    def __init__(self, target, drafter: Drafter, prompt_ids: list[int], cache_length: int, sampling):
        state = new_state(target, drafter, prompt_ids, cache_length, sampling)
        self.logits = run_prefill(state, drafter)
        self.state = state
        self.seconds = 0.0

    @torch.inference_mode()
    def start(self, drafter: Drafter, controls, generator: torch.Generator | None,
              stats: GenerationStats, sampling=None) -> DecodingState:
        """A new generation's state: copies of the cache and of the drafter state begun before the shared prefill,
        its first token picked with ``generator`` (and ``controls``; :func:`~speculant.engine.rounds.first_token`)."""
        src = self.state
        state = dataclasses.replace(src, cache=copy.deepcopy(src.cache), tokens=list(src.tokens),
                                    layer_tokens=list(src.layer_tokens),
                                    drafter_state=copy.deepcopy(src.drafter_state),
                                    sampling=sampling or src.sampling)
        state.controls = controls
        return first_token(state, self.logits, generator, stats)


def generate_n(gen, prompt, config, n: int) -> list:
    """:meth:`SpeculativeGenerator.generate_n` (see there)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise SpeculantError(f"n={n!r} is out of range; allowed: an integer in [1, {MAX_N}]")
    ids = gen._check_prompt(gen.encode(prompt, config.chat) if isinstance(prompt, str) else list(prompt))
    if n == 1:
        return [gen.generate(ids, config)]
    ctx = gen.model.config.context_length
    budget = gen.builder.fresh().budget() if gen.builder is not None else 0
    cache_length = min(ctx, len(ids) + min(config.max_new_tokens, ctx - len(ids)) + budget + 2)
    t0 = time.perf_counter()
    shared = SharedPrefill(executor_of(gen.model), gen.drafter, ids, cache_length, config.sampling)
    shared.seconds = time.perf_counter() - t0
    results = []
    for i in range(n):
        sampling = dataclasses.replace(config.sampling, seed=sample_seed(config.sampling.seed, i))
        cfg = dataclasses.replace(config, sampling=sampling)
        for _ in gen.stream(ids, cfg, shared=shared):
            pass
        results.append(gen.last_result)
    return results
