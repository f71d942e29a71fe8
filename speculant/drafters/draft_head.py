"""Feature-level draft head (EAGLE family): the module, its on-disk format and its loading.

Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", Sec. 3
(and EAGLE-2 for the trees grown from it): the draft runs at the *feature* level.  An entry at
position ``i`` reads the target's feature ``f_i`` (its last hidden state at position ``i``, the
one that predicted token ``x_{i+1}``) and the embedding of ``x_{i+1}``, and predicts ``f_{i+1}``::

    x = fc([embed(x_{i+1}); f_i])                     fc: Linear(2D -> D) with bias
    f^_{i+1} = DecoderLayer(x)                        one Llama layer, its input RMSNorm dropped (as EAGLE)
    draft logits for x_{i+2} = W_sub f^_{i+1}        W_sub: rows ``vocab_ids`` of the target's frozen LM head

``feature="post-norm"`` (EAGLE-1/2's choice: the base model's output *after* the final RMSNorm, fed
straight to the LM head) or ``"pre-norm"`` (the residual stream leaving the last layer; the head then
applies a copy of the target's final norm before the LM head).  The reduced draft vocabulary
``vocab_ids`` (``V'`` tokens ranked by frequency; FR-Spec, Zhao et al. 2025) makes the draft's LM head
read ``V'/V`` of the full head's bytes; logits outside it are ``-inf``, which keeps speculative decoding
exact (the acceptance rules only need ``q`` to be a distribution).  The embedding and the LM-head rows
are the target's (frozen, never stored): an artefact holds ``fc``, the layer, and ``vocab_ids``.

On disk: ``head.safetensors`` + ``config.json`` (format :data:`FORMAT`) + ``README.md`` model card;
shipped heads live under ``speculant/artifacts/draft_heads/<model name>/<name>/``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SpeculantError
from ..kernels.draft_head_step import FusedDraftHead
from ..models.config import ModelConfig
from ..models.kv_cache import KVCache
from ..models.linear import DecodeLinear
from ..models.llama import DecoderLayer, RMSNorm, attention_inputs, causal_mask, layer_output
from ..runtime.steps import attend
from ..models.rope import rope_tables
from ..runtime.formats import select_rows
from .artifacts import check_compatible, read_config, resolve_dir, shipped_names, write_dir

FORMAT = "speculant-draft-head"
KIND = "draft_heads"
FEATURES = ("post-norm", "pre-norm")
WEIGHTS_FILE = "head.safetensors"


def head_config(target_config: ModelConfig, base_model: str, vocab_ids: torch.Tensor | None,
                feature: str = "post-norm") -> dict:
    """The ``config.json`` dict of a head for a target of shape ``target_config``.

    Raises:
        SpeculantError: ``feature`` not in :data:`FEATURES`.
    """
    if feature not in FEATURES:
        raise SpeculantError(f"feature={feature!r} is unknown; allowed: {', '.join(FEATURES)}")
    c = target_config
    return {"format": FORMAT, "version": 1, "architecture": "eagle", "base_model": base_model, "feature": feature,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "draft_vocab_size": c.vocab_size if vocab_ids is None else int(len(vocab_ids))}


def _layer_config(conf: dict) -> ModelConfig:
    return ModelConfig(vocab_size=conf["vocab_size"], hidden_size=conf["hidden_size"],
                       intermediate_size=conf["intermediate_size"], num_hidden_layers=1,
                       num_attention_heads=conf["num_attention_heads"], num_key_value_heads=conf["num_key_value_heads"],
                       max_position_embeddings=conf["max_position_embeddings"], rms_norm_eps=conf["rms_norm_eps"],
                       rope_theta=conf["rope_theta"], head_dim=conf["head_dim"])


LM_ROW_FORMATS = ("target", "w4a8")
"""What a draft head's LM-head rows can be read in (:meth:`DraftHead.pack_lm_rows`)."""


