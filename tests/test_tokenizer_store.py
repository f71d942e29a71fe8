"""The BPE copy of ``tokenizer.json`` as arrays (speculant.models.tokenizer_store) against the ``tokenizers`` library
reading the file whole (``Tokenizer.from_file``).

Checked: a BPE tokenizer trained here (normalizer, pre-tokenizer, decoder, TemplateProcessing, ``byte_fallback``,
``fuse_unk``, ``unk_token``, special and non-special added tokens, inside and past the vocabulary) rebuilt from its
copy serializes to the very same JSON string, has the same vocabulary, and encodes and decodes texts (added tokens,
unicode, byte fallback, unknown characters) the same; merges in the older ``"a b"`` form, merges whose parts hold
spaces, subword prefixes/suffixes; a second open reads the copy without writing; a changed file gets a new copy;
non-BPE models are not copied but still open; a damaged copy is refused and rewritten; a merge of unknown parts is
not copied; ``load_tokenizer``/``open_fast`` of an HF-style directory go through the copy.  All tokenizers are built
here (no downloads); ``SPECULANT_CACHE`` is a fresh directory per test.
"""

import json
import os
import time

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from speculant.models import tokenizer_store
from speculant.models.loading import load_tokenizer
from speculant.models.tokenizer import FastTokenizer, open_fast

WORDS = ["alpha", "beta", "gamma", "über", "naïve", "café", "中文", "日本語", "42", "3.14", "foo_bar", "tab\tsep",
         "x²", "ﬁne", "Ωmega"]
TEXTS = ["alpha beta gamma", "  leading and   multiple spaces ", "über naïve café 中文 日本語", "digits 0123456789 3.14",
         "<|im_start|>user\nalpha<tool> beta<|im_start|>", "<s> inside </s> text", "unseen ЖЗИЙ 한국어 chars",
         "emoji 🤖 and 🎉🎉 outside", "ﬁne x² Ωmega", "", "\t\n"]


@pytest.fixture(autouse=True)
def store(tmp_path, monkeypatch):
    """A fresh cache per test; returns the copies' directory."""
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizers"


def _trained(path, vocab_size=400, rounds=300):
    """Train a byte-fallback BPE on varied text and save it to ``path`` (``<0xNN>`` tokens for bytes below 0xF0
    only: 4-byte characters such as emoji fall to the fused ``<unk>``)."""
    lines = [f"{WORDS[i % 15]} {WORDS[i * 7 % 15]}  {i * 37} {WORDS[(i * 5 + 3) % 15]}!\n" for i in range(rounds)]
    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.NFKC()
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"]))
    data = json.loads(tk.to_str())
    vocab = data["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(0xF0)})
    tk = Tokenizer.from_str(json.dumps(data))
    inside = max((t for t in vocab if t.startswith("▁") and len(t) > 3), key=len)   # added, already a token
    tk.add_special_tokens(["<|im_start|>", "<s>"])
    tk.add_tokens([AddedToken("<tool>", lstrip=True), AddedToken(inside, single_word=True), "zzz"])
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
        special_tokens=[("<s>", tk.token_to_id("<s>")), ("</s>", tk.token_to_id("</s>"))])
    tk.save(str(path))
    return path


def _assert_same(got, path, texts=TEXTS):
    """``got`` is ``Tokenizer.from_file(path)``: the same JSON (parsed, then as a string), vocabulary, ids, tokens
    and decoded texts."""
    ref = Tokenizer.from_file(str(path))
    assert json.loads(got.to_str()) == json.loads(ref.to_str())
    assert got.to_str() == ref.to_str()
    assert got.get_vocab(with_added_tokens=True) == ref.get_vocab(with_added_tokens=True)
    assert got.get_vocab_size(with_added_tokens=False) == ref.get_vocab_size(with_added_tokens=False)
    for text in texts:
        for special in (True, False):
            a, b = got.encode(text, add_special_tokens=special), ref.encode(text, add_special_tokens=special)
            assert (a.ids, a.tokens, a.offsets) == (b.ids, b.tokens, b.offsets), text
            for skip in (True, False):
                assert got.decode(a.ids, skip_special_tokens=skip) == ref.decode(b.ids, skip_special_tokens=skip)
    assert got.encode(texts[0], texts[-1]).ids == ref.encode(texts[0], texts[-1]).ids


