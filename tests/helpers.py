"""Tiny random models built inside the tests (no download, fixed seeds)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from speculant.models.config import ModelConfig
from speculant.models.llama import LlamaDecoder
from speculant.models.loading import LoadedModel


def tiny_config(vocab=64, layers=4, hidden=64, heads=4, kv_heads=2, inter=128, ctx=512, tie=True, eos=None):
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=ctx,
                       rope_theta=10000.0, tie_word_embeddings=tie, eos_token_id=eos)


def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """Tokens 't0'..'t{V-1}', whitespace separated."""
    words = {f"t{i}": i for i in range(vocab)}
    tk = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def prefilled_caches(decoder, prompts: list[list[int]], length: int) -> list:
    """One KV cache of ``length`` slots per prompt, each holding its prompt's keys/values (the prompt's forward)."""
    caches = []
    for p in prompts:
        c = decoder.new_cache(length)
        decoder(torch.tensor([p]), None, None, c, 0)
        c.crop(len(p))
        caches.append(c)
    return caches


def tiny_model(seed=0, scale=1.0, **kw) -> LoadedModel:
    """A random Llama decoder; ``scale`` multiplies the weights (larger -> peakier distributions)."""
    torch.manual_seed(seed)
    cfg = tiny_config(**kw)
    dec = LlamaDecoder(cfg)
    with torch.no_grad():
        for name, p in dec.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.02 * 10 * scale if "embed" in name else 0.02 * 5 * scale)
    dec.eval().requires_grad_(False)
    return LoadedModel("tiny", dec, word_tokenizer(cfg.vocab_size), None)


def on_fused_step(model: LoadedModel) -> LoadedModel:
    """``model`` in ``w4a8`` with every cached forward, prompts included, on the fused step
    (speculant/kernels/decode_step.c): the route real models decode on, and a quarter to half of the torch step's
    time per forward on a tiny model (so the sampling tests' thousands of generations cost less).  Unchanged (the
    torch step, float32) where our kernels do not build here."""
    from speculant.kernels import build
    from speculant.runtime.executor import executor_of
    from speculant.runtime.formats import apply_weight_format
    if build.available():
        apply_weight_format(model.decoder, "w4a8")
        executor_of(model).fused_prompt_tokens = 64
        assert executor_of(model).fused_layers() is not None
    return model


def generate_blocks(model, prompt: list[int], max_new: int = 40, **kw):
    """Greedy decoding of ``prompt`` with ``build_generator(model, **kw)`` through ``generate_blocks`` (the engine's
    rounds); returns ``(token ids, GenerationStats, the generator)``."""
    from speculant import GenerationConfig, build_generator
    from speculant.engine.stats import GenerationStats
    gen = build_generator(model, **kw)
    stats = GenerationStats()
    out = [t for b in gen.generate_blocks(prompt, GenerationConfig(max_new_tokens=max_new), stats) for t in b]
    return out, stats, gen


def self_distilled_corpus(model, path, n: int, n_train: int, max_new: int, seed: int = 0) -> list[list[int]]:
    """A make-data corpus at ``path`` of ``model``'s own greedy responses (``max_new`` tokens) to ``n`` random prompts
    of 3 to 8 tokens (seeded): the first ``n_train`` records in the train split, the others held out (the data of the
    self-distillation recipes).  Returns the prompts."""
    from speculant import GenerationConfig, build_generator
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    ar = build_generator(model, method="ar")
    responses = [ar.generate(p, GenerationConfig(max_new_tokens=max_new)).token_ids for p in prompts]
    Path(path).write_text("".join(json.dumps({"id": str(i), "source": "t", "split": "train" if i < n_train else
                                              "heldout", "prompt": "", "prompt_ids": p, "response_ids": r, "text": ""})
                                  + "\n" for i, (p, r) in enumerate(zip(prompts, responses))))
    return prompts


def random_hf_model(hf_class, config, seed: int, norms: tuple[float, float], embed_std: float, std: float = 0.25):
    """A random tiny transformers model ``hf_class(config)`` (seeded ``seed``), in eval mode: norm weights uniform in
    ``norms``, the embedding normal with ``embed_std``, the other weights with ``std`` (peaky distributions)."""
    torch.manual_seed(seed)
    model = hf_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(*norms)
            else:
                p.normal_(0, embed_std if "embed" in name else std)
    return model


def save_with_word_tokenizer(hf_model, folder):
    """``hf_model`` and a :func:`word_tokenizer` of its vocabulary saved in ``folder`` (an HF directory); returns it."""
    hf_model.save_pretrained(folder)
    word_tokenizer(hf_model.config.vocab_size).save_pretrained(folder)
    return folder


def load_hf_dir_in(hf_dir, weights: str) -> LoadedModel:
    """The HF directory ``hf_dir`` loaded with its weights in format ``weights`` (``fp32``: as stored); skips the
    test where our kernels for ``weights`` do not build on this machine."""
    import pytest

    from speculant.models.loading import load_hf_dir
    from speculant.runtime.formats import apply_weight_format, format_available
    if not format_available(weights):
        pytest.skip(f"our {weights} kernels do not build on this machine")
    model = load_hf_dir(hf_dir)
    if weights != "fp32":
        apply_weight_format(model.decoder, weights)
        model.weights = weights
    return model


ARCH_SPECS = {"early-exit": dict(method="early-exit", exit_layer=1, num_speculations=3),
              "prompt-lookup": dict(method="prompt-lookup", num_speculations=4),
              "rsd-s": dict(method="rsd-s", exit_layer=1, beam_width=3, draft_length=3),
              "draft-model": dict(method="draft-model", draft_model="truncated:1", num_speculations=3)}
"""The greedy methods an architecture's tiny model must decode token-identically to ``ar``
(:func:`assert_methods_equal_ar`; tests/test_gemma3.py, tests/test_qwen3.py)."""


def greedy_ids(model, spec: dict, prompt: list[int], n: int = 20) -> list[int]:
    """``n`` greedy tokens of ``build_generator(model, **spec)`` after ``prompt``."""
    from speculant import GenerationConfig, build_generator
    return build_generator(model, **spec).generate(prompt, GenerationConfig(max_new_tokens=n)).token_ids


def assert_methods_equal_ar(model, prompts, specs: dict = ARCH_SPECS, n: int = 20, label=None) -> None:
    """Every method of ``specs`` decodes each prompt token-identically to ``ar`` (``n`` tokens, all of them)."""
    for prompt in prompts:
        ar = greedy_ids(model, dict(method="ar"), prompt, n)
        assert len(ar) == n
        for name, spec in specs.items():
            assert greedy_ids(model, spec, prompt, n) == ar, (label, name, prompt)


def assert_hf_dir_round_trips(ours: LoadedModel, hf_class, ids: torch.Tensor, want: torch.Tensor, folder) -> dict:
    """``save_hf_dir(ours, folder)`` is read by transformers (``hf_class``) as the same model (its logits on ``ids``
    equal ``want`` bit for bit) and by ``load_hf_dir`` again with the same config and weights; returns our weights
    under their HF names (``ours_to_hf_state``)."""
    from speculant.models.loading import load_hf_dir, ours_to_hf_state, save_hf_dir
    save_hf_dir(ours, folder)
    back = hf_class.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        assert torch.equal(back(ids).logits[0], want)
    again = load_hf_dir(folder)
    assert again.config == ours.config
    mine, theirs = ours_to_hf_state(ours.decoder), ours_to_hf_state(again.decoder)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    return mine


DELETE = object()
"""A value of :func:`edit_config`'s ``changes``: remove the key."""


