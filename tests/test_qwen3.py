"""Qwen3 (``model_type: qwen3``): per-head q/k RMSNorms before RoPE, an explicit ``head_dim``, no q/k/v biases.

Checked on a tiny random ``Qwen3ForCausalLM`` (``head_dim`` 32 with 4 heads of a 64-wide model, so
``head_dim != hidden / heads``): our fp32 logits equal transformers' within 1e-4 relative; the HF directory round
trip (``save_hf_dir`` -> transformers and ``load_hf_dir``); greedy ``early-exit``, ``prompt-lookup``, ``rsd-s`` and
``draft-model`` (a truncated copy)
token-identical to ``ar`` in fp32 and in ``w4a8`` on the fused C step (which applies the q/k norms; its logits
within float tolerance of the torch step's);
the config read strictly (defaults as transformers', unknown fields refused in one line).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (ARCH_SPECS, assert_hf_dir_round_trips, assert_methods_equal_ar, greedy_ids, load_hf_dir_in,
                     random_hf_model, save_with_word_tokenizer)
from transformers import Qwen3Config, Qwen3ForCausalLM

from speculant.errors import SpeculantError
from speculant.models.config import ModelConfig
from speculant.models.loading import load_hf_dir, ours_to_hf_state
from speculant.runtime.executor import executor_of, why_not_fused
from speculant.runtime.formats import format_available

VOCAB = 100
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6)
PROMPTS = ([3, 17, 42, 8, 25, 60, 1], [7, 8, 9, 10] * 4, [11, 12, 13, 14, 15, 16, 11, 12, 13])


def _hf_model(tie: bool = False, seed: int = 0) -> Qwen3ForCausalLM:
    """A random tiny Qwen3 with peaky distributions and q/k norm weights away from 1 (so that they matter)."""
    return random_hf_model(Qwen3ForCausalLM, Qwen3Config(**SHAPE, tie_word_embeddings=tie), seed, (0.5, 1.5), 0.5)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_with_word_tokenizer(_hf_model(), tmp_path_factory.mktemp("qwen3"))


@pytest.mark.parametrize("tie", (False, True))
def test_fp32_logits_match_transformers_and_the_hf_directory_round_trips(tie, tmp_path):
    ref = _hf_model(tie=tie, seed=int(tie))
    ours = load_hf_dir(save_with_word_tokenizer(ref, tmp_path / "hf"))
    cfg = ours.config
    assert cfg.model_type == "qwen3" and cfg.qk_norm and cfg.head_dim == 32 and not cfg.qkv_bias
    assert cfg.tie_word_embeddings == tie
    ids = torch.tensor([[5, 9, 2, 7, 33, 81, 14, 60, 2, 99, 0, 41]])
    with torch.inference_mode():
        want = ref(ids).logits[0]
        got = ours.decoder(ids)[0]
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    # the q/k norms are applied: without them the logits differ
    plain = copy.deepcopy(ours.decoder)
    for layer in plain.layers:
        layer.self_attn.q_norm.weight.data.fill_(1.0)
    with torch.inference_mode():
        assert float((plain(ids)[0] - want).abs().max() / want.abs().max()) > 1e-2
    # our directory is read by transformers as the same model, and by us again bit for bit
    mine = assert_hf_dir_round_trips(ours, Qwen3ForCausalLM, ids, want, tmp_path / "ours")
    assert "model.layers.1.self_attn.k_norm.weight" in mine


@pytest.mark.parametrize("weights", ("fp32", "w4a8"))
def test_greedy_methods_equal_ar(weights, hf_dir):
    model = load_hf_dir_in(hf_dir, weights)
    if weights != "fp32":
        # w4a8 runs the fused C step, q/k norms included, close to the torch step on the same weights
        ex = executor_of(model)
        assert ex.fused_layers() is not None, why_not_fused(model.decoder, ex.kv_dtype)
        ids = torch.tensor([PROMPTS[0]])
        with torch.inference_mode():
            ex.fused_prompt_tokens = 64                    # the prompt's layers through the fused step too
            fused = ex(ids, None, None, ex.new_cache(16), 0)
            ex.use_fused = False
            torch_step = ex(ids, None, None, ex.new_cache(16), 0)
            ex.use_fused, ex.fused_prompt_tokens = True, 0
        torch.testing.assert_close(fused, torch_step, rtol=1e-4, atol=1e-4)   # 4.7 apart without the C norms
    assert_methods_equal_ar(model, PROMPTS, label=weights)


def _unavailable() -> str:
    from speculant.kernels import decode_step
    return decode_step.build.unavailable_reason()


def test_config_defaults_are_transformers_and_unknown_fields_are_refused():
    d = {k: SHAPE[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads")}
    ours = ModelConfig.from_hf_dict({"model_type": "qwen3", **d})
    ref = Qwen3Config(**d)
    assert ours.head_dim == ref.head_dim == 128            # not hidden / heads
    assert ours.max_position_embeddings == ref.max_position_embeddings
    assert ours.rms_norm_eps == ref.rms_norm_eps and ours.rope_theta == ref.rope_parameters["rope_theta"]
    assert ours.sliding_window is None and ours.qk_norm and not ours.qkv_bias and not ours.o_bias
    biased = ModelConfig.from_hf_dict({"model_type": "qwen3", **d, "attention_bias": True})
    assert biased.qkv_bias and biased.o_bias and biased.to_hf_dict()["attention_bias"] is True
    assert ModelConfig.from_hf_dict(ours.to_hf_dict()) == ours
    with pytest.raises(SpeculantError) as e:
        ModelConfig.from_hf_dict({"model_type": "qwen3", **d, "mlp_bias": True})
    assert "mlp_bias" in str(e.value) and "qwen3" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SpeculantError, match="architectures=.*allowed: Qwen3ForCausalLM"):
        ModelConfig.from_hf_dict({"model_type": "qwen3", **d, "architectures": ["Qwen2ForCausalLM"]})
    with pytest.raises(SpeculantError, match="qk_norm=True does not fit model_type='llama'"):
        ModelConfig(**d, num_key_value_heads=4, qk_norm=True)


GGUF_PROMPT = [258, 260, 221, 263, 258, 260, 221, 263, 258, 260]


@pytest.mark.parametrize("head_dim", (128, 32))
def test_a_qwen3_gguf_file_loads_as_its_dequantized_weights(head_dim, tmp_path, in_process):
    """qwen3 files keep q/k rows in HF order (no llama permutation); the head size is the file's
    ``attention.key_length`` (transformers' GGUF loader reads none for qwen3 and assumes 128, so its own forward of
    the file is the reference only at 128; at 32 the reference is transformers' forward of our conversion)."""
    import numpy as np
    from gguf import GGUFReader, dequantize
    from gguf_helpers import write_tiny_gguf
    from transformers import AutoModelForCausalLM

    from speculant.models.loading import read_checkpoint
    path = write_tiny_gguf(tmp_path / "q3.gguf", "Q8_0", arch="qwen3", head_dim=head_dim, seed=7)
    model = read_checkpoint(str(path))
    assert model.config.model_type == "qwen3" and model.config.head_dim == head_dim
    ours = ours_to_hf_state(model.decoder)
    file = {t.name: np.array(dequantize(t.data, t.tensor_type), dtype=np.float32) for t in GGUFReader(str(path)).tensors}
    for gguf_name, hf_name in (("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight"),
                               ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight"),
                               ("blk.1.attn_q_norm.weight", "model.layers.1.self_attn.q_norm.weight"),
                               ("blk.0.attn_k_norm.weight", "model.layers.0.self_attn.k_norm.weight")):
        assert torch.equal(ours[hf_name], torch.from_numpy(file[gguf_name])), hf_name
    if head_dim == 128:
        ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        ref = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=torch.float32)
    ids = torch.tensor([GGUF_PROMPT])
    with torch.inference_mode():
        got, want = model.decoder(ids)[0], ref.eval()(ids).logits[0]
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4


