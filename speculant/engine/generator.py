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

from ..drafters.base import DecodingState, Drafter
from ..errors import SpeculantError, check_range
from ..models.loading import LoadedModel
from ..sampling.processors import SamplingConfig, logits_to_probs
from ..trees.builders import IIDTreeBuilder, TreeBuilder
from ..verification.rules import greedy_accept, recursive_rejection_sampling
from .stats import GenerationStats


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
        cache = target.new_cache(min(cfg.max_position_embeddings, len(prompt_ids) + max_new + budget + 2))
        counts_before = list(target.layer_token_counts)
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                yield from self._rounds(prompt_ids, config.sampling, max_new, cache, budget, stats, t0, eos, generator)
        finally:
            stats.layer_token_evaluations = [a - b for a, b in zip(target.layer_token_counts, counts_before)]

    def _rounds(self, prompt_ids, sampling, max_new, cache, budget, stats, t0, eos, generator):
        target, builder = self.model.decoder, self.builder
        logits = self.drafter.prefill(target, torch.tensor([prompt_ids]), cache)[0, -1]
        cache.crop(len(prompt_ids))
        stats.target_forwards += 1
        first = self._pick(logits[None], sampling, generator)
        state = DecodingState(target, cache, list(prompt_ids) + [first], sampling)
        stats.time_to_first_token_s = time.perf_counter() - t0
        emitted = stats.new_tokens = 1
        stats.seconds = time.perf_counter() - t0
        yield [first]
        if first in eos or emitted >= max_new:
            return
        self.drafter.begin(state)
        if builder is not None:
            builder.reset()
        while True:
            n = cache.length
            max_depth = min(builder.max_depth if builder else 0, max_new - emitted - 1)
            max_nodes = min(budget, cache.max_length - n - 1)
            tree = self.drafter.draft(state, builder, generator, max_nodes, max_depth)
            stats.draft_forwards = state.draft_forwards
            logits = self.drafter.verify_logits(state, tree)
            stats.target_forwards += 1
            if sampling.greedy:
                path, token = greedy_accept(tree, logits.argmax(-1).tolist())
            else:
                probs = logits_to_probs(logits, sampling)
                path, token = recursive_rejection_sampling(tree, probs, generator, self.without_replacement)
            cache.crop(n + 1)
            cache.keep([n + 1 + i for i in path], start=n + 1)
            self.drafter.commit(state, path)
            if builder is not None:
                builder.observe(len(path), tree.max_depth)
            stats.record_round(len(tree), tree.max_depth, len(path))
            block = []
            for tok in [tree.tokens[i] for i in path] + [token]:
                block.append(tok)
                emitted += 1
                if tok in eos or emitted >= max_new:
                    break
            state.tokens.extend(block)
            stats.new_tokens = emitted
            stats.seconds = time.perf_counter() - t0
            yield block
            if block[-1] in eos or emitted >= max_new:
                return

    @staticmethod
    def _pick(logits: torch.Tensor, sampling: SamplingConfig, generator) -> int:
        if sampling.greedy:
            return int(logits[0].argmax())
        return int(torch.multinomial(logits_to_probs(logits[0], sampling), 1, generator=generator))

    # ---------------------------------------------------------------- text layer
    def stream(self, prompt: str | list[int], config: GenerationConfig | None = None) -> Iterator[str]:
        """Yield text pieces as they are produced; ``self.last_result`` holds the result afterwards.

        A string prompt is encoded with :meth:`encode` (chat template unless
        ``config.chat`` is False); a list is taken as token ids.
        """
        config = config or GenerationConfig()
        ids = self.encode(prompt, config.chat) if isinstance(prompt, str) else list(prompt)
        tok = self.model.tokenizer
        eos = set(self.model.eos_token_ids)
        stats = GenerationStats()
        out: list[int] = []
        text, shown = "", 0
        hold = max((len(s) for s in config.stop), default=1) - 1
        reason = "length"
        blocks = self.generate_blocks(ids, config, stats)
        for block in blocks:
            start = len(out)
            out.extend(block)
            text = tok.decode(out, skip_special_tokens=True)
            hit = _find_stop(text, config.stop, max(0, shown - hold))
            if hit is not None:
                # cut exactly at the stop string: keep the fewest tokens whose text contains it
                for k in range(start + 1, len(out) + 1):
                    if _find_stop(tok.decode(out[:k], skip_special_tokens=True), config.stop, 0) is not None:
                        break
                del out[k:]
                text = text[:hit]
                stats.new_tokens = len(out)
                reason = "stop"
                blocks.close()
                break
            if out[-1] in eos:
                reason = "eos"
            safe = len(text) - hold if config.stop else len(text)
            if text.endswith("\ufffd"):
                safe = min(safe, len(text) - 1)
            if safe > shown:
                yield text[shown:safe]
                shown = safe
        if len(text) > shown:
            yield text[shown:]
        self.last_result = GenerationResult(text, out, stats, reason)

    def generate(self, prompt: str | list[int], config: GenerationConfig | None = None) -> GenerationResult:
        """Generate to completion; returns text, token ids (prompt excluded) and stats."""
        for _ in self.stream(prompt, config):
            pass
        return self.last_result


def _find_stop(text: str, stops, start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None

