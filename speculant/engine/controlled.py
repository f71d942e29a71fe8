"""Acceptance and token choice when context-dependent controls are on (:mod:`speculant.sampling.controls`).

Every block entry's row is processed for its own prefix: entry 0 (the root) for the committed tokens,
entry ``i + 1`` (drafted node ``i``) for the committed tokens and the drafted tokens on the path to node
``i``.  Rows are processed lazily, only for the entries the acceptance rule visits (the root and each
accepted node), so the cost is one processed row per emitted token, as in ``ar``.
"""

from __future__ import annotations

import torch

from ..sampling.controls import SequenceControls
from ..sampling.argmax import first_argmax
from ..sampling.processors import SamplingConfig, logits_to_probs, sample_categorical
from ..trees.tree import DraftTree
from ..verification.rules import greedy_accept
from ..verification.sequence import sampling_accept


def entry_path(tree: DraftTree, entry: int) -> tuple[int, ...]:
    """The drafted tokens between the committed prefix and block entry ``entry`` (``()`` for the root)."""
    return () if entry == 0 else tuple(tree.tokens[i] for i in tree.path_to(entry - 1))


def node_paths(tree: DraftTree, nodes: list[int]) -> list[tuple[int, ...]]:
    """:func:`entry_path` of each node (``-1`` = the root): the prefix a drafted node's children extend."""
    return [entry_path(tree, node + 1) for node in nodes]


def processed_row(controls: SequenceControls, logits: torch.Tensor, path: tuple[int, ...]) -> torch.Tensor:
    """Processed logits ``[V]`` of one raw row ``[V]`` for the prefix committed tokens + ``path``."""
    return controls.process(logits.reshape(1, -1), [path])[0]


def controlled_pick(controls: SequenceControls, logits: torch.Tensor, sampling: SamplingConfig,
                    generator: torch.Generator | None) -> int:
    """The target's token after the committed tokens from raw logits ``[V]``: argmax of the processed
    logits under greedy decoding, else one draw from the processed distribution."""
    row = processed_row(controls, logits, ())
    if sampling.greedy:
        return first_argmax(row)
    return int(sample_categorical(logits_to_probs(row, sampling), generator)[0])


class _LazyArgmax:
    """``target_argmax[entry]`` for :func:`greedy_accept`, computed on first use from the processed row."""

    def __init__(self, controls: SequenceControls, tree: DraftTree, logits: torch.Tensor):
        self.controls, self.tree, self.logits = controls, tree, logits

    def __getitem__(self, entry: int) -> int:
        return first_argmax(processed_row(self.controls, self.logits[entry], entry_path(self.tree, entry)))


def controlled_accept(controls: SequenceControls, tree: DraftTree, logits: torch.Tensor, sampling: SamplingConfig,
                      generator: torch.Generator | None, without_replacement: bool,
                      verification: str = "token") -> tuple[list[int], int]:
    """``(accepted node indices, emitted token)`` against the target's raw logits ``[N + 1, V]``, each row
    processed for its own prefix; the same rules as without controls (greedy match; under sampling
    ``verification``: recursive rejection sampling, block or traversal verification,
    :func:`speculant.verification.sequence.sampling_accept`)."""
    if sampling.greedy:
        return greedy_accept(tree, _LazyArgmax(controls, tree, logits))

    def p_row(entry: int) -> torch.Tensor:
        return logits_to_probs(processed_row(controls, logits[entry], entry_path(tree, entry)), sampling)

    return sampling_accept(tree, p_row, generator, without_replacement, verification)


def block_rows(logits: torch.Tensor, path: list[int], block: list[int]) -> list[torch.Tensor]:
    """The raw rows ``[V]`` the tokens of ``block`` were chosen at: entry 0, then each accepted node's entry."""
    entries = [0] + [i + 1 for i in path]
    return [logits[entries[j]] for j in range(len(block))]
