"""EAGLE-3 draft head: the module, its on-disk layout (the one vLLM and SGLang load) and its loading.

Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test",
Sec. 3.  The head reads three of the target's hidden states at position ``i`` (a low, a middle and a high layer:
the *auxiliary* hidden states, ids recorded in the config) and the embedding of ``x_{i+1}``::

    g_i   = fc([a_low; a_mid; a_high])                         fc: Linear(3D -> D), no bias
    u     = [input_layernorm(embed(x_{i+1})); hidden_norm(g_i)]  2D wide: the attention's only input
    h     = g_i + o_proj(Attention(u))                         residual: the fused feature g_i
    p_i   = h + MLP(post_attention_layernorm(h))               the head's pre-norm output
    draft logits for x_{i+2} = lm_head(norm(p_i))              lm_head: the head's own ``[V', D]``

A drafted step feeds the head's own pre-norm output ``p`` in place of ``g`` (no ``fc``): EAGLE-3's recurrence,
as the reference ``LlamaForCausalLMEagle3`` (SafeAILab/EAGLE ``cnets.py``), vLLM's ``llama_eagle3.py`` and SGLang's
``llama_eagle3.py`` run it.  The draft vocabulary has ``V'`` tokens: draft id ``j`` is target token
``j + d2t[j]`` (``d2t`` int64 offsets); logits outside it are ``-inf``, which keeps decoding exact.

Auxiliary-layer ids (:data:`AUX_IDS_KEY`) count hidden-state *boundaries* as vLLM does: id ``k`` is the residual
stream entering target layer ``k`` (Hugging Face's ``hidden_states[k]``; ``k = L``, the last layer's output before
the final norm).  They are always written out, never guessed: a config without them is refused.

On disk (``config.json`` + ``model.safetensors``): ``architectures: ["LlamaForCausalLMEagle3"]``, the Llama
shape keys, ``draft_vocab_size``, ``target_hidden_size``, the ids at the top level and under ``eagle_config``,
and our own metadata under ``"speculant"``; tensors ``fc.weight``, ``midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64 ``[V']``) and
``t2d`` (bool ``[V]``).  The token embedding is the target's (not stored; vLLM and SGLang share it too).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SpeculantError
from ..models.config import ModelConfig
from ..models.kv_cache import KVCache
from ..models.linear import DecodeLinear
from ..models.llama import DecoderLayer, RMSNorm, attention_inputs, causal_mask, layer_output
from ..models.rope import rope_tables
from ..runtime.steps import attend
from .artifacts import write_dir

ARCHITECTURE = "LlamaForCausalLMEagle3"
FORMAT = "speculant-eagle3-head"
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
WEIGHTS_FILE = "model.safetensors"
AUX_IDS_MEANING = ("hidden-state boundary k = the residual stream entering target layer k (HF hidden_states[k]; "
                   "k = num_hidden_layers: the last layer's output before the final norm), as vLLM counts")
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "draft_vocab_size")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE-3 reference's low/middle/high choice ``[2, L // 2, L - 3]`` (boundaries, as vLLM counts),
    clamped into ``1 .. L`` for shallow targets and made strictly increasing.

    Raises:
        SpeculantError: a target of fewer than 3 layers.
    """
    if num_layers < 3:
        raise SpeculantError(f"an EAGLE-3 head needs a target of >= 3 layers; this one has {num_layers}")
    ids = sorted({min(max(k, 1), num_layers) for k in (2, num_layers // 2, num_layers - 3)})
    return ids if len(ids) == 3 else [1, max(2, num_layers // 2), num_layers]


def check_aux_layer_ids(ids, num_layers: int) -> list[int]:
    """``ids`` as a list of 3 strictly increasing ints in ``1 .. num_layers`` (0, the embeddings, is not a layer's
    state; vLLM would take it, the EAGLE-3 recipes never use it).

    Raises:
        SpeculantError: anything else (the message names the value and what is allowed).
    """
    ok = isinstance(ids, (list, tuple)) and len(ids) == 3 and \
        all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= num_layers for k in ids) and \
        list(ids) == sorted(set(ids))
    if not ok:
        raise SpeculantError(f"{AUX_IDS_KEY}={ids!r} is invalid; allowed: 3 increasing hidden-state ids in "
                             f"1..{num_layers} ({AUX_IDS_MEANING})")
    return list(ids)


def eagle3_config(target_config: ModelConfig, base_model: str, aux_ids: list[int], draft_vocab_size: int,
                  target_layers: int | None = None) -> dict:
    """The ``config.json`` dict of an EAGLE-3 head for a target of shape ``target_config`` (its layer shape copied).

    Raises:
        SpeculantError: bad ``aux_ids`` (:func:`check_aux_layer_ids`).
    """
    c = target_config
    layers = target_layers or c.num_hidden_layers
    ids = check_aux_layer_ids(aux_ids, layers)
    return {"architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "draft_vocab_size": int(draft_vocab_size), "target_hidden_size": c.hidden_size,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "bias": False,
            AUX_IDS_KEY: ids, "eagle_config": {AUX_IDS_KEY: ids, "use_aux_hidden_state": True},
            "speculant": {"format": FORMAT, "version": 1, "base_model": base_model,
                          "target_num_hidden_layers": layers, "aux_ids_meaning": AUX_IDS_MEANING}}


def aux_layer_ids(config: dict, where: str = "EAGLE-3 head") -> list[int]:
    """The auxiliary-layer ids a head config records (top level, else under ``eagle_config``), never guessed.

    Raises:
        SpeculantError: none recorded, or the two places disagree.
    """
    top, nested = config.get(AUX_IDS_KEY), (config.get("eagle_config") or {}).get(AUX_IDS_KEY)
    if top is None and nested is None:
        raise SpeculantError(f"{where} has no {AUX_IDS_KEY} in config.json; allowed: the 3 target hidden-state ids "
                             "it was trained on, written out (speculant never guesses them)")
    if top is not None and nested is not None and list(top) != list(nested):
        raise SpeculantError(f"{where} has {AUX_IDS_KEY}={top} but eagle_config.{AUX_IDS_KEY}={nested}; "
                             "allowed: one list")
    return list(top if top is not None else nested)


def _layer_config(conf: dict) -> ModelConfig:
    return ModelConfig(vocab_size=conf["vocab_size"], hidden_size=conf["hidden_size"],
                       intermediate_size=conf["intermediate_size"], num_hidden_layers=1,
                       num_attention_heads=conf["num_attention_heads"], num_key_value_heads=conf["num_key_value_heads"],
                       max_position_embeddings=conf["max_position_embeddings"], rms_norm_eps=conf["rms_norm_eps"],
                       rope_theta=conf["rope_theta"], head_dim=conf.get("head_dim"))


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft head (module docstring).

    Args:
        config: from :func:`eagle3_config` (or an engine's ``config.json`` with the same keys).
        embed_weight: the target's token embedding ``[V, D]`` (frozen, shared, not stored).
        d2t: int64 ``[V']`` draft-to-target offsets (target id = draft id + ``d2t``).
    Attributes:
        aux_layer_ids: the 3 target hidden-state boundaries the head reads (:data:`AUX_IDS_KEY`).
        vocab_ids: int64 ``[V']`` target ids of the draft vocabulary.
    """

    def __init__(self, config: dict, embed_weight: torch.Tensor, d2t: torch.Tensor):
        super().__init__()
        self.config = dict(config)
        self.aux_layer_ids = aux_layer_ids(config)
        cfg = _layer_config(config)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = DecodeLinear(3 * config.get("target_hidden_size", d), d, bias=False)
        self.embed_norm = RMSNorm(d, eps)                 # midlayer.input_layernorm
        self.hidden_norm = RMSNorm(d, eps)                # midlayer.hidden_norm
        self.layer = DecoderLayer(cfg)
        self.layer.input_layernorm = nn.Identity()        # the 2D-wide input is normed half by half (above)
        attn = self.layer.self_attn
        attn.qkv_proj = DecodeLinear(2 * d, attn.qkv_proj.out_features, bias=False)
        self.norm = RMSNorm(d, eps)
        self.lm_head = DecodeLinear(d, int(config["draft_vocab_size"]), bias=False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        d2t = d2t.long().reshape(-1)
        if d2t.numel() != self.lm_head.out_features:
            raise SpeculantError(f"d2t has {d2t.numel()} entries; allowed: draft_vocab_size="
                                 f"{self.lm_head.out_features}")
        self.register_buffer("vocab_ids", torch.arange(d2t.numel()) + d2t, persistent=False)
        self.weight_format = "fp32"

    feature = "eagle3"

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the head's activations and KV cache (the target's float dtype)."""
        return self.embed_weight.dtype

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                cache_position: int = 0) -> torch.Tensor:
        """The head's pre-norm outputs.

        Args:
            hidden: ``[B, T, 3D]`` the target's auxiliary hidden states (concatenated low, mid, high; ``fc`` fuses
                them), or ``[B, T, D]`` the head's own pre-norm outputs (a drafted step: no ``fc``).
            tokens: ``[B, T]`` ids ``x_{i+1}``.
            positions: RoPE positions ``[T]`` or ``[B, T]``.
            attention_mask: bool ``[T, S]`` (True = may attend; ``S = cache_position + T``) or ``None``: causal.
            cache: the head's KV cache (:meth:`new_cache`); entries go to slots ``cache_position ..``.
        Returns:
            ``[B, T, D]`` pre-norm outputs ``p`` (:meth:`logits` decodes them; the next step feeds them back).
        """
        hidden, q, k, v = self.attention_inputs(hidden, tokens, positions)
        t = hidden.shape[1]
        is_causal, mask = False, attention_mask
        if mask is None and t > 1:
            if cache is None or cache_position == 0:
                is_causal = True
            else:
                mask = causal_mask(t, cache_position, hidden.device)
        return layer_output(self.layer, hidden, attend(q, k, v, mask, is_causal, cache, 0, cache_position))

    def attention_inputs(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """The layer's first half: ``hidden`` (``[B, T, 3D]`` target states, fused by ``fc``, or ``[B, T, D]``) ->
        ``(fused [B, T, D], q [B, H, T, Dh], k, v [B, Hkv, T, Dh])``: q/k/v from ``[embed_norm(embedding);
        hidden_norm(fused)]``, RoPE at ``positions``.  :meth:`forward` attends and finishes with
        :func:`~speculant.models.llama.layer_output` (training-time test attends its own way)."""
        if hidden.shape[-1] == self.fc.in_features:
            hidden = self.fc(hidden)
        emb = F.embedding(tokens, self.embed_weight).to(hidden.dtype)
        u = torch.cat([self.embed_norm(emb), self.hidden_norm(hidden)], dim=-1)
        cos = self.rope_cos[positions].to(hidden.dtype).unsqueeze(-2)
        sin = self.rope_sin[positions].to(hidden.dtype).unsqueeze(-2)
        return (hidden, *attention_inputs(self.layer, u, cos, sin))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs ``[..., D]`` -> fp32 logits ``[..., V']`` over the draft vocabulary."""
        return self.lm_head(self.norm(hidden)).float()

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             attention_mask: torch.Tensor | None, cache: KVCache, cache_position: int,
             logit_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` and :meth:`logits` of one sequence's rows (``hidden`` ``[T, 3D]`` or ``[T, D]``, ``tokens``
        ``[T]``; the drafter's interface, :meth:`speculant.drafters.draft_head.DraftHead.step`), through the torch
        modules: ``(pre-norm outputs [T, D], fp32 draft-vocabulary logits [L, V'] of the last L = logit_rows rows)``."""
        from .draft_head import torch_step
        return torch_step(self, hidden, tokens, positions, attention_mask, cache, cache_position, logit_rows)

    def new_cache(self, max_length: int) -> KVCache:
        """A KV cache of ``max_length`` slots for the head's one layer."""
        attn = self.layer.self_attn
        return KVCache(1, attn.n_kv, attn.head_dim, max_length, 1, self.dtype, self.embed_weight.device)

    def d2t(self) -> torch.Tensor:
        """int64 ``[V']`` offsets: target id minus draft id."""
        return self.vocab_ids - torch.arange(self.vocab_ids.numel(), device=self.vocab_ids.device)

    def projections(self) -> list[nn.Module]:
        """The projections :meth:`pack` packs: ``fc``, the layer's four, ``lm_head``."""
        from ..runtime.formats import PROJECTIONS
        return [self.fc] + [self.layer.get_submodule(p) for p in PROJECTIONS] + [self.lm_head]

    def float_projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``(weight, None)`` float32 of :meth:`projections` (the drafter-format tune step times these shapes)."""
        return [(m.weight.detach().float(), None) for m in self.projections()]

    def pack(self, fmt: str) -> "Eagle3Head":
        """Put :meth:`projections` in weight format ``fmt`` (``int8``, ``w8a8``, ``bf16``), in place, for decoding
        (as :meth:`speculant.drafters.draft_head.DraftHead.pack`; exactness does not depend on it).

        Raises:
            SpeculantError: unknown format, or a head already packed.
        """
        from ..runtime.formats import pack_linear, pack_projections
        from .weights import check_drafter_format
        if check_drafter_format(fmt) == "fp32":
            return self
        if self.weight_format != "fp32":
            raise SpeculantError(f"EAGLE-3 head already packed in {self.weight_format}; allowed: pack a float head once")
        self.fc = pack_linear(fmt, self.fc.weight)
        self.lm_head = pack_linear(fmt, self.lm_head.weight)
        pack_projections(self.layer, fmt)
        self.weight_format = fmt
        return self

    def weight_bytes(self) -> int:
        """Bytes of weights one head forward reads (the embedding row is ignored)."""
        from ..runtime.formats import weight_bytes
        return weight_bytes(self)


def _qkv_sizes(head: Eagle3Head) -> list[int]:
    attn = head.layer.self_attn
    return [attn.n_heads * attn.head_dim, attn.n_kv * attn.head_dim, attn.n_kv * attn.head_dim]


def engine_state(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """The head's float tensors under the names vLLM's and SGLang's EAGLE-3 loaders read (module docstring),
    ``d2t`` (int64) and ``t2d`` (bool ``[V]``) included."""
    sd = {k: v.detach() for k, v in head.state_dict().items()}
    out = {"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"],
           "midlayer.input_layernorm.weight": sd["embed_norm.weight"],
           "midlayer.hidden_norm.weight": sd["hidden_norm.weight"],
           "midlayer.post_attention_layernorm.weight": sd["layer.post_attention_layernorm.weight"],
           "midlayer.self_attn.o_proj.weight": sd["layer.self_attn.o_proj.weight"],
           "midlayer.mlp.down_proj.weight": sd["layer.mlp.down_proj.weight"]}
    for n, w in zip("qkv", sd["layer.self_attn.qkv_proj.weight"].split(_qkv_sizes(head), dim=0)):
        out[f"midlayer.self_attn.{n}_proj.weight"] = w
    gate, up = sd["layer.mlp.gate_up_proj.weight"].chunk(2, dim=0)
    out.update({"midlayer.mlp.gate_proj.weight": gate, "midlayer.mlp.up_proj.weight": up})
    t2d = torch.zeros(head.config["vocab_size"], dtype=torch.bool)
    t2d[head.vocab_ids.cpu()] = True
    out.update({"d2t": head.d2t(), "t2d": t2d})
    return {k: v.contiguous() for k, v in out.items()}


def _our_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`engine_state` (without ``d2t``/``t2d``); raises ``KeyError`` naming a missing tensor."""
    p = "midlayer."
    return {"fc.weight": sd.pop("fc.weight"), "norm.weight": sd.pop("norm.weight"),
            "lm_head.weight": sd.pop("lm_head.weight"), "embed_norm.weight": sd.pop(p + "input_layernorm.weight"),
            "hidden_norm.weight": sd.pop(p + "hidden_norm.weight"),
            "layer.post_attention_layernorm.weight": sd.pop(p + "post_attention_layernorm.weight"),
            "layer.self_attn.o_proj.weight": sd.pop(p + "self_attn.o_proj.weight"),
            "layer.mlp.down_proj.weight": sd.pop(p + "mlp.down_proj.weight"),
            "layer.self_attn.qkv_proj.weight": torch.cat([sd.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
            "layer.mlp.gate_up_proj.weight": torch.cat([sd.pop(p + "mlp.gate_proj.weight"),
                                                        sd.pop(p + "mlp.up_proj.weight")])}


def save_eagle3(head: Eagle3Head, out_dir: str | Path, card: str | None = None, metrics: dict | None = None,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (float tensors in ``dtype``; the layout of the module docstring)
    and, given, ``README.md`` / ``metrics.json``; returns the directory."""
    if head.weight_format != "fp32":
        raise SpeculantError(f"EAGLE-3 head packed in {head.weight_format}; allowed: save a float head")
    return write_dir(out_dir, WEIGHTS_FILE, engine_state(head), dtype, "pt",
                     dict(head.config, torch_dtype=str(dtype).replace("torch.", "")), metrics, card)


def is_eagle3_dir(path: Path) -> bool:
    """True when ``path/config.json`` names the EAGLE-3 architecture."""
    f = Path(path) / "config.json"
    return f.is_file() and ARCHITECTURE in (json.loads(f.read_text()).get("architectures") or [])


def read_eagle3(path: Path, model) -> tuple[dict, dict[str, torch.Tensor]]:
    """``config.json`` and the tensors of the EAGLE-3 head in ``path``, checked against ``model``.

    Raises:
        SpeculantError: not an EAGLE-3 head, no auxiliary-layer ids, ids out of the target's range, another
            hidden size or vocabulary, missing or unexpected tensors (each named).
    """
    from safetensors.torch import load_file
    conf = json.loads((path / "config.json").read_text())
    where = f"EAGLE-3 head {str(path)!r}"
    if ARCHITECTURE not in (conf.get("architectures") or []):
        raise SpeculantError(f"{where} has architectures={conf.get('architectures')}; allowed: [{ARCHITECTURE!r}]")
    c = model.decoder.config
    check_aux_layer_ids(aux_layer_ids(conf, where), model.decoder.num_layers)
    for key, have in (("hidden_size", c.hidden_size), ("vocab_size", c.vocab_size)):
        if conf.get(key) != have:
            raise SpeculantError(f"{where} has {key}={conf.get(key)} but model {model.name!r} has {have}; "
                                 "allowed: a head trained for this model")
    if conf.get("target_hidden_size", c.hidden_size) != c.hidden_size or conf.get("num_hidden_layers", 1) != 1:
        raise SpeculantError(f"{where} has target_hidden_size={conf.get('target_hidden_size')}, num_hidden_layers="
                             f"{conf.get('num_hidden_layers')}; allowed: {c.hidden_size} and 1")
    missing = [k for k in _SHAPE_KEYS if k not in conf and k != "head_dim"]
    if missing:
        raise SpeculantError(f"{where} lacks config keys {missing}; allowed: a Llama head config")
    return conf, load_file(str(path / WEIGHTS_FILE))


def load_eagle3(path: str | Path, model, weights: str | None = None) -> Eagle3Head:
    """Load the EAGLE-3 head in directory ``path`` for ``model``, in the model's dtype, its projections in
    ``weights`` (default: :func:`speculant.drafters.draft_head.head_weight_format`'s rule, measuring nothing).

    Raises:
        SpeculantError: see :func:`read_eagle3`.
    """
    path = Path(path)
    conf, sd = read_eagle3(path, model)
    where = f"EAGLE-3 head {str(path)!r}"
    vocab = conf["draft_vocab_size"]
    d2t = sd.pop("d2t", torch.zeros(vocab, dtype=torch.long))
    sd.pop("t2d", None)
    sd.pop("embed_tokens.weight", None)             # a head that stores the embedding: ours is the target's
    try:
        ours = _our_state(sd)
    except KeyError as e:
        raise SpeculantError(f"{where} lacks tensor {e.args[0]!r}; allowed: the tensors of an EAGLE-3 head") from None
    if sd:
        raise SpeculantError(f"{where} has unexpected tensors {sorted(sd)}; allowed: the tensors of an EAGLE-3 head")
    dec = model.decoder
    head = Eagle3Head(conf, dec.embed_tokens.weight, d2t)
    try:
        head.load_state_dict({k: v.float() for k, v in ours.items()}, strict=True)
    except RuntimeError as e:
        raise SpeculantError(f"{where}: {str(e).splitlines()[-1].strip()}; allowed: shapes of its config") from None
    if int(head.vocab_ids.min()) < 0 or int(head.vocab_ids.max()) >= conf["vocab_size"]:
        raise SpeculantError(f"{where} has d2t mapping outside 0..{conf['vocab_size'] - 1}; allowed: target ids")
    head = head.to(dec.dtype).eval().requires_grad_(False)
    from .weights import drafter_weight_format
    return head.pack(weights or drafter_weight_format(model, "eagle3-head", head.float_projections()))


def new_eagle3(model, aux_ids: list[int] | None = None, vocab_ids: torch.Tensor | None = None,
               seed: int | None = None) -> Eagle3Head:
    """A fresh float32 head for ``model``: ``lm_head`` rows and ``norm`` copied from the target's LM head and final
    norm (EAGLE-3's initialisation), ``fc`` and the layer random (``std`` 0.02, norms 1).

    Args:
        aux_ids: hidden-state boundaries (default :func:`default_aux_layer_ids`).
        vocab_ids: int64 ``[V']`` increasing target ids of the draft vocabulary (default: all).
    Raises:
        SpeculantError: bad ids, an unsorted draft vocabulary, or a target whose LM head is not float.
    """
    dec = model.decoder
    ids = default_aux_layer_ids(dec.num_layers) if aux_ids is None else aux_ids
    if vocab_ids is None:
        vocab_ids = torch.arange(dec.config.vocab_size)
    vocab_ids = vocab_ids.long()
    if len(vocab_ids) > 1 and not bool((vocab_ids[1:] > vocab_ids[:-1]).all()):
        raise SpeculantError("vocab_ids are not strictly increasing; allowed: sorted target ids (d2t >= 0)")
    conf = eagle3_config(dec.config, model.name, ids, len(vocab_ids), dec.num_layers)
    if seed is not None:
        torch.manual_seed(seed)
    head = Eagle3Head(conf, dec.embed_tokens.weight.detach().float(), vocab_ids - torch.arange(len(vocab_ids)))
    lm = getattr(dec.lm_head_proj, "weight", None)
    if lm is None:
        raise SpeculantError(f"target LM head is {type(dec.lm_head_proj).__name__}; allowed: a float target")
    with torch.no_grad():
        for m in head.projections():
            m.weight.normal_(0, 0.02)
        head.lm_head.weight.copy_(lm.detach().float()[vocab_ids])
        head.norm.weight.copy_(dec.norm.weight.detach().float())
    return head.float()
