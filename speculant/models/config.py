"""Architecture hyper-parameters of a Llama-family decoder, read strictly from a Hugging Face ``config.json``.

Families (``model_type``) and what is implemented of each (anything else is refused, see
:meth:`ModelConfig.from_hf_dict`):

* ``llama`` (``LlamaForCausalLM``): ``attention_bias`` (q/k/v/o biases), ``mlp_bias``, ``head_dim``,
  RoPE scaling ``linear``/``dynamic``/``llama3`` (:mod:`speculant.models.rope`), tied or untied LM head.
* ``qwen2`` (``Qwen2ForCausalLM``): q/k/v biases (no o_proj bias); a sliding window, when enabled,
  limits the context we run (see below).
* ``mistral`` (``MistralForCausalLM``): ``sliding_window`` limits the context we run (see below).
* ``qwen3`` (``Qwen3ForCausalLM``): an RMSNorm over each q and k head (``q_norm``/``k_norm``, weights ``[head_dim]``,
  eps ``rms_norm_eps``) between the q/k projections and RoPE; ``attention_bias`` (q/k/v/o biases, off by default);
  ``head_dim`` (transformers' default 128 when absent, whatever ``hidden_size / num_attention_heads`` is); a sliding
  window as ``qwen2``'s.
* ``gemma3_text`` (``Gemma3ForCausalLM``, Gemma 3; Gemma Team 2025): four RMSNorms per layer (input,
  post-attention, pre- and post-feed-forward), each multiplying by ``1 + weight``; q/k RMSNorms; GeGLU
  (``hidden_activation`` ``gelu_pytorch_tanh``); embeddings scaled by ``sqrt(hidden_size)``; attention scale
  ``query_pre_attn_scalar ** -0.5``; interleaved local (``sliding_attention``, window ``sliding_window``, RoPE base
  ``rope_local_base_freq`` / the ``sliding_attention`` RoPE parameters, 10 000 by default) and global
  (``full_attention``, RoPE base and scaling of ``full_attention``, 1e6 by default) layers from ``layer_types`` or
  ``sliding_window_pattern`` (every N-th layer global, default 6).  Unlike the other families the window is applied
  in the attention mask of the local layers (:func:`speculant.models.llama.window_mask`), so the context is not
  capped at it.  Soft-capping and bidirectional attention are refused.

Sliding windows (``qwen2``/``qwen3``/``mistral``): a query at position p attends keys at positions ``> p - window`` (transformers'
``sliding_window_overlay``).  We never run positions at or past the window: the usable context
(:attr:`ModelConfig.context_length`) is ``min(max_position_embeddings, window)``, inside which a sliding
window attends every earlier position, so our logits equal transformers' on every sequence we accept.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import SpeculantError
from .rope import normalize_rope_scaling

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
"""Supported ``model_type`` -> its ``architectures`` entry."""

# transformers 5.24's defaults for fields a config.json may leave out (tests check them against transformers)
FAMILY_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": None},
    "mistral": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096,
              "head_dim": 128},
    "gemma3_text": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                    "sliding_window": 4096, "head_dim": 256, "query_pre_attn_scalar": 256, "rope_local_theta": 10_000.0,
                    "sliding_window_pattern": 6},
}
LAYER_TYPES = ("full_attention", "sliding_attention")
"""Attention kinds of a layer (``layer_types`` of a Gemma 3 config)."""
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_READ = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters",
         "rope_scaling", "tie_word_embeddings", "head_dim", "bos_token_id", "eos_token_id", "hidden_act",
         "model_type", "architectures"}
_FAMILY_FIELDS = {"llama": {"attention_bias", "mlp_bias"}, "mistral": {"sliding_window"},
                  "qwen2": {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
                  "qwen3": {"attention_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
                  "gemma3_text": {"attention_bias", "sliding_window", "layer_types", "sliding_window_pattern",
                                  "_sliding_window_pattern", "hidden_activation", "query_pre_attn_scalar",
                                  "rope_local_base_freq", "final_logit_softcapping", "attn_logit_softcapping",
                                  "use_bidirectional_attention", "cache_implementation"}}
# fields that do not change the forward at inference: metadata, training-only settings (dropout,
# initialisation, tensor-parallel split), generation defaults of old config.json files (our sampling
# comes from GenerationConfig) and output switches
_HARMLESS = {
    "_name_or_path", "_model_name_or_path", "unk_token_id", "transformers_version", "dtype", "torch_dtype", "use_cache", "initializer_range",
    "attention_dropout", "pretraining_tp", "pad_token_id", "sep_token_id", "decoder_start_token_id", "return_dict",
    "output_attentions", "output_hidden_states", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "chunk_size_feed_forward", "id2label", "label2id", "problem_type", "finetuning_task", "tokenizer_class",
    "prefix", "task_specific_params", "_attn_implementation_autoset", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "cross_attention_hidden_size",
}
_MUST_BE_OFF = ("is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder", "pruned_heads")


def _checked_model_type(d: dict) -> str:
    """The ``model_type`` of a Hugging Face ``config.json`` dict once its architecture, fields and required fields
    are checked (:meth:`ModelConfig.from_hf_dict`).

    Raises:
        SpeculantError: one line naming the unsupported model type, architecture or field(s), or a missing one.
    """
    model_type = d.get("model_type", "llama")
    if model_type == "gemma3":
        raise SpeculantError("model_type='gemma3' (Gemma3ForConditionalGeneration, text and vision) is not "
                             "supported; allowed: its text model, model_type='gemma3_text' (Gemma3ForCausalLM), "
                             "or the model's GGUF file")
    if model_type not in FAMILIES:
        raise SpeculantError(f"model_type={model_type!r} is not supported; allowed: {', '.join(FAMILIES)}")
    archs = d.get("architectures") or [FAMILIES[model_type]]
    bad = [a for a in archs if a != FAMILIES[model_type]]
    if bad:
        raise SpeculantError(f"architectures={bad} is not supported for model_type={model_type!r}; "
                             f"allowed: {FAMILIES[model_type]}")
    unknown = sorted(set(d) - _READ - _HARMLESS - _FAMILY_FIELDS[model_type] - set(_MUST_BE_OFF))
    if unknown:
        raise SpeculantError(f"config field(s) {', '.join(unknown)} are not supported for model_type="
                             f"{model_type!r} (they may change the forward); see README 'Supported models'")
    on = [k for k in _MUST_BE_OFF if d.get(k)]
    if on:
        raise SpeculantError(f"config field(s) {', '.join(f'{k}={d[k]!r}' for k in on)} are not supported; "
                             "allowed: a decoder-only causal LM")
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise SpeculantError(f"config.json lacks {', '.join(missing)}; required for model_type={model_type!r}")
    return model_type


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP).

    Attributes are named as in Hugging Face's ``LlamaConfig``; ``head_dim`` defaults to
    ``hidden_size // num_attention_heads``.  Beyond those:

    Attributes:
        model_type: ``llama`` | ``mistral`` | ``qwen2`` | ``qwen3`` | ``gemma3_text`` (what :meth:`to_hf_dict`
            writes back).
        rope_scaling: ``None`` or validated RoPE scaling parameters (:func:`~speculant.models.rope.normalize_rope_scaling`).
        qkv_bias / o_bias / mlp_bias: biases of the q/k/v, o and MLP projections.
        sliding_window: attention window [tokens] when one is active, else ``None``; see :attr:`context_length`.
        qk_norm: an RMSNorm (weight ``[head_dim]``) over each q and each k head before RoPE; ``None`` (the default)
            means what the family has: ``True`` for ``qwen3`` and ``gemma3_text``.
        hidden_act: the MLP's gate activation: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (GeGLU, Gemma).
        query_pre_attn_scalar: attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (Gemma); ``None``:
            ``head_dim ** -0.5``.
        layer_types: per layer ``full_attention`` or ``sliding_attention`` (Gemma 3: the window is masked in the
            sliding layers, which use RoPE base :attr:`rope_local_theta`); ``None`` for the other families.
        rope_local_theta: RoPE base of the sliding layers (unscaled) [radians^-1 per position]; Gemma 3 only.
    Raises:
        SpeculantError: heads not a multiple of the KV heads, an odd ``head_dim``, bad RoPE scaling, ``qk_norm``
            other than the family's.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    model_type: str = "llama"
    rope_scaling: dict | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    qk_norm: bool | None = None
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise SpeculantError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise SpeculantError(f"head_dim={self.head_dim} is odd; allowed: an even head size (RoPE rotates pairs)")
        if self.model_type not in FAMILIES:
            raise SpeculantError(f"model_type={self.model_type!r} is not supported; allowed: {', '.join(FAMILIES)}")
        family_norm = self.model_type in ("qwen3", "gemma3_text")
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", family_norm)
        elif self.qk_norm != family_norm:
            raise SpeculantError(f"qk_norm={self.qk_norm!r} does not fit model_type={self.model_type!r}; "
                                 f"allowed: {family_norm} (q/k norms are qwen3's and gemma3_text's only)")
        object.__setattr__(self, "rope_scaling", normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings))
        self._check_gemma()

    def _check_gemma(self) -> None:
        """The Gemma 3 fields: all set for ``gemma3_text`` (one layer type per layer), none for the other families."""
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        act = "gelu_pytorch_tanh" if self.is_gemma else "silu"
        if self.hidden_act != act:
            raise SpeculantError(f"hidden_act={self.hidden_act!r} does not fit model_type={self.model_type!r}; "
                                 f"allowed: {act!r}")
        if not self.is_gemma:
            extra = [k for k in ("query_pre_attn_scalar", "layer_types", "rope_local_theta") if getattr(self, k) is not None]
            if extra:
                raise SpeculantError(f"{', '.join(extra)} are gemma3_text fields; allowed for "
                                     f"model_type={self.model_type!r}: none")
            return
        types = self.layer_types
        if types is None or len(types) != self.num_hidden_layers or set(types) - set(LAYER_TYPES):
            raise SpeculantError(f"layer_types={types!r} is invalid; allowed: one of {', '.join(LAYER_TYPES)} per layer "
                                 f"({self.num_hidden_layers} layers)")
        if "sliding_attention" in types and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise SpeculantError(f"sliding_window={self.sliding_window!r} is invalid; allowed: a positive integer")
        for key in ("query_pre_attn_scalar", "rope_local_theta"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise SpeculantError(f"{key}={value!r} is invalid; allowed: a number > 0")

    @property
    def is_gemma(self) -> bool:
        """Whether this is a Gemma 3 decoder (sandwich norms scaled by ``1 + weight``, scaled embeddings, GeGLU)."""
        return self.model_type == "gemma3_text"

    @property
    def norm_offset(self) -> float:
        """What every RMSNorm adds to its weight before scaling: 1 for Gemma (``x_hat * (1 + w)``), else 0."""
        return 1.0 if self.is_gemma else 0.0

    @property
    def embed_scale(self) -> float | None:
        """The factor token embeddings are multiplied by: ``sqrt(hidden_size)`` for Gemma, else ``None``."""
        return self.hidden_size ** 0.5 if self.is_gemma else None

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it is a sliding-window (local) layer whose window is applied in its mask."""
        if self.layer_types is None:
            return (False,) * self.num_hidden_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def context_length(self) -> int:
        """Longest sequence (prompt + output) we run [tokens]: ``max_position_embeddings``, capped at the
        sliding window when one is active (the window then never slides, so the forward stays exact)."""
        if self.sliding_window is None or self.is_gemma:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict of a ``llama``, ``mistral``, ``qwen2`` or ``qwen3`` model.

        Every field that changes the forward is either implemented or refused: unknown fields, other
        architectures, activations other than SiLU, RoPE types other than default/linear/dynamic/llama3,
        partial rotary embeddings, encoder-decoder settings.

        Raises:
            SpeculantError: one line naming the unsupported field(s) or value, or a missing required field.
        """
        model_type = _checked_model_type(d)
        if model_type == "gemma3_text":
            return cls(**_gemma3_fields(d))
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise SpeculantError(f"hidden_act={act!r} is not supported; allowed: 'silu'")
        defaults = FAMILY_DEFAULTS[model_type]

        def get(key):
            value = d.get(key)
            return defaults[key] if value is None else value

        rope = d.get("rope_parameters")
        if rope is None:
            rope = d.get("rope_scaling")
        if rope is not None and not isinstance(rope, dict):
            raise SpeculantError(f"rope_parameters={rope!r} is invalid; allowed: a dict")
        rope = dict(rope or {})
        if any(isinstance(v, dict) for v in rope.values()):
            raise SpeculantError("rope_parameters per layer type are not supported; allowed: one RoPE for all layers")
        theta = rope.get("rope_theta")
        theta = get("rope_theta") if theta is None else theta
        if model_type == "llama":
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
            mlp_bias = bool(d.get("mlp_bias", False))
        elif model_type == "qwen3":
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
            mlp_bias = False
        else:
            qkv_bias, o_bias, mlp_bias = model_type == "qwen2", False, False
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            max_position_embeddings=get("max_position_embeddings"),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=float(theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            head_dim=d.get("head_dim") if d.get("head_dim") is not None else defaults.get("head_dim"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            model_type=model_type,
            rope_scaling=rope,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_window=_active_window(d, model_type, get),
        )

    def to_hf_dict(self) -> dict:
        """The ``config.json`` dict that transformers reads as this model (``LlamaConfig``, ``MistralConfig``,
        ``Qwen2Config``, ``Qwen3Config`` or ``Gemma3TextConfig`` by :attr:`model_type`)."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        rope.update(self.rope_scaling or {})
        d = {k: v for k, v in asdict(self).items()
             if k not in ("rope_theta", "rope_scaling", "qkv_bias", "o_bias", "mlp_bias", "sliding_window", "qk_norm",
                          "hidden_act", "query_pre_attn_scalar", "layer_types", "rope_local_theta")}
        d.update(architectures=[FAMILIES[self.model_type]], hidden_act="silu", rope_parameters=rope)
        if self.is_gemma:
            return _gemma3_hf_dict(self, d)
        if self.model_type == "llama":
            if self.qkv_bias != self.o_bias:
                raise SpeculantError("a llama config has q/k/v and o biases together or not at all; "
                                     "use model_type='qwen2' for q/k/v biases only")
            d.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        elif self.model_type == "mistral":
            d.update(sliding_window=self.sliding_window)
        else:
            if self.model_type == "qwen3":
                if self.qkv_bias != self.o_bias or self.mlp_bias:
                    raise SpeculantError("a qwen3 config has q/k/v and o biases together or not at all, and no MLP "
                                         f"biases; got qkv_bias={self.qkv_bias}, o_bias={self.o_bias}, "
                                         f"mlp_bias={self.mlp_bias}")
                d.update(attention_bias=self.qkv_bias)
            d.update(use_sliding_window=self.sliding_window is not None, sliding_window=self.sliding_window,
                     max_window_layers=0)
        return d

    def with_layers(self, num_hidden_layers: int) -> "ModelConfig":
        """A copy with another layer count (used for truncated draft models)."""
        d = asdict(self)
        d["num_hidden_layers"] = num_hidden_layers
        if self.layer_types is not None:
            d["layer_types"] = self.layer_types[:num_hidden_layers]
        return ModelConfig(**d)


