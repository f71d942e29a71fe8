"""Our forward pass of a Llama-family decoder, in pieces the drafters need.

The pieces are ``embed`` -> ``run_layers(start, end)`` -> ``final_norm`` ->
``lm_head``, so the early-exit drafter can stop at any exit layer E and the
verifier can resume from layer E (LayerSkip, Elhoushi et al. 2024, Sec. 4).
Every call takes explicit RoPE position ids and an explicit boolean attention
mask (True = may attend), which is how tree attention is expressed.
Projections are fused (``qkv_proj``, ``gate_up_proj``): fewer kernel launches
per layer, the same bytes read, which is what decoding on a CPU is bound by.  Every projection is a
:class:`~speculant.models.linear.DecodeLinear`, which keeps a K+1-token verification block at about
the cost of one decoding step on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kv_cache import KVCache
from .linear import DecodeLinear
from .rope import rope_tables


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), statistics in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) * sin == roll(x) * sin_signed``."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = DecodeLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = DecodeLinear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int, cache_position: int, is_causal: bool):
        b, t, _ = x.shape
        qkv = self.qkv_proj(x).view(b, t, self.n_heads + 2 * self.n_kv, self.head_dim)
        qk = apply_rope(qkv[:, :, :self.n_heads + self.n_kv], cos, sin)     # q and k heads in one go
        q = qk[:, :, :self.n_heads].transpose(1, 2)
        k = qk[:, :, self.n_heads:].transpose(1, 2)
        v = qkv[:, :, self.n_heads + self.n_kv:].transpose(1, 2)
        if cache is not None:
            k, v = cache.write(layer, k, v, cache_position)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = DecodeLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = DecodeLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, layer, cache_position, is_causal):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, cache_position, is_causal)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaDecoder(nn.Module):
    """A Llama-family causal LM with an explicit-mask, explicit-position forward.

    Shapes: ``B`` batch, ``T`` new tokens, ``S`` visible cache slots, ``D``
    hidden size, ``V`` vocabulary size.  Logits are returned in fp32.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head_proj = DecodeLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head_proj.weight = self.embed_tokens.weight
        self.layer_token_counts = [0] * cfg.num_hidden_layers   # tokens each layer has processed
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, max_length: int, batch: int = 1) -> KVCache:
        """A static KV cache of ``max_length`` slots for every layer of this model."""
        c = self.config
        return KVCache(self.num_layers, c.num_key_value_heads, c.head_dim, max_length, batch, self.dtype, self.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, T]`` -> hidden states ``[B, T, D]``."""
        return self.embed_tokens(input_ids)

    def run_layers(self, hidden: torch.Tensor, start: int, end: int, positions: torch.Tensor,
                   attention_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                   cache_position: int = 0) -> torch.Tensor:
        """Run decoder layers ``start .. end-1`` over ``hidden`` ``[B, T, D]``.

        Args:
            positions: RoPE position ids ``[T]`` or ``[B, T]`` (int64).
            attention_mask: bool ``[T, S]`` or ``[B, 1, T, S]`` with
                ``S = cache_position + T`` when a cache is given (else ``S = T``);
                True where a query may attend a key.  ``None`` means causal.
            cache: KV cache; the new keys/values go to slots
                ``cache_position .. cache_position+T-1`` of layers ``start..end-1``.
            cache_position: first slot written (tokens).

        Returns:
            hidden states ``[B, T, D]`` leaving layer ``end-1``.
        """
        t = hidden.shape[1]
        cos = self.rope_cos[positions].to(hidden.dtype).unsqueeze(-2)     # [(B,) T, 1, Dh]
        sin = self.rope_sin[positions].to(hidden.dtype).unsqueeze(-2)
        is_causal = False
        mask = attention_mask
        if mask is None and t > 1:
            if cache is None or cache_position == 0:
                is_causal = True
            else:
                mask = causal_mask(t, cache_position, hidden.device)
        counts = self.layer_token_counts
        for i in range(start, end):
            hidden = self.layers[i](hidden, cos, sin, mask, cache, i, cache_position, is_causal)
            counts[i] += t
        return hidden

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared final RMSNorm, applied at the last layer or at an early exit."""
        return self.norm(hidden)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalised hidden ``[..., D]`` -> fp32 logits ``[..., V]``."""
        return self.lm_head_proj(hidden).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                cache_position: int = 0) -> torch.Tensor:
        """Full forward: ids ``[B, T]`` -> fp32 logits ``[B, T, V]``."""
        if positions is None:
            positions = torch.arange(cache_position, cache_position + input_ids.shape[1], device=input_ids.device)
        h = self.run_layers(self.embed(input_ids), 0, self.num_layers, positions, attention_mask, cache, cache_position)
        return self.lm_head(self.final_norm(h))


def causal_mask(t: int, prefix: int, device=None) -> torch.Tensor:
    """Bool mask ``[t, prefix + t]``: query i sees every prefix slot and new slots ``<= i``."""
    q = torch.arange(t, device=device)[:, None] + prefix
    k = torch.arange(prefix + t, device=device)[None, :]
    return k <= q
