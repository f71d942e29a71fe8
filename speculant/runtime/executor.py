"""The executor: runs a model description (:class:`~speculant.models.llama.LlamaDecoder`) fast on this machine.

The model is pure (config, weights, a torch reference forward); the executor owns how it is run:

- the route of a forward: every layer of a range as one call of our fused C step
  (:class:`speculant.kernels.decode_step.FusedLayers`, ``w4a8`` weights over a float32 or float16 KV cache), or
  the torch layer step (:mod:`speculant.runtime.steps`), compiled (:mod:`speculant.runtime.compiled`) or eager;
  prompts through the fused step where :attr:`Executor.fused_prompt_tokens` covers a chunk of them
  (:data:`PREFILL_CHUNK` tokens at a time: the same bits as the whole block in one call), else through the torch
  prompt step;
- the KV cache dtype (:attr:`Executor.kv_dtype`) and the kernels' buffers (built once from the packed weights).

Its one entry point for the layers is :meth:`Executor.run`, over a list of
:class:`~speculant.runtime.blocks.Block`: one sequence's one-token step, verification block, tree under its mask or
prompt is a list of one block; a batched round is a block per sequence, run in one pass over the weights
(:mod:`speculant.runtime.ragged`).  :meth:`~Executor.run_layers` is that call for one block, and
:meth:`~Executor.embed`, :meth:`~Executor.final_norm` and :meth:`~Executor.lm_head` go around it.  Nothing here measures: the choices come
from a :class:`~speculant.runtime.tune.TuneResult` (:meth:`Executor.from_tune`) or are given.
"""

from __future__ import annotations

import torch

from ..errors import SpeculantError
from ..kernels import attention as attention_kernel
from ..kernels import decode_step
from ..models.kv_cache import KVCache, mark_dynamic
from ..models.llama import LlamaDecoder, dense_mask
from .blocks import Block
from .steps import COMPILED_MAX_ROWS, decoder_layer_step, prefill_layer_step


PREFILL_CHUNK = 256
"""Rows of a block without a mask (a prompt, a prompt's continuation after a cached prefix) that the fused step runs
per call [tokens]: a longer block runs as consecutive chunks, each attending to the cache the chunks before it wrote,
which gives the very bits of the whole block in one call (each row's products and attention are computed alone:
``tests/test_decode_step.py``) with the call's workspaces (quadratic in its rows) bounded, as llama.cpp bounds its
micro-batch; not slower than the whole block on the models measured (BENCHMARKS.md BD)."""


def default_kv_dtype(head_dim: int) -> torch.dtype:
    """The KV cache dtype without a measurement: float32 where our attention kernel runs (batch-invariant rows),
    else float64 (SDPA, whose float64 rows rounded to float32 are batch-invariant too)."""
    return torch.float32 if attention_kernel.supports(head_dim) else torch.float64


def _projection_buffers(module) -> decode_step.ProjectionBuffers | None:
    """A W4A8/W8A8 projection's buffers for the fused step (a stack of them: its parts'), or ``None`` for any other
    module."""
    from .formats import StackedLinear, W4A8KLinear, W4A8Linear, W5A8Linear, W6A8Linear, W8A8Linear
    if type(module) is StackedLinear:
        parts = tuple(_projection_buffers(p) for p in module.parts)
        if any(p is None for p in parts):
            return None
        return decode_step.ProjectionBuffers(0, module.in_features, module.out_features, None, None, None,
                                             module.bias, parts=parts)
    if type(module) is W4A8Linear:
        bits, offsets = 4, getattr(module, "offsets", None)
    elif type(module) is W8A8Linear:
        bits, offsets = 8, getattr(module, "offsets", None)
    elif type(module) is W6A8Linear:
        bits, offsets = 6, module.supers
    elif type(module) is W5A8Linear:
        bits, offsets = 5, None
    elif type(module) is W4A8KLinear:
        bits, offsets = 4, module.supers
    else:
        return None
    return decode_step.ProjectionBuffers(bits, module.in_features, module.out_features, module.codes, module.scales,
                                         offsets, module.bias, module.scale_group)


