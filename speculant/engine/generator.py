"""The decoding loop: draft -> verify in one target forward -> accept -> commit the caches.

One loop serves every method: autoregressive decoding is the loop with
nothing drafted, ordinary speculative decoding a chain, RSD/SpecInfer trees.
Stops (EOS, stop strings, ``max_new_tokens``) inside an accepted block end
the output exactly there.

Each generation owns its state (KV cache, drafter state in :class:`DecodingState`, a fresh copy of the
tree builder), and our compute runs under ``torch.inference_mode`` one step at a time, never across a
``yield``: between blocks the caller's torch state is its own, and any number of generations on one
model may be interleaved in any order, each giving what it gives alone.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from ..drafters.base import DecodingState, Drafter
from ..errors import SpeculantError, check_range
from ..models.loading import LoadedModel
from ..runtime.executor import executor_of
from ..sampling.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from ..sampling.processors import SamplingConfig
from ..trees.builders import IIDTreeBuilder, TreeBuilder
from .prompts import check_prompt_ids, encode_prompt
from .requests import check_controls, make_controls, stop_token_set
from .goodput import CostTable, DepthAcceptance
from .rounds import accept_and_commit, draft_limits, prefill
from .speculation import RoundSizer, RoundTiming
from .stats import GenerationStats
from .text import StopStringText

if TYPE_CHECKING:
    from ..sampling.grammar import Grammar


@dataclass
class GenerationConfig:
    """Per-call settings.

    Attributes:
        max_new_tokens: upper bound on emitted tokens (>= 1) [tokens].
        sampling: temperature / top-k / top-p / seed.
        stop: stop strings; the text is cut just before the first one.  A single string is one stop
            string (``stop="t33"`` stops at "t33", not at any of its characters).
        chat: apply the tokenizer's chat template to a string prompt (``--raw`` turns it off).
        logprobs: ``None`` = off; ``k`` (0..20): each emitted token's log-probability and the ``k`` most likely
            tokens at its position, from the target's raw distribution (:mod:`speculant.sampling.logprobs`).
        grammar: a :class:`~speculant.sampling.grammar.Grammar` (:func:`~speculant.sampling.grammar.compile_grammar`)
            the output must follow; every position's distribution (target and draft) is masked to it.  The end
            token it accepts ends the output (also with ``ignore_eos``).
        min_tokens: the stop tokens (EOS, ``stop_token_ids``) are masked until this many tokens were
            generated [tokens] (vLLM's ``min_tokens``; stop strings still apply).
        ignore_eos: the model's EOS tokens do not end the output (they may be emitted).
        stop_token_ids: more tokens that end the output (kept in ``token_ids``, as EOS is).
    Raises:
        SpeculantError: ``max_new_tokens < 1``, an empty or non-string stop, ``sampling`` not a SamplingConfig,
            ``logprobs`` outside 0..20, ``min_tokens < 0`` or above ``max_new_tokens``, a bad stop token id.
    """

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] | str = ()
    chat: bool = True
    logprobs: int | None = None
    grammar: "Grammar | None" = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        check_range("max_new_tokens", self.max_new_tokens, 1)
        if not isinstance(self.sampling, SamplingConfig):
            raise SpeculantError(f"sampling={self.sampling!r} is invalid; allowed: a SamplingConfig")
        check_controls(self, MAX_TOP_LOGPROBS)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (tuple, list)) or any(not isinstance(s, str) or not s for s in stop):
            raise SpeculantError(f"stop={self.stop!r} is invalid; allowed: a non-empty string or a sequence of them")
        self.stop = tuple(stop)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    stop_reason: str          # 'eos' | 'stop' | 'length', or 'abandoned' (stream closed early: a partial result)
    logprobs: list[TokenLogprob] | None = None
    """One per token of ``token_ids`` when ``GenerationConfig.logprobs`` was set: log-probabilities from the
    target's *raw* distribution (log_softmax of its logits, before temperature, penalties, bias and grammar;
    see :mod:`speculant.sampling.logprobs`)."""

    def to_dict(self) -> dict:
        d = {"text": self.text, "token_ids": self.token_ids, "stop_reason": self.stop_reason,
             "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            d["logprobs"] = [lp.to_dict() for lp in self.logprobs]
        return d


def _logprobs(controls, text) -> list[TokenLogprob] | None:
    """The log-probabilities of the output's tokens (the text layer may have cut the last block)."""
    if controls is None or controls.logprobs_k is None:
        return None
    return controls.logprobs[:len(text.token_ids)]