def edit_config(folder, **changes):
    """Rewrite ``folder/config.json`` with ``changes`` (a key set to :data:`DELETE` is removed); returns ``folder``."""
    path = Path(folder) / "config.json"
    conf = json.loads(path.read_text())
    for k, v in changes.items():
        if v is DELETE:
            conf.pop(k, None)
        else:
            conf[k] = v
    path.write_text(json.dumps(conf))
    return Path(folder)


def one_line_error(err: str) -> bool:
    """The CLI's bad-input contract: exactly one ``speculant: error: ...`` line, the last one on stderr
    (progress lines such as the first-load kernel measurement may come before it)."""
    lines = err.strip().splitlines()
    return bool(lines) and lines[-1].startswith("speculant: error: ") and \
        sum(line.startswith("speculant: error:") for line in lines) == 1 and "Traceback" not in err


def pattern_corpus(path, n_train=24, n_heldout=4, length=40, vocab=64):
    """Sequences that count up by a per-sequence stride mod vocab: learnable, and different from random."""
    g = torch.Generator().manual_seed(3)
    with open(path, "w") as f:
        for i in range(n_train + n_heldout):
            start, stride = int(torch.randint(vocab, (1,), generator=g)), 1 + i % 3
            ids = [(start + stride * j) % vocab for j in range(length)]
            f.write(json.dumps({"id": str(i), "source": "t", "split": "train" if i < n_train else "heldout",
                                "prompt": "", "prompt_ids": ids[:5], "response_ids": ids[5:], "text": ""}) + "\n")
    return path


MERGES = [("c", "a"), ("ca", "t"), ("Ġ", "o"), ("Ġo", "n"), ("t", "r"), ("tr", "u"), ("tru", "e"), ("Ġ", "t"),
          ("Ġt", "h"), ("Ġth", "e"), (",", "Ġ"), ("Ġ", "1"), ("y", "e"), ("ye", "s"), ('"', "o"), ('"o', "k")]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2/SmolLM2 style) with a fixed vocabulary: <eos>, the 256 byte symbols, a few merges
    (built, not trained, so that every process gets the same ids)."""
    vocab = {"<eos>": 0}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tk.add_special_tokens(["<eos>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


def tiny_chat_dir(folder, layers: int = 8):
    """A random tiny Llama (:func:`tiny_model`, EOS id 1) saved as an HF directory whose word tokenizer has a chat
    template (user turns ``t2 ... t1``, the assistant's header ``t3``): what the device runbook's toy preset and
    self-instruct sampling need.  Returns the folder."""
    from pathlib import Path

    from speculant.models.loading import save_hf_dir
    m = tiny_model(layers=layers, eos=1)
    m.tokenizer.chat_template = ("{% for m in messages %}t2 {{ m['content'] }} t1 {% endfor %}"
                                 "{% if add_generation_prompt %}t3 {% endif %}")
    return save_hf_dir(m, Path(folder), m.tokenizer)


def use_kernels(monkeypatch, lib) -> None:
    """Products on the kernel library ``lib`` (``build.load()``'s or ``build.load_variant``'s) alone, at every row
    count (no variant kept for many rows: ``build.for_rows``)."""
    from speculant.kernels import build
    monkeypatch.setattr(build, "_LIB", lib)
    monkeypatch.setattr(build, "_LIB_MANY", None)
