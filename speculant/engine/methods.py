"""Method names -> (drafter, tree builder): what ``--method`` selects."""

from __future__ import annotations

from dataclasses import dataclass

from ..drafters.base import Drafter
from ..drafters.draft_head import default_head_for, load_head
from ..drafters.draft_model import DraftModelDrafter, check_vocab_compatible, truncated_copy
from ..drafters.eagle import DraftHeadDrafter
from ..drafters.early_exit import EarlyExitDrafter
from ..drafters.exit_adapter import default_adapter_for, load_exit_adapter
from ..drafters.prompt_lookup import PromptLookupDrafter
from ..errors import SpeculantError, check_range
from ..models.loading import LoadedModel, load_model
from ..trees.builders import (ChainBuilder, ConstantBranchingBuilder, IIDTreeBuilder, StochasticBeamBuilder,
                              TreeBuilder)
from .generator import SpeculativeGenerator

METHODS = ("ar", "early-exit", "draft-model", "prompt-lookup", "eagle", "rsd-c", "rsd-s", "specinfer")
TREE_METHODS = ("rsd-c", "rsd-s", "specinfer")
HEAD_METHODS = ("eagle",) + TREE_METHODS          # methods that can draft with a draft head


@dataclass
class MethodSpec:
    """Parameters of a decoding method (CLI flags map 1:1 onto these fields).

    ``drafter`` picks what drafts for chain/tree methods: ``early-exit`` (layers < exit_layer
    of the target) or ``draft-model`` (``draft_model``: a known name, a path, or ``truncated:E``).
    ``exit_adapter``: a trained exit head (name or directory); with ``method="early-exit"`` and
    ``None``, a shipped ``default`` adapter for the model is used when its exit layer fits
    ``exit_layer`` (or ``exit_layer`` is ``None``); ``"none"`` turns that off.
    ``draft_head``: a trained feature-level draft head (name or directory) that drafts for ``eagle``
    (default: the model's shipped ``default`` head) and, when given, for the tree methods.
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
    draft_head: str | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise SpeculantError(f"method={self.method!r} is unknown; allowed: {', '.join(METHODS)}")
        self._check_drafter_flags()
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


    def _check_drafter_flags(self) -> None:
        """One drafter per method: reject flags that pick another one (one-line errors)."""
        head = self.draft_head is not None or self.method == "eagle"
        if self.draft_head is not None and self.method not in HEAD_METHODS:
            raise SpeculantError(f"--draft-head={self.draft_head!r} does not apply to method {self.method!r}; "
                                 f"allowed with: {', '.join(HEAD_METHODS)}")
        if not head:
            return
        what = "--draft-head" if self.draft_head is not None else "method 'eagle'"
        for flag, value in (("--draft-model", self.draft_model), ("--exit-layer", self.exit_layer),
                            ("--exit-adapter", self.exit_adapter)):
            if value is not None:
                raise SpeculantError(f"{flag}={value!r} conflicts with {what} (the draft head drafts); "
                                     f"allowed: one drafter, drop {flag}")


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
    if spec.method == "eagle" or spec.draft_head is not None:
        name = spec.draft_head or default_head_for(model.name)
        if name is None:
            raise SpeculantError(f"no draft head ships for model {model.name!r}; allowed: --draft-head DIR "
                                 "(train one with `speculant train --recipe draft-head`)")
        return DraftHeadDrafter(load_head(name, model))
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
        adapter = default_adapter_for(model.name, exit_layer)
    if adapter and adapter != "none":
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
