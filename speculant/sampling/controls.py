"""Per-position logits processing that depends on the tokens before the position: logit bias, penalties,
``min_tokens`` and a grammar, for one generation.

Under speculation a verified block holds several positions, and a tree several prefixes per depth: each
row (and each drafted node's draft distribution) is processed for *its own* prefix, the committed tokens
followed by the drafted tokens on its path.  :meth:`SequenceControls.process` takes those paths explicitly,
so the processed distribution at a position is the one ``ar`` uses there, and the acceptance rules
(:mod:`speculant.verification.rules`) stay exact with respect to it.
"""

from __future__ import annotations

import torch

from .grammar import GrammarMatcher
from .logprobs import TokenLogprob, token_logprob
from .penalties import apply_penalties, bias_vector
from .processors import SamplingConfig


class SequenceControls:
    """The context-dependent processing of one generation.

    Args:
        sampling: its sampling settings (penalties, logit bias).
        vocab_size: the model's vocabulary [tokens].
        prompt_ids: the prompt (the repetition penalty counts it; frequency and presence count only generated tokens).
        matcher: the grammar's matcher (``None`` = unconstrained).
        min_tokens: stop tokens are masked until this many tokens were generated [tokens].
        stop_ids: the tokens ``min_tokens`` masks (the EOS tokens and ``stop_token_ids``).
        logprobs: record each emitted token's log-probability and this many alternatives
            (:mod:`speculant.sampling.logprobs`; ``None`` = off).
    Attributes:
        generated: tokens committed after the prompt [tokens].
        logprobs: the :class:`TokenLogprob` of every emitted token, in order (when ``logprobs`` is set).
    """

    def __init__(self, sampling: SamplingConfig, vocab_size: int, prompt_ids: list[int],
                 matcher: GrammarMatcher | None = None, min_tokens: int = 0, stop_ids=(), logprobs: int | None = None):
        self.sampling, self.vocab_size = sampling, vocab_size
        self.logprobs_k = logprobs
        self.logprobs: list[TokenLogprob] = []
        self.matcher, self.min_tokens = matcher, min_tokens
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long)
        self.bias = bias_vector(sampling.logit_bias, vocab_size)
        self.counts = torch.zeros(vocab_size)
        self.in_context = torch.zeros(vocab_size, dtype=torch.bool)
        self.in_context[torch.tensor(prompt_ids, dtype=torch.long)] = True
        self.generated = 0
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def active(self) -> bool:
        """True when any processing here changes logits."""
        return self.sampling.penalized or self.matcher is not None or self.min_tokens > 0

    def fork(self) -> "SequenceControls":
        """An independent copy at the same state (for ``n`` samples sharing a prompt)."""
        new = object.__new__(SequenceControls)
        new.__dict__.update(self.__dict__)
        new.counts, new.in_context, new._masks = self.counts.clone(), self.in_context.clone(), {}
        new.logprobs = list(self.logprobs)
        new.matcher = self.matcher.fork() if self.matcher is not None else None
        return new

    def commit(self, tokens: list[int], rows: list[torch.Tensor] | None = None) -> None:
        """Emitted ``tokens`` join the prefix (counts, the grammar's committed state).

        Args:
            rows: the raw target logits ``[V]`` each token was drawn at (for the log-probabilities).
        """
        if not tokens:
            return
        if self.logprobs_k is not None:
            self.logprobs.extend(token_logprob(row, tok, self.logprobs_k) for row, tok in zip(rows, tokens))
        ids = torch.tensor(tokens, dtype=torch.long)
        self.counts.index_add_(0, ids, torch.ones(len(tokens)))
        self.in_context[ids] = True
        self.generated += len(tokens)
        if self.matcher is not None:
            self.matcher.accept(tokens)
        self._masks.clear()

    def allowed(self, path: tuple[int, ...]) -> torch.Tensor | None:
        """Bool ``[V]`` of the tokens the grammar and ``min_tokens`` allow after the committed tokens and
        ``path`` (``None``: all); cached until the next :meth:`commit`."""
        path = tuple(path)
        if path in self._masks:
            return self._masks[path]
        mask = self.matcher.allowed(path) if self.matcher is not None else None
        if self.generated + len(path) < self.min_tokens and len(self.stop_ids):
            mask = torch.ones(self.vocab_size, dtype=torch.bool) if mask is None else mask.clone()
            mask[self.stop_ids] = False
        self._masks[path] = mask
        return mask

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` (a drafted chain after the committed tokens) are allowed, each after
        the ones before it."""
        n = len(tokens)
        if self.matcher is not None:
            n = self.matcher.valid_prefix(tokens)
        if len(self.stop_ids) and self.generated < self.min_tokens:
            stops = set(self.stop_ids.tolist())
            n = next((i for i, t in enumerate(tokens[:n]) if t in stops and self.generated + i < self.min_tokens), n)
        return n

    def process(self, logits: torch.Tensor, paths: list[tuple[int, ...]]) -> torch.Tensor:
        """Processed logits ``[R, V]`` (fp32): row r for the prefix committed tokens + ``paths[r]``.

        Args:
            logits: ``[R, V]`` raw logits (target or draft).
            paths: ``R`` token tuples, the drafted tokens between the committed prefix and the row's position.
        Forbidden tokens get ``-inf``.  Elementwise per row: a row's result does not depend on the other rows.
        """
        r = logits.shape[0]
        out = logits.float()
        if self.sampling.penalized:
            counts = self.counts.expand(r, -1).clone()
            in_context = self.in_context.expand(r, -1).clone()
            for i, path in enumerate(paths):
                if path:
                    ids = torch.tensor(path, dtype=torch.long)
                    counts[i].index_add_(0, ids, torch.ones(len(path)))
                    in_context[i, ids] = True
            out = apply_penalties(out, counts, in_context, self.sampling, self.bias)
        masks = [self.allowed(path) for path in paths]
        if any(m is not None for m in masks):
            out = out.clone() if out is logits else out
            for i, m in enumerate(masks):
                if m is not None:
                    out[i].masked_fill_(~m, float("-inf"))
        return out