@pytest.mark.skipif(not format_available("w4a8"), reason="our w4a8 kernel does not build on this machine")
def test_a_qwen3_q4_0_gguf_runs_w4a8_on_its_own_codes_through_the_fused_step(tmp_path):
    import numpy as np
    from gguf import GGUFReader
    from gguf_helpers import write_tiny_gguf

    from speculant.runtime.loader import load_model
    path = write_tiny_gguf(tmp_path / "q3-q40.gguf", "Q4_0", arch="qwen3", head_dim=32, seed=8)
    model = load_model(str(path), weights="w4a8", compile=False)       # converted in a child process
    assert model.weights == "w4a8" and model.fused
    q_rows = model.config.num_attention_heads * model.config.head_dim
    codes = model.decoder.layers[1].self_attn.qkv_proj.group_quantized().codes[:q_rows]
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.1.attn_q.weight")
    b = np.asarray(t.data).reshape(t.data.shape[0], -1, 18)[..., 2:]
    file_codes = np.concatenate([b & 15, b >> 4], -1).reshape(t.data.shape[0], -1)
    assert torch.equal(codes, torch.from_numpy(file_codes.astype(np.uint8)))   # HF row order as stored
    ar = greedy_ids(model, dict(method="ar"), GGUF_PROMPT)
    assert greedy_ids(model, ARCH_SPECS["prompt-lookup"], GGUF_PROMPT) == ar
    assert greedy_ids(model, ARCH_SPECS["early-exit"], GGUF_PROMPT) == ar