def _norm_scale(norm) -> torch.Tensor:
    """What an :class:`~speculant.models.llama.RMSNorm` multiplies by, float32 ``[dim]``: its weight (Llama; the
    tensor itself), or ``weight + offset`` computed as its forward computes it (Gemma's ``1 + weight``; a copy)."""
    weight = norm.weight.detach()
    return (weight.float() + norm.offset).contiguous() if norm.offset else weight


def _layer_buffers(decoder: LlamaDecoder, i: int) -> decode_step.LayerBuffers | str:
    """Layer ``i``'s buffers for the fused step, or why not (a projection that is not W4A8/W8A8)."""
    layer = decoder.layers[i]
    modules = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    projections = [_projection_buffers(p) for p in modules]
    if any(p is None for p in projections):
        kind = type(next(m for m, p in zip(modules, projections) if p is None)).__name__
        return f"layer {i} has a projection that is not w4a8/w8a8 ({kind})"
    attn = layer.self_attn
    qk = [None if n is None else _norm_scale(n).float().contiguous() for n in (attn.q_norm, attn.k_norm)]
    if layer.pre_feedforward_layernorm is None:          # Llama's pre-norm layer
        return decode_step.LayerBuffers(_norm_scale(layer.input_layernorm),
                                        _norm_scale(layer.post_attention_layernorm), *projections, *qk)
    # Gemma 3's sandwich: post_attention_layernorm normalises the attention output, pre_feedforward the MLP's input
    return decode_step.LayerBuffers(_norm_scale(layer.input_layernorm), _norm_scale(layer.pre_feedforward_layernorm),
                                    *projections, *qk, attn_out_norm=_norm_scale(layer.post_attention_layernorm),
                                    mlp_out_norm=_norm_scale(layer.post_feedforward_layernorm),
                                    local=bool(decoder.local_layers[i]))


def model_buffers(decoder: LlamaDecoder) -> decode_step.ModelBuffers | str:
    """The buffers and shapes :class:`~speculant.kernels.decode_step.FusedLayers` runs ``decoder`` from, or why
    not (a projection that is not W4A8/W8A8).  Gemma 3's norm scales (``1 + weight``) are copies made here: the
    executor rebuilds its fused step when the projections are replaced, not when norm weights are changed in place."""
    cfg = decoder.config
    layers = []
    for i in range(decoder.num_layers):
        layer = _layer_buffers(decoder, i)
        if isinstance(layer, str):
            return layer
        layers.append(layer)
    attn = decoder.layers[0].self_attn if decoder.num_layers else None
    local = any(layer.local for layer in layers)
    shared = decoder.rope_cos.dtype == torch.float32 and decoder.rope_cos.is_contiguous()
    if not shared:                   # the step gets a float32 copy: every row of it computed first
        decoder.ensure_rope(decoder.rope_cos.shape[0])
    return decode_step.ModelBuffers(
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
        cfg.rms_norm_eps, layers, decoder.rope_cos.float().contiguous(), decoder.rope_sin.float().contiguous(),
        _norm_scale(decoder.norm).float().contiguous(), float(decoder.norm.eps),
        _projection_buffers(decoder.lm_head_proj),
        activation="gelu_tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "silu",
        q_scale=float(attn.q_scale) if attn is not None and attn.q_scale is not None else 1.0,
        window=int(cfg.sliding_window or 0) if local else 0,
        rope_cos_local=decoder.rope_cos_local.float().contiguous() if local else None,
        rope_sin_local=decoder.rope_sin_local.float().contiguous() if local else None,
        rope_filled=(lambda: decoder.rope_filled) if shared else None)      # rows computed as positions come