class SpeculativeGenerator:
    """Generates with a target model, a drafter and a tree builder.

    The generator holds configuration only (plus :attr:`last_result`, :attr:`round_timing` and
    ``acceptance_history``: the long-run acceptance per round context of its greedy generations, from which the
    next greedy generation's cost-aware rounds start, :class:`~speculant.engine.speculation.RoundSizer`); each call
    makes its own state, so a call's output depends on its prompt, config and seed alone, whatever ran before or in
    between (the history changes how many rounds a greedy output takes, never the output; sampled generations
    neither read nor change it).

    Args:
        model: the target (:func:`speculant.load_model`).
        drafter: ``None`` for autoregressive decoding.
        builder: shapes the draft tree (chain, RSD-C, RSD-S, i.i.d.); ``None`` with no drafter.
        verification: acceptance rule under sampling, ``token``, ``block`` or ``traversal``
            (:func:`speculant.verification.sequence.sampling_accept`).
        costs: a :class:`~speculant.engine.goodput.CostTable` that sizes each round by expected tokens per second
            (:mod:`speculant.engine.speculation`; zero drafts make an ``ar`` round); ``None``: every round drafts as
            deep as the builder allows (``--speculation always``).
        sampled_costs: the table for generations at a temperature (whose acceptance costs more per draft), or a
            function returning it (called once, at the first such generation); ``None``: ``costs``.
        acceptance_prior: ``prior(sampled) -> {round context: DepthAcceptance} | None``, the drafter's acceptance
            measured once on fixed prompts (:func:`~speculant.engine.speculation.acceptance_prior`), called once per
            kind at the first such cost-aware generation (which pays its one measurement, if not yet kept with the
            tune): a sampled generation's rounds start from (a copy of) the sampled one, the greedy history from the
            greedy one; ``None``: no prior (certainty, then the rounds' own counts).
        round_timing: time the rounds of greedy cost-aware generations and correct what a drafting round costs by
            what such rounds took beside the ``ar`` rounds (:class:`~speculant.engine.speculation.RoundTiming`, kept
            as :attr:`round_timing` across generations; greedy outputs do not depend on it, sampled generations are
            sized without it).

    Raises:
        SpeculantError: an ``acceptance_prior`` that is not callable (and, at the first generation that asks it,
            one returning anything but ``None`` or ``{round context: DepthAcceptance}``).
    """

    def __init__(self, model: LoadedModel, drafter: Drafter | None = None, builder: TreeBuilder | None = None,
                 verification: str = "token", costs: CostTable | None = None, sampled_costs=None,
                 acceptance_prior=None, round_timing: bool = False):
        self.model = model
        self.drafter = drafter or Drafter()
        self.builder = builder
        self.without_replacement = not isinstance(builder, IIDTreeBuilder)
        self.verification = verification
        self.costs = costs if builder is not None else None
        self._sampled_costs = (costs if sampled_costs is None else sampled_costs) if builder is not None else None
        self.acceptance_history: dict = {}     # greedy generations' long-run acceptance per round context
        if acceptance_prior is not None and not callable(acceptance_prior):
            raise SpeculantError(f"acceptance_prior={acceptance_prior!r} is invalid; allowed: None or a callable "
                                 "prior(sampled) returning {round context: DepthAcceptance} or None")
        self._prior = acceptance_prior
        self._priors: dict[bool, dict | None] = {}
        self.round_timing = RoundTiming() if round_timing and self.costs is not None else None
        self.last_result: GenerationResult | None = None

    # ---------------------------------------------------------------- prompts
    def encode(self, prompt: str | list[dict], chat: bool = True) -> list[int]:
        """Prompt ids by the one rule of :func:`speculant.engine.prompts.encode_prompt` (chat template when ``chat``
        and the tokenizer has one, else the text with the tokenizer's special tokens).

        Raises:
            SpeculantError: empty prompt, invalid Unicode (see :func:`~speculant.engine.prompts.encode_prompt`).
        """
        return encode_prompt(self.model.tokenizer, prompt, chat)

    def _check_prompt(self, ids) -> list[int]:
        """``ids`` as a list of ints, checked against the model's context and vocabulary (:func:`check_prompt_ids`)."""
        return check_prompt_ids(ids, self.model.config.context_length, self.model.config.vocab_size)

    # ---------------------------------------------------------------- core loop
    def costs_for(self, sampling: SamplingConfig) -> CostTable | None:
        """The cost table that sizes rounds under ``sampling``: ``costs`` under greedy decoding, else the sampled one
        (given as a table, or a function measuring it once, at the first sampled generation)."""
        if sampling.greedy or self._sampled_costs is None:
            return self.costs
        if callable(self._sampled_costs):
            self._sampled_costs = self._sampled_costs()
        return self._sampled_costs

    def generate_blocks(self, prompt_ids: list[int], config: GenerationConfig,
                        stats: GenerationStats, controls=None, shared=None) -> Iterator[list[int]]:
        """Yield each round's emitted tokens (EOS, stop tokens and ``max_new_tokens`` already applied).

        ``stats`` is filled as the generation goes (it is right after every block).  ``controls``: the
        generation's :class:`~speculant.sampling.controls.SequenceControls` (default: made from ``config``
        by :func:`~speculant.engine.requests.make_controls`); ``shared``: a
        :class:`~speculant.engine.multi.SharedPrefill` of this prompt to start from instead of a prefill.

        Raises:
            SpeculantError: an empty or too long prompt, or a token id outside the vocabulary.
        """
        prompt_ids = self._check_prompt(prompt_ids)
        ctx = self.model.config.context_length
        builder = self.builder.fresh() if self.builder is not None else None
        budget = builder.budget() if builder is not None else 0
        max_new = min(config.max_new_tokens, ctx - len(prompt_ids))
        eos = stop_token_set(config, self.model.eos_token_ids)
        if controls is None:
            controls = make_controls(config, self.model, prompt_ids)
        generator = config.sampling.generator()
        if self.costs_for(config.sampling) is not None:  # one-off measurements (sampled draft costs, the acceptance
            self._prior_for(not config.sampling.greedy)  # prior) before the clock starts, not in this one's time
        executor_of(self.model).adapt_threads()           # the load since the last generation, before its prefill
        t0 = time.perf_counter()
        if shared is not None:
            state = shared.start(self.drafter, controls, generator, stats, config.sampling)
            stats.time_to_first_token_s = stats.seconds = time.perf_counter() - t0
            stats.new_tokens = 1
        else:
            state = self._prefill(prompt_ids, config.sampling, min(ctx, len(prompt_ids) + max_new + budget + 2),
                                  generator, stats, t0, controls)
        sizer = self.round_sizer(state, builder, self.costs_for(config.sampling))
        block = state.tokens[-1:]
        while True:
            yield list(block)
            emitted = len(state.tokens) - len(prompt_ids)
            if block[-1] in eos or emitted >= max_new:
                return
            executor_of(self.model).adapt_threads()
            block = self._round(state, builder, budget, max_new - emitted, generator, eos, stats, sizer)
            stats.new_tokens = emitted + len(block)
            stats.seconds = time.perf_counter() - t0

    def round_sizer(self, state: DecodingState, builder: TreeBuilder | None, costs: CostTable | None):
        """What sizes a generation's rounds: a :class:`~speculant.engine.speculation.RoundSizer` from ``costs``
        (``None`` without costs: every round drafts as deep as the builder allows)."""
        if costs is None:
            return None
        return RoundSizer(costs, builder, self.drafter.capabilities.draft_confidence,
                          lambda context: self.drafter.round_costs(state, context, costs),
                          lambda context: self.drafter.round_extra_seconds(state, context),
                          self.history_for(state.sampling.greedy),
                          self.round_timing if state.sampling.greedy else None,
                          lambda: self.drafter.one_off_work(state))

    def history_for(self, greedy: bool) -> dict | None:
        """What a cost-aware generation's rounds start from and update (:class:`RoundSizer`'s ``history``): greedy,
        :attr:`acceptance_history`, seeded from the greedy acceptance prior at its first use; sampled, a fresh copy
        of the sampled prior (``None`` without one), so that a seeded sampled output depends on no earlier
        generation."""
        prior = self._prior_for(not greedy)
        if not greedy:
            return copy.deepcopy(prior) if prior is not None else None
        if prior and not self.acceptance_history:
            self.acceptance_history.update(copy.deepcopy(prior))
        return self.acceptance_history

    def _prior_for(self, sampled: bool) -> dict | None:
        """The acceptance prior of one kind, asked of ``acceptance_prior`` once and kept (checked)."""
        if sampled not in self._priors:
            prior = self._prior(sampled) if self._prior is not None else None
            if prior is not None and not (isinstance(prior, dict)
                                          and all(isinstance(a, DepthAcceptance) for a in prior.values())):
                raise SpeculantError(f"acceptance_prior({sampled}) returned {prior!r}; allowed: None or "
                                     "{round context: DepthAcceptance}")
            self._priors[sampled] = prior
        return self._priors[sampled]

    @torch.inference_mode()
    def _prefill(self, prompt_ids, sampling, cache_length, generator, stats, t0, controls=None) -> DecodingState:
        """Run the prompt through the target, pick the first token, start the drafter (:func:`rounds.prefill`);
        returns the generation's state (``tokens`` = prompt + first token)."""
        state = prefill(executor_of(self.model), self.drafter, prompt_ids, cache_length, sampling, generator, stats,
                        controls)
        stats.time_to_first_token_s = stats.seconds = time.perf_counter() - t0
        stats.new_tokens = 1
        return state

    @torch.inference_mode()
    def _round(self, state: DecodingState, builder, budget: int, remaining: int, generator, eos,
               stats: GenerationStats, sizer: RoundSizer | None = None) -> list[int]:
        """One draft -> verify -> accept -> commit round; returns the emitted tokens (at most ``remaining``,
        ending at an EOS).  With a ``sizer`` the round drafts the depth it chooses (0: an ``ar`` round)."""
        start = time.perf_counter()                  # the round whole, its sizing included (RoundTiming)
        max_nodes, max_depth = draft_limits(state, builder, budget, remaining)
        context = self.drafter.round_context(state) if max_depth else None
        name = self.drafter.context_name(context) if max_depth else None
        if sizer is not None:
            sizer.resolve_shadow(state.tokens)
            free = self.drafter.free_draft(state, context, max_depth) if max_depth else None
            asked, max_depth = max_depth, sizer.depth(state, max_depth, context, free is not None,
                                                          remaining)
            if asked and not max_depth:          # the chain a free draft gives, checked against what is emitted
                sizer.shadow(context, free, len(state.tokens))
        t0, forwards = time.perf_counter(), state.draft_forwards
        tree = self.drafter.draft(state, builder, generator, max_nodes, max_depth)
        if sizer is not None and len(tree):
            sizer.drop_shadow()
        stats.draft_seconds += time.perf_counter() - t0
        stats.draft_forwards, stats.first_draft_seconds = state.draft_forwards, state.first_draft_seconds
        logits = self.drafter.verify_logits(state, tree)
        stats.target_forwards += 1
        accepted, t0 = stats.accepted_tokens, time.perf_counter()
        block = accept_and_commit(state, self.drafter, builder, tree, logits, generator, self.without_replacement,
                                  remaining, eos, stats, verification=self.verification)
        stats.accept_seconds += time.perf_counter() - t0
        if name is not None:
            stats.record_context(name, len(tree), stats.accepted_tokens - accepted)
        if sizer is not None:
            calls = max(state.draft_forwards - forwards, tree.max_depth)    # prompt lookup: no forwards
            sizer.observe(tree.max_depth, stats.accepted_tokens - accepted, len(tree), calls)
            sizer.timed(time.perf_counter() - start)
        return block

    # ---------------------------------------------------------------- text layer
    def stream(self, prompt: str | list[int] | list[dict], config: GenerationConfig | None = None,
               shared=None) -> Iterator[str]:
        """Yield text pieces as they are produced; ``self.last_result`` holds the result afterwards.

        A string prompt, or a list of chat messages (``{'role', 'content'}`` dicts), is encoded with :meth:`encode`
        (chat template unless ``config.chat`` is False); another list is taken as token ids.  ``last_result`` is
        ``None`` while the stream runs; a stream closed early (``break`` + ``close()``, or garbage-collected) leaves a
        partial result with ``stop_reason='abandoned'``.

        Raises:
            SpeculantError: bad prompt (see :meth:`encode`, :meth:`generate_blocks`).
        """
        self.last_result = None
        config = config or GenerationConfig()
        messages = isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)
        ids = self._check_prompt(self.encode(prompt, config.chat) if isinstance(prompt, str) or messages
                                 else list(prompt))
        eos = stop_token_set(config, self.model.eos_token_ids)
        stats = GenerationStats()
        text = StopStringText(self.model.tokenizer, config.stop)
        reason = "length"
        controls = make_controls(config, self.model, ids)
        blocks = self.generate_blocks(ids, config, stats, controls, shared)
        first = True
        try:
            for block in blocks:
                before = len(text.token_ids)
                piece = text.add(block)
                if text.stopped:
                    stats.new_tokens = len(text.token_ids)
                    if not first:   # the drafted tokens past the cut were not emitted: not accepted either
                        stats.cut_last_round(len(text.token_ids) - before)
                    reason = "stop"
                    blocks.close()
                elif block[-1] in eos:
                    reason = "eos" if block[-1] in self.model.eos_token_ids else "stop"
                first = False
                if piece:
                    yield piece
                if text.stopped:
                    break
            piece = text.finish()
            if text.stopped and reason != "stop":        # a stop string completed by the final flush
                stats.new_tokens = len(text.token_ids)
                reason = "stop"
            if piece:
                yield piece
        except GeneratorExit:
            blocks.close()
            text.finish()
            self.last_result = GenerationResult(text.text, list(text.token_ids), stats,
                                                "stop" if text.stopped else "abandoned", _logprobs(controls, text))
            raise
        self.last_result = GenerationResult(text.text, list(text.token_ids), stats, reason, _logprobs(controls, text))

    def generate(self, prompt: str | list[int], config: GenerationConfig | None = None) -> GenerationResult:
        """Generate to completion; returns text, token ids (prompt excluded) and stats."""
        for _ in self.stream(prompt, config):
            pass
        return self.last_result

    def generate_n(self, prompt: str | list[int], config: GenerationConfig | None = None,
                   n: int = 1) -> list[GenerationResult]:
        """``n`` independent samples of one prompt, sharing its prefill (:mod:`speculant.engine.multi`).

        Sample ``i`` runs with seed ``(config.sampling.seed + i) mod 2**64`` (sample 0 is :meth:`generate`'s
        output with the same config), from a copy of the KV cache (and drafter state) left by one forward
        over the prompt; its first token is drawn from the shared logits with its own seed.

        Raises:
            SpeculantError: ``n`` not an integer in [1, 128]; bad prompt or config (as :meth:`generate`).
        """
        from .multi import generate_n
        return generate_n(self, prompt, config or GenerationConfig(), n)
