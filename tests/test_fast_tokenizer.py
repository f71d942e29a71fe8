"""The tokenizer of a later load without transformers (speculant.models.tokenizer) against transformers' own, and
the packed copy's reader (speculant.runtime.store.read_safetensors) against the safetensors package."""

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from speculant.models import gguf_hf, loading
from speculant.models.tokenizer import FastTokenizer, open_fast
from speculant.runtime.store import read_safetensors

TEXTS = ["hi", "Hello, world!  Multiple   spaces\n\nnewlines\t tab", "<|im_start|>user\nx<|im_end|>",
         "émoji 🤖 中文 ", " leading space", "<s> inside </s> text"]
CHATS = [[{"role": "user", "content": "hi"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}, {"role": "user", "content": "é🤖 and  spaces "}]]
TEMPLATE = ("{% for m in messages %}{{ bos_token if loop.first }}<|{{ m['role'] }}|>\n  {{ m['content'] | trim }}"
            "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _assert_same(fast, hf):
    for text in TEXTS:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text
        ids = hf.encode(text)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    for chat in CHATS:
        for gen in (True, False):
            text = hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert fast.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == text
            ids = hf.apply_chat_template(chat, add_generation_prompt=gen)["input_ids"]
            assert fast.apply_chat_template(chat, add_generation_prompt=gen)["input_ids"] == ids
            assert fast.apply_chat_template(chat, add_generation_prompt=gen, return_dict=False) == ids
    assert fast.vocab_size == hf.vocab_size and len(fast) == len(hf) and fast.get_vocab() == hf.get_vocab()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "eos_token"):
        assert getattr(fast, name) == getattr(hf, name), name
    tokens = list(hf.get_vocab())[:5] + ["certainly-not-a-token"]
    assert fast.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert fast.convert_ids_to_tokens([0, 1, 2]) == hf.convert_ids_to_tokens([0, 1, 2])


def _byte_bpe(tmp_path, extra: int = 0, **config):
    """A byte-level BPE tokenizer with special tokens and a chat template, saved by transformers (``extra`` more
    vocabulary entries, never produced: no merge makes them)."""
    vocab = {chr(c): i for i, c in enumerate(range(33, 127))} | {"Ġ": 94, "Ċ": 95, "ĉ": 96, "Ã": 97, "©": 98}
    vocab |= {f"x{i}y": 99 + i for i in range(extra)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="~"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="~",
                                 pad_token="</s>", **config)
    hf.add_special_tokens({"additional_special_tokens": []})
    hf.chat_template = TEMPLATE
    hf.save_pretrained(str(tmp_path))
    return tmp_path


def test_fast_tokenizer_equals_transformers_on_a_saved_directory(tmp_path):
    path = _byte_bpe(tmp_path)
    fast = loading.load_tokenizer(path)
    assert isinstance(fast, FastTokenizer), "a plain saved directory must load without transformers"
    _assert_same(fast, PreTrainedTokenizerFast.from_pretrained(str(path)))


def test_a_vocabulary_over_100000_tokens_loads_without_transformers(tmp_path):
    """transformers 5 runs ``_patch_mistral_regex`` on such vocabularies (Llama 3's 128256 tokens), which leaves the
    pre-tokenizer as it is unless ``fix_mistral_regex`` is asked for (a key open_fast leaves to transformers)."""
    path = _byte_bpe(tmp_path, extra=100_100)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "transformers_version": "5.24.0"}))
    fast = loading.load_tokenizer(path)
    assert isinstance(fast, FastTokenizer) and len(fast) > 100_000
    _assert_same(fast, PreTrainedTokenizerFast.from_pretrained(str(path)))
    conf = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(conf | {"fix_mistral_regex": True}))
    assert open_fast(path) is None


def test_directories_transformers_would_change_are_left_to_it(tmp_path):
    path = _byte_bpe(tmp_path)
    conf = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(conf | {"add_bos_token": True}))
    assert open_fast(path) is None                      # transformers may rewrite the post-processor for it
    assert not isinstance(loading.load_tokenizer(path), FastTokenizer)
    (path / "tokenizer_config.json").write_text(json.dumps(conf | {"eos_token": "never-added"}))
    assert open_fast(path) is None                      # transformers adds the token: tokenization changes
    (path / "tokenizer.json").write_text("{not json")
    (path / "tokenizer_config.json").write_text(json.dumps(conf))
    assert open_fast(path) is None


