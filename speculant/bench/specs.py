"""``--methods`` syntax: which of our methods and transformers' baselines a benchmark runs.

Grammar: a comma-separated list; an item whose text before ``:`` is a method name starts a
method, the following ``KEY=VALUE`` items are its parameters::

    ar,early-exit:E=20,K=4,rsd-s:W=4,L=4,E=20,draft-model:E=12,K=4,hf-ar,hf-early-exit:E=20,hf-prompt-lookup:K=10

Ours (keys -> :class:`speculant.engine.methods.MethodSpec` fields):

=====================  ==========================================================
``E``                  exit_layer (``draft-model``: the truncated:E draft copy)
``K``                  num_speculations (int or ``auto``)
``draft``              draft_model for tree methods (``truncated:E``, name or path)
``N`` / ``n``          max_ngram / min_ngram (prompt-lookup)
``b``                  branching, ``x``-separated (``b=3x2x1`` = 3,2,1)
``W`` / ``L``          beam_width / draft_length (rsd-s)
``adapter``            exit_adapter (name or directory)
``head``               draft_head (name or directory)
``rt``                 the runtime the method runs in, when not the run's own (``--weights``): a weight
                       format ``fp32|bf16|int8|int4|w4a8``, with ``-eager`` for no torch.compile and ``-kv16``
                       for a float16 KV cache, e.g. ``ar:rt=fp32-eager``, ``ar:rt=w4a8-kv16`` (each distinct
                       runtime loads the model once more)
``head``               draft_head (name or directory): ``eagle`` and the tree methods draft with it
``spec``               speculation, ``cost`` or ``always`` (default: the run's ``--speculation``, ``cost``)
``verif``              verification under sampling: ``token`` (recursive rejection sampling, the default),
                       ``block`` (chains: Sun et al. 2025) or ``traversal`` (chains and RSD-C/SpecInfer trees:
                       Weng et al. 2025), :mod:`speculant.verification.sequence`; e.g. ``eagle:verif=block``
=====================  ==========================================================

Transformers (:mod:`speculant.bench.hf_baselines`): ``hf-ar``; ``hf-early-exit[:E=..,K=..]``
(``assistant_early_exit``; E defaults to ``early-exit``'s default, :func:`~speculant.engine.methods.default_exit_layer`); ``hf-prompt-lookup:K=..[,N=..]`` (``prompt_lookup_num_tokens``,
``max_matching_ngram_size``); ``hf-assistant:E=..[,K=..]`` (``assistant_model`` = truncated copy).

llama.cpp's ``llama-server`` (:mod:`speculant.bench.llamacpp`, needs the ``llamacpp`` extra), on the model's own
GGUF file: ``llamacpp``; ``llamacpp-lookup[:K=..,N=..]`` (its ``ngram-simple`` speculation: draft length K,
lookup n-gram size N).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.methods import METHODS, TREE_METHODS, MethodSpec
from ..engine.speculation import SPECULATION
from ..errors import SpeculantError
from ..runtime.formats import FORMATS
from ..verification.sequence import VERIFICATIONS

HF_METHODS = ("hf-ar", "hf-early-exit", "hf-prompt-lookup", "hf-assistant")
LLAMACPP_METHODS = ("llamacpp", "llamacpp-lookup")
ALL_METHODS = METHODS + HF_METHODS + LLAMACPP_METHODS

_OURS_KEYS = {"E": "exit_layer", "K": "num_speculations", "draft": "draft_model", "N": "max_ngram",
              "n": "min_ngram", "b": "branching", "W": "beam_width", "L": "draft_length", "adapter": "exit_adapter",
              "head": "draft_head", "spec": "speculation",
              "verif": "verification"}
_ALLOWED = {
    "ar": ("rt",), "early-exit": ("E", "K", "adapter", "rt", "spec", "verif"),
    "draft-model": ("E", "K", "draft", "rt", "spec", "verif"), "prompt-lookup": ("K", "N", "n", "rt", "spec", "verif"),
    "eagle": ("K", "head", "rt", "spec", "verif"), "eagle-lookup": ("K", "N", "n", "head", "rt", "spec", "verif"), "rsd-c": ("E", "b", "draft", "adapter", "head", "rt", "spec", "verif"),
    "specinfer": ("E", "b", "draft", "adapter", "head", "rt", "spec", "verif"),
    "rsd-s": ("E", "W", "L", "draft", "adapter", "head", "rt", "spec", "verif"),
    "hf-ar": (), "hf-early-exit": ("E", "K"), "hf-prompt-lookup": ("K", "N"), "hf-assistant": ("E", "K"),
    "llamacpp": (), "llamacpp-lookup": ("K", "N"),
}
_INT_KEYS = ("E", "N", "n", "W", "L")


@dataclass
class BenchMethod:
    """One method of a benchmark run.

    Attributes:
        label: the text given on the command line (``early-exit:E=20,K=4``), unique in a run.
        name: the method name (``early-exit``, ``hf-ar``...).
        params: parsed ``KEY=VALUE`` parameters (ints where the key takes an int).
        spec: the :class:`MethodSpec` for our methods, ``None`` for transformers'.
    """

    label: str
    name: str
    params: dict = field(default_factory=dict)
    spec: MethodSpec | None = None

    @property
    def is_hf(self) -> bool:
        return self.name in HF_METHODS

    @property
    def is_llamacpp(self) -> bool:
        return self.name in LLAMACPP_METHODS


RUNTIMES = tuple(f"{w}{suffix}{kv}" for w in FORMATS for suffix in ("", "-eager") for kv in ("", "-kv16"))
"""Values of the ``rt=`` key: another weight format (``-eager``: no torch.compile; ``-kv16``: a float16 KV cache)
than the run's."""


