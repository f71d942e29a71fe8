"""Method names -> (drafter, tree builder): what ``--method`` selects."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..drafters.base import Drafter
from ..drafters.draft_head import default_head_for
from ..drafters.draft_model import DraftModelDrafter, check_vocab_compatible, truncated_copy
from ..drafters.eagle3 import head_drafter
from ..drafters.early_exit import EarlyExitDrafter
from ..drafters.exit_adapter import default_adapter_exit_layer, default_adapter_for, load_exit_adapter
from ..drafters.lookup_head import with_lookup
from ..drafters.prompt_lookup import PromptLookupDrafter
from ..drafters.weights import tune_drafter
from ..errors import SpeculantError, check_range
from ..models.loading import LoadedModel, read_checkpoint
from ..runtime.executor import executor_of
from ..trees.builders import (ChainBuilder, ConstantBranchingBuilder, IIDTreeBuilder, StochasticBeamBuilder,
                              TreeBuilder)
from ..verification.sequence import check_verification
from .generator import SpeculativeGenerator
from .goodput import CostTable
from .names import METHODS, TREE_METHODS
from .speculation import acceptance_prior, check_speculation, cost_table



_USES = {
    "ar": (),
    "early-exit": ("exit_layer", "exit_adapter", "num_speculations"),
    "draft-model": ("draft_model", "num_speculations"),
    "prompt-lookup": ("num_speculations", "max_ngram", "min_ngram"),
    "eagle": ("draft_head", "num_speculations"),
    "eagle-lookup": ("draft_head", "num_speculations", "max_ngram", "min_ngram"),
    "rsd-c": ("exit_layer", "exit_adapter", "draft_model", "draft_head", "branching"),
    "specinfer": ("exit_layer", "exit_adapter", "draft_model", "draft_head", "branching"),
    "rsd-s": ("exit_layer", "exit_adapter", "draft_model", "draft_head", "beam_width", "draft_length"),
}
"""The :class:`MethodSpec` parameters each method reads."""
_DEFAULTS = {"num_speculations": 4, "max_ngram": 3, "min_ngram": 1, "branching": "2,2,2", "beam_width": 4,
             "draft_length": 4}
_METHOD_DEFAULTS = {"eagle-lookup": {"min_ngram": 2}}
"""Defaults of one method that differ from :data:`_DEFAULTS` (``eagle-lookup``: a 1-token match leaves the round to
the head)."""
_COST_DEFAULTS = {"prompt-lookup": {"num_speculations": 8, "max_ngram": 5},
                  "eagle-lookup": {"num_speculations": 8, "max_ngram": 5}}
"""Defaults of one method under ``speculation="cost"`` that differ from :data:`_DEFAULTS`: prompt lookup's cost-aware
rounds keep the acceptance per matched n-gram size, so long matches draft deep and short ones little
(BENCHMARKS.md AW); rounds that always draft (the server's batches) keep the shorter defaults."""


def drafts_with_exit_layers(method: str, draft_model: str | None = None, draft_head: str | None = None) -> bool:
    """True when ``method`` drafts with the target's first layers (early exit), not a separate model or head."""
    return method == "early-exit" or (method in TREE_METHODS and not draft_model and not draft_head)


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

    ``None`` means "not given": a parameter the method reads then takes its default
    (num_speculations 4, max_ngram 3 (prompt lookup under ``speculation="cost"``: 8 and 5), min_ngram 1, branching
    "2,2,2", beam_width 4, draft_length 4;
    exit_layer: see :func:`default_exit_layer`).  A parameter given to a method that does not read it
    is refused, never silently ignored, and so are ``exit_layer``/``exit_adapter`` together with
    ``draft_model`` (the draft model replaces early-exit drafting).  ``num_speculations="auto"`` is the
    adaptive chain length (early-exit and draft-model drafting).  ``speculation``: ``cost`` (each round drafts the
    depth, zero included, that maximizes expected tokens per second, :mod:`speculant.engine.speculation`) or
    ``always`` (every round drafts as deep as the method's parameters say).

    Raises:
        SpeculantError: unknown method, a parameter the method does not use, conflicting parameters,
            or a bad value (the message names it and what is allowed).
    """

    method: str = "ar"
    exit_layer: int | None = None
    num_speculations: int | str | None = None     # int, or "auto" (adaptive chain length)
    draft_model: str | None = None
    max_ngram: int | None = None
    min_ngram: int | None = None
    branching: str | list[int] | None = None
    beam_width: int | None = None
    draft_length: int | None = None
    exit_adapter: str | None = None
    draft_head: str | None = None
    verification: str = "token"
    speculation: str = "cost"

    def __post_init__(self):
        check_speculation(self.speculation)
        check_verification(self.verification, self.method, TREE_METHODS, ("rsd-s",))
        if self.method not in METHODS:
            raise SpeculantError(f"method={self.method!r} is unknown; allowed: {', '.join(METHODS)}")
        if self.draft_model and self.draft_head:
            raise SpeculantError(f"draft_head={self.draft_head!r} conflicts with draft_model={self.draft_model!r}; "
                                 "give one drafter")
        if self.draft_model or self.draft_head:
            drafter = f"draft_model={self.draft_model!r}" if self.draft_model else f"draft_head={self.draft_head!r}"
            for name in ("exit_layer", "exit_adapter"):
                value = getattr(self, name)
                if value is not None and value != "none":
                    raise SpeculantError(f"{name}={value!r} conflicts with {drafter}: it drafts instead of the "
                                         "early-exit layers; give one of them")
        uses = _USES[self.method]
        for name in ("exit_layer", "exit_adapter", "draft_model", "draft_head", *_DEFAULTS):
            value = getattr(self, name)
            if value is None or name in uses or (name == "exit_adapter" and value == "none"):
                continue
            users = ", ".join(m for m, u in _USES.items() if name in u)
            raise SpeculantError(f"{name}={value!r} is not used by method={self.method!r}; it applies to: {users}")
        for name in uses:
            if name in _DEFAULTS and getattr(self, name) is None:
                own = dict(_METHOD_DEFAULTS.get(self.method, {}))
                own.update(_COST_DEFAULTS.get(self.method, {}) if self.speculation == "cost" else {})
                setattr(self, name, own.get(name, _DEFAULTS[name]))
        k = self.num_speculations
        if k is not None and k != "auto":
            if isinstance(k, str) and k.strip().isdigit():
                k = int(k)
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise SpeculantError(f"num_speculations={self.num_speculations!r} is invalid; "
                                     "allowed: an integer >= 1 or 'auto'")
            self.num_speculations = k
        if k == "auto" and self.method == "prompt-lookup":
            raise SpeculantError("num_speculations='auto' is not supported by method='prompt-lookup' (an n-gram "
                                 "draft has no confidence to adapt on); allowed: an integer >= 1")
        for name in ("beam_width", "draft_length", "max_ngram", "min_ngram"):
            if getattr(self, name) is not None:
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


def default_exit_layer(model: LoadedModel) -> int:
    """Exit layer E when none is given: that of the model's shipped ``default`` exit adapter, else
    ``min(DEFAULT_EXIT_LAYER, L // 2)``.  ``early-exit`` and ``hf-early-exit`` both use it."""
    e = default_adapter_exit_layer(model.name)
    return e if e is not None else min(DEFAULT_EXIT_LAYER, model.decoder.num_layers // 2)


def draft_head_name(method: str, draft_head: str | None, model_name: str) -> str | None:
    """The draft head ``method`` drafts with for ``model_name`` (its name as loaded: a known model's own file by path
    has the known name): ``draft_head`` if given, else the shipped ``default`` for the methods that need a head
    (``eagle``, ``eagle-lookup``); ``None`` for the others without one.  Known before the model loads.

    Raises:
        SpeculantError: the method needs a head and none ships for the model.
    """
    if draft_head is not None or method not in ("eagle", "eagle-lookup"):
        return draft_head
    name = default_head_for(model_name)
    if name is None:
        raise SpeculantError(f"no draft head ships for model {model_name!r}; allowed: --draft-head DIR "
                             "(train one with `speculant train --recipe draft-head`)")
    return name


def fixed_prompts(model: LoadedModel) -> list[list[int]]:
    """Token ids of the acceptance prior's fixed prompts (:data:`~speculant.engine.speculation.PRIOR_PROMPTS`, chat
    template): what a drafter's tune step may generate from; none for a model without a tokenizer."""
    from .prompts import encode_prompt
    from .speculation import PRIOR_PROMPTS
    if getattr(model, "tokenizer", None) is None:
        return []
    return [encode_prompt(model.tokenizer, prompt) for prompt in PRIOR_PROMPTS]


def _drafter(spec: MethodSpec, model: LoadedModel) -> Drafter | None:
    target = executor_of(model)
    if spec.method == "ar":
        return None
    if spec.method == "prompt-lookup":
        return PromptLookupDrafter(spec.max_ngram, spec.min_ngram)
    if spec.method in ("eagle", "eagle-lookup") or spec.draft_head is not None:
        name = draft_head_name(spec.method, spec.draft_head, model.name)
        drafter = head_drafter(name, model, lambda: fixed_prompts(model))   # EAGLE-3 or ours, in its tuned format
        if spec.method == "eagle-lookup":
            drafter = with_lookup(drafter, spec.max_ngram, spec.min_ngram)
        return drafter
    if not drafts_with_exit_layers(spec.method, spec.draft_model):
        name = spec.draft_model
        if not name:
            raise SpeculantError("--method draft-model needs --draft-model NAME_OR_PATH or truncated:E")
        if name.startswith("truncated:"):
            try:
                e = int(name.split(":", 1)[1])
            except ValueError:
                raise SpeculantError(f"draft_model={name!r} is invalid; allowed: truncated:E with an integer E") from None
            return DraftModelDrafter(target.like(truncated_copy(target.decoder, e)))
        draft = read_checkpoint(name, dtype=target.dtype)
        check_vocab_compatible(model.tokenizer, draft.tokenizer, target, draft.decoder)
        return DraftModelDrafter(executor_of(draft))
    exit_layer, head, adapter = spec.exit_layer, None, spec.exit_adapter
    if adapter is None:              # early-exit drafting (chain or tree): a shipped default adapter, if it fits
        adapter = default_adapter_for(model.name, exit_layer)
    if adapter and adapter != "none":
        head, exit_layer = load_exit_adapter(adapter, model, exit_layer)
        tune_drafter(model, "exit-adapter", head.adapter)   # the tune step, once per machine and adapter shape
    if exit_layer is None:
        exit_layer = default_exit_layer(model)
    return EarlyExitDrafter(target.num_layers, exit_layer, head)


def drafter_signature(spec: MethodSpec) -> str:
    """What identifies a drafter's cost per draft call on one model: its method and drafting parameters (the
    key of its measured cost in the tune, :func:`speculant.engine.speculation.draft_seconds`)."""
    fields = ("exit_layer", "exit_adapter", "draft_model", "draft_head", "max_ngram", "min_ngram")
    return spec.method + "".join(f",{f}={getattr(spec, f)}" for f in fields if getattr(spec, f) is not None)


def lookup_costs(model: LoadedModel, spec: MethodSpec):
    """``seconds(sampled)``: the measured ``(first, further)`` seconds of prompt-lookup draft calls with ``spec``'s
    n-gram sizes and length on ``model`` (greedy, or sampled), kept in the tune as prompt lookup's own
    (:func:`speculant.engine.speculation.draft_seconds`): what an ``eagle-lookup`` round that copies pays."""
    from .speculation import draft_seconds
    lookup = MethodSpec(method="prompt-lookup", num_speculations=spec.num_speculations, max_ngram=spec.max_ngram,
                        min_ngram=spec.min_ngram)
    drafter, builder = _drafter(lookup, model), _builder(lookup)

    def seconds(sampled: bool) -> float:
        return draft_seconds(model, drafter, builder, drafter_signature(lookup), sampled)
    return seconds


def build_generator(model: LoadedModel, spec: MethodSpec | None = None, costs: CostTable | None = None,
                    round_timing: bool = False, **kwargs) -> SpeculativeGenerator:
    """A :class:`SpeculativeGenerator` for ``spec`` (or ``MethodSpec(**kwargs)``).  Under ``speculation="cost"``
    its rounds are sized by ``costs``, by default the model's measured ones
    (:func:`speculant.engine.speculation.cost_table`, greedy and, measured at the first sampled generation, sampled;
    a model without a tune drafts every round).  ``round_timing``: greedy rounds also corrected by what they took
    (:class:`~speculant.engine.speculation.RoundTiming`; off by default: measured end to end it cut `eagle`'s
    drafting and its speed, 1.07x `ar` -> 1.02 over four alternated pairs, and moved the others within the noise,
    BENCHMARKS.md BM).

    Raises:
        SpeculantError: unknown method or bad parameters (the message names the value).
    """
    spec = spec or MethodSpec(**kwargs)
    layers = model.decoder.num_layers
    e = spec.exit_layer
    if e is not None and (isinstance(e, bool) or not isinstance(e, int) or not 1 <= e < layers):
        raise SpeculantError(f"exit_layer={spec.exit_layer} is out of range; allowed: 1..{layers - 1}")
    drafter, builder = _drafter(spec, model), _builder(spec)
    sampled_costs, prior = costs, None
    if spec.speculation != "cost":
        costs = sampled_costs = None
    elif costs is None:
        head, signature, lookup = drafter, drafter_signature(spec), None
        if spec.method == "eagle-lookup":
            # the head's rounds cost what the head's draft calls cost (the plain head drafter's figures, shared with
            # eagle: a calibration of the mixed drafter times mostly copies), copying rounds prompt lookup's
            head, lookup = drafter.head_drafter, lookup_costs(model, spec)
            signature = drafter_signature(replace(spec, method="eagle", max_ngram=None, min_ngram=None))
        signature += getattr(head, "cost_signature", "")     # the tune's choices that change a call's cost
        costs = cost_table(model, head, builder, signature)
        if costs is not None:
            if lookup is not None:
                drafter.lookup_seconds = {True: lookup(False), False: (0.0, 0.0)}

            def sampled_costs():
                if lookup is not None:
                    drafter.lookup_seconds[False] = lookup(True)
                return cost_table(model, head, builder, signature, sampled=True)

            def prior(sampled: bool):
                return acceptance_prior(model, drafter, builder, drafter_signature(spec), sampled,
                                        spec.verification)
    return SpeculativeGenerator(model, drafter, builder, verification=spec.verification, costs=costs,
                                sampled_costs=sampled_costs, acceptance_prior=prior,
                                round_timing=round_timing and costs is not None)
