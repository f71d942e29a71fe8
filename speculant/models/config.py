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

Sliding windows: a query at position p attends keys at positions ``> p - window`` (transformers'
``sliding_window_overlay``).  We never run positions at or past the window: the usable context
(:attr:`ModelConfig.context_length`) is ``min(max_position_embeddings, window)``, inside which a sliding
window attends every earlier position, so our logits equal transformers' on every sequence we accept.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import SpeculantError
from .rope import normalize_rope_scaling

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}
"""Supported ``model_type`` -> its ``architectures`` entry."""

# transformers 5.24's defaults for fields a config.json may leave out (tests check them against transformers)
FAMILY_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": None},
    "mistral": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096,
              "head_dim": 128},
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_READ = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters",
         "rope_scaling", "tie_word_embeddings", "head_dim", "bos_token_id", "eos_token_id", "hidden_act",
         "model_type", "architectures"}
_FAMILY_FIELDS = {"llama": {"attention_bias", "mlp_bias"}, "mistral": {"sliding_window"},
                  "qwen2": {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
                  "qwen3": {"attention_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}}
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


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP).

    Attributes are named as in Hugging Face's ``LlamaConfig``; ``head_dim`` defaults to
    ``hidden_size // num_attention_heads``.  Beyond those:

    Attributes:
        model_type: ``llama`` | ``mistral`` | ``qwen2`` | ``qwen3`` (what :meth:`to_hf_dict` writes back).
        rope_scaling: ``None`` or validated RoPE scaling parameters (:func:`~speculant.models.rope.normalize_rope_scaling`).
        qkv_bias / o_bias / mlp_bias: biases of the q/k/v, o and MLP projections.
        sliding_window: attention window [tokens] when one is active, else ``None``; see :attr:`context_length`.
        qk_norm: an RMSNorm (weight ``[head_dim]``) over each q and each k head before RoPE; ``None`` (the default)
            means what the family has: ``True`` for ``qwen3`` only.
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
        family_norm = self.model_type == "qwen3"
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", family_norm)
        elif self.qk_norm != family_norm:
            raise SpeculantError(f"qk_norm={self.qk_norm!r} does not fit model_type={self.model_type!r}; "
                                 f"allowed: {family_norm} (q/k norms are qwen3's only)")
        object.__setattr__(self, "rope_scaling", normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings))

    @property
    def context_length(self) -> int:
        """Longest sequence (prompt + output) we run [tokens]: ``max_position_embeddings``, capped at the
        sliding window when one is active (the window then never slides, so the forward stays exact)."""
        if self.sliding_window is None:
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
        model_type = d.get("model_type", "llama")
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
        ``Qwen2Config`` or ``Qwen3Config`` by :attr:`model_type`)."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        rope.update(self.rope_scaling or {})
        d = {k: v for k, v in asdict(self).items()
             if k not in ("rope_theta", "rope_scaling", "qkv_bias", "o_bias", "mlp_bias", "sliding_window", "qk_norm")}
        d.update(architectures=[FAMILIES[self.model_type]], hidden_act="silu", rope_parameters=rope)
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
        return ModelConfig(**d)


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
