"""Transformers' own decoding on *our* weights: the baselines ``hf-ar``, ``hf-early-exit``,
``hf-prompt-lookup`` and ``hf-assistant``.

The Hugging Face ``LlamaForCausalLM`` is built in-process from the loaded
decoder with :func:`speculant.models.loading.ours_to_hf_state`, so both
runtimes decode the same weights from the same prompt ids.  Target calls are
counted with a forward pre-hook (for ``assistant_early_exit`` only calls that
run every layer count), which gives transformers' block efficiency
(emitted tokens per target call, prefill included, as in
:class:`speculant.engine.stats.GenerationStats`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from ..errors import SpeculantError
from ..models.llama import LlamaDecoder
from ..models.loading import LoadedModel, ours_to_hf_state
from ..sampling.processors import SamplingConfig


def hf_model_from_decoder(decoder: LlamaDecoder):
    """A transformers ``*ForCausalLM`` of the decoder's family (Llama, Mistral, Qwen2) holding a copy of
    ``decoder``'s weights (same dtype, eval mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = decoder.config.to_hf_dict()
    cfg = AutoConfig.for_model(d.pop("model_type"), **{k: v for k, v in d.items() if k != "architectures"})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    state = {k: v.clone() for k, v in ours_to_hf_state(decoder).items()}
    hf.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    # non-persistent buffers (RoPE inverse frequencies, Gemma's embedding scale) were created on the meta device
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)
    embed = hf.model.embed_tokens
    if getattr(embed, "embed_scale", None) is not None and embed.embed_scale.is_meta:
        embed.register_buffer("embed_scale", torch.tensor(decoder.config.embed_scale), persistent=False)
    left = [n for n, b in hf.named_buffers() if b.is_meta]
    if left:
        raise SpeculantError(f"transformers' {type(hf).__name__} has buffers this baseline does not set: {left}")
    return hf.to(decoder.dtype).eval().requires_grad_(False)


def truncated_hf_copy(hf, exit_layer: int):
    """A standalone copy of transformers' model ``hf`` with its first ``exit_layer`` layers (the draft of ``hf-assistant``)."""
    layers = hf.model.layers
    hf.model.layers = torch.nn.ModuleList(list(layers)[:exit_layer])
    try:
        draft = copy.deepcopy(hf)
    finally:
        hf.model.layers = layers
    draft.config.num_hidden_layers = exit_layer
    if draft.config.tie_word_embeddings:
        draft.lm_head.weight = draft.model.embed_tokens.weight
    return draft


def hf_model_for(model: LoadedModel):
    """transformers' model on ``model``'s float32 weights (read again when ``model``'s projections are in a packed
    format: from its directory, or for a GGUF model from its float32 checkpoint, which
    :func:`~speculant.models.loading.read_checkpoint` writes the first time)."""
    if model.weights == "fp32":
        return hf_model_from_decoder(model.decoder)
    from ..models.loading import is_gguf_source, load_hf_dir, read_checkpoint
    if is_gguf_source(model.name):
        return hf_model_from_decoder(read_checkpoint(model.name).decoder)
    return hf_model_from_decoder(load_hf_dir(model.path, name=model.name).decoder)


@dataclass
class HFRun:
    """One transformers ``generate`` call: new token ids (prompt excluded), wall time [s], target calls
    (every layer) and draft calls (early exit or assistant model)."""

    token_ids: list[int]
    seconds: float
    target_forwards: int
    draft_forwards: int = 0


