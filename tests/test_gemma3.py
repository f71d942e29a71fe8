"""Gemma 3 (``model_type: gemma3_text``, GGUF architecture ``gemma3``): four norms per layer scaled by ``1 + weight``,
q/k norms, GeGLU, embeddings times ``sqrt(hidden)``, ``query_pre_attn_scalar``, interleaved sliding-window (local)
and global layers with their own RoPE bases.

Checked on a tiny random ``Gemma3ForCausalLM`` whose window (8) is shorter than the prompts, with both kinds of
layer and ``query_pre_attn_scalar != head_dim``: our fp32 logits equal transformers' within 1e-4 relative, in one
forward and token by token through the runtime's steps; the HF directory round trip; greedy ``early-exit``,
``prompt-lookup``, ``rsd-s`` and ``draft-model`` (truncated) token-identical to ``ar`` (fp32 on the torch step, and
``w4a8`` on the fused C step, which agrees with the torch step on the same weights past the window); a batched
(ragged) pass equal to the sequences run alone (bit for bit on the fused step); tiny GGUF files (norms stored as
``1 + weight``) equal to transformers' reading of them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (ARCH_SPECS, assert_hf_dir_round_trips, assert_methods_equal_ar, greedy_ids, load_hf_dir_in,
                     random_hf_model, save_with_word_tokenizer)
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from speculant.errors import SpeculantError
from speculant.models.config import ModelConfig
from speculant.models.loading import load_hf_dir, ours_to_hf_state
from speculant.runtime.blocks import Block
from speculant.runtime.executor import executor_of, why_not_fused
from speculant.runtime.formats import apply_weight_format, format_available

VOCAB = 100
WINDOW = 8
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
             sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=24)
PROMPTS = ([3, 17, 42, 8, 25, 60, 1, 9, 33, 70, 12, 5], [7, 8, 9, 10] * 4, [11, 12, 13, 14, 15, 16, 11, 12, 13])
IDS = torch.tensor([[5, 9, 2, 7, 33, 81, 14, 60, 2, 99, 0, 41, 17, 3, 3, 8, 71, 22, 40, 5]])   # 20 > WINDOW


def _hf_model(seed: int = 0, **changes) -> Gemma3ForCausalLM:
    """A random tiny Gemma 3 with peaky distributions and norm weights away from 0 (so that ``1 + w`` matters)."""
    return random_hf_model(Gemma3ForCausalLM, Gemma3TextConfig(**{**SHAPE, **changes}), seed, (-0.5, 0.5), 0.1)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_with_word_tokenizer(_hf_model(), tmp_path_factory.mktemp("gemma3"))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_fp32_logits_match_transformers_and_the_hf_directory_round_trips(hf_dir, tmp_path):
    ref = Gemma3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ours = load_hf_dir(hf_dir)
    cfg = ours.config
    assert cfg.model_type == "gemma3_text" and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.context_length == 256
    with torch.inference_mode():
        want = ref(IDS).logits[0]
        got = ours.decoder(IDS)[0]
    assert _rel(got, want) < 1e-4
    # the window and the local RoPE base matter on this prompt: without them the logits differ
    for change in (dict(sliding_window=64), dict(rope_local_theta=cfg.rope_theta)):
        other = copy.deepcopy(ours.decoder)
        other.config = ModelConfig(**{**cfg.__dict__, **change})
        other.set_rope_tables()
        with torch.inference_mode():
            assert _rel(other(IDS)[0], want) > 1e-3, change
    # our directory is read by transformers as the same model, and by us again bit for bit
    mine = assert_hf_dir_round_trips(ours, Gemma3ForCausalLM, IDS, want, tmp_path / "ours")
    assert "model.layers.3.post_feedforward_layernorm.weight" in mine


def test_the_runtime_steps_token_by_token_equal_transformers(hf_dir):
    """Prompt, a verification block and single tokens through the executor (the torch step: fp32 weights), past the
    window, against transformers' one forward."""
    model = load_hf_dir(hf_dir)
    ex = executor_of(model)
    assert "not w4a8" in why_not_fused(model.decoder, ex.kv_dtype)
    ref = Gemma3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    cache = ex.new_cache(32)
    with torch.inference_mode():
        want = ref(IDS).logits[0]
        parts = [ex(IDS[:, :10], None, None, cache, 0), ex(IDS[:, 10:14], None, None, cache, 10)]
        parts += [ex(IDS[:, j:j + 1], None, None, cache, j) for j in range(14, IDS.shape[1])]
    assert _rel(torch.cat(parts, 1)[0], want) < 1e-4