def test_trained_bpe_round_trips_through_its_copy(tmp_path):
    path = _trained(tmp_path / "tokenizer.json")
    ref = Tokenizer.from_file(str(path))
    size = ref.get_vocab_size(with_added_tokens=False)
    added = {t.content: i for i, t in ref.get_added_tokens_decoder().items()}
    assert any(i < size and not t.startswith("<") for t, i in added.items()), "an added token inside the vocabulary"
    assert added["<|im_start|>"] >= size and added["zzz"] >= size, "added tokens past the vocabulary"
    tokens = [t for text in TEXTS for t in ref.encode(text).tokens]
    assert "<unk>" in tokens and any(t.startswith("<0x") for t in tokens), "the texts hit unk and byte fallback"
    assert ref.decode(ref.encode(TEXTS[2]).ids) == TEXTS[2], "a decoder that restores the text"
    assert not tokenizer_store.copy_dir(path).exists()
    got = tokenizer_store.open_tokenizer(path)
    where = tokenizer_store.copy_dir(path)
    assert {p.name for p in where.iterdir()} == {"vocab.npz", "pipeline.json", "meta.json"}
    assert len(json.loads((where / "pipeline.json").read_text())["model"]["vocab"]) == len(added)
    _assert_same(got, path)


def test_older_string_merges_round_trip(tmp_path):
    path = _trained(tmp_path / "tokenizer.json")
    data = json.loads(path.read_text())
    merges = data["model"]["merges"]
    assert merges and not any(" " in part for merge in merges for part in merge)
    data["model"]["merges"] = [" ".join(merge) for merge in merges]
    path.write_text(json.dumps(data, ensure_ascii=False))
    assert tokenizer_store.write(path) is not None
    _assert_same(tokenizer_store.load(path), path)


def _file(vocab, merges, added=(), **model):
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": list(added), "normalizer": None,
            "pre_tokenizer": None, "post_processor": None, "decoder": None,
            "model": {"type": "BPE", "vocab": vocab, "merges": merges, **model}}


def _added(content, i):
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": True}


V = {"a": 0, "b": 1, "c": 2, " ": 3, "ab": 4, "a ": 5, "a b": 6, "a bc": 7, "abc": 8}
CRAFTED = {
    "spaces": _file(V, [["a", " "], ["a ", "b"], ["a b", "c"], ["a", "b"], ["ab", "c"]], [_added("<x>", 9)]),
    "prefix_suffix": _file({"a": 0, "##b": 1, "ab": 2, "##c</w>": 3, "c</w>": 4, "abc</w>": 5, "<unk>": 6},
                           [["a", "##b"], ["ab", "##c</w>"]], continuing_subword_prefix="##",
                           end_of_word_suffix="</w>", ignore_merges=True, unk_token="<unk>", dropout=0.0),
    "ids_with_holes": _file({"a": 0, "b": 5, "ab": 9}, [["a", "b"]]),
    "vocab_not_in_id_order": _file({"b": 1, "a": 0, "ba": 2, "ab": 3}, [["a", "b"], ["b", "a"]]),
    "added_id_differs_from_vocab": _file(V, [["a", "b"]], [_added("ab", 40)]),
    "added_id_inside_vocab": _file(V, [["a", "b"]], [_added("<x>", 4)]),
    "added_id_past_a_gap": _file(V, [["a", "b"]], [_added("<x>", 20)]),
}
REFUSED = {"ids_with_holes", "added_id_differs_from_vocab", "added_id_inside_vocab", "added_id_past_a_gap"}
"""Files whose added tokens' ids (or the vocabulary's gaps) are not what ``tokenizers`` assigns when it reads them:
no copy (the copy fixes the file's ids), the file parsed whole instead."""


@pytest.mark.parametrize("name", list(CRAFTED))
def test_handmade_bpe_files_round_trip(tmp_path, name):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(CRAFTED[name], ensure_ascii=False))
    Tokenizer.from_file(str(path))                      # a file tokenizers reads
    assert (tokenizer_store.write(path) is None) == (name in REFUSED)
    _assert_same(tokenizer_store.open_tokenizer(path), path,
                 ["a b c", "a bc", "abc", "ab ab", "ba aba", "<x>ab", "c", "ab40"])


def test_second_open_reads_the_copy_without_writing(tmp_path, monkeypatch):
    path = _trained(tmp_path / "tokenizer.json")
    tokenizer_store.open_tokenizer(path)
    meta = tokenizer_store.copy_dir(path) / "meta.json"
    stamp = meta.stat().st_mtime_ns

    def no_write(_):
        raise AssertionError("write called although the copy exists")
    monkeypatch.setattr(tokenizer_store, "write", no_write)
    assert tokenizer_store.load(path) is not None
    _assert_same(tokenizer_store.open_tokenizer(path), path)
    assert meta.stat().st_mtime_ns == stamp