def runtime_of(method: "BenchMethod") -> tuple[str, bool, str | None] | None:
    """``(weights, compile, kv_cache)`` of a method's ``rt=`` key (``kv_cache``: ``"float16"``, or ``None`` for
    the run's own), or ``None`` (the run's own model)."""
    rt = method.params.get("rt")
    if rt is None:
        return None
    kv = "float16" if rt.endswith("-kv16") else None
    rt = rt.removesuffix("-kv16")
    return rt.removesuffix("-eager"), not rt.endswith("-eager"), kv


def _value(method: str, key: str, raw: str):
    if key in _INT_KEYS or (key == "K" and raw != "auto"):
        try:
            v = int(raw)
        except ValueError:
            raise SpeculantError(f"{method}: {key}={raw!r} is invalid; allowed: an integer"
                                 + (" or 'auto'" if key == "K" and method in METHODS else "")) from None
        if v < 1:
            raise SpeculantError(f"{method}: {key}={v} is out of range; allowed: >= 1")
        return v
    if key == "spec":
        if raw not in SPECULATION:
            raise SpeculantError(f"{method}: spec={raw!r} is unknown; allowed: {', '.join(SPECULATION)}")
        return raw
    if key == "verif":
        if raw not in VERIFICATIONS:
            raise SpeculantError(f"{method}: verif={raw!r} is unknown; allowed: {', '.join(VERIFICATIONS)}")
        return raw
    if key == "rt":
        if raw not in RUNTIMES:
            raise SpeculantError(f"{method}: rt={raw!r} is unknown; allowed: {', '.join(RUNTIMES)}")
        return raw
    if key == "K" and method not in METHODS:
        raise SpeculantError(f"{method}: K={raw!r} is invalid; allowed: an integer")
    return raw


def to_spec(name: str, params: dict, exit_adapter: str | None = None, speculation: str = "cost") -> MethodSpec:
    """The :class:`MethodSpec` of one of our methods; ``exit_adapter`` is used where the method drafts
    with early-exit layers and no ``adapter=`` was given, ``speculation`` where no ``spec=`` was."""
    kw = {_OURS_KEYS[k]: v for k, v in params.items() if k != "rt"}
    kw.setdefault("speculation", speculation)
    if name == "draft-model":
        e = kw.pop("exit_layer", None)
        if e is not None:
            if "draft_model" in kw:
                raise SpeculantError(f"draft-model: E={e} and draft={kw['draft_model']!r} conflict; give one of them")
            kw["draft_model"] = f"truncated:{e}"
        if "draft_model" not in kw:
            raise SpeculantError("draft-model needs E=<layers of the truncated copy> or draft=NAME|DIR|truncated:E")
    if "branching" in kw:
        kw["branching"] = ",".join(str(kw["branching"]).split("x"))
    uses_exit = name == "early-exit" or (name in TREE_METHODS and not kw.get("draft_model")
                                         and not kw.get("draft_head"))
    if uses_exit and exit_adapter and "exit_adapter" not in kw:
        kw["exit_adapter"] = exit_adapter
    return MethodSpec(method=name, **kw)


def parse_methods(text: str, exit_adapter: str | None = None, speculation: str = "cost") -> list[BenchMethod]:
    """Parse a ``--methods`` string (grammar in the module docstring); ``speculation``: our methods' default
    ``spec`` (``--speculation``).

    Raises:
        SpeculantError: unknown method or key (names the allowed ones), a bad value, a
            duplicate label, or an empty list.
    """
    items = [t.strip() for t in (text or "").split(",") if t.strip()]
    groups: list[list[str]] = []
    for item in items:
        head = item.split(":", 1)[0]
        if "=" not in head:
            if head not in ALL_METHODS:
                raise SpeculantError(f"method {head!r} is unknown; allowed: {', '.join(ALL_METHODS)}")
            groups.append([head] + ([item.split(":", 1)[1]] if ":" in item else []))
        else:
            if not groups:
                raise SpeculantError(f"--methods={text!r}: parameter {item!r} comes before any method")
            groups[-1].append(item)
    if not groups:
        raise SpeculantError("--methods is empty; allowed: a comma-separated list such as ar,early-exit:E=20,K=4,hf-ar")
    out, seen = [], set()
    for name, *kvs in groups:
        params = {}
        for kv in kvs:
            if "=" not in kv:
                raise SpeculantError(f"{name}: {kv!r} is not KEY=VALUE")
            k, v = kv.split("=", 1)
            if k not in _ALLOWED[name]:
                allowed = ", ".join(_ALLOWED[name]) or "none"
                raise SpeculantError(f"{name}: parameter {k!r} is unknown; allowed: {allowed}")
            params[k] = _value(name, k, v)
        label = name + (":" + ",".join(kvs) if kvs else "")
        if label in seen:
            raise SpeculantError(f"method {label!r} is given twice")
        seen.add(label)
        if name == "hf-assistant" and "E" not in params:
            raise SpeculantError(f"{name} needs E=<layers of the assistant copy>, e.g. {name}:E=12")
        spec = to_spec(name, params, exit_adapter, speculation) if name in METHODS else None
        out.append(BenchMethod(label, name, params, spec))
    return out