@pytest.mark.parametrize("weights", ("fp32", "w4a8"))
def test_a_batched_pass_equals_the_sequences_alone(weights, hf_dir):
    """Two sequences past the window in one ragged pass against each alone: close on the torch step (fp32), bit for
    bit on the fused C step (w4a8), whose sliding-window layers take their own RoPE rows and windowed masks."""
    if not format_available(weights):
        pytest.skip(f"our {weights} kernels do not build on this machine")
    model = load_hf_dir(hf_dir)
    dec = model.decoder
    if weights != "fp32":
        apply_weight_format(dec, weights)
    ex = executor_of(model)
    assert (ex.fused_layers() is not None) == (weights == "w4a8")
    caches = [ex.new_cache(32), ex.new_cache(32)]
    lengths = (12, 15)
    with torch.inference_mode():
        for c, n in zip(caches, lengths):           # prompts past the window
            ex(IDS[:, :n], None, None, c, 0)
        alone = [ex(IDS[:, n:n + 3], None, None, copy.deepcopy(c), n) for c, n in zip(caches, lengths)]
        blocks = [Block(dec.embed(IDS[:, n:n + 3]), 0, torch.arange(n, n + 3), None, c, n)
                  for c, n in zip(caches, lengths)]
        together = [ex.lm_head(ex.final_norm(h)) for h in ex.run(blocks)]
    for a, b in zip(alone, together):
        if weights == "fp32":
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(b, a)


@pytest.mark.parametrize("weights", ("fp32", "w4a8"))
def test_greedy_methods_equal_ar(weights, hf_dir):
    model = load_hf_dir_in(hf_dir, weights)
    if weights != "fp32":
        _fused_step_equals_the_torch_step(executor_of(model))
        executor_of(model).fused_prompt_tokens = 64            # the prompts' layers through the fused step too
    assert_methods_equal_ar(model, PROMPTS, label=weights)


