"""Tree builders: which children each frontier node gets, depth by depth.

A builder sees the draft distributions ``q`` ``[F, V]`` of the current frontier
(F nodes, all at one depth) and returns, for each frontier node, its children
in sampling order.  The drafter runs the draft model once per depth over the
whole frontier (one batched forward with the tree mask), then asks again.

Builders:
    * :class:`ChainBuilder` - one child per depth (Leviathan et al. 2023), with an
      optional adaptive length (stop when the draft's top probability is low).
    * :class:`ConstantBranchingBuilder` - RSD-C (Jeon et al. 2024, Sec. 3.2): b_d
      children per node sampled *without replacement* with Gumbel-Top-k.
    * :class:`IIDTreeBuilder` - SpecInfer's i.i.d. tree (Miao et al. 2024):
      b_d children sampled *with* replacement.
    * :class:`StochasticBeamBuilder` - RSD-S (Jeon et al. 2024, Sec. 3.3): stochastic
      beam search (Kool et al. 2019, Alg. 1), W beams sampled without replacement.
Under greedy decoding each builder falls back to its deterministic analogue
(argmax chain, top-k tree, beam search).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..errors import SpeculantError
from ..sampling.gumbel import sample_without_replacement, truncated_gumbel_below
from ..sampling.argmax import rows_argmax
from ..sampling.processors import sample_categorical


class TreeBuilder:
    """Base class. ``max_depth`` bounds the tree depth; ``budget`` the node count.

    State: what a builder changes while it works lives in attributes that :meth:`begin` (per-generation
    state, e.g. an adaptive threshold) and :meth:`reset` (per-tree state) set; the constructor's fields
    are never changed.  The engine works on :meth:`fresh` copies, one per generation, so neither earlier
    calls nor interleaved generations change what a generation does.
    """

    max_depth: int = 0

    def fresh(self) -> "TreeBuilder":
        """An independent copy with its per-generation state at its initial values (:meth:`begin`)."""
        builder = copy.copy(self)
        builder.begin()
        return builder

    def begin(self) -> None:
        """Set the per-generation state to its initial values (called by :meth:`fresh`)."""
        self.reset()

    def reset(self) -> None:
        """Called before each new tree."""

    def budget(self) -> int:
        """Largest number of nodes a tree may get (for KV cache sizing)."""
        raise NotImplementedError

    def expand(self, depth: int, q: torch.Tensor, greedy: bool,
               generator: torch.Generator | None) -> list[list[int]]:
        """Children tokens of each frontier node.

        Args:
            depth: depth of the children to create (1 = children of the root).
            q: draft distributions ``[F, V]`` of the frontier (under greedy decoding the
                untempered softmax, so top-k and beam search can rank tokens).
            greedy: deterministic decoding.
        Returns:
            ``F`` lists of token ids, each in sampling order (may be empty).
        """
        raise NotImplementedError

    def observe(self, accepted_length: int, drafted_depth: int) -> None:
        """Feedback after verification (used by adaptive builders)."""

    def expand_top(self, depth: int, top: list[int], top_probs: list[float]) -> list[list[int]] | None:
        """Greedy decoding's children from each frontier row's top token ``top`` (its index in the row) and that
        token's draft probability ``top_probs``, without the rows: what :meth:`expand` gives on those rows
        where a builder's greedy children are the top token at most (a chain's); ``None`` where it needs the
        whole rows (the default)."""
        return None


@dataclass
class ChainBuilder(TreeBuilder):
    """A single chain of ``num_speculations`` drafted tokens.

    ``adaptive=True`` stops drafting when the draft's top probability falls under
    ``current_threshold``, and moves that threshold after each block: up when the block
    was rejected early, down when fully accepted (in the spirit of the dynamic
    speculation lookahead of Mamou et al. 2024 / HF's assistant confidence
    threshold).  Every generation starts again from ``threshold`` (:meth:`begin`).
    Stopping early never changes the output distribution: the acceptance rule is
    exact for any draft length.
    """

    num_speculations: int = 4
    adaptive: bool = False
    threshold: float = 0.4
    step: float = 0.05

    def __post_init__(self):
        if self.num_speculations < 1:
            raise SpeculantError(f"num_speculations={self.num_speculations} is out of range; allowed: >= 1")
        self.max_depth = self.num_speculations
        self.begin()

    def begin(self):
        self.current_threshold = self.threshold

    def budget(self) -> int:
        return self.num_speculations

    def expand(self, depth, q, greedy, generator):
        toks = rows_argmax(q) if greedy else sample_categorical(q, generator)[:, 0]
        if self.adaptive and depth > 1:
            keep = (q.amax(-1) >= self.current_threshold).tolist()
            return [[t] if k else [] for t, k in zip(toks.tolist(), keep)]
        return [[t] for t in toks.tolist()]

    def expand_top(self, depth, top, top_probs):
        if self.adaptive and depth > 1:
            return [[t] if p >= self.current_threshold else [] for t, p in zip(top, top_probs)]
        return [[t] for t in top]

    def observe(self, accepted_length, drafted_depth):
        if not self.adaptive or drafted_depth == 0:
            return
        if accepted_length >= drafted_depth:
            self.current_threshold = max(0.0, self.current_threshold - self.step)
        else:
            self.current_threshold = min(0.95, self.current_threshold + self.step)


def _parse_branching(branching) -> list[int]:
    try:
        b = [int(x) for x in (branching.split(",") if isinstance(branching, str) else branching)]
    except (TypeError, ValueError):
        b = []
    if not b or any(x < 1 for x in b):
        raise SpeculantError(f"branching={branching!r} is invalid; allowed: comma-separated integers >= 1, e.g. 3,2,1")
    return b


@dataclass
class ConstantBranchingBuilder(TreeBuilder):
    """RSD-C: ``branching[d-1]`` children per node at depth d, sampled without replacement (successive
    sampling, the law of Gumbel-Top-k: :func:`~speculant.sampling.gumbel.sample_without_replacement`)."""

    branching: list[int] | str = (2, 2, 2)

    def __post_init__(self):
        self.branching = _parse_branching(self.branching)
        self.max_depth = len(self.branching)

    def budget(self) -> int:
        total, width = 0, 1
        for b in self.branching:
            width *= b
            total += width
        return total

    def expand(self, depth, q, greedy, generator):
        b = self.branching[depth - 1]
        if greedy:
            return torch.topk(q, min(b, q.shape[-1]), dim=-1).indices.tolist()
        return sample_without_replacement(q, b, generator)[0].tolist()


@dataclass
class IIDTreeBuilder(ConstantBranchingBuilder):
    """SpecInfer's i.i.d. tree: ``branching[d-1]`` children per node sampled *with* replacement."""

    def expand(self, depth, q, greedy, generator):
        b = self.branching[depth - 1]
        if greedy:
            return super().expand(depth, q, greedy, generator)
        return sample_categorical(q, generator, b).tolist()


