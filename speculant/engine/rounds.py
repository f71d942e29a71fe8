"""The parts of a decoding round that do not depend on how the target forward was batched.

One sequence (:class:`~speculant.engine.generator.SpeculativeGenerator`) and a batch of sequences
(:class:`~speculant.engine.batch.BatchedGenerator`) run the same steps around their target forwards:
prefill and the first token (:func:`prefill`, :func:`first_token`), the draft limits (:func:`draft_limits`), and acceptance +
commit of the caches, drafter and tree builder (:func:`accept_and_commit`).
"""

from __future__ import annotations

import torch

from ..drafters.base import DecodingState, Drafter, target_prefill
from ..models.llama import LlamaDecoder
from ..sampling.argmax import first_argmax, rows_argmax
from ..sampling.processors import SamplingConfig, logits_to_probs
from ..trees.builders import TreeBuilder
from ..trees.tree import DraftTree
from ..verification.rules import greedy_accept, sample_residual
from ..verification.sequence import sampling_accept
from .controlled import block_rows, controlled_accept, controlled_pick
from .stats import GenerationStats


def pick_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """The target's token from fp32 logits ``[V]``: argmax under greedy decoding, else one draw."""
    if sampling.greedy:
        return first_argmax(logits)
    return sample_residual(logits_to_probs(logits, sampling), None, None, generator)


def prefill(target: LlamaDecoder, drafter: Drafter, prompt_ids: list[int], cache_length: int,
            sampling: SamplingConfig, generator: torch.Generator | None, stats: GenerationStats,
            controls=None) -> DecodingState:
    """Start the drafter (:meth:`~Drafter.begin`), run the prompt through the target (:func:`target_prefill`, or the
    drafter's :meth:`~Drafter.prefill` where it declares ``own_prefill``; the LM head on the last position only) and
    pick the first token.

    Args:
        cache_length: slots of the new KV cache [tokens].
    Returns:
        the sequence's :class:`DecodingState`: ``tokens`` = prompt + first token, ``cache.length`` = prompt length;
        ``stats.layer_token_evaluations`` is its per-layer token count (kept up to date as it decodes).
        ``controls``: the generation's :class:`~speculant.sampling.controls.SequenceControls` (or ``None``).
    """
    state = new_state(target, drafter, prompt_ids, cache_length, sampling, controls)
    return first_token(state, run_prefill(state, drafter), generator, stats)


def new_state(target: LlamaDecoder, drafter: Drafter, prompt_ids: list[int], cache_length: int,
              sampling: SamplingConfig, controls=None) -> DecodingState:
    """A generation's :class:`DecodingState` with an empty KV cache of ``cache_length`` slots, its ``controls``
    (:class:`~speculant.sampling.controls.SequenceControls` or ``None``) and the drafter's state
    (:meth:`~Drafter.begin`)."""
    state = DecodingState(target, target.new_cache(cache_length), list(prompt_ids), sampling)
    state.controls = controls
    state.drafter_state = drafter.begin(state)
    return state


def run_prefill(state: DecodingState, drafter: Drafter) -> torch.Tensor:
    """The prompt's forward as the drafter declares it: its own :meth:`~Drafter.prefill`, or the plain
    :func:`target_prefill`.  Returns fp32 logits ``[1, V]`` of the last position."""
    return drafter.prefill(state) if drafter.capabilities.own_prefill else target_prefill(state)


def first_token(state: DecodingState, logits: torch.Tensor, generator: torch.Generator | None,
                stats: GenerationStats) -> DecodingState:
    """After the prompt's forward (its KV in ``state.cache``, fp32 ``logits`` ``[1, V]`` of its last position):
    keep the prompt's slots, pick the first token.  The second half of :func:`prefill`, also
    run after a batched prefill (:meth:`~speculant.engine.batch.BatchedGenerator.start_many`)."""
    state.cache.crop(len(state.tokens))
    stats.target_forwards += 1
    controls = state.controls
    if controls is not None and controls.active:
        token = controlled_pick(controls, logits[0], state.sampling, generator)
    else:
        token = pick_token(logits[0], state.sampling, generator)
    state.tokens.append(token)
    if controls is not None:
        controls.commit([token], [logits[0]])
    stats.layer_token_evaluations = state.layer_tokens
    return state


def draft_limits(state: DecodingState, builder: TreeBuilder | None, budget: int, remaining: int) -> tuple[int, int]:
    """``(max_nodes, max_depth)`` of the next tree [tokens]: the builder's budget and depth, within the KV
    cache and within the ``remaining`` tokens the sequence may still emit (one is always the target's)."""
    max_depth = min(builder.max_depth if builder else 0, remaining - 1)
    max_nodes = min(budget, state.cache.max_length - state.n - 1)
    return max_nodes, max_depth


class RowArgmax:
    """``target_argmax[entry]`` for :func:`greedy_accept`: the argmax of ``logits`` ``[N + 1, V]`` row ``entry``, computed
    when the rule visits it (a tree's rule visits one row per accepted depth, not its ``N + 1``)."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def __getitem__(self, entry: int) -> int:
        return first_argmax(self.logits[entry])


def accept_and_commit(state: DecodingState, drafter: Drafter, builder: TreeBuilder | None, tree: DraftTree,
                      logits: torch.Tensor, generator: torch.Generator | None, without_replacement: bool,
                      remaining: int, eos: set[int], stats: GenerationStats,
                      target_argmax: list[int] | None = None, verification: str = "token") -> list[int]:
    """Accept against the target's logits ``[N + 1, V]``, keep the accepted path in the KV cache, commit the
    drafter and the builder, record the round; returns the emitted tokens (appended to ``state.tokens``).
    ``target_argmax``: the logits' argmax per row when the caller has it (a batched round takes it for all
    sequences in one call), else computed here.

    The block ends at the first EOS and holds at most ``remaining`` tokens.  Acceptance: greedy match
    (Stern et al. 2018) or, under sampling, ``verification``: recursive rejection sampling
    (:mod:`speculant.verification.rules`), block or traversal verification (:mod:`speculant.verification.sequence`)
    on the target's processed distribution of only the rows the rule visits.
    """
    cache, sampling, n, controls = state.cache, state.sampling, state.n, state.controls
    if controls is not None and controls.active:
        path, token = controlled_accept(controls, tree, logits, sampling, generator, without_replacement,
                                        verification)
    elif sampling.greedy:
        if target_argmax is None:
            target_argmax = rows_argmax(logits).tolist() if tree.is_chain else RowArgmax(logits)
        path, token = greedy_accept(tree, target_argmax)
    elif len(tree) == 0:         # an ar round: every rule reduces to one draw from the target (the same draw)
        path, token = [], pick_token(logits[0], sampling, generator)
    else:
        path, token = sampling_accept(tree, lambda entry: logits_to_probs(logits[entry], sampling), generator,
                                      without_replacement, verification)
    cache.crop(n + 1)
    cache.keep([n + 1 + i for i in path], start=n + 1)
    drafter.commit(state, path)
    if builder is not None:
        builder.observe(len(path), tree.max_depth)
    block = []
    for tok in [tree.tokens[i] for i in path] + [token]:
        block.append(tok)
        if tok in eos or len(block) >= remaining:
            break
    # accepted drafted tokens that were emitted (an EOS or max_new_tokens may cut the block)
    stats.record_round(len(tree), tree.max_depth, min(len(path), len(block)))
    if controls is not None:
        controls.commit(block, block_rows(logits, path, block))
    state.tokens.extend(block)
    return block