def _fused_step_equals_the_torch_step(ex) -> None:
    """The fused C step runs Gemma 3's layers (sandwich norms, GeGLU, q/k norms, ``query_pre_attn_scalar``, local
    layers' RoPE base and window) and agrees with the torch step on the same w4a8 weights within the tolerance the
    Llama layers are held to (``tests/test_decode_step.py``): a prompt, a block and single tokens, past the window."""
    fused = ex.fused_layers()
    assert fused is not None, why_not_fused(ex.decoder, ex.kv_dtype)
    assert fused.local_layers == (True, False, True, False)
    out = {}
    with torch.inference_mode():
        for use_fused in (True, False):
            ex.use_fused, ex.fused_prompt_tokens = use_fused, 64
            cache = ex.new_cache(32)
            parts = [ex(IDS[:, :10], None, None, cache, 0), ex(IDS[:, 10:14], None, None, cache, 10)]
            parts += [ex(IDS[:, j:j + 1], None, None, cache, j) for j in range(14, IDS.shape[1])]
            out[use_fused] = torch.cat(parts, 1)[0]
    ex.use_fused, ex.fused_prompt_tokens = True, 0
    got, want = out[True], out[False]
    assert float((got - want).abs().max()) <= 2e-5 * float(want.abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    with pytest.raises(ValueError, match="sliding-window layers"):       # the ragged entry needs the local rows
        from speculant.kernels.attention import RaggedPlan
        plan = RaggedPlan([1], [0], [ex.new_cache(4)], [torch.ones(1, 1, dtype=torch.bool)])
        d, dh = ex.config.hidden_size, ex.config.head_dim
        fused.run(torch.zeros(1, d), 0, 2, torch.zeros(1, dh), torch.zeros(1, dh), plan)


def test_config_defaults_are_transformers_and_bad_fields_are_refused():
    d = {k: SHAPE[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads")}
    ours = ModelConfig.from_hf_dict({"model_type": "gemma3_text", **d})
    ref = Gemma3TextConfig(**d)
    assert ours.head_dim == ref.head_dim and ours.query_pre_attn_scalar == ref.query_pre_attn_scalar
    assert ours.sliding_window == ref.sliding_window and list(ours.layer_types) == ref.layer_types
    assert ours.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"]
    assert ours.rope_local_theta == ref.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.max_position_embeddings == ref.max_position_embeddings and ours.rms_norm_eps == ref.rms_norm_eps
    assert ours.tie_word_embeddings == ref.tie_word_embeddings
    assert ModelConfig.from_hf_dict(ours.to_hf_dict()) == ours
    old = ModelConfig.from_hf_dict({"model_type": "gemma3_text", **d, "rope_theta": 5e5, "rope_local_base_freq": 2e4,
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 2})
    assert (old.rope_theta, old.rope_local_theta, old.rope_scaling) == (5e5, 2e4, {"rope_type": "linear", "factor": 8.0})
    assert old.layer_types == ("sliding_attention", "full_attention") * 2
    for bad, match in (({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
                       ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
                       ({"layer_types": ["full_attention"]}, "layer_types=")):
        with pytest.raises(SpeculantError, match=match) as e:
            ModelConfig.from_hf_dict({"model_type": "gemma3_text", **d, **bad})
        assert "\n" not in str(e.value)
    with pytest.raises(SpeculantError, match="model_type='gemma3'.*allowed: its text model"):
        ModelConfig.from_hf_dict({"model_type": "gemma3", "text_config": d})


GGUF_PROMPT = [258, 260, 221, 263, 258, 260, 221, 263, 258, 260, 221, 263, 258]


@pytest.mark.parametrize("head_dim", (256, 32))
def test_a_gemma3_gguf_file_loads_as_its_dequantized_weights(head_dim, tmp_path, in_process):
    """llama.cpp stores Gemma's norms as ``1 + weight`` (transformers' reader subtracts 1 again); every 6th layer is
    global (llama.cpp's fixed pattern); the attention scale is ``key_length ** -0.5``, which transformers' GGUF
    loader does not read (it assumes 256: its own forward of the file is the reference at 256 only; at 32 it is its
    forward of our conversion)."""
    import numpy as np
    from gguf import GGUFReader, dequantize
    from gguf_helpers import write_tiny_gguf
    from transformers import AutoModelForCausalLM

    from speculant.models.loading import read_checkpoint
    path = write_tiny_gguf(tmp_path / "g3.gguf", "Q8_0", arch="gemma3", layers=6, head_dim=head_dim, seed=7, window=6)
    model = read_checkpoint(str(path))
    cfg = model.config
    assert cfg.model_type == "gemma3_text" and cfg.head_dim == head_dim and cfg.query_pre_attn_scalar == head_dim
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",) and cfg.sliding_window == 6
    ours = ours_to_hf_state(model.decoder)
    file = {t.name: np.array(dequantize(t.data, t.tensor_type), dtype=np.float32) for t in GGUFReader(str(path)).tensors}
    for gguf_name, hf_name, offset in (("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", 0),
                                       ("blk.1.attn_q_norm.weight", "model.layers.1.self_attn.q_norm.weight", 1),
                                       ("blk.0.ffn_norm.weight", "model.layers.0.pre_feedforward_layernorm.weight", 1),
                                       ("blk.2.post_ffw_norm.weight", "model.layers.2.post_feedforward_layernorm.weight",
                                        1), ("output_norm.weight", "model.norm.weight", 1)):
        assert torch.equal(ours[hf_name], torch.from_numpy(file[gguf_name] - offset)), hf_name
    if head_dim == 256:
        ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        ref = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=torch.float32)
        assert ref.config.query_pre_attn_scalar == 32
    ids = torch.tensor([GGUF_PROMPT])
    with torch.inference_mode():
        got, want = model.decoder(ids)[0], ref.eval()(ids).logits[0]
    assert _rel(got, want) < 1e-4
    ar = greedy_ids(model, dict(method="ar"), GGUF_PROMPT)
    assert greedy_ids(model, ARCH_SPECS["prompt-lookup"], GGUF_PROMPT) == ar