@dataclass
class StochasticBeamBuilder(TreeBuilder):
    """RSD-S: stochastic beam search of ``beam_width`` W beams over ``draft_length`` L depths.

    At each depth every beam's children are scored with Gumbel perturbations of
    ``log q`` truncated to the beam's own perturbed score (Kool et al. 2019,
    Alg. 1); the W best (parent, token) pairs over all beams survive.  Each
    parent's surviving children are a without-replacement sample listed in
    sampling order (descending perturbed score); beams that lose every child end
    early, so a tree has at most W * L nodes.  Greedy decoding runs plain beam search.
    """

    beam_width: int = 4
    draft_length: int = 4

    def __post_init__(self):
        if self.beam_width < 1 or self.draft_length < 1:
            raise SpeculantError(f"beam_width={self.beam_width}, draft_length={self.draft_length}; allowed: both >= 1")
        self.max_depth = self.draft_length
        self.reset()

    def budget(self) -> int:
        return self.beam_width * self.draft_length

    def reset(self):
        self._log_p = torch.zeros(1, 1)      # [B, F] draft log-probability of each frontier beam
        self._score = torch.zeros(1, 1)      # [B, F] its perturbed score G

    def expand_batch(self, q: torch.Tensor, greedy: bool, generator: torch.Generator | None):
        """One depth for B independent trees: ``q`` ``[B, F, V]`` -> (parents, tokens), each ``[B, W']``.

        Survivors are grouped by parent (frontier order), each group in sampling order; that is also the
        order of the next frontier.  ``W' = min(W, finite scores)``.  Only each parent's W best children can
        survive, so only they are scored: under sampling a without-replacement sample of W tokens with
        their top-down truncated Gumbel scores (the best child scores the parent's score T, the next the
        Gumbel of the mass left truncated at the previous score; Kool et al. 2019, Alg. 1 with Appendix B),
        the same law as perturbing all V children; under greedy decoding the W most likely.  No pass over
        the vocabulary but one cumulative sum per draw (:func:`~speculant.sampling.gumbel.sample_without_replacement`).
        """
        b, f, v = q.shape
        if self._log_p.shape[0] != b:
            self._log_p = self._log_p.expand(b, -1)
            self._score = self._score.expand(b, -1)
        if greedy:
            top_q, tokens = torch.topk(q, min(self.beam_width, v), dim=-1)       # [B, F, K]
            log_p = self._log_p[:, :, None] + torch.log(top_q)
            score = log_p
        else:
            tokens, left = sample_without_replacement(q.reshape(b * f, v), self.beam_width, generator, pad=True)
            tokens, left = tokens.view(b, f, -1), left.view(b, f, -1)
            log_p = self._log_p[:, :, None] + torch.log(q.gather(2, tokens.clamp_min(0)))
            score = self._beam_scores(left, generator)
            log_p = torch.where(tokens >= 0, log_p, float("-inf"))
            score = torch.where(tokens >= 0, score, float("-inf"))
        k = tokens.shape[-1]
        flat = score.reshape(b, -1)
        w = min(self.beam_width, int(torch.isfinite(flat).sum(-1).min()))
        top = torch.topk(flat, w, dim=-1).indices                            # descending score
        order = torch.sort(top // k, dim=-1, stable=True).indices            # group by parent
        top = top.gather(1, order)
        self._log_p = log_p.reshape(b, -1).gather(1, top)
        self._score = flat.gather(1, top)
        return top // k, tokens.reshape(b, -1).gather(1, top)

    def _beam_scores(self, left: torch.Tensor, generator) -> torch.Tensor:
        """Perturbed scores ``[B, F, K]`` (float64) of each parent's children in sampling order, from the mass
        ``left`` before each draw: the first child scores the parent's score, child j the Gumbel at
        ``log p(parent) + log left_j`` truncated at child j-1's score (:func:`truncated_gumbel_below`)."""
        parent_log_p = self._log_p.double()
        scores = [self._score.double()]
        for j in range(1, left.shape[-1]):
            scores.append(truncated_gumbel_below(parent_log_p + torch.log(left[..., j]), scores[-1], generator))
        return torch.stack(scores, -1)

    def expand(self, depth, q, greedy, generator):
        parents, tokens = self.expand_batch(q[None], greedy, generator)
        kids: list[list[int]] = [[] for _ in range(q.shape[0])]
        for par, tok in zip(parents[0].tolist(), tokens[0].tolist()):
            kids[par].append(tok)
        return kids