def _gemma3_rope(d: dict, defaults: dict) -> tuple[float, dict | None, float]:
    """``(global base, global scaling, local base)`` of a Gemma 3 config: ``rope_parameters`` per layer type
    (transformers 5), or the older ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    rope = d.get("rope_parameters")
    if rope is not None and (not isinstance(rope, dict) or set(rope) - set(LAYER_TYPES)
                             or not all(isinstance(v, dict) for v in rope.values())):
        raise SpeculantError(f"rope_parameters={rope!r} is invalid for gemma3_text; allowed: a dict of "
                             f"{' and '.join(LAYER_TYPES)} parameters")
    rope = rope or {}
    full = dict(rope.get("full_attention") or d.get("rope_scaling") or {})
    local = dict(rope.get("sliding_attention") or {})
    if normalize_rope_scaling(local, d.get("max_position_embeddings") or 1) is not None:
        raise SpeculantError(f"sliding_attention rope_parameters={local!r} are not supported; allowed: rope_type "
                             "'default' (the local layers' RoPE is unscaled)")
    theta = full.pop("rope_theta", None) or d.get("rope_theta") or defaults["rope_theta"]
    local_theta = local.get("rope_theta") or d.get("rope_local_base_freq") or defaults["rope_local_theta"]
    return float(theta), full or None, float(local_theta)


def _gemma3_fields(d: dict) -> dict:
    """:class:`ModelConfig` arguments of a ``gemma3_text`` config dict (transformers' ``Gemma3TextConfig`` defaults
    where a field is absent).

    Raises:
        SpeculantError: soft-capping, bidirectional attention, an activation other than ``gelu_pytorch_tanh``, bad
            RoPE parameters or layer types.
    """
    defaults = FAMILY_DEFAULTS["gemma3_text"]
    on = [f"{k}={d[k]!r}" for k in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention")
          if d.get(k)]
    if on:
        raise SpeculantError(f"config field(s) {', '.join(on)} are not supported; allowed: null/false (Gemma 3's "
                             "causal LM has neither soft-capping nor bidirectional attention)")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise SpeculantError(f"hidden_activation={act!r} is not supported; allowed: 'gelu_pytorch_tanh'")
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or defaults["sliding_window_pattern"]
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    theta, scaling, local_theta = _gemma3_rope(d, defaults)

    def get(key):
        return defaults[key] if d.get(key) is None else d[key]

    bias = bool(d.get("attention_bias", False))
    return dict(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                num_hidden_layers=n, num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                max_position_embeddings=get("max_position_embeddings"), rms_norm_eps=float(get("rms_norm_eps")),
                rope_theta=theta, tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
                head_dim=get("head_dim"), bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
                model_type="gemma3_text", rope_scaling=scaling, qkv_bias=bias, o_bias=bias,
                sliding_window=get("sliding_window"), hidden_act=act,
                query_pre_attn_scalar=get("query_pre_attn_scalar"), layer_types=tuple(types),
                rope_local_theta=local_theta)


def _gemma3_hf_dict(cfg: ModelConfig, d: dict) -> dict:
    """``d`` (the common fields of :meth:`ModelConfig.to_hf_dict`) completed as a ``Gemma3TextConfig`` dict."""
    if cfg.qkv_bias != cfg.o_bias or cfg.mlp_bias:
        raise SpeculantError("a gemma3_text config has q/k/v and o biases together or not at all, and no MLP biases; "
                             f"got qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias}, mlp_bias={cfg.mlp_bias}")
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    full.update(cfg.rope_scaling or {})
    d = {k: v for k, v in d.items() if k != "hidden_act"}
    d.update(hidden_activation=cfg.hidden_act, attention_bias=cfg.qkv_bias, sliding_window=cfg.sliding_window,
             query_pre_attn_scalar=cfg.query_pre_attn_scalar, layer_types=list(cfg.layer_types),
             rope_parameters={"full_attention": full,
                              "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}})
    return d


def _active_window(d: dict, model_type: str, get) -> int | None:
    """The sliding window [tokens] transformers applies to at least one layer, else ``None``."""
    if model_type == "llama":
        return None
    if model_type == "mistral":
        window = d["sliding_window"] if "sliding_window" in d else get("sliding_window")
    else:
        window = get("sliding_window") if d.get("use_sliding_window", False) else None
        types = d.get("layer_types")
        if types is not None:
            bad = sorted(set(types) - {"full_attention", "sliding_attention"})
            if bad or len(types) != d["num_hidden_layers"]:
                raise SpeculantError(f"layer_types={types!r} is not supported; allowed: "
                                     "'full_attention'/'sliding_attention', one per layer")
            sliding = "sliding_attention" in types
        else:
            sliding = d.get("max_window_layers", 28) < d["num_hidden_layers"]
        window = window if sliding else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise SpeculantError(f"sliding_window={window!r} is invalid; allowed: a positive integer or null")
    return window