class HFMethod:
    """A transformers decoding method on the weights of ``model``.

    Args:
        model: our loaded model (weights and tokenizer are shared with the HF copy).
        kind: ``hf-ar`` | ``hf-early-exit`` | ``hf-prompt-lookup`` | ``hf-assistant``.
        exit_layer: E for ``hf-early-exit`` (``assistant_early_exit=E``) and ``hf-assistant``
            (``assistant_model`` = a standalone copy of the first E layers).
        num_tokens: K drafted tokens per round; ``None`` keeps transformers' defaults
            (20 with its heuristic schedule and confidence threshold for assistants, 10 for prompt lookup).
            An explicit K uses the constant schedule with the confidence threshold off, like our fixed chains.
        max_ngram: ``max_matching_ngram_size`` for prompt lookup (``None``: transformers' default 2).
        hf_model: reuse an already built HF target (saves memory when several methods run).
    Raises:
        SpeculantError: unknown kind or a missing/out-of-range E.
    """

    KINDS = ("hf-ar", "hf-early-exit", "hf-prompt-lookup", "hf-assistant")

    def __init__(self, model: LoadedModel, kind: str, exit_layer: int | None = None, num_tokens: int | None = None,
                 max_ngram: int | None = None, hf_model=None):
        if kind not in self.KINDS:
            raise SpeculantError(f"method={kind!r} is unknown; allowed: {', '.join(self.KINDS)}")
        n_layers = model.decoder.num_layers
        if kind in ("hf-early-exit", "hf-assistant"):
            if exit_layer is None or not 1 <= exit_layer < n_layers:
                raise SpeculantError(f"{kind}: E={exit_layer!r} is out of range; allowed: 1..{n_layers - 1}")
        self.kind, self.exit_layer, self.num_tokens, self.max_ngram = kind, exit_layer, num_tokens, max_ngram
        self.model = model
        self.hf = hf_model if hf_model is not None else hf_model_for(model)
        self.assistant = None
        if kind == "hf-assistant":
            self.assistant = truncated_hf_copy(self.hf, exit_layer)
        self.calls = self.draft_calls = 0
        full = model.decoder.num_layers
        base = self.hf.model

        def count(_module, _args):
            if base.config.num_hidden_layers == full:
                self.calls += 1
            else:
                self.draft_calls += 1

        def count_draft(_module, _args):
            self.draft_calls += 1
        self._hooks = [self.hf.register_forward_pre_hook(count)]
        if self.assistant is not None:
            self._hooks.append(self.assistant.register_forward_pre_hook(count_draft))
        self._gen_cfg = copy.deepcopy(self.hf.generation_config)
        self._asst_cfg = copy.deepcopy(self.assistant.generation_config) if self.assistant is not None else None

    def close(self) -> None:
        """Remove the call-counting hooks."""
        for h in self._hooks:
            h.remove()

    def _kwargs(self, max_new_tokens: int, temperature: float, seed: int, ignore_eos: bool = False) -> dict:
        eos = self.model.eos_token_ids
        kw = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens if ignore_eos else 0,
                  eos_token_id=eos or None,
                  pad_token_id=eos[0] if eos else 0, top_k=0, top_p=1.0, use_cache=True)
        if SamplingConfig(temperature).greedy:        # the same greedy threshold as our methods
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:
            kw.update(do_sample=True, temperature=temperature)
        if self.kind == "hf-early-exit":
            kw["assistant_early_exit"] = self.exit_layer
            kw["assistant_model"] = self.hf
        elif self.kind == "hf-assistant":
            kw["assistant_model"] = self.assistant
        elif self.kind == "hf-prompt-lookup":
            kw["prompt_lookup_num_tokens"] = self.num_tokens or 10
            if self.max_ngram:
                kw["max_matching_ngram_size"] = self.max_ngram
        if self.kind in ("hf-early-exit", "hf-assistant") and self.num_tokens:
            kw.update(num_assistant_tokens=self.num_tokens, num_assistant_tokens_schedule="constant",
                      assistant_confidence_threshold=0.0)
        return kw

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
            ignore_eos: bool = False) -> HFRun:
        """Generate from ``prompt_ids`` (already chat-templated); times the whole ``generate`` call.  ``ignore_eos``:
        exactly ``max_new_tokens`` tokens (transformers' ``min_new_tokens``, which masks EOS until then)."""
        # assistants keep their adaptive K in their generation_config: restore it so calls are independent
        self.hf.generation_config = copy.deepcopy(self._gen_cfg)
        if self.assistant is not None:
            self.assistant.generation_config = copy.deepcopy(self._asst_cfg)
        kw = self._kwargs(max_new_tokens, temperature, seed, ignore_eos)
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        torch.manual_seed(seed)
        self.calls = self.draft_calls = 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        seconds = time.perf_counter() - t0
        return HFRun(out[0, len(prompt_ids):].tolist(), seconds, self.calls, self.draft_calls)
