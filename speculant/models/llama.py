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

from ..errors import SpeculantError
from ..kernels import attention as attention_kernel
from .config import ModelConfig
from .kv_cache import KVCache, mark_dynamic
from .linear import DecodeLinear
from .rope import rope_tables

COMPILED_MAX_ROWS = 64
"""Forwards of more tokens run the eager layer step (as prefills do): they are compute-bound, and every
compiled graph fewer shortens loading."""


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


def attention_inputs(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """First half of a decoder layer: input norm, fused q/k/v projection, RoPE.

    ``x`` ``[B, T, D]`` -> ``q`` ``[B, H, T, Dh]``, ``k`` and ``v`` ``[B, Hkv, T, Dh]`` (float32).
    """
    attn = layer.self_attn
    b, t, _ = x.shape
    qkv = attn.qkv_proj(layer.input_layernorm(x)).view(b, t, attn.n_heads + 2 * attn.n_kv, attn.head_dim)
    qk = apply_rope(qkv[:, :, :attn.n_heads + attn.n_kv], cos, sin)     # q and k heads in one go
    q = qk[:, :, :attn.n_heads].transpose(1, 2)
    k = qk[:, :, attn.n_heads:].transpose(1, 2)
    v = qkv[:, :, attn.n_heads + attn.n_kv:].transpose(1, 2)
    return q, k, v


def layer_output(layer: DecoderLayer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """Second half of a decoder layer: output projection, residual, post-attention norm, MLP, residual.

    ``x`` ``[B, T, D]`` (the layer's input), ``attended`` ``[B, T, H * Dh]`` -> ``[B, T, D]``.
    """
    x = x + layer.self_attn.o_proj(attended)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def decoder_layer_step(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       mask: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One decoder layer over ``x`` ``[1, T, D]`` with a static KV cache (one sequence: decoding and verification).

    ``keys``/``values`` ``[1, Hkv, S_max, Dh]`` are the layer's cache; ``mask`` bool ``[T, S]`` says which of
    the first ``S`` slots each row attends (True = may attend); the new keys/values go to ``slots``
    ``[T]`` (``S - T .. S - 1``).  Attention runs in the cache's dtype (see :func:`attend`): a float32 cache through
    our row-by-row kernel (:mod:`speculant.kernels.attention`), a float64 one through SDPA.  Everything here is
    traceable by ``torch.compile`` with ``T`` and ``S`` dynamic.
    """
    q, k, v = attention_inputs(layer, x, cos, sin)
    keys.index_copy_(2, slots, k.to(keys.dtype))
    values.index_copy_(2, slots, v.to(values.dtype))
    return layer_output(layer, x, cache_attention(q, keys, values, mask).to(x.dtype))


def cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one sequence's rows ``q`` ``[1, H, T, Dh]`` over the first ``S`` slots of one layer's cache
    ``keys``/``values`` ``[1, Hkv, S_max, Dh]`` where ``mask`` ``[T, S]`` (bool) is True -> ``[1, T, H * Dh]`` in the
    cache's dtype: a float32 cache through our row-by-row kernel (:mod:`speculant.kernels.attention`), a float64
    one through SDPA (see :attr:`LlamaDecoder.attention_dtype`); a float16 one through our kernel too (its keys and
    values read back as float32, every sum in float32).  Traceable by ``torch.compile``."""
    if keys.dtype in attention_kernel.CACHE_DTYPES:
        return torch.ops.speculant.attention(q, keys, values, mask, q.shape[-1] ** -0.5)
    visible = mask.shape[-1]
    out = F.scaled_dot_product_attention(q.to(keys.dtype), keys[:, :, :visible], values[:, :, :visible],
                                         attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(1, q.shape[2], -1)


def prefill_layer_step(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One decoder layer over a whole prompt ``x`` ``[1, T, D]`` into an empty static KV cache (slots ``0 .. T-1``).

    Attention is causal over the prompt itself and runs in float32 (``is_causal``: the flash kernel skips the
    masked half), whatever the cache's dtype (:func:`decoder_layer_step` attends in it): a prompt's forward is the same call for every
    method and is never compared with a one-token step, so its rows need no batch invariance, and float64
    attention over an 800-token prompt took 1.6 s of SmolLM2's 4.7 s prefill on a 2-core AVX2 CPU.  The keys and
    values are stored in the cache's dtype (float32 -> float64 is exact).
    """
    t = x.shape[1]
    q, k, v = attention_inputs(layer, x, cos, sin)
    keys[:, :, :t] = k
    values[:, :, :t] = v
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return layer_output(layer, x, out.transpose(1, 2).reshape(1, t, -1))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
           cache: KVCache | None, layer: int, cache_position: int) -> torch.Tensor:
    """Scaled dot-product attention over the KV cache (new keys/values written at ``cache_position``).

    Computed in the cache's dtype: a float32 cache (one sequence, where our kernels run) through our row-by-row
    kernel, a float64 one through SDPA; either makes each row's result independent of how many rows share the call (batch invariance;
    see :attr:`LlamaDecoder.attention_dtype`).  ``q`` ``[B, H, T, Dh]`` -> ``[B, T, H * Dh]`` in ``q``'s dtype.
    """
    dtype = q.dtype
    if cache is not None:
        if q.shape[0] == 1 and attention_kernel.supports(q.shape[-1], cache.dtype):
            cache.write(layer, k, v, cache_position)       # in the cache's dtype (float16: rounded to nearest even)
            mask = _dense_mask(mask, q.shape[2], cache_position, q.device)
            return cache_attention(q.float(), cache.layer_keys[layer], cache.layer_values[layer], mask).to(dtype)
        if cache.dtype == torch.float16:
            raise SpeculantError(f"a float16 KV cache is read by our attention kernel only (one sequence per call, "
                                 f"head size a multiple of 8); got batch {q.shape[0]}, head size {q.shape[-1]}; "
                                 "allowed here: a float32 or float64 cache")
        q, k, v = q.to(cache.dtype), k.to(cache.dtype), v.to(cache.dtype)
        k, v = cache.write(layer, k, v, cache_position)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    b, h, t, d = out.shape
    return out.to(dtype).transpose(1, 2).reshape(b, t, h * d)


class LlamaDecoder(nn.Module):
    """A Llama-family causal LM with an explicit-mask, explicit-position forward.

    Shapes: ``B`` batch, ``T`` new tokens, ``S`` visible cache slots, ``D``
    hidden size, ``V`` vocabulary size.  Logits are returned in fp32.

    ``attention_dtype`` is the KV cache's dtype, in which attention is computed: float32 (our row-by-row
    attention kernel, :mod:`speculant.kernels.attention`: AVX2, a C compiler, head size a multiple of 8) or
    float64 (SDPA); or float16, stored rounded and read by the same kernel in float32 (``--kv-cache float16``,
    :func:`speculant.runtime.loader.set_kv_cache`).  A new decoder takes float32 where the kernel runs; the runtime's loader sets what the kernel
    tuner measured faster on the machine at hand (:func:`speculant.runtime.tune.measure_attention`).  In float32, torch's CPU attention kernels give a query row different bits depending on
    how many rows share the call and how many masked keys follow (measured: 71 of 104 cases); those
    differences, rounded to bfloat16 at the next int4/int8 projection, moved SmolLM2's verification logits by
    up to 0.3 from the one-token step's.  Our kernel computes each row over its attended keys in slot order, the
    same operations whatever else is in the call; torch's, accumulated in float64 and rounded to float32, agree
    bit for bit too (tested in ``tests/test_runtime_formats.py``), at twice the cache bytes.  Either way
    verification sees exactly the logits decoding would.
    ``layer_step`` is :func:`decoder_layer_step` or its compiled version (:mod:`speculant.runtime.compiled`).
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
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head_proj = DecodeLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head_proj.weight = self.embed_tokens.weight
        self.layer_token_counts = [0] * cfg.num_hidden_layers   # tokens each layer has processed
        # KV cache / attention dtype, see attend(): float32 with our kernel, else float64
        self.attention_dtype: torch.dtype = (torch.float32 if attention_kernel.supports(cfg.head_dim)
                                             else torch.float64)
        self.layer_step = decoder_layer_step     # eager; speculant.runtime.compiled swaps in the compiled step
        self.use_fused = True                    # run w4a8 layers as one C call where it can (fused_layers)
        self._fused = None                       # (attention dtype it was decided for, FusedLayers or None)
        # prompts of up to this many tokens run through the fused step (causal mask) instead of prefill_layer_step:
        # chosen per machine by measurement (speculant.runtime.tune.measure_prompt_route); 0 = never
        self.fused_prompt_tokens = 0
        self.weight_format = "fp32"
        with torch.device("cpu"):     # real tables even in a meta-device skeleton (no torch._dynamo import)
            cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def __getstate__(self):
        """Copies (``copy.deepcopy``, pickling) drop the fused step: it points into this decoder's tensors."""
        state = dict(super().__getstate__())
        state["_fused"] = None
        return state

    def fused_layers(self):
        """The :class:`~speculant.kernels.decode_step.FusedLayers` of this decoder (every layer of a forward over
        a float32 or float16 KV cache in one C call), or ``None`` where it does not apply: weights not in ``w4a8``,
        :attr:`use_fused` False, or what :func:`~speculant.kernels.decode_step.why_not` names.  Built at the
        first call, after the weights were packed (it points into them)."""
        if not self.use_fused or self.weight_format != "w4a8":
            return None
        if self._fused is None or self._fused[0] != self.attention_dtype:    # built (or refused) once per cache dtype
            from ..kernels import decode_step
            fused = decode_step.FusedLayers(self) if decode_step.why_not(self) is None else None
            self._fused = (self.attention_dtype, fused)
        return self._fused[1]

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
        """A static KV cache of ``max_length`` slots for every layer of this model, in :attr:`attention_dtype`."""
        c = self.config
        return KVCache(self.num_layers, c.num_key_value_heads, c.head_dim, max_length, batch,
                       self.attention_dtype, self.device)

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
        b, t, _ = hidden.shape
        counts = self.layer_token_counts
        if cache is not None and b == 1:      # decoding: one fused (compilable) step per layer
            visible = cache_position + t
            if visible > cache.max_length:
                raise SpeculantError(f"KV cache overflow: slot {visible} > max_length={cache.max_length}")
            prompt = cache_position == 0 and attention_mask is None and t > 1
            fused = self.fused_layers() if cache.dtype in attention_kernel.CACHE_DTYPES else None
            if fused is not None and not (prompt and t > self.fused_prompt_tokens):
                # every layer of the range in one C call (speculant.kernels.decode_step), RoPE rows and mask too
                mask = None if attention_mask is None else _dense_mask(attention_mask, t, cache_position, hidden.device)
                out = fused.step(hidden, start, end, positions.reshape(-1), cache, cache_position, mask)
                for i in range(start, end):
                    counts[i] += t
                return out.to(hidden.dtype)
        cos, sin = self._rope_rows(positions, hidden)
        if cache is not None and b == 1:
            if prompt:        # a prompt the fused step does not take (above): see prefill_layer_step
                for i in range(start, end):
                    hidden = prefill_layer_step(self.layers[i], hidden, cos, sin, cache.layer_keys[i],
                                                cache.layer_values[i])
                    counts[i] += t
                return hidden
            mask = _dense_mask(attention_mask, t, cache_position, hidden.device)
            mark_dynamic(mask, 1)
            slots = torch.arange(cache_position, visible, device=hidden.device)
            if t > 1:
                mark_dynamic(slots, 0)
                mark_dynamic(mask, 0)
            # prefills (an empty cache) and long blocks run eagerly: one compiled graph fewer to load
            step = self.layer_step if cache_position > 0 and t <= COMPILED_MAX_ROWS else decoder_layer_step
            for i in range(start, end):
                hidden = step(self.layers[i], hidden, cos, sin, mask, slots, cache.layer_keys[i], cache.layer_values[i])
                counts[i] += t
            return hidden
        is_causal = False
        mask = attention_mask
        if mask is None and t > 1:
            if cache is None or cache_position == 0:
                is_causal = True
            else:
                mask = causal_mask(t, cache_position, hidden.device)
        for i in range(start, end):
            layer = self.layers[i]
            q, k, v = attention_inputs(layer, hidden, cos, sin)
            hidden = layer_output(layer, hidden, attend(q, k, v, mask, is_causal, cache, i, cache_position))
            counts[i] += t
        return hidden

    def _rope_rows(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE ``cos``/``sin`` ``[(B,) T, 1, Dh]`` at ``positions`` in ``hidden``'s dtype (dynamic in T for the
        compiled step)."""
        cos = self.rope_cos[positions].to(hidden.dtype).unsqueeze(-2)
        sin = self.rope_sin[positions].to(hidden.dtype).unsqueeze(-2)
        if hidden.shape[1] > 1:   # one compiled graph serves every block size 2..N (see speculant.runtime.compiled)
            mark_dynamic(hidden, 1)
            for table in (cos, sin):
                mark_dynamic(table, table.dim() - 3)
        return cos, sin

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared final RMSNorm, applied at the last layer or at an early exit (in C, the layers' own norm
        code, where the layers run as one C call: :meth:`fused_layers`)."""
        fused = self.fused_layers()
        if fused is not None and hidden.dtype == torch.float32:
            return fused.final_norm(hidden)
        return self.norm(hidden)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalised hidden ``[..., D]`` -> fp32 logits ``[..., V]`` (the head's kernel called directly where
        the layers run as one C call)."""
        fused = self.fused_layers()
        if fused is not None and fused.has_head and hidden.dtype == torch.float32:
            return fused.lm_head(hidden)
        return self.lm_head_proj(hidden).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                cache_position: int = 0) -> torch.Tensor:
        """Full forward: ids ``[B, T]`` -> fp32 logits ``[B, T, V]``."""
        if positions is None:
            positions = torch.arange(cache_position, cache_position + input_ids.shape[1], device=input_ids.device)
        h = self.run_layers(self.embed(input_ids), 0, self.num_layers, positions, attention_mask, cache, cache_position)
        return self.lm_head(self.final_norm(h))


def _dense_mask(mask: torch.Tensor | None, t: int, prefix: int, device) -> torch.Tensor:
    """The bool mask ``[T, prefix + T]`` for one sequence: causal when ``mask`` is None; a ``[1, 1, T, S]`` mask squeezed."""
    if mask is None:
        return causal_mask(t, prefix, device)
    return mask.reshape(mask.shape[-2], mask.shape[-1])


def causal_mask(t: int, prefix: int, device=None) -> torch.Tensor:
    """Bool mask ``[t, prefix + t]``: query i sees every prefix slot and new slots ``<= i``."""
    q = torch.arange(t, device=device)[:, None] + prefix
    k = torch.arange(prefix + t, device=device)[None, :]
    return k <= q
