"""The decoding loop: draft -> verify in one target forward -> accept -> commit the caches.

One loop serves every method: autoregressive decoding is the loop with
nothing drafted, ordinary speculative decoding a chain, RSD/SpecInfer trees.
Stops (EOS, stop strings, ``max_new_tokens``) inside an accepted block end
the output exactly there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..drafters.base import Drafter
from ..errors import SpeculantError, check_range
from ..models.loading import LoadedModel
from ..sampling.processors import SamplingConfig
from ..trees.builders import IIDTreeBuilder, TreeBuilder
from .rounds import accept_and_commit, draft_limits, prefill
from .stats import GenerationStats
from .text import StopStringText


@dataclass
class GenerationConfig:
    """Per-call settings.

    Attributes:
        max_new_tokens: upper bound on emitted tokens (>= 1) [tokens].
        sampling: temperature / top-k / top-p / seed.
        stop: strings that end the output; the text is cut just before the first one.
        chat: apply the tokenizer's chat template to a string prompt (``--raw`` turns it off).
    """

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    chat: bool = True

    def __post_init__(self):
        check_range("max_new_tokens", self.max_new_tokens, 1)
        if any(not s for s in self.stop):
            raise SpeculantError("stop=''; allowed: non-empty strings")


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    stop_reason: str          # 'eos' | 'stop' | 'length'

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stop_reason": self.stop_reason,
                "stats": self.stats.to_dict()}


class SpeculativeGenerator:
    """Generates with a target model, a drafter and a tree builder.

    Args:
        model: the target (:func:`speculant.load_model`).
        drafter: ``None`` for autoregressive decoding.
        builder: shapes the draft tree (chain, RSD-C, RSD-S, i.i.d.); ``None`` with no drafter.
    """

    def __init__(self, model: LoadedModel, drafter: Drafter | None = None, builder: TreeBuilder | None = None):
        self.model = model
        self.drafter = drafter or Drafter()
        self.builder = builder
        self.without_replacement = not isinstance(builder, IIDTreeBuilder)

    # ---------------------------------------------------------------- prompts
    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Prompt ids; the chat template is applied when ``chat`` and the tokenizer has one.

        Raises:
            SpeculantError: empty prompt, or one that leaves no room in the model's context.
        """
        if not prompt or not prompt.strip():
            raise SpeculantError("prompt is empty; allowed: a non-empty string")
        tok = self.model.tokenizer
        if chat and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            if not isinstance(ids, list):
                ids = ids["input_ids"]
        else:
            ids = tok.encode(prompt, add_special_tokens=False)
        return list(ids)

    def _check_prompt(self, ids: list[int]) -> None:
        ctx = self.model.config.max_position_embeddings
        if not ids:
            raise SpeculantError("prompt is empty; allowed: at least one token")
        if len(ids) >= ctx:
            raise SpeculantError(f"prompt length={len(ids)} tokens is too long; allowed: < {ctx} (the model's context)")

    # ---------------------------------------------------------------- core loop
    def generate_blocks(self, prompt_ids: list[int], config: GenerationConfig,
                        stats: GenerationStats) -> Iterator[list[int]]:
        """Yield each round's emitted tokens (EOS and ``max_new_tokens`` already applied)."""
        self._check_prompt(prompt_ids)
        target = self.model.decoder
        cfg = self.model.config
        generator = config.sampling.generator()
        eos = set(self.model.eos_token_ids)
        builder = self.builder
        budget = builder.budget() if builder is not None else 0
        max_new = min(config.max_new_tokens, cfg.max_position_embeddings - len(prompt_ids))
        cache_length = min(cfg.max_position_embeddings, len(prompt_ids) + max_new + budget + 2)
        counts_before = list(target.layer_token_counts)
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                yield from self._rounds(prompt_ids, config.sampling, max_new, cache_length, budget, stats, t0, eos,
                                        generator)
        finally:
            stats.layer_token_evaluations = [a - b for a, b in zip(target.layer_token_counts, counts_before)]

    def _rounds(self, prompt_ids, sampling, max_new, cache_length, budget, stats, t0, eos, generator):
        target, builder = self.model.decoder, self.builder
        if builder is not None:
            builder.reset()
        state = prefill(target, self.drafter, prompt_ids, cache_length, sampling, generator, stats)
        first = state.tokens[-1]
        stats.time_to_first_token_s = time.perf_counter() - t0
        emitted = stats.new_tokens = 1
        stats.seconds = time.perf_counter() - t0
        yield [first]
        if first in eos or emitted >= max_new:
            return
        while True:
            max_nodes, max_depth = draft_limits(state, builder, budget, max_new - emitted)
            tree = self.drafter.draft(state, builder, generator, max_nodes, max_depth)
            stats.draft_forwards = state.draft_forwards
            logits = self.drafter.verify_logits(state, tree)
            stats.target_forwards += 1
            block = accept_and_commit(state, self.drafter, builder, tree, logits, generator, self.without_replacement,
                                      max_new - emitted, eos, stats)
            emitted += len(block)
            stats.new_tokens = emitted
            stats.seconds = time.perf_counter() - t0
            yield block
            if block[-1] in eos or emitted >= max_new:
                return

    # ---------------------------------------------------------------- text layer
    def stream(self, prompt: str | list[int], config: GenerationConfig | None = None) -> Iterator[str]:
        """Yield text pieces as they are produced; ``self.last_result`` holds the result afterwards.

        A string prompt is encoded with :meth:`encode` (chat template unless
        ``config.chat`` is False); a list is taken as token ids.
        """
        config = config or GenerationConfig()
        ids = self.encode(prompt, config.chat) if isinstance(prompt, str) else list(prompt)
        eos = set(self.model.eos_token_ids)
        stats = GenerationStats()
        text = StopStringText(self.model.tokenizer, config.stop)
        reason = "length"
        blocks = self.generate_blocks(ids, config, stats)
        for block in blocks:
            piece = text.add(block)
            if text.stopped:
                stats.new_tokens = len(text.token_ids)
                reason = "stop"
                blocks.close()
            elif block[-1] in eos:
                reason = "eos"
            if piece:
                yield piece
            if text.stopped:
                break
        piece = text.finish()
        if piece:
            yield piece
        self.last_result = GenerationResult(text.text, list(text.token_ids), stats, reason)

    def generate(self, prompt: str | list[int], config: GenerationConfig | None = None) -> GenerationResult:
        """Generate to completion; returns text, token ids (prompt excluded) and stats."""
        for _ in self.stream(prompt, config):
            pass
        return self.last_result

