"""A Llama-family decoder: configuration, weights and the torch reference forward, in pieces the drafters need.

The pieces are ``embed`` -> ``run_layers(start, end)`` -> ``final_norm`` ->
``lm_head``, so the early-exit drafter can stop at any exit layer E and the
verifier can resume from layer E (LayerSkip, Elhoushi et al. 2024, Sec. 4).
Every call takes explicit RoPE position ids and an explicit boolean attention
mask (True = may attend), which is how tree attention is expressed.
Projections are fused (``qkv_proj``, ``gate_up_proj``): fewer kernel launches
per layer, the same bytes read, which is what decoding on a CPU is bound by.  Every projection is a
:class:`~speculant.models.linear.DecodeLinear`, which keeps a K+1-token verification block at about
the cost of one decoding step on CPU.  The layer's semantics are written here once (:func:`attention_inputs`,
attention, :func:`layer_output`); the runtime (:mod:`speculant.runtime.executor`) runs them, or their C twin
(:mod:`speculant.kernels.decode_step`), which the tests hold equal.  This module imports nothing of the runtime or
the kernels.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from .config import ModelConfig
from .kv_cache import KVCache, mark_dynamic
from .linear import DecodeLinear
from .rope import fill_rope_rows, rope_block_rows, rope_inv_frequencies


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), statistics in fp32: ``x / rms(x) * (offset + weight)``.

    ``offset``: 0 (Llama: the weight is the scale) or 1 (Gemma: the checkpoint stores ``scale - 1``, transformers'
    ``Gemma3RMSNorm``); the weight is kept as the checkpoint has it.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if not offset else torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight + self.offset if self.offset else self.weight
        return F.rms_norm(x, self.weight.shape, scale, self.eps)


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
        # Qwen3, Gemma 3: an RMSNorm over each q and k head ([head_dim] weights) between the projection and RoPE
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        # Gemma: scores scaled by query_pre_attn_scalar ** -0.5; every attention here scales by head_dim ** -0.5,
        # so q is multiplied by the ratio (None when it is 1)
        qpas = cfg.query_pre_attn_scalar
        self.q_scale = None if qpas is None or qpas == self.head_dim else (self.head_dim / qpas) ** 0.5


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = DecodeLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = DecodeLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"      # GeGLU (Gemma), else SwiGLU

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        # outside autograd the product goes into the activation's own buffer (the same bits: one rounding either
        # way): a 256-token prompt's torch layer step held [T, 3 * intermediate] floats at once instead of 4
        return self.down_proj(act * up if torch.is_grad_enabled() else act.mul_(up))


class DecoderLayer(nn.Module):
    """Llama's pre-norm layer; Gemma's adds a norm after attention's output and one before and after the MLP (its
    ``post_attention_layernorm`` normalises the attention output, not the residual stream)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.mlp = MLP(cfg)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset) if cfg.is_gemma else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset) if cfg.is_gemma else None