def test_fast_tokenizer_falls_back_to_transformers_for_the_rest(tmp_path):
    fast = loading.load_tokenizer(_byte_bpe(tmp_path))
    assert fast._hf is None
    batch = fast(["ab", "c"], padding=True)             # __call__ and other methods: transformers' own
    assert batch["input_ids"][1][-1] == fast.pad_token_id and fast._hf is not None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert fast.apply_chat_template(CHATS[0], tools=tools, tokenize=False).startswith("<s><|user|>")


def test_smollm2_tokenizer_as_converted_equals_transformers(tmp_path):
    gguf = loading.gguf_file_of(loading.DEFAULT_MODEL)
    if gguf is None or not gguf.is_file():
        pytest.skip(f"{loading.DEFAULT_MODEL}'s GGUF package is not installed")
    converted = loading.converted_dir(loading.DEFAULT_MODEL)
    if (converted / "tokenizer.json").is_file():        # the session's conversion (other tests load SmolLM2)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (converted / name).is_file():
                shutil.copy(converted / name, tmp_path / name)
    else:                                               # what the conversion writes (~7 s)
        gguf_hf.tokenizer(gguf, "llama").save_pretrained(str(tmp_path))
    fast = loading.load_tokenizer(tmp_path)
    assert isinstance(fast, FastTokenizer), "SmolLM2's converted tokenizer must load without transformers"
    _assert_same(fast, PreTrainedTokenizerFast.from_pretrained(str(tmp_path)))


def test_read_safetensors_equals_the_safetensors_package(tmp_path):
    from safetensors.torch import load_file, save_file
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(3, 5, generator=g), "b": torch.randint(-128, 127, (7,), dtype=torch.int8),
             "c": torch.randn(4, generator=g).to(torch.bfloat16), "d": torch.randn(2, 3, generator=g).half(),
             "e": torch.zeros(0, 4), "f": torch.randint(0, 255, (13,), dtype=torch.uint8),
             "g": torch.arange(6, dtype=torch.int32).reshape(2, 3)}
    save_file(state, str(tmp_path / "x.safetensors"), metadata={"k": "v"})
    meta, got = read_safetensors(tmp_path / "x.safetensors")
    want = load_file(str(tmp_path / "x.safetensors"))
    assert meta == {"k": "v"} and set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        assert got[k].data_ptr() % 64 == 0 or got[k].numel() == 0, k
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "short.safetensors").write_bytes(data[:-3])
    with pytest.raises(ValueError, match="ends inside"):
        read_safetensors(tmp_path / "short.safetensors")


def _gemma_dir(tmp_path):
    """transformers' ``GemmaTokenizer`` (which builds its own pipeline around vocabulary and merges: byte-fallback
    BPE, spaces as ``▁``) over a small vocabulary with the 256 byte tokens, saved with a chat template."""
    from transformers import GemmaTokenizer
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "h", "i", "e", "l", "o", "hi", "▁hi", "ll", "he", "hell", "hello", "▁hello"]:
        vocab.setdefault(piece, len(vocab))
    tok = GemmaTokenizer(vocab=vocab, merges=[("h", "i"), ("▁", "hi"), ("l", "l"), ("h", "e"), ("he", "ll"),
                                              ("hell", "o"), ("▁", "hello")])
    tok.chat_template = TEMPLATE.replace("<|", "<").replace("|>", ">")
    tok.save_pretrained(str(tmp_path))
    return tmp_path


def test_a_gemma_class_directory_loads_without_transformers_only_with_its_own_pipeline(tmp_path):
    """``GemmaTokenizer`` sets its normalizer, pre-tokenizer, decoder and BPE options itself: a directory whose
    ``tokenizer.json`` holds exactly those loads as :class:`FastTokenizer` with transformers' ids, texts and chat
    prompts; one whose ``tokenizer.json`` says otherwise (here an NFKC normalizer, which the class would replace)
    goes to transformers."""
    from transformers import AutoTokenizer
    path = _gemma_dir(tmp_path / "g")
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "GemmaTokenizer"
    fast = loading.load_tokenizer(path)
    assert isinstance(fast, FastTokenizer)
    hf = AutoTokenizer.from_pretrained(str(path))
    assert type(hf).__name__ == "GemmaTokenizer"
    _assert_same(fast, hf)
    assert fast.encode("hello hi") == hf.encode("hello hi") == [vocab_id(hf, p) for p in ("hello", "▁hi")]
    other = shutil.copytree(path, tmp_path / "other")
    doc = json.loads((other / "tokenizer.json").read_text())
    doc["normalizer"] = {"type": "NFKC"}
    (other / "tokenizer.json").write_text(json.dumps(doc))
    assert open_fast(other) is None and type(loading.load_tokenizer(other)).__name__ == "GemmaTokenizer"


def vocab_id(tok, piece: str) -> int:
    return tok.convert_tokens_to_ids(piece)
