"""Method names -> (drafter, tree builder): what ``--method`` selects."""

from __future__ import annotations

from dataclasses import dataclass

from ..drafters.base import Drafter
from ..drafters.draft_model import DraftModelDrafter, check_vocab_compatible, truncated_copy
from ..drafters.early_exit import EarlyExitDrafter
from ..drafters.prompt_lookup import PromptLookupDrafter
from ..errors import SpeculantError, check_range
from ..models.loading import LoadedModel, load_model
from ..trees.builders import (ChainBuilder, ConstantBranchingBuilder, IIDTreeBuilder, StochasticBeamBuilder,
                              TreeBuilder)
from .generator import SpeculativeGenerator

METHODS = ("ar", "early-exit", "draft-model", "prompt-lookup", "rsd-c", "rsd-s", "specinfer")
TREE_METHODS = ("rsd-c", "rsd-s", "specinfer")


@dataclass
class MethodSpec:
    """Parameters of a decoding method (CLI flags map 1:1 onto these fields).

    ``drafter`` picks what drafts for chain/tree methods: ``early-exit`` (layers < exit_layer
    of the target) or ``draft-model`` (``draft_model``: a known name, a path, or ``truncated:E``).
    ``exit_adapter``: a trained exit head (name or directory); with ``method="early-exit"`` and
    ``None``, a shipped ``default`` adapter for the model is used when its exit layer fits
    ``exit_layer`` (or ``exit_layer`` is ``None``); ``"none"`` turns that off.
    """

    method: str = "ar"
    exit_layer: int | None = None
    num_speculations: int | str = 4         # int, or "auto" (adaptive chain length)
    draft_model: str | None = None
    max_ngram: int = 3
    min_ngram: int = 1
    branching: str | list[int] = "2,2,2"
    beam_width: int = 4
    draft_length: int = 4
    exit_adapter: str | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise SpeculantError(f"method={self.method!r} is unknown; allowed: {', '.join(METHODS)}")
        # Checked for every method, so a bad value is never silently ignored (e.g. with method="ar").
        k = self.num_speculations
        if k != "auto":
            if isinstance(k, str) and k.strip().isdigit():
                k = int(k)
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise SpeculantError(f"num_speculations={self.num_speculations!r} is invalid; "
                                     "allowed: an integer >= 1 or 'auto'")
            self.num_speculations = k
        for name in ("beam_width", "draft_length", "max_ngram", "min_ngram"):
            check_range(name, getattr(self, name), 1)


def _builder(spec: MethodSpec) -> TreeBuilder | None:
    if spec.method == "ar":
        return None
    if spec.method == "rsd-c":
        return ConstantBranchingBuilder(spec.branching)
    if spec.method == "specinfer":
        return IIDTreeBuilder(spec.branching)
    if spec.method == "rsd-s":
        return StochasticBeamBuilder(spec.beam_width, spec.draft_length)
    k = spec.num_speculations             # an int >= 1 or "auto" (MethodSpec checked it)
    return ChainBuilder(8, adaptive=True) if k == "auto" else ChainBuilder(k)


DEFAULT_EXIT_LAYER = 8   # used when no exit layer is given (capped at half the layers)


def _drafter(spec: MethodSpec, model: LoadedModel) -> Drafter | None:
    target = model.decoder
    if spec.method == "ar":
        return None
    if spec.method == "prompt-lookup":
        return PromptLookupDrafter(spec.max_ngram, spec.min_ngram)
    use_model = spec.method == "draft-model" or (spec.method in TREE_METHODS and spec.draft_model)
    if use_model:
        name = spec.draft_model
        if not name:
            raise SpeculantError("--method draft-model needs --draft-model NAME_OR_PATH or truncated:E")
        if name.startswith("truncated:"):
            try:
                e = int(name.split(":", 1)[1])
            except ValueError:
                raise SpeculantError(f"draft_model={name!r} is invalid; allowed: truncated:E with an integer E") from None
            return DraftModelDrafter(truncated_copy(target, e))
        draft = load_model(name, dtype=target.dtype)
        check_vocab_compatible(model.tokenizer, draft.tokenizer, target, draft.decoder)
        return DraftModelDrafter(draft.decoder)
    exit_layer, head, adapter = spec.exit_layer, None, spec.exit_adapter
    if adapter is None:              # early-exit drafting (chain or tree): a shipped default adapter, if it fits
        from ..training.adapter import default_adapter_for
        adapter = default_adapter_for(model.name, exit_layer)
    if adapter and adapter != "none":
        from ..training.adapter import load_exit_adapter
        head, exit_layer = load_exit_adapter(adapter, model, exit_layer)
    if exit_layer is None:
        exit_layer = min(DEFAULT_EXIT_LAYER, target.num_layers // 2)
    return EarlyExitDrafter(target.num_layers, exit_layer, head)


def build_generator(model: LoadedModel, spec: MethodSpec | None = None, **kwargs) -> SpeculativeGenerator:
    """A :class:`SpeculativeGenerator` for ``spec`` (or ``MethodSpec(**kwargs)``).

    Raises:
        SpeculantError: unknown method or bad parameters (the message names the value).
    """
    spec = spec or MethodSpec(**kwargs)
    layers = model.decoder.num_layers
    e = spec.exit_layer
    if e is not None and (isinstance(e, bool) or not isinstance(e, int) or not 1 <= e < layers):
        raise SpeculantError(f"exit_layer={spec.exit_layer} is out of range; allowed: 1..{layers - 1}")
    return SpeculativeGenerator(model, _drafter(spec, model), _builder(spec))