class DraftHead(nn.Module):
    """The EAGLE draft head (module docstring).

    Args:
        config: from :func:`head_config`.
        embed_weight: the target's token embedding ``[V, D]`` (frozen, shared, not stored).
        lm_head_rows: the target's LM-head rows of the draft vocabulary, a projection ``[..., D] -> [..., V']``
            in the target's weight format (frozen, not stored; see :func:`~speculant.runtime.formats.select_rows`).
        vocab_ids: int64 ``[V']`` token ids of the draft vocabulary, or ``None`` (full vocabulary).
        final_norm_weight: the target's final RMSNorm weight ``[D]``; used (frozen) when
            ``config["feature"] == "pre-norm"``.
    """

    def __init__(self, config: dict, embed_weight: torch.Tensor, lm_head_rows: nn.Module,
                 vocab_ids: torch.Tensor | None, final_norm_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = dict(config)
        cfg = _layer_config(config)
        d = cfg.hidden_size
        self.fc = DecodeLinear(2 * d, d, bias=True)
        self.layer = DecoderLayer(cfg)
        self.layer.input_layernorm = nn.Identity()          # EAGLE: the first layer's input norm is dropped
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        # not a registered submodule: not stored, and .to(dtype) must not touch a packed format's scales
        self._lm_head_rows = (lm_head_rows,)
        self._lm_rows_by_format = {"target": lm_head_rows}     # the rows in each format made (:meth:`pack_lm_rows`)
        self.lm_rows_format = "target"
        self.register_buffer("vocab_ids", None if vocab_ids is None else vocab_ids.long().clone(), persistent=False)
        self.weight_format = "fp32"                         # of fc and the layer's projections (:meth:`pack`)
        self.use_fused = True           # :meth:`step` through the fused C forward where it applies (:meth:`fused`)
        self._fused = None              # (key it was built for, FusedDraftHead or None)
        self.out_norm = None
        if config["feature"] == "pre-norm":
            self.out_norm = RMSNorm(d, cfg.rms_norm_eps).requires_grad_(False)
            if final_norm_weight is not None:
                with torch.no_grad():
                    self.out_norm.weight.copy_(final_norm_weight)

    @property
    def feature(self) -> str:
        return self.config["feature"]

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the head's activations and KV cache (the target's float dtype)."""
        return self.embed_weight.dtype

    def pack(self, fmt: str) -> "DraftHead":
        """Put ``fc`` and the layer's projections in weight format ``fmt`` (``int8``, ``w8a8``, ``bf16``; see
        :func:`~speculant.runtime.formats.pack_linear`), in place, for decoding: the draft reads fewer weight
        bytes per step.  Exactness does not depend on it (the acceptance rules take whatever ``q`` the head
        gives); the draft distribution moves by the format's rounding.  The packed head cannot be trained.

        Raises:
            SpeculantError: unknown format (``fp32`` leaves the head as it is).
        """
        from ..runtime.formats import pack_linear, pack_projections
        from .weights import check_drafter_format
        if check_drafter_format(fmt) == "fp32":
            return self
        if self.weight_format != "fp32":
            raise SpeculantError(f"draft head already packed in {self.weight_format}; allowed: pack a float head once")
        self.fc = pack_linear(fmt, self.fc.weight, self.fc.bias)
        pack_projections(self.layer, fmt)
        self.weight_format = fmt
        return self

    def pack_lm_rows(self, fmt: str) -> "DraftHead":
        """Read the draft vocabulary's LM-head rows in ``fmt``: ``target`` (the target's own rows, in its format) or
        ``w4a8`` (those rows requantized to 4 bits a weight by llama.cpp's Q4_1 reference quantizer, on int8
        activations: about two thirds of an 8-bit head's 16384 x 576 bytes, which a draft call reads from memory
        after each target forward).  Exactness does not depend on it; the draft's logits move by the rounding
        (:func:`~speculant.drafters.weights.tune_head_lm_rows` measures how often its top token moves).

        Raises:
            SpeculantError: another ``fmt``, or ``w4a8`` where our kernels do not run.
        """
        from ..kernels import qgemm
        from ..runtime.formats import PackedLinear, pack_linear
        if fmt not in LM_ROW_FORMATS:
            raise SpeculantError(f"draft head LM rows {fmt!r}; allowed: {', '.join(LM_ROW_FORMATS)}")
        rows = self._lm_rows_by_format.get(fmt)
        if rows is None:                                    # w4a8, made once from the target's rows
            if not qgemm.available():
                raise SpeculantError(f"draft head LM rows 'w4a8' {qgemm.unavailable_reason()}; allowed here: target")
            target = self._lm_rows_by_format["target"]
            weight = target.dequantized_weight() if isinstance(target, PackedLinear) else target.weight.detach().float()
            rows = self._lm_rows_by_format[fmt] = pack_linear("w4a8", weight)
        self._lm_head_rows = (rows,)
        self.lm_rows_format = fmt
        return self

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                cache_position: int = 0) -> torch.Tensor:
        """Predicted next features.

        Args:
            features: ``[B, T, D]`` features ``f_i`` (target's, or the head's own predictions).
            tokens: ``[B, T]`` ids ``x_{i+1}`` (the token each feature predicted).
            positions: RoPE positions ``[T]`` or ``[B, T]`` (``i``).
            attention_mask: bool ``[T, S]`` (True = may attend; ``S = cache_position + T``) or ``None``: causal.
            cache: the head's KV cache (:meth:`new_cache`); entries go to slots ``cache_position ..``.
        Returns:
            ``[B, T, D]`` predicted features ``f^_{i+1}``.
        """
        x = self.fc(torch.cat([F.embedding(tokens, self.embed_weight).to(features.dtype), features], dim=-1))
        t = x.shape[1]
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(-2)
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(-2)
        is_causal, mask = False, attention_mask
        if mask is None and t > 1:
            if cache is None or cache_position == 0:
                is_causal = True
            else:
                mask = causal_mask(t, cache_position, x.device)
        q, k, v = attention_inputs(self.layer, x, cos, sin)
        return layer_output(self.layer, x, attend(q, k, v, mask, is_causal, cache, 0, cache_position))

    def fused(self, cache_dtype: torch.dtype) -> FusedDraftHead | None:
        """The head's forward as one C call over a ``cache_dtype`` KV cache
        (:class:`~speculant.kernels.draft_head_step.FusedDraftHead`), or ``None`` where it does not apply:
        :attr:`use_fused` False, projections or LM-head rows not w4a8/w8a8, a non-float32 head, or kernels that
        do not build (:func:`fused_head_why_not` says why).  Built at the first call and again when the
        projections are replaced."""
        if not self.use_fused:
            return None
        key = (cache_dtype, id(self.fc), id(self.layer.self_attn.qkv_proj), id(self._lm_head_rows[0]),
               id(self.embed_weight))
        if self._fused is None or self._fused[0] != key:
            buffers = fused_head_buffers(self)
            ok = not isinstance(buffers, str) and fused_head_why_not(self, cache_dtype) is None
            self._fused = (key, FusedDraftHead(buffers, cache_dtype, getattr(self.fc, "prefetch", 0)) if ok else None)
        return self._fused[1]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fused"] = None          # pointers into this process's tensors: rebuilt on first use
        return state

    def step(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             attention_mask: torch.Tensor | None, cache: KVCache, cache_position: int,
             logit_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` and :meth:`logits` of one sequence's rows, in one C call where :meth:`fused` applies
        (else the torch modules): ``features`` ``[T, D]``, ``tokens`` ``[T]``, ``positions`` ``[T]``,
        ``attention_mask`` bool ``[T, cache_position + T]`` or ``None`` (causal).

        Returns:
            ``(predicted features [T, D], fp32 draft-vocabulary logits [L, V'] of the last L = logit_rows rows)``
            (``None``: all ``T``).
        """
        fused = self.fused(cache.dtype)
        if fused is not None:
            out, logits = fused.forward(features, tokens, positions, cache, cache_position, attention_mask, logit_rows)
            return out.to(features.dtype), logits
        return torch_step(self, features, tokens, positions, attention_mask, cache, cache_position, logit_rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted features ``[..., D]`` -> fp32 logits ``[..., V']`` over the draft vocabulary."""
        if self.out_norm is not None:
            hidden = self.out_norm(hidden)
        return self._lm_head_rows[0](hidden).float()

    def new_cache(self, max_length: int) -> KVCache:
        """A KV cache of ``max_length`` slots for the head's one layer."""
        c = self.config
        return KVCache(1, c["num_key_value_heads"], c["head_dim"], max_length, 1, self.dtype,
                       self.embed_weight.device)

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The tensors an artefact stores: the trained ones, plus ``vocab_ids`` (int32)."""
        sd = {k: v for k, v in self.state_dict().items() if not k.startswith("out_norm.")}
        if self.vocab_ids is not None:
            sd["vocab_ids"] = self.vocab_ids.to(torch.int32)
        return sd

    def float_projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``(weight, bias)`` of the projections :meth:`pack` packs (``fc``, then the layer's), float."""
        from ..runtime.formats import PROJECTIONS
        mods = [self.fc] + [self.layer.get_submodule(p) for p in PROJECTIONS]
        return [(m.weight.detach().float(), None if m.bias is None else m.bias.detach().float()) for m in mods]

    def weight_bytes(self) -> int:
        """Bytes of weights one head forward reads (fc, layer, LM-head rows; the embedding row is ignored)."""
        from ..runtime.formats import weight_bytes
        return weight_bytes(self) + weight_bytes(self._lm_head_rows[0])


def torch_step(head: nn.Module, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
               attention_mask: torch.Tensor | None, cache: KVCache, cache_position: int,
               logit_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`DraftHead.step` through the torch modules of ``head`` (its ``forward`` and ``logits``; an EAGLE-3
    head's too): ``(predicted features [T, D], fp32 draft-vocabulary logits [L, V'] of the last L rows)``."""
    out = head(features[None], tokens[None], positions, attention_mask, cache, cache_position)[0]
    return out, head.logits(out[out.shape[0] - (out.shape[0] if logit_rows is None else logit_rows):])


def fused_head_buffers(head: DraftHead):
    """``head``'s buffers for :class:`~speculant.kernels.draft_head_step.FusedDraftHead`, or why not (a float32
    projection or LM-head rows: only w4a8/w8a8 run there)."""
    from ..kernels.decode_step import LayerBuffers, ModelBuffers
    from ..kernels.draft_head_step import DraftHeadBuffers
    from ..runtime.executor import _projection_buffers
    layer = head.layer
    modules = (head.fc, layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
               layer.mlp.down_proj, head._lm_head_rows[0])
    projections = [_projection_buffers(m) for m in modules]
    if any(p is None for p in projections):
        return f"draft head has a projection that is not w4a8/w8a8 (weights {head.weight_format})"
    if head.dtype != torch.float32:
        return f"draft head in {head.dtype}; allowed: float32"
    c = head.config
    post = layer.post_attention_layernorm.weight.detach().float().contiguous()
    model = ModelBuffers(c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                         c["intermediate_size"], float(c["rms_norm_eps"]),
                         [LayerBuffers(None, post, *projections[1:5])], head.rope_cos.float().contiguous(),
                         head.rope_sin.float().contiguous(), post, float(c["rms_norm_eps"]))
    out_norm = None if head.out_norm is None else head.out_norm.weight.detach().float().contiguous()
    return DraftHeadBuffers(model, projections[0], projections[5], head.embed_weight.contiguous(), out_norm,
                            float(head.out_norm.eps) if head.out_norm is not None else 1e-6)


def fused_head_why_not(head: DraftHead, cache_dtype: torch.dtype) -> str | None:
    """Why ``head`` cannot run as one C call over a ``cache_dtype`` KV cache, or ``None``."""
    from ..kernels import build
    from ..kernels.draft_head_step import why_not_head
    if not build.available():
        return f"the kernels {build.unavailable_reason()}"
    buffers = fused_head_buffers(head)
    return buffers if isinstance(buffers, str) else why_not_head(buffers, cache_dtype)


def _lm_head_rows(decoder, vocab_ids: torch.Tensor | None) -> nn.Module:
    """The target's LM head restricted to the draft vocabulary, in the head's own weight format."""
    head = decoder.lm_head_proj
    return head if vocab_ids is None else select_rows(head, vocab_ids.long())


def new_head(model, vocab_ids: torch.Tensor | None = None, feature: str = "post-norm",
             init: str = "last-layer") -> DraftHead:
    """A fresh head for ``model`` (fp32).

    Args:
        init: ``last-layer`` copies the target's last decoder layer into the head's layer and sets
            ``fc`` to pass the feature through (identity on the feature half, small random on the
            embedding half); ``random`` is a plain random initialisation (as EAGLE).
    Raises:
        SpeculantError: unknown ``feature`` or ``init``.
    """
    if init not in ("last-layer", "random"):
        raise SpeculantError(f"init={init!r} is unknown; allowed: last-layer, random")
    dec = model.decoder
    conf = head_config(dec.config, model.name, vocab_ids, feature)
    head = DraftHead(conf, dec.embed_tokens.weight.detach().float(), _lm_head_rows(dec, vocab_ids),
                     vocab_ids, _final_norm_scale(dec)).float()
    d = conf["hidden_size"]
    with torch.no_grad():
        if init == "last-layer":
            last = dec.layers[-1]
            own = {k: v for k, v in last.state_dict().items() if not k.startswith("input_layernorm.")}
            head.layer.load_state_dict(own, strict=True)
            head.fc.weight.zero_()
            head.fc.weight[:, :d].normal_(0, 0.02)
            head.fc.weight[:, d:].copy_(torch.eye(d))
        head.fc.bias.zero_()
    return head


def save_head(head: DraftHead, out_dir: str | Path, card: str | None = None, metrics: dict | None = None,
              dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``head.safetensors`` (float tensors in ``dtype``), ``config.json`` and (given) ``README.md``,
    ``metrics.json``; returns the directory."""
    return write_dir(out_dir, WEIGHTS_FILE, head.trained_state(), dtype, FORMAT,
                     dict(head.config, stored_dtype=str(dtype).replace("torch.", "")), metrics, card)


def available_heads(model_name: str) -> list[str]:
    """Names of the draft heads shipped for ``model_name``."""
    return shipped_names(KIND, model_name)


def load_head(name_or_path: str | Path, model, weights: str | None = None) -> DraftHead:
    """Load a draft head (a shipped name such as ``default``, or a directory: ours, or ours exported in vLLM's
    EAGLE-1 layout by :func:`speculant.drafters.export.export_eagle1`) for ``model``, in the model's dtype,
    its projections in ``weights`` (``fp32``/``int8``/``w8a8``/``bf16``), by default :func:`head_weight_format`
    (:meth:`DraftHead.pack`; 8 bits read ~1/4 of the float32 bytes).

    Raises:
        SpeculantError: unknown name, another format, or a head trained for a differently shaped model.
    """
    from safetensors.torch import load_file
    from .export import is_eagle1_dir, read_eagle1
    path = resolve_dir(KIND, "draft head", str(name_or_path), model.name)
    if is_eagle1_dir(path):                          # our head exported in vLLM's EAGLE-1 layout
        conf, sd = read_eagle1(path)
    else:
        conf = read_config(path, FORMAT, "draft head")
        sd = load_file(str(path / WEIGHTS_FILE))
    dec = model.decoder
    c = dec.config
    check_compatible(conf, model, {"hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
                                   "num_attention_heads": c.num_attention_heads,
                                   "num_key_value_heads": c.num_key_value_heads}, path, "draft head")
    vocab_ids = sd.pop("vocab_ids", None)
    head = DraftHead(conf, dec.embed_tokens.weight, _lm_head_rows(dec, vocab_ids), vocab_ids, _final_norm_scale(dec))
    missing, unexpected = head.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.startswith("out_norm.")]     # the target's final norm, not stored
    if missing or unexpected:
        raise SpeculantError(f"draft head {str(path)!r} has missing tensors {missing} / unexpected tensors "
                             f"{unexpected}; allowed: exactly the tensors of a {conf['feature']} head")
    head = head.to(dec.dtype).eval().requires_grad_(False)
    return head.pack(weights or head_weight_format(model, head))


def head_weight_format(model, head: DraftHead) -> str:
    """The weight format ``head``'s projections are loaded in for ``model``, measuring nothing: ``fp32`` for a
    float32 target; for a quantized one what the tune step (:func:`~speculant.drafters.weights.tune_drafter`) chose
    on this machine for the head's shapes (:func:`~speculant.drafters.weights.drafter_weight_format`)."""
    from .weights import drafter_weight_format
    return drafter_weight_format(model, "draft-head", head.float_projections())


def default_head_for(model_name: str) -> str | None:
    """``'default'`` when a draft head named default ships for ``model_name``, else ``None``."""
    return "default" if "default" in available_heads(model_name) else None


def _final_norm_scale(dec) -> torch.Tensor:
    """The target's final-norm scale ``[D]`` (float32) as a plain RMSNorm weight: its weight plus its offset (Gemma's
    norms scale by ``1 + weight``, :class:`~speculant.models.llama.RMSNorm`)."""
    return (dec.norm.weight.detach().float() + dec.norm.offset).contiguous()