def attention_inputs(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """First half of a decoder layer: input norm, fused q/k/v projection, the per-head q/k norms where the model has
    them (Qwen3, Gemma 3: ``q_norm``/``k_norm`` over each head's ``Dh`` values), RoPE, and q times ``q_scale``
    where the model's attention scale is not ``Dh ** -0.5`` (Gemma's ``query_pre_attn_scalar``).

    ``x`` ``[B, T, D]`` -> ``q`` ``[B, H, T, Dh]``, ``k`` and ``v`` ``[B, Hkv, T, Dh]`` (float32).
    """
    attn = layer.self_attn
    b, t, _ = x.shape
    qkv = attn.qkv_proj(layer.input_layernorm(x)).view(b, t, attn.n_heads + 2 * attn.n_kv, attn.head_dim)
    if attn.q_norm is None:
        qk = apply_rope(qkv[:, :, :attn.n_heads + attn.n_kv], cos, sin)     # q and k heads in one go
    else:
        qk = apply_rope(torch.cat([attn.q_norm(qkv[:, :, :attn.n_heads]),
                                   attn.k_norm(qkv[:, :, attn.n_heads:attn.n_heads + attn.n_kv])], dim=2), cos, sin)
    q = qk[:, :, :attn.n_heads].transpose(1, 2)
    if attn.q_scale is not None:
        q = q * attn.q_scale
    k = qk[:, :, attn.n_heads:].transpose(1, 2)
    v = qkv[:, :, attn.n_heads + attn.n_kv:].transpose(1, 2)
    return q, k, v


def layer_output(layer: DecoderLayer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """Second half of a decoder layer: output projection, residual, post-attention norm, MLP, residual; Gemma's
    sandwich instead: ``x + norm(o_proj)``, then ``+ post_ff_norm(MLP(pre_ff_norm(x)))``.

    ``x`` ``[B, T, D]`` (the layer's input), ``attended`` ``[B, T, H * Dh]`` -> ``[B, T, D]``.
    """
    if layer.pre_feedforward_layernorm is None:
        x = x + layer.self_attn.o_proj(attended)
        return x + layer.mlp(layer.post_attention_layernorm(x))
    x = x + layer.post_attention_layernorm(layer.self_attn.o_proj(attended))
    return x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                   cache: KVCache | None, layer: int, cache_position: int) -> torch.Tensor:
    """The reference attention: scaled dot-product attention (SDPA; Vaswani et al. 2017, Eq. 1) over the KV cache
    (new keys/values written at ``cache_position``), computed in the cache's dtype (float32 for a float16 cache,
    whose keys and values are stored rounded), or in ``q``'s without a cache.

    ``q`` ``[B, H, T, Dh]``, ``k``/``v`` ``[B, Hkv, T, Dh]``, ``mask`` bool ``[T, S]`` or ``[B, 1, T, S]`` (True = may
    attend) or ``None`` -> ``[B, T, H * Dh]`` in ``q``'s dtype.  The runtime's executor
    (:mod:`speculant.runtime.executor`) swaps in our batch-invariant kernel where it runs.
    """
    dtype = q.dtype
    if cache is not None:
        compute = torch.float32 if cache.dtype == torch.float16 else cache.dtype
        k, v = cache.write(layer, k, v, cache_position)
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    b, h, t, d = out.shape
    return out.to(dtype).transpose(1, 2).reshape(b, t, h * d)


class LlamaDecoder(nn.Module):
    """A Llama-family causal LM: its configuration, its weights and the torch reference forward, with explicit
    masks and positions.

    Shapes: ``B`` batch, ``T`` new tokens, ``S`` visible cache slots, ``D`` hidden size, ``V`` vocabulary size.
    Logits are returned in fp32.  A decoder knows nothing of how it is run fast: the runtime's executor
    (:class:`speculant.runtime.executor.Executor`) owns the route (our fused C step, a compiled or eager torch
    step), the KV cache dtype and the kernels, and calls the layer halves defined here
    (:func:`attention_inputs`, :func:`layer_output`).  :meth:`run_layers` is the reference: plain torch ops,
    attention through SDPA (:func:`sdpa_attention`).  ``weight_format`` names the format its projections are
    stored in (``fp32`` until :func:`speculant.runtime.formats.apply_weight_format` swaps the modules);
    ``layer_token_counts`` counts the tokens each layer has processed (whoever runs it counts).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        if torch.empty(0).device.type == "meta":     # a skeleton weights are loaded into (runtime.store): no random
            # init, whose meta-device implementation imports torch._dynamo (~2.5 s of a warm start)
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                             _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        else:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.local_layers = cfg.local_layers       # per layer: a sliding-window layer (Gemma 3), see run_layers
        self.lm_head_proj = DecodeLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head_proj.weight = self.embed_tokens.weight
        self.layer_token_counts = [0] * cfg.num_hidden_layers   # tokens each layer has processed
        self.weight_format = "fp32"
        self.set_rope_tables()

    def set_rope_tables(self) -> None:
        """(Re)make the RoPE tables on the CPU (real tables even in a meta-device skeleton, without importing
        torch._dynamo): ``rope_cos``/``rope_sin`` ``[P, Dh]`` float32 (``P`` = ``config.context_length``), and for a
        model with sliding-window layers ``rope_cos_local``/``rope_sin_local`` with the local layers' base (Gemma 3),
        else ``None``.  Their rows are computed as positions come into use (:meth:`ensure_rope`; a KV cache of
        ``L`` slots computes the first ``L``): the rest of a table is never written, so its pages are never
        resident (a 32k-token context of Gemma 3's 256-wide heads is 128 MiB of tables)."""
        cfg = self.config
        with torch.device("cpu"):
            self._rope_inv = [rope_inv_frequencies(cfg)]
            if any(cfg.local_layers):
                self._rope_inv.append(rope_inv_frequencies(replace(cfg, rope_theta=cfg.rope_local_theta,
                                                                   rope_scaling=None)))
            tables = [torch.empty(cfg.context_length, cfg.head_dim) for _ in range(2 * len(self._rope_inv))]
        tables += [None] * (4 - len(tables))
        for name, table in zip(("rope_cos", "rope_sin", "rope_cos_local", "rope_sin_local"), tables):
            self.register_buffer(name, table, persistent=False)
        self.rope_filled = 0        # rows of the tables computed so far [positions]

    def ensure_rope(self, positions: int) -> None:
        """Compute the RoPE tables' rows up to position ``positions - 1`` (capped at the tables' length) where they
        are not yet: whole blocks of rows (:func:`~speculant.models.rope.fill_rope_rows`), so each row has the bits
        it would have were the table computed at once."""
        total = self.rope_cos.shape[0]
        if positions <= self.rope_filled or self.rope_filled >= total:
            return
        step = rope_block_rows(self.rope_cos.shape[1])
        end = min(total, -(-positions // step) * step)
        pairs = [(self.rope_cos, self.rope_sin), (self.rope_cos_local, self.rope_sin_local)]
        for (cos, sin), inv_freq in zip(pairs, self._rope_inv):
            fill_rope_rows(cos, sin, inv_freq, self.rope_filled, end)
        self.rope_filled = end

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, max_length: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> KVCache:
        """A static KV cache of ``max_length`` slots for every layer of this model, in ``dtype``; the RoPE rows of
        its positions are computed (:meth:`ensure_rope`)."""
        self.ensure_rope(max_length)
        c = self.config
        return KVCache(self.num_layers, c.num_key_value_heads, c.head_dim, max_length, batch, dtype, self.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, T]`` -> hidden states ``[B, T, D]`` (times ``sqrt(D)`` for Gemma, rounded to the
        embedding's dtype as transformers' ``Gemma3TextScaledWordEmbedding`` does)."""
        scale = self.config.embed_scale
        out = self.embed_tokens(input_ids)
        return out if scale is None else out * torch.tensor(scale, dtype=out.dtype)

    def run_layers(self, hidden: torch.Tensor, start: int, end: int, positions: torch.Tensor,
                   attention_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                   cache_position: int = 0, attention=None) -> torch.Tensor:
        """The reference forward of decoder layers ``start .. end-1`` over ``hidden`` ``[B, T, D]``.

        Args:
            positions: RoPE position ids ``[T]`` or ``[B, T]`` (int64).
            attention_mask: bool ``[T, S]`` or ``[B, 1, T, S]`` with
                ``S = cache_position + T`` when a cache is given (else ``S = T``);
                True where a query may attend a key.  ``None`` means causal.
            cache: KV cache; the new keys/values go to slots
                ``cache_position .. cache_position+T-1`` of layers ``start..end-1``.
            cache_position: first slot written (tokens).
            attention: ``attention(q, k, v, mask, is_causal, cache, layer, cache_position)`` with the signature of
                :func:`sdpa_attention` (the default); a runtime passes its own kernel's attention here.

        Returns:
            hidden states ``[B, T, D]`` leaving layer ``end-1``.
        Raises:
            SpeculantError: the block would write past the cache's ``max_length``.
        """
        attention = attention or sdpa_attention
        t = hidden.shape[1]
        self.ensure_rope(int(positions.max()) + 1 if positions.numel() else 0)
        cos, sin = self.rope_rows(positions, hidden)
        is_causal = False
        mask = attention_mask
        if mask is None and t > 1:
            if cache is None or cache_position == 0:
                is_causal = True
            else:
                mask = causal_mask(t, cache_position, hidden.device)
        keys = positions if cache is None else torch.arange(cache_position + t, device=hidden.device)
        local = self.local_rows(positions, hidden, mask, keys, range(start, end))
        for i in range(start, end):
            layer = self.layers[i]
            c, s, m = local if local and self.local_layers[i] else (cos, sin, mask)
            causal = is_causal and m is None
            q, k, v = attention_inputs(layer, hidden, c, s)
            hidden = layer_output(layer, hidden, attention(q, k, v, m, causal, cache, i, cache_position))
            self.layer_token_counts[i] += t
        return hidden

    def local_rows(self, positions: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor | None,
                   key_positions: torch.Tensor, layers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """What the sliding-window layers among ``layers`` use instead of the global ones (Gemma 3): their RoPE rows
        ``cos``/``sin`` (local base, as :meth:`rope_rows`) and ``mask`` with the window applied (:func:`window_mask`;
        ``None`` = causal, made explicit; ``mask`` itself when no key falls out of the window), or ``None`` when no
        layer of ``layers`` is local.

        ``positions`` ``[T]`` or ``[B, T]`` (the queries'), ``key_positions`` ``[S]`` (the keys' positions: their
        slots in a KV cache, whose slot of a prefix token is its position)."""
        if not any(self.local_layers[i] for i in layers):
            return None
        cos, sin = self.rope_rows(positions, hidden, local=True)
        window = self.config.sliding_window
        if int(positions.max()) - int(key_positions.min()) < window:
            return cos, sin, mask          # no key falls out of the window
        if mask is None:
            t, s = positions.shape[-1], key_positions.shape[-1]
            mask = causal_mask(t, s - t, hidden.device)
        return cos, sin, window_mask(mask, positions, key_positions, window)

    def rope_rows(self, positions: torch.Tensor, hidden: torch.Tensor,
                  local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE ``cos``/``sin`` ``[(B,) T, 1, Dh]`` at ``positions`` in ``hidden``'s dtype (dynamic in T for a
        compiled step, :mod:`speculant.runtime.compiled`); ``local``: the sliding-window layers' tables (Gemma 3)."""
        cos_table, sin_table = (self.rope_cos_local, self.rope_sin_local) if local else (self.rope_cos, self.rope_sin)
        cos = cos_table[positions].to(hidden.dtype).unsqueeze(-2)
        sin = sin_table[positions].to(hidden.dtype).unsqueeze(-2)
        if hidden.shape[1] > 1:   # one compiled graph serves every block size 2..N (see speculant.runtime.compiled)
            mark_dynamic(hidden, 1)
            for table in (cos, sin):
                mark_dynamic(table, table.dim() - 3)
        return cos, sin

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared final RMSNorm, applied at the last layer or at an early exit."""
        return self.norm(hidden)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalised hidden ``[..., D]`` -> fp32 logits ``[..., V]``."""
        return self.lm_head_proj(hidden).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                cache_position: int = 0) -> torch.Tensor:
        """Full reference forward: ids ``[B, T]`` -> fp32 logits ``[B, T, V]``."""
        if positions is None:
            positions = torch.arange(cache_position, cache_position + input_ids.shape[1], device=input_ids.device)
        h = self.run_layers(self.embed(input_ids), 0, self.num_layers, positions, attention_mask, cache, cache_position)
        return self.lm_head(self.final_norm(h))


def dense_mask(mask: torch.Tensor | None, t: int, prefix: int, device) -> torch.Tensor:
    """The bool mask ``[T, prefix + T]`` for one sequence: causal when ``mask`` is None; a ``[1, 1, T, S]`` mask squeezed."""
    if mask is None:
        return causal_mask(t, prefix, device)
    return mask.reshape(mask.shape[-2], mask.shape[-1])


def window_mask(mask: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` restricted to a sliding window: a query at position ``p`` keeps the keys at positions ``> p - window``
    (transformers' ``sliding_window_overlay``, Gemma 3's local layers; a token sees itself and ``window - 1`` before).

    ``mask`` bool ``[T, S]`` or ``[B, 1, T, S]``, ``positions`` ``[T]`` or ``[B, T]`` (queries), ``key_positions``
    ``[S]`` -> ``mask``'s shape.  In a KV cache a tree's keys sit at slots at or past their positions, so a slot
    taken as a key's position keeps every key the window keeps (and more only when the tree is deeper than the window).
    """
    q = positions.unsqueeze(-1) if positions.dim() == 1 else positions[:, None, :, None]
    keys = key_positions if key_positions.dim() == 1 else key_positions[:, None, None, :]
    return mask & (keys > q - window)


def causal_mask(t: int, prefix: int, device=None) -> torch.Tensor:
    """Bool mask ``[t, prefix + t]``: query i sees every prefix slot and new slots ``<= i``."""
    q = torch.arange(t, device=device)[:, None] + prefix
    k = torch.arange(prefix + t, device=device)[None, :]
    return k <= q
