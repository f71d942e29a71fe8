"""Drafting with an EAGLE-3 head (Li et al. 2025; chains, and the RSD-C / RSD-S / SpecInfer trees).

The indexing is EAGLE's (:mod:`speculant.drafters.eagle`): head entry ``i`` reads ``(g_i, x_{i+1})`` at head-cache
slot ``i``, and a drafted node reads its parent's prediction.  What differs: a committed entry's feature is the
target's three auxiliary hidden states at position ``i`` (the :class:`~speculant.drafters.eagle3_head.Eagle3Head`
fuses them with ``fc``), which the target hands over with every verification (:attr:`Drafter.feature_layers`: the
verification forward runs in segments that stop at those boundaries, in our fused C step as in the torch step), and
a drafted node's feature is the head's own pre-norm output (no ``fc``; EAGLE-3's recurrence).
"""

from __future__ import annotations

import torch

from .base import DecodingState, last_position_logits, run_with_features
from .eagle import DraftHeadDrafter, HeadState
from .eagle3_head import Eagle3Head


class Eagle3Drafter(DraftHeadDrafter):
    """Drafts with an :class:`~speculant.drafters.eagle3_head.Eagle3Head`; the target's verification also
    returns the head's auxiliary hidden states (:attr:`feature_layers`), so sequences batch as EAGLE's do."""

    name = "eagle3"

    def __init__(self, head: Eagle3Head):
        super().__init__(head)
        self.feature_layers = tuple(head.aux_layer_ids)

    def prefill(self, state: DecodingState[HeadState]) -> torch.Tensor:
        """Target forward over the prompt (in segments at the auxiliary boundaries); keeps the prompt's auxiliary
        hidden states ``[T, 3D]`` for the head.  Returns fp32 logits ``[1, V]`` of the last position."""
        target = state.target
        ids = torch.tensor([state.tokens], dtype=torch.long)
        positions = torch.arange(ids.shape[1])

        def run(hidden, start, end):
            return state.run_layers(hidden, start, end, positions, None, 0)

        h, aux = run_with_features(run, target.embed(ids), 0, target.num_layers, self.feature_layers)
        self.keep_prompt_features(state, torch.cat(aux, dim=-1)[0])
        return last_position_logits(target, h)

    def verification_hidden(self, state: DecodingState, tree, hidden: torch.Tensor,
                            aux: list[torch.Tensor] | None = None) -> None:
        state.drafter_state.block_features = torch.cat(aux, dim=-1)


def head_drafter(name: str, model, prompts=None) -> DraftHeadDrafter:
    """The drafter of draft head ``name`` (a shipped name or a directory) for ``model``: an EAGLE-3 head
    (``config.json`` architecture ``LlamaForCausalLMEagle3``) or our EAGLE-1/2-style head, loaded in the drafter
    format tuned for it on this machine (the tune step runs once per machine and head shape; ``prompts()``: token
    ids of fixed prompts that step may generate from, :func:`~speculant.drafters.weights.tune_head_lm_rows`).

    Raises:
        SpeculantError: unknown name, or a head that does not fit ``model`` (see the loaders).
    """
    from .artifacts import resolve_dir
    from .draft_head import KIND, load_head
    from .eagle3_head import is_eagle3_dir, load_eagle3
    from .weights import tune_drafter, tune_head_lm_rows, tune_head_route
    path = resolve_dir(KIND, "draft head", str(name), model.name)
    if is_eagle3_dir(path):
        head = load_eagle3(path, model)
        tune_drafter(model, "eagle3-head", head)
        return Eagle3Drafter(head)
    head = load_head(path, model)
    tune_drafter(model, "draft-head", head)
    tune_head_route(model, head)             # one C call or the torch modules, as measured here
    tune_head_lm_rows(model, head, prompts)  # the target's LM-head rows or 4-bit ones, as measured here
    drafter = DraftHeadDrafter(head)
    drafter.catchup_seconds = catchup_seconds(model, head, str(name))
    return drafter


def catchup_seconds(model, head, name: str) -> float:
    """The head's catch-up seconds per entry (:func:`~speculant.drafters.eagle.measure_catchup_seconds`), measured
    once per machine, model and head and kept in the model's tune (``draft_ms``, in ms); 0 without a tune (no
    cost-aware rounds)."""
    from .eagle import measure_catchup_seconds
    tune = getattr(model, "tune", None)
    if tune is None:
        return 0.0
    key = f"catch-up,draft_head={name}"
    if key not in tune.draft_ms:
        seconds = measure_catchup_seconds(head, model.config.hidden_size, model.config.vocab_size)
        tune.draft_ms[key] = round(seconds * 1e3, 6)
        from ..runtime import tune as tune_module
        tune_module.save(tune)
    return tune.draft_ms[key] / 1e3
