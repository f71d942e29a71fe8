"""Batched speculative decoding: many sequences, one target forward per round.

Each round drafts for every active sequence (each with its own drafter state, tree builder, sampling
``torch.Generator`` and KV cache), then verifies *all* their trees in one ragged target forward
(:meth:`~speculant.runtime.executor.Executor.run`: the rows of every block concatenated for the projections
and the MLP, attention per sequence against its own cache and mask), then accepts and commits each sequence
with its own accepted length (:func:`~speculant.engine.rounds.accept_and_commit`, the same code the
one-sequence generator runs).  Sequences join (:meth:`BatchedGenerator.start`: their own prefill forward) and
leave between rounds, which is continuous batching (Yu et al. 2022, "Orca", iteration-level scheduling); with a
:class:`~speculant.engine.prefix_cache.PrefixCache`, a joining prompt prefills only what follows the longest
prefix it shares with a cached one (:meth:`BatchedGenerator.start_many`, :meth:`BatchedGenerator.release`).

Exactness: a sequence's logits in the batched forward are bit-identical to those of the same sequence
decoded alone (per-row projections batch-invariant, measured: :func:`speculant.runtime.tune.invariant_rows`;
per-row norms; attention per sequence in float64), its draws come from its own seeded generator in the
order its own rounds make them, so greedy output equals the sequence's ``ar`` output and a seeded sampled
output is the same whatever else runs beside it.

Verification: drafters declaring ``batchable_verification`` (:class:`~speculant.drafters.base.DrafterCapabilities`:
``ar``, prompt lookup, a draft model, early exit resuming at its exit layer, a draft head that also declares
``needs_features`` and gets the target's hidden states through
:meth:`~speculant.drafters.base.Drafter.verification_hidden`) are batched through
:meth:`~speculant.drafters.base.Drafter.verification_input`; any other is verified alone inside the round
(:meth:`~speculant.drafters.base.Drafter.verify_logits`).  One drafter object serves every sequence: each
sequence's drafter state is its own (``state.drafter_state``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace

import torch

from ..drafters.base import DecodingState, Drafter, run_with_features
from ..errors import SpeculantError
from ..kernels import attention as attention_kernel
from ..models.loading import LoadedModel
from ..runtime.executor import executor_of
from ..runtime.blocks import Block
from ..sampling.argmax import rows_argmax
from ..trees.builders import IIDTreeBuilder, TreeBuilder
from ..trees.tree import DraftTree
from .generator import GenerationConfig
from .goodput import GoodputPolicy
from .prefix_cache import PrefixCache
from .prompts import check_prompt_ids
from .requests import make_controls, stop_token_set
from .rounds import accept_and_commit, draft_limits, first_token, new_state, run_prefill
from .stats import GenerationStats


@dataclass
class Sequence:
    """One request decoded inside a batch.

    Attributes:
        prompt_ids: the prompt's token ids.
        config: its generation settings (``max_new_tokens``, sampling, seed; stop strings are the text
            layer's business, see :mod:`speculant.engine.text`).
        drafter: the batch's drafter (its per-sequence state is ``state.drafter_state``).
        builder: its own tree builder (a copy of the batch's), or ``None``.
        generator: the ``torch.Generator`` of every random draw of this sequence (seeded from ``config``).
        state: tokens (prompt + emitted), KV cache (``cache.length`` committed slots).
        stats: its counters (rounds, drafted/accepted tokens by depth, target forwards shared by the batch).
        max_new: tokens it may emit (``max_new_tokens`` within the context) [tokens].
        budget: the builder's node budget [tokens].
        emitted: tokens emitted so far [tokens].
        finished: why it ended: ``'eos'`` (an EOS or a ``stop_token_ids`` token), ``'length'``, or ``None`` while
            it runs.
        last_block: the tokens its last :meth:`BatchedGenerator.start` / :meth:`BatchedGenerator.step` emitted.
        eos: the tokens that end it (:func:`~speculant.engine.requests.stop_token_set` of its config).
    The per-position controls of its config (penalties, logit bias, grammar, ``min_tokens``, logprobs) are
    ``state.controls`` (:class:`~speculant.sampling.controls.SequenceControls`, or ``None``); its logprobs are
    ``state.controls.logprobs``.
    """

    prompt_ids: list[int]
    config: GenerationConfig
    drafter: Drafter
    builder: TreeBuilder | None
    generator: torch.Generator
    state: DecodingState
    stats: GenerationStats
    max_new: int
    budget: int
    emitted: int = 1
    finished: str | None = None
    last_block: list[int] = field(default_factory=list)
    eos: set[int] = field(default_factory=set)

    @property
    def remaining(self) -> int:
        """Tokens it may still emit."""
        return self.max_new - self.emitted

    @property
    def logprobs(self) -> list | None:
        """The :class:`~speculant.sampling.logprobs.TokenLogprob` of each emitted token (``None``: not asked)."""
        controls = self.state.controls
        return None if controls is None or controls.logprobs_k is None else controls.logprobs


@dataclass
class _Unstarted:
    """A sequence between :meth:`BatchedGenerator._new_state` and its prefill: what :class:`Sequence` will hold."""

    prompt_ids: list[int]
    config: GenerationConfig
    drafter: Drafter
    builder: TreeBuilder | None
    budget: int
    max_new: int
    generator: torch.Generator
    state: DecodingState
    eos: set[int] = field(default_factory=set)


class BatchedGenerator:
    """Decodes a changing set of sequences, one batched round at a time.

    Not thread-safe: one thread (the server's scheduler) calls :meth:`start` and :meth:`step`.

    Args:
        model: the target.
        drafter: the drafter of every sequence (``None``: autoregressive decoding).
        builder: the tree builder every sequence copies (``None`` with no drafter).
        prefix_cache: where :meth:`start_many` keeps prompts' KV and looks up new prompts' prefixes
            (``None``: no prefix caching).
        policy: decides per round whether its greedy sequences draft (:mod:`speculant.engine.goodput`;
            ``None``: every round drafts).
    """

    def __init__(self, model: LoadedModel, drafter: Drafter | None = None, builder: TreeBuilder | None = None,
                 prefix_cache: PrefixCache | None = None, policy: GoodputPolicy | None = None):
        self.model = model
        self.prefix_cache = prefix_cache
        self.policy = policy
        self._last_round: tuple | None = None     # (start [s], sequences, rows, draft seconds) for the policy
        self._rounds = 0
        self.drafter = drafter or Drafter()
        self.builder = builder
        self.without_replacement = not isinstance(builder, IIDTreeBuilder)
        self.eos = set(model.eos_token_ids)
        self.target_forwards = 0                   # batched verification forwards + prefills [count]
        self.batched_verification = self.drafter.capabilities.batchable_verification

    @property
    def rows_per_sequence(self) -> int:
        """Most rows one sequence adds to a round's forward: its tree budget + the root [tokens]."""
        return (self.builder.budget() if self.builder is not None else 0) + 1

    def check_prompt(self, prompt_ids: list[int]) -> list[int]:
        """``prompt_ids`` as a list of ints; raises :class:`SpeculantError` for an empty prompt, one with no room left
        in the context, or a token id outside the vocabulary (:func:`speculant.engine.prompts.check_prompt_ids`)."""
        return check_prompt_ids(prompt_ids, self.model.config.context_length, self.model.config.vocab_size)

    @torch.inference_mode()
    def start(self, prompt_ids: list[int], config: GenerationConfig) -> Sequence:
        """Prefill a new sequence on its own (one target forward over the prompt) and pick its first token.

        The prompt runs alone, exactly as a one-sequence generation runs it, so its KV cache holds the same
        bits.  ``seq.last_block`` is ``[first token]``; ``seq.finished`` is set when that already ends it.

        Raises:
            SpeculantError: see :meth:`check_prompt`.
        """
        new = self._new_state(prompt_ids, config)
        t0 = time.perf_counter()
        self.target_forwards += 1
        return self._started(new, run_prefill(new.state, new.drafter), t0)

    @torch.inference_mode()
    def start_many(self, requests: list[tuple[list[int], GenerationConfig]]) -> list[Sequence | SpeculantError]:
        """Start several sequences (``(prompt_ids, config)`` each); returns per request its :class:`Sequence`, or
        the :class:`SpeculantError` of :meth:`check_prompt` (the others start all the same).

        The prompts whose prefill is the plain target forward (the drafter does not declare ``own_prefill``) and runs
        on the fused step (``len(prompt) <=`` the executor's ``fused_prompt_tokens``) share ragged target forwards of up to
        that many rows in all, each prompt causal over itself in its own KV cache, then one LM-head pass over
        their last positions; the others run alone, as :meth:`start` runs them.  The fused step gives each row
        the bits it gets alone (:mod:`speculant.kernels.decode_step`), so every sequence's cache and first token
        are those of :meth:`start`: a server's new requests join with one forward instead of one each (a batched
        prefill, as vLLM's scheduler batches the prompts of a step).

        With a :attr:`prefix_cache`, such a prompt first takes the KV of the longest prefix it shares with a
        cached prompt, and only its other tokens are prefilled (at least its last one); every prompt so
        prefilled is then cached.  The cached slots hold the bits its own prefill computes (the fused step's
        rows, see :mod:`speculant.engine.prefix_cache`), so the cache and first token are still those of
        :meth:`start`.  ``state.layer_tokens`` counts the rows actually computed.
        """
        target = executor_of(self.model)
        self._last_round = None                   # a prefill between two rounds is not a round's overhead
        new: list = []
        for ids, config in requests:
            try:
                new.append(self._new_state(ids, config))
            except SpeculantError as e:
                new.append(e)
        out: list = [None] * len(requests)
        shared = [i for i, n in enumerate(new) if not isinstance(n, SpeculantError) and self._prefill_shares(n.state)]
        cached = {i: self._load_prefix(new[i].state) for i in shared}      # slots taken from the prefix cache
        groups, rows = [], 0
        for i in shared:                          # consecutive groups of at most fused_prompt_tokens rows
            t = len(requests[i][0]) - cached[i]
            if not groups or rows + t > target.fused_prompt_tokens:
                groups.append([])
                rows = 0
            groups[-1].append(i)
            rows += t
        for group in groups:
            t0 = time.perf_counter()
            states = [new[i].state for i in group]
            blocks = [Block(target.embed(torch.tensor([st.tokens[cached[i]:]])), 0,
                                  torch.arange(cached[i], len(st.tokens)), None, st.cache, cached[i])
                      for i, st in zip(group, states)]
            hidden = target.run(blocks)
            logits = target.lm_head(target.final_norm(torch.cat([h[0, -1:] for h in hidden])))    # [G, V]
            self.target_forwards += 1
            for k, (i, st) in enumerate(zip(group, states)):
                st.count_layers(0, target.num_layers, len(st.tokens) - cached[i])
                if self.prefix_cache is not None:
                    self.prefix_cache.store(st.tokens, st.cache)
                out[i] = self._started(new[i], logits[k:k + 1], t0)
        for i, n in enumerate(new):
            if out[i] is None:
                if isinstance(n, SpeculantError):
                    out[i] = n
                else:
                    t0 = time.perf_counter()
                    self.target_forwards += 1
                    out[i] = self._started(n, run_prefill(n.state, n.drafter), t0)
        return out

    @torch.inference_mode()
    def start_n(self, prompt_ids: list[int], config: GenerationConfig, n: int) -> list[Sequence]:
        """``n`` independent samples of one prompt as ``n`` sequences sharing its prefill (one target forward):
        sample ``i`` runs with seed :func:`~speculant.engine.multi.sample_seed` ``(seed, i)`` from a copy of the
        KV cache and drafter state the prompt left (:class:`~speculant.engine.multi.SharedPrefill`), so each is
        what :meth:`start` of its config gives, and what ``SpeculativeGenerator.generate_n`` gives.

        Raises:
            SpeculantError: ``n`` not an integer in [1, 128]; see :meth:`check_prompt`.
        """
        import dataclasses

        from .multi import MAX_N, SharedPrefill, sample_seed
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise SpeculantError(f"n={n!r} is out of range; allowed: an integer in [1, {MAX_N}]")
        self._last_round = None
        first = self._new_state(prompt_ids, config)          # checks the prompt and the config's token ids
        t0 = time.perf_counter()
        shared = SharedPrefill(executor_of(self.model), self.drafter, first.prompt_ids, first.state.cache.max_length,
                               config.sampling)
        self.target_forwards += 1
        seqs = []
        for i in range(n):
            sampling = dataclasses.replace(config.sampling, seed=sample_seed(config.sampling.seed, i))
            cfg = dataclasses.replace(config, sampling=sampling)
            controls = make_controls(cfg, self.model, first.prompt_ids)
            generator, stats = sampling.generator(), GenerationStats()
            state = shared.start(self.drafter, controls, generator, stats, sampling)
            stats.time_to_first_token_s = stats.seconds = time.perf_counter() - t0
            stats.new_tokens = 1
            builder = self.builder.fresh() if self.builder is not None else None
            seq = Sequence(first.prompt_ids, cfg, self.drafter, builder, generator, state, stats, first.max_new,
                           first.budget, last_block=[state.tokens[-1]], eos=first.eos)
            self._finish_if_done(seq)
            seqs.append(seq)
        return seqs

    def release(self, seq: Sequence) -> None:
        """``seq`` leaves the batch (finished or dropped): with a :attr:`prefix_cache`, the KV of its committed
        tokens (prompt and emitted ones) is cached, so a conversation's next turn, which repeats them, prefills
        only its new tokens.  Only where every committed row came from the fused step and the target's own
        verification forwards (drafters that declare neither ``drafts_into_target_cache`` nor ``own_prefill``, and
        whose verification is batched: ``ar``, prompt lookup, a draft model), so the cached slots hold the bits a
        prefill of those tokens computes."""
        caps = seq.drafter.capabilities
        if (self.prefix_cache is None or caps.drafts_into_target_cache or not caps.batchable_verification
                or not self._prefill_shares(seq.state, len(seq.prompt_ids))):
            return
        self.prefix_cache.store(seq.state.tokens[:seq.state.cache.length], seq.state.cache)

    def _load_prefix(self, state: DecodingState) -> int:
        """Copy the longest cached prefix of ``state.tokens`` into its KV cache; returns its length [tokens]."""
        if self.prefix_cache is None:
            return 0
        n, key = self.prefix_cache.match(state.tokens)
        if n:
            self.prefix_cache.load(key, n, state.cache)
        return n

    def _prefill_shares(self, state: DecodingState, prompt_length: int | None = None) -> bool:
        """Whether this sequence's prefill (of ``prompt_length`` tokens, default all of ``state.tokens``) may share
        a ragged forward, on the fused step (see :meth:`start_many`)."""
        target = executor_of(self.model)
        n = len(state.tokens) if prompt_length is None else prompt_length
        return (not self.drafter.capabilities.own_prefill and n <= target.fused_prompt_tokens
                and state.cache.dtype in attention_kernel.CACHE_DTYPES and target.fused_layers() is not None)

    def _new_state(self, prompt_ids: list[int], config: GenerationConfig) -> "_Unstarted":
        """A new sequence before its prefill (an empty KV cache).  Raises :class:`SpeculantError` (see
        :meth:`check_prompt`)."""
        prompt_ids = self.check_prompt(prompt_ids)
        cfg = self.model.config
        drafter = self.drafter
        builder = self.builder.fresh() if self.builder is not None else None
        budget = builder.budget() if builder is not None else 0
        max_new = min(config.max_new_tokens, cfg.context_length - len(prompt_ids))
        cache_length = min(cfg.context_length, len(prompt_ids) + max_new + budget + 2)
        controls = make_controls(config, self.model, prompt_ids)
        state = new_state(executor_of(self.model), drafter, prompt_ids, cache_length, config.sampling, controls)
        return _Unstarted(list(prompt_ids), config, drafter, builder, budget, max_new, config.sampling.generator(),
                          state, stop_token_set(config, self.model.eos_token_ids))

    def _started(self, new: "_Unstarted", logits: torch.Tensor, t0: float) -> Sequence:
        """The :class:`Sequence` after its prompt's forward (``logits`` ``[1, V]`` of the last position; the caller
        counts that forward in :attr:`target_forwards`)."""
        stats = GenerationStats()
        first_token(new.state, logits, new.generator, stats)
        stats.time_to_first_token_s = stats.seconds = time.perf_counter() - t0
        stats.new_tokens = 1
        seq = Sequence(new.prompt_ids, new.config, new.drafter, new.builder, new.generator, new.state, stats,
                       new.max_new, new.budget, last_block=[new.state.tokens[-1]], eos=new.eos)
        self._finish_if_done(seq)
        return seq

    def _finish_if_done(self, seq: Sequence) -> None:
        if seq.last_block[-1] in seq.eos:
            seq.finished = "eos"
        elif seq.emitted >= seq.max_new:
            seq.finished = "length"

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> None:
        """One round for every sequence in ``seqs`` (all unfinished): draft each (greedy ones only when the
        :attr:`policy` says drafting pays at this batch size), verify all in one target forward, accept and
        commit each.  Sets each sequence's ``last_block`` (its emitted tokens, ending at
        an EOS, at most ``remaining``), ``emitted`` and ``finished``."""
        if not seqs:
            return
        executor_of(self.model).adapt_threads()      # fewer threads while other processes keep cores busy
        trees: list[DraftTree] = []
        t0 = time.perf_counter()
        drafts = self._who_drafts(seqs, t0)
        names = []                                                # round contexts counted in the stats
        for s, d in zip(seqs, drafts):
            max_nodes, max_depth = draft_limits(s.state, s.builder, s.budget, s.remaining)
            if not d:                                             # an ar round for it (same tokens)
                max_nodes = max_depth = 0
            names.append(s.drafter.context_name(s.drafter.round_context(s.state)) if max_depth else None)
            trees.append(s.drafter.draft(s.state, s.builder, s.generator, max_nodes, max_depth))
            s.stats.draft_forwards = s.state.draft_forwards
        draft_seconds = time.perf_counter() - t0
        argmax: list = [None] * len(seqs)
        if self.batched_verification:
            every, logits = self._verify(seqs, trees)
            if any(s.state.sampling.greedy for s in seqs):      # one argmax call for the round's rows
                best = rows_argmax(every).tolist()
                ends = list(itertools.accumulate(lg.shape[0] for lg in logits))
                argmax = [best[a:b] for a, b in zip([0] + ends, ends)]
        else:
            logits = [s.drafter.verify_logits(s.state, tree) for s, tree in zip(seqs, trees)]
        self.target_forwards += 1 if self.batched_verification else len(seqs)
        for s, tree, lg, am, name in zip(seqs, trees, logits, argmax, names):
            s.stats.target_forwards += 1
            accepted = s.stats.accepted_tokens
            block = accept_and_commit(s.state, s.drafter, s.builder, tree, lg, s.generator, self.without_replacement,
                                      s.remaining, s.eos, s.stats, am)
            if name is not None:
                s.stats.record_context(name, len(tree), s.stats.accepted_tokens - accepted)
            s.emitted += len(block)
            s.stats.new_tokens = s.emitted
            s.last_block = block
            self._finish_if_done(s)
        if self.policy is not None:
            rows = [len(t) + 1 for t in trees]
            mine = [i for i, d in enumerate(drafts) if d]
            if self.builder is not None and mine:
                self.policy.observe(len(mine), sum(rows[i] for i in mine), sum(len(seqs[i].last_block) for i in mine),
                                    draft_seconds)
            self._last_round = (t0, len(seqs), sum(rows), draft_seconds)

    def _who_drafts(self, seqs: list[Sequence], now: float) -> list[bool]:
        """Per sequence of the round starting at ``now`` [s], whether it drafts: all of them without a
        :attr:`policy`; with one, the sampled ones and the greedy ones the policy lets draft (all, or one in turn
        when it explores).  Also hands the policy the previous round's period."""
        if self.policy is None or self.builder is None:
            return [True] * len(seqs)
        if self._last_round is not None:
            start, sequences, rows, drafting = self._last_round
            self.policy.observe_period(sequences, rows, now - start, drafting)
        n = self.policy.drafting(len(seqs))
        explorer = self._rounds % len(seqs) if n == 1 else -1    # the one that drafts when exploring (in turn)
        self._rounds += 1
        return [n == len(seqs) or i == explorer or not s.state.sampling.greedy for i, s in enumerate(seqs)]

    @torch.inference_mode()
    def matches_single_sequence(self, with_neighbours: bool = True, seed: int = 0) -> bool:
        """Whether a sequence's logits in a batched forward equal, bit for bit, those of the one-sequence
        forward (:meth:`LlamaDecoder.forward`, the compiled step when compiled): a one-token step alone, and a
        one-token step and a three-token block each next to another sequence's block (``with_neighbours``).

        A self-check on random tokens (it also compiles the ragged forward's graphs, when compiled): the
        ragged forward runs the layer halves (compiled separately when the model is compiled) instead of
        the fused one-sequence step, which an optimizing compiler could round differently.
        """
        target = executor_of(self.model)
        g = torch.Generator().manual_seed(seed)
        vocab = self.model.config.vocab_size
        prompt = torch.randint(vocab, (1, 6), generator=g)
        same = True
        for sizes in ((1,), (3,)) + (((1, 2), (3, 2)) if with_neighbours else ()):
            caches = [target.new_cache(16) for _ in range(len(sizes) + 1)]
            for c in caches:
                target(prompt, None, None, c, 0)
                c.crop(6)
            ids = [torch.randint(vocab, (1, t), generator=g) for t in sizes]
            alone = target(ids[0], torch.arange(6, 6 + sizes[0]), None, caches[-1], 6)[0]
            blocks = [Block(target.embed(x), 0, torch.arange(6, 6 + x.shape[1]), None, c, 6)
                      for x, c in zip(ids, caches)]
            hidden = target.run(blocks)
            logits = target.lm_head(target.final_norm(torch.cat(hidden, dim=1)))[0, :sizes[0]]
            same &= torch.equal(alone, logits)
        return bool(same)

    def _verify(self, seqs: list[Sequence], trees: list[DraftTree]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every sequence's tree in one ragged target forward; returns the fp32 logits of all rows ``[R, V]`` and
        their views per sequence ``[N_i + 1, V]``."""
        target = executor_of(self.model)
        blocks = []
        for s, tree in zip(seqs, trees):
            v = s.drafter.verification_input(s.state, tree)
            blocks.append(Block(v.hidden, v.start_layer, v.positions, v.mask, s.state.cache, v.cache_position))
        layers = self.drafter.feature_layers

        def run(hiddens, start, end):
            return target.run([replace(b, hidden=h, start_layer=start) for b, h in zip(blocks, hiddens)], end)

        if layers:      # blocks of a feature drafter all start at layer 0 (token embeddings)
            hidden, aux = run_with_features(run, [b.hidden for b in blocks], 0, target.num_layers, layers)
        else:
            hidden, aux = target.run(blocks), None
        if self.drafter.capabilities.needs_features:
            for i, (s, tree, h) in enumerate(zip(seqs, trees, hidden)):
                s.drafter.verification_hidden(s.state, tree, h[0], *([[a[i][0] for a in aux]] if layers else []))
        sizes = [h.shape[1] for h in hidden]
        logits = target.lm_head(target.final_norm(torch.cat(hidden, dim=1)))[0]    # one LM-head pass: [R, V]
        return logits, list(logits.split(sizes))