def why_not_fused(decoder: LlamaDecoder, kv_dtype: torch.dtype) -> str | None:
    """Why the fused step cannot run ``decoder`` over a ``kv_dtype`` KV cache, or ``None``."""
    if not decode_step.build.available():
        return f"the kernels {decode_step.build.unavailable_reason()}"
    buffers = model_buffers(decoder)
    return buffers if isinstance(buffers, str) else decode_step.why_not(buffers, kv_dtype)


class Executor:
    """Runs ``decoder``: the route, the KV cache dtype and the kernels' buffers of one model on this machine.

    Args:
        decoder: the model description (weights already in their format: build the executor after
            :func:`~speculant.runtime.formats.apply_weight_format`; the fused step's buffers are re-read when the
            projections are replaced).
        kv_dtype: the KV caches' dtype (float32 or float16: our attention kernel; float64: SDPA); default
            :func:`default_kv_dtype`.
        fused_prompt_tokens: prompts whose first :data:`PREFILL_CHUNK` tokens are at most this many run through the
            fused step, a chunk at a time (0: none).
        use_fused: run ``w4a8`` layers through the fused step where it applies (``False``: the torch step).
        layer_step: the one-sequence torch layer step (:func:`~speculant.runtime.steps.decoder_layer_step` or its
            compiled version, :func:`speculant.runtime.compiled.enable_compile`).
        threads: torch threads (torch's thread pool is the process's: :meth:`activate` sets it; ``None``: as is).
        weight_prefetch: how far ahead our products prefetch their codes [bytes] (0 or ``None``: none; never changes
            a result), passed to every kernel call of this model (:meth:`configure`).
        fp32_route: the float32 projections' route (a key of :data:`speculant.runtime.tune.FP32_ROUTES`; ``None``:
            plain ``F.linear``), set on this model's projections (:meth:`configure`).

    Attributes shared with the decoder (``config``, ``num_layers``, ``layers``, ``layer_token_counts``, ``dtype``,
    ``device``, ``weight_format``) read through, so a drafter may hold an executor where it held a decoder.
    """

    def __init__(self, decoder: LlamaDecoder, kv_dtype: torch.dtype | None = None, fused_prompt_tokens: int = 0,
                 use_fused: bool = True, layer_step=None, threads: int | None = None,
                 weight_prefetch: int | None = None, fp32_route: str | None = None):
        self.decoder = decoder
        self.threads, self.weight_prefetch, self.fp32_route = threads, weight_prefetch, fp32_route
        self.kv_dtype = kv_dtype if kv_dtype is not None else default_kv_dtype(decoder.config.head_dim)
        self.fused_prompt_tokens = fused_prompt_tokens
        self.use_fused = use_fused
        self.layer_step = layer_step or decoder_layer_step
        self.halves = None          # compiled (attention_inputs, layer_output) of the ragged pass, if compiled
        self._fused = None          # (key it was built for, FusedLayers or None)
        self.governor = None        # a ThreadGovernor (runtime.occupancy) where the loader lets threads follow load
        self.configure()

    @classmethod
    def from_tune(cls, decoder: LlamaDecoder, result, kv_dtype: torch.dtype | None = None) -> "Executor":
        """An executor with the choices of ``result`` (a :class:`~speculant.runtime.tune.TuneResult`, or ``None``:
        the defaults); ``kv_dtype`` overrides the tuned KV cache dtype."""
        from . import tune
        if result is None:
            return cls(decoder, kv_dtype)
        out = cls(decoder, kv_dtype or tune.attention_dtype(result), result.fused_prompt_tokens or 0,
                  threads=result.threads, weight_prefetch=result.weight_prefetch, fp32_route=result.fp32_route)
        if kv_dtype is None and result.kv_cache and out.fused_layers() is not None:   # the fused format's choice
            out.kv_dtype = getattr(torch, result.kv_cache)
        return out

    def configure(self) -> None:
        """Set this executor's per-model choices on its decoder's projections: the float32 route on the
        :class:`~speculant.models.linear.DecodeLinear` ones, the weight prefetch distance on the block-quantized ones
        (called at construction; call it again after replacing projections)."""
        from ..models.linear import DecodeLinear
        from .formats import _BlockLinear
        routes = None
        if self.fp32_route is not None:
            from .tune import FP32_ROUTES
            routes = FP32_ROUTES[self.fp32_route]
        for m in self.decoder.modules():
            if routes is not None and isinstance(m, DecodeLinear):
                m.routes = routes
            elif self.weight_prefetch is not None and isinstance(m, _BlockLinear):
                m.prefetch = self.weight_prefetch

    def activate(self, set_threads: bool = True) -> None:
        """Put this executor's thread count in force (with ``set_threads``, where set): torch's thread pool and
        OpenMP's are the process's."""
        if set_threads and self.threads:
            torch.set_num_threads(self.threads)

    def adapt_threads(self) -> None:
        """Between rounds: the thread count follows the machine's load where a :attr:`governor` is set
        (:class:`~speculant.runtime.occupancy.ThreadGovernor`; the loader sets one for the fused step when the count
        was not fixed by the user)."""
        if self.governor is not None:
            self.governor.tick()

    def replace(self, **choices) -> "Executor":
        """A copy of this executor with ``choices`` (constructor arguments: ``kv_dtype``, ``weight_prefetch``, ...)
        changed, on the same decoder, whose projections it leaves as they are (the tuner times alternatives this
        way: each copy's fused step carries its own choices)."""
        out = Executor.__new__(Executor)
        out.__dict__.update(self.__dict__)
        for name, value in choices.items():
            if name not in self.__dict__ or name.startswith("_") or name in ("decoder", "halves", "governor"):
                raise TypeError(f"Executor.replace: {name!r} is not a choice; allowed: kv_dtype, fused_prompt_tokens, "
                                "use_fused, layer_step, threads, weight_prefetch, fp32_route")
            setattr(out, name, value)
        out._fused = None
        return out

    def like(self, decoder: LlamaDecoder) -> "Executor":
        """An executor of ``decoder`` (e.g. a truncated copy of this one's) with this one's choices."""
        out = Executor(decoder, self.kv_dtype, self.fused_prompt_tokens, self.use_fused, self.layer_step,
                       self.threads, self.weight_prefetch, self.fp32_route)
        out.halves = self.halves
        return out

    def __getstate__(self):
        """Copies (``copy.deepcopy``, pickling) drop the fused step: it points into this decoder's tensors."""
        state = dict(self.__dict__)
        state["_fused"] = None
        return state

    # what a drafter reads of the model
    config = property(lambda self: self.decoder.config)
    num_layers = property(lambda self: self.decoder.num_layers)
    layers = property(lambda self: self.decoder.layers)
    layer_token_counts = property(lambda self: self.decoder.layer_token_counts)
    dtype = property(lambda self: self.decoder.dtype)
    device = property(lambda self: self.decoder.device)
    weight_format = property(lambda self: self.decoder.weight_format)

    def fused_layers(self) -> decode_step.FusedLayers | None:
        """The fused step of the decoder over a :attr:`kv_dtype` cache, or ``None`` where it does not apply: weights
        not in ``w4a8``, :attr:`use_fused` False, or what :func:`why_not_fused` names.  Built at the first call
        (and again when the cache dtype or the LM head module changed)."""
        dec = self.decoder
        if not self.use_fused or dec.weight_format != "w4a8":
            return None
        key = (self.kv_dtype, id(dec.lm_head_proj), id(dec.layers[0].self_attn.qkv_proj) if dec.layers else 0)
        if self._fused is None or self._fused[0] != key:
            buffers = model_buffers(dec) if decode_step.build.available() else None
            ok = buffers is not None and not isinstance(buffers, str) and \
                decode_step.why_not(buffers, self.kv_dtype) is None
            self._fused = (key, decode_step.FusedLayers(buffers, self.kv_dtype, self.weight_prefetch or 0)
                           if ok else None)
        return self._fused[1]

    def new_cache(self, max_length: int, batch: int = 1) -> KVCache:
        """A static KV cache of ``max_length`` slots for every layer, in :attr:`kv_dtype`."""
        return self.decoder.new_cache(max_length, batch, self.kv_dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, T]`` -> hidden states ``[B, T, D]``."""
        return self.decoder.embed(input_ids)

    def run(self, blocks: list[Block], end: int | None = None) -> list[torch.Tensor]:
        """Run each block through its layers ``block.start_layer .. end-1`` (default ``end``: all layers).

        One block runs by the route of this executor: the fused step where it applies (a prompt, ``cache_position``
        0 without a mask, only where its first :data:`PREFILL_CHUNK` tokens are within :attr:`fused_prompt_tokens`;
        a block without a mask longer than :data:`PREFILL_CHUNK` runs as chunks of it), else the torch step: the
        prompt step into an empty cache, the (compiled) layer step otherwise; a ``[B, T, D]`` block over a batched
        cache, or one without a cache, the model's layer halves with :func:`~speculant.runtime.steps.attend`.  Several blocks
        (each with its own cache: a batched round, batched prompts) run in one pass per layer, their rows
        concatenated for the projections and MLP, each row getting the bits it gets alone
        (:func:`speculant.runtime.ragged.ragged_run_layers`).

        Returns:
            per block, the hidden states (shaped as ``block.hidden``) leaving layer ``end - 1``.
        Raises:
            SpeculantError: a block would write past its cache's ``max_length``, or its mask has the wrong shape.
        """
        end = self.decoder.num_layers if end is None else end
        if len(blocks) == 1:
            b = blocks[0]
            return [self._run_one(b.hidden, b.start_layer, end, b.positions, b.mask, b.cache, b.cache_position)]
        from .ragged import ragged_run_layers
        return ragged_run_layers(self, blocks, end)

    def run_layers(self, hidden: torch.Tensor, start: int, end: int, positions: torch.Tensor,
                   attention_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                   cache_position: int = 0) -> torch.Tensor:
        """:meth:`run` of one block: layers ``start .. end-1`` over ``hidden`` ``[B, T, D]``.

        Arguments and result as :meth:`LlamaDecoder.run_layers` (``attention_mask`` bool ``[T, S]`` or
        ``[B, 1, T, S]``, True = may attend, ``None`` causal; new keys/values to slots ``cache_position ..``).

        Raises:
            SpeculantError: the block would write past the cache's ``max_length``.
        """
        return self.run([Block(hidden, start, positions, attention_mask, cache, cache_position)], end)[0]

    def _run_one(self, hidden, start, end, positions, attention_mask, cache, cache_position):
        """:meth:`run` of one block (see there)."""
        b, t, _ = hidden.shape
        if cache is None or b != 1:
            return self._run_batch(hidden, start, end, positions, attention_mask, cache, cache_position)
        counts = self.decoder.layer_token_counts
        visible = cache_position + t
        if visible > cache.max_length:
            raise SpeculantError(f"KV cache overflow: slot {visible} > max_length={cache.max_length}")
        prompt = cache_position == 0 and attention_mask is None and t > 1
        fused = self.fused_layers() if cache.dtype in attention_kernel.CACHE_DTYPES else None
        if fused is not None and not (prompt and min(t, PREFILL_CHUNK) > self.fused_prompt_tokens):
            if attention_mask is None and t > PREFILL_CHUNK:     # consecutive chunks: the same bits, bounded memory
                flat = positions.reshape(-1)
                return torch.cat([self._run_one(hidden[:, i:i + PREFILL_CHUNK], start, end, flat[i:i + PREFILL_CHUNK],
                                                None, cache, cache_position + i)
                                  for i in range(0, t, PREFILL_CHUNK)], dim=1)
            # every layer of the range in one C call (speculant.kernels.decode_step), RoPE rows and mask too
            mask = None if attention_mask is None else dense_mask(attention_mask, t, cache_position, hidden.device)
            out = fused.step(hidden, start, end, positions.reshape(-1), cache, cache_position, mask)
            for i in range(start, end):
                counts[i] += t
            return out.to(hidden.dtype)
        dec = self.decoder
        dec.ensure_rope(int(positions.max()) + 1)
        cos, sin = dec.rope_rows(positions, hidden)
        layers = dec.layers
        # Gemma 3's sliding-window layers: their own RoPE rows and the window in their mask (local_rows)
        local = dec.local_rows(positions.reshape(-1), hidden, None if prompt else dense_mask(
            attention_mask, t, cache_position, hidden.device), torch.arange(visible), range(start, end))
        if prompt:        # a prompt the fused step does not take (above): see prefill_layer_step
            for i in range(start, end):
                c, s, m = local if local and dec.local_layers[i] else (cos, sin, None)
                hidden = prefill_layer_step(layers[i], hidden, c, s, cache.layer_keys[i], cache.layer_values[i], m)
                counts[i] += t
            return hidden
        mask = dense_mask(attention_mask, t, cache_position, hidden.device)
        slots = torch.arange(cache_position, visible, device=hidden.device)
        for m in (mask,) + ((local[2],) if local else ()):
            mark_dynamic(m, 1)
            if t > 1:
                mark_dynamic(m, 0)
        if t > 1:
            mark_dynamic(slots, 0)
        # prefills (an empty cache) and long blocks run eagerly: one compiled graph fewer to load
        step = self.layer_step if cache_position > 0 and t <= COMPILED_MAX_ROWS else decoder_layer_step
        for i in range(start, end):
            c, s, m = local if local and dec.local_layers[i] else (cos, sin, mask)
            hidden = step(layers[i], hidden, c, s, m, slots, cache.layer_keys[i], cache.layer_values[i])
            counts[i] += t
        return hidden

    def _run_batch(self, hidden, start, end, positions, attention_mask, cache, cache_position):
        """:meth:`run_layers` of a ``[B, T, D]`` batch over one batched cache, or of any block without a cache: the
        model's reference forward with attention by :func:`~speculant.runtime.steps.attend` (in the cache's dtype)."""
        from .steps import attend
        return self.decoder.run_layers(hidden, start, end, positions, attention_mask, cache, cache_position,
                                       attention=attend)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared final RMSNorm (in C, the layers' own norm code, where the layers run as one C call)."""
        fused = self.fused_layers()
        if fused is not None and hidden.dtype == torch.float32:
            return fused.final_norm(hidden)
        return self.decoder.final_norm(hidden)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalised hidden ``[..., D]`` -> fp32 logits ``[..., V]`` (the head's kernel called directly where the
        layers run as one C call)."""
        fused = self.fused_layers()
        if fused is not None and fused.has_head and hidden.dtype == torch.float32:
            return fused.lm_head(hidden)
        return self.decoder.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                cache_position: int = 0) -> torch.Tensor:
        """Full forward: ids ``[B, T]`` -> fp32 logits ``[B, T, V]``."""
        if positions is None:
            positions = torch.arange(cache_position, cache_position + input_ids.shape[1], device=input_ids.device)
        h = self.run_layers(self.embed(input_ids), 0, self.num_layers, positions, attention_mask, cache, cache_position)
        return self.lm_head(self.final_norm(h))

    __call__ = forward


def executor_of(model) -> Executor:
    """The executor of a :class:`~speculant.models.loading.LoadedModel` (``model.executor``), made with the default
    choices (nothing measured) when it has none or its decoder was replaced; an :class:`Executor` is returned as
    it is."""
    if isinstance(model, Executor):
        return model
    ex = getattr(model, "executor", None)
    if ex is None or ex.decoder is not model.decoder:
        ex = Executor(model.decoder)
        model.executor = ex
    return ex
