"""Architecture hyper-parameters of a Llama-family decoder."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import SpeculantError


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP).

    Attributes are named as in Hugging Face's ``LlamaConfig``; ``head_dim``
    defaults to ``hidden_size // num_attention_heads``.
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

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise SpeculantError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (``model_type`` llama/mistral/qwen2-like).

        Raises:
            SpeculantError: for a model type this runtime does not implement.
        """
        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "mistral"):
            raise SpeculantError(f"model_type={model_type!r} is not supported; allowed: 'llama', 'mistral'")
        rope_theta = d.get("rope_theta")
        if rope_theta is None:
            rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            head_dim=d.get("head_dim"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )

    def to_hf_dict(self) -> dict:
        """The ``config.json`` dict that transformers' ``LlamaConfig`` reads."""
        d = asdict(self)
        d["model_type"] = "llama"
        d["architectures"] = ["LlamaForCausalLM"]
        d["hidden_act"] = "silu"
        return d

    def with_layers(self, num_hidden_layers: int) -> "ModelConfig":
        """A copy with another layer count (used for truncated draft models)."""
        d = asdict(self)
        d["num_hidden_layers"] = num_hidden_layers
        return ModelConfig(**d)