def test_a_changed_file_gets_a_new_copy(tmp_path, store):
    path = _trained(tmp_path / "tokenizer.json")
    old_dir, old = tokenizer_store.copy_dir(path), tokenizer_store.open_tokenizer(path)
    _trained(path, vocab_size=330, rounds=120)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    new_dir = tokenizer_store.copy_dir(path)
    assert new_dir != old_dir and not new_dir.exists()
    got = tokenizer_store.open_tokenizer(path)
    assert new_dir.is_dir() and old.get_vocab_size() != got.get_vocab_size()
    _assert_same(got, path)
    assert {p.name for p in store.iterdir()} >= {old_dir.name, new_dir.name}


def test_a_file_replaced_with_its_size_and_modification_time_gets_a_new_copy(tmp_path, store):
    """Content of the same size written over the file and its modification time restored (``cp -p``, ``tar``,
    ``rsync -t``): its status-change time differs, so the copy is not the old file's."""
    path = tmp_path / "tokenizer.json"
    merges = [["a", "b"], ["ab", "c"], ["a", " "], ["a ", "b"]]
    path.write_text(json.dumps(_file(V, merges)))
    st = path.stat()
    before = tokenizer_store.open_tokenizer(path)
    time.sleep(0.01)
    path.write_text(json.dumps(_file(V, merges[::-1])))          # the same bytes in another order: the same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    got = tokenizer_store.open_tokenizer(path)
    assert got.to_str() != before.to_str()
    _assert_same(got, path, ["a b c", "abc", "a bc", "ab c"])


def _word_level():
    tk = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2, "!": 3}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<s>"])
    return tk


def _unigram():
    tk = Tokenizer(models.Unigram([("<unk>", 0.0), ("▁hello", -1.0), ("▁world", -1.5), ("▁", -2.0), ("h", -3.0),
                                   ("e", -3.0), ("l", -3.0), ("o", -3.0), ("!", -2.5)], unk_id=0, byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    return tk


@pytest.mark.parametrize("build", [_word_level, _unigram])
def test_other_models_are_not_copied_but_open(tmp_path, store, build):
    path = tmp_path / "tokenizer.json"
    build().save(str(path))
    assert tokenizer_store.write(path) is None
    assert not store.exists() or not any(store.iterdir())
    _assert_same(tokenizer_store.open_tokenizer(path), path, ["hello world!", "hello <s> there", "héllo", ""])
    assert not store.exists() or not any(store.iterdir())


def _no_vocab(where):
    (where / "vocab.npz").unlink()


def _garbage_meta(where):
    (where / "meta.json").write_text("{not json")


def _wrong_added_id(where):
    meta = json.loads((where / "meta.json").read_text())
    meta["added"]["<|im_start|>"] += 1
    (where / "meta.json").write_text(json.dumps(meta))


def _wrong_vocab_size(where):
    meta = json.loads((where / "meta.json").read_text())
    meta["vocab_size"] -= 1
    (where / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", [_no_vocab, _garbage_meta, _wrong_added_id, _wrong_vocab_size])
def test_a_damaged_copy_is_refused_and_rewritten(tmp_path, damage):
    path = _trained(tmp_path / "tokenizer.json")
    where = tokenizer_store.write(path)
    assert where == tokenizer_store.copy_dir(path) and tokenizer_store.load(path) is not None
    damage(where)
    assert tokenizer_store.load(path) is None
    _assert_same(tokenizer_store.open_tokenizer(path), path)
    assert tokenizer_store.load(path) is not None, "open_tokenizer rewrites the copy"


@pytest.mark.parametrize("merges", [[["a", "b"], ["ab", "q"]], ["a b", "ab q"], ["a b c"]])
def test_a_merge_of_unknown_parts_is_not_copied(tmp_path, store, merges):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(_file(V, merges)))
    with pytest.raises(Exception):
        Tokenizer.from_file(str(path))
    assert tokenizer_store.write(path) is None
    assert not store.exists() or not any(store.iterdir()), "nothing half-written"
    with pytest.raises(Exception):
        tokenizer_store.open_tokenizer(path)           # says what tokenizers says


def test_load_tokenizer_of_a_directory_goes_through_the_copy(tmp_path):
    _trained(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>"}))
    ref = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert not tokenizer_store.copy_dir(tmp_path / "tokenizer.json").exists()
    for fast in (load_tokenizer(tmp_path), open_fast(tmp_path)):
        assert isinstance(fast, FastTokenizer)
        assert tokenizer_store.copy_dir(tmp_path / "tokenizer.json").is_dir()
        assert fast.backend.to_str() == ref.to_str()
        for text in TEXTS:
            assert fast.encode(text) == ref.encode(text).ids
            for skip in (True, False):
                ids = ref.encode(text).ids
                assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        assert fast.bos_token_id == ref.token_to_id("<s>") and fast.eos_token_id == ref.token_to_id("</s>")
