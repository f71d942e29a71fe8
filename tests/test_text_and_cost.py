"""Long prompts and outputs cost what they need (issue 13, section 5), with the text unchanged.

* Prefill runs the LM head on the last prompt position only.
* ``stream()`` decodes each token with a short window of tokens (incremental detokenization); the text
  equals the full decode, multi-byte characters split across tokens and stop strings across block edges
  included.
* Recursive rejection sampling computes the target's processed distribution only for the rows it visits,
  with the same random draws (the chi-square tests in test_sampling_*.py check the law).
"""

import random

import pytest
import torch
from helpers import tiny_model, word_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.engine.text import IncrementalDetokenizer, StopStringText
from speculant.models.llama import LlamaDecoder
from speculant.sampling.processors import logits_to_probs
from speculant.trees.tree import DraftTree
from speculant.verification.rules import recursive_rejection_sampling

CORPUS = ["the cat sat on the mat", "héllo wörld 🙂 世界 日本語", "stop here please", "naïve café 🎉🎉 ok"] * 5
TEXT = "héllo 🙂 世界, the cat 🎉 stop here naïve 日本語"


def _trained(pre, dec, vocab):
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer, tk.decoder = pre, dec
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre, pre_tokenizers.ByteLevel) else []
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=alphabet, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tk)


@pytest.fixture(scope="module")
def byte_tok():
    """Byte-level BPE (GPT-2/SmolLM2 style): emoji and CJK characters are split over several tokens."""
    return _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), 300)


@pytest.fixture(scope="module")
def metaspace_tok():
    """SentencePiece-style: a lone token decodes without its leading space."""
    return _trained(pre_tokenizers.Metaspace(), decoders.Metaspace(), 120)


def _incremental(tok, ids):
    d = IncrementalDetokenizer(tok)
    pieces = [d.add(t) for t in ids]
    return pieces, d.flush(), d


def test_multibyte_characters_are_split_across_tokens(byte_tok):
    ids = byte_tok.encode(TEXT)
    assert any("\ufffd" in byte_tok.decode([i]) for i in ids)   # the test really splits characters


@pytest.mark.parametrize("which", ["byte", "metaspace", "word"])
def test_incremental_detokenizer_equals_full_decode(byte_tok, metaspace_tok, which):
    tok = {"byte": byte_tok, "metaspace": metaspace_tok, "word": word_tokenizer(64)}[which]
    texts = [TEXT, "the cat sat on the mat 🙂🙂", "t1 t2 t3 t45 t63"]
    seqs = [tok.encode(t, add_special_tokens=False) for t in texts]
    rng = random.Random(0)
    seqs += [[rng.randrange(len(tok)) for _ in range(40)] for _ in range(30)]     # invalid byte runs included
    for ids in seqs:
        pieces, tail, d = _incremental(tok, ids)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=True) == d.text
        assert d.ends[-1] == len(d.text) and d.ends == sorted(d.ends)
    for ids in seqs[:3]:                              # well-formed text: no piece shows half a character
        pieces, tail, _ = _incremental(tok, ids)
        assert not any("\ufffd" in p for p in pieces) and tail == ""


def _reference_stop(tok, ids, stops):
    """The first prefix ``ids[:k]`` whose text holds a stop string in characters that are final: a prefix that ends
    inside a multi-byte character decodes it as U+FFFD, which is no stop hit if later tokens complete it."""
    final = tok.decode(ids)
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        hits = [i for s in stops if (i := text.find(s)) >= 0 and final.startswith(text[:i + len(s)])]
        if hits:
            return text[:min(hits)], ids[:k]
    return final, ids


@pytest.mark.parametrize("stops", [("🙂 世",), ("cat 🎉",), ("stop",), ("界,", "naïve"), ("日本語",), ("absent",)])
def test_stop_strings_across_block_edges(byte_tok, stops):
    """Every split of the output into blocks gives the same pieces' text and tokens as the reference."""
    ids = byte_tok.encode(TEXT)
    want_text, want_ids = _reference_stop(byte_tok, ids, stops)
    rng = random.Random(1)
    for trial in range(40):
        cuts = sorted(rng.sample(range(1, len(ids)), rng.randrange(0, 8))) if trial else list(range(1, len(ids)))
        blocks = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]
        text = StopStringText(byte_tok, stops)
        pieces = []
        for block in blocks:
            pieces.append(text.add(block))
            if text.stopped:
                break
        pieces.append(text.finish())
        assert "".join(pieces) == text.text == want_text
        assert text.token_ids == want_ids
        assert not any("\ufffd" in p for p in pieces)


@pytest.fixture(scope="module")
def byte_model(byte_tok):
    model = tiny_model(seed=4, scale=1.5, vocab=300, layers=3)
    model.tokenizer = byte_tok
    return model


@pytest.mark.parametrize("spec", [dict(method="ar"), dict(method="early-exit", exit_layer=1, num_speculations=4),
                                  dict(method="rsd-s", exit_layer=1, beam_width=3, draft_length=3)],
                         ids=lambda s: s["method"])
def test_streamed_text_equals_decode_of_the_tokens(byte_model, byte_tok, spec):
    gen = build_generator(byte_model, **spec)
    for seed, stop in ((0, ()), (1, ()), (2, ("\u4e16",)), (3, ("e", "\ufffd"))):
        cfg = GenerationConfig(max_new_tokens=60, stop=stop, sampling=SamplingConfig(temperature=1.0, seed=seed))
        text = "".join(gen.stream(byte_tok.encode(TEXT), cfg))
        res = gen.last_result
        assert text == res.text
        if res.stop_reason == "stop":
            want, _ = _reference_stop(byte_tok, res.token_ids, stop)
            assert text == want
        else:
            assert text == byte_tok.decode(res.token_ids)


def test_stream_decodes_short_windows(monkeypatch):
    """300 streamed tokens in one-token blocks: no decode call sees more than a few tokens."""
    model = tiny_model(seed=11, scale=2.5, vocab=64, layers=2)
    sizes = []
    real = type(model.tokenizer).decode
    monkeypatch.setattr(type(model.tokenizer), "decode", lambda self, ids, **kw: sizes.append(len(ids)) or real(self, ids, **kw))
    gen = build_generator(model, method="ar")
    text = "".join(gen.stream([1, 2, 3], GenerationConfig(max_new_tokens=300)))
    assert len(gen.last_result.token_ids) == 300 and text == real(model.tokenizer, gen.last_result.token_ids)
    assert max(sizes[:-1]) <= 3                         # the last call is the reference decode above


# ---------------------------------------------------------------- LM head and sampling work
@pytest.mark.parametrize("spec", [dict(method="ar"), dict(method="early-exit", exit_layer=2, num_speculations=3),
                                  dict(method="draft-model", draft_model="truncated:2", num_speculations=3),
                                  dict(method="rsd-s", draft_model="truncated:1", beam_width=2, draft_length=3),
                                  dict(method="rsd-c", exit_layer=1, branching="2,2")],
                         ids=lambda s: "-".join(map(str, s.values())))
def test_prefill_runs_the_lm_head_on_the_last_position_only(monkeypatch, spec):
    model = tiny_model(seed=1, vocab=64, layers=3)
    rows = []
    real = LlamaDecoder.lm_head
    monkeypatch.setattr(LlamaDecoder, "lm_head", lambda self, h: rows.append(h.numel() // h.shape[-1]) or real(self, h))
    prompt = [(7 * i) % 64 for i in range(80)]
    build_generator(model, **spec).generate(prompt, GenerationConfig(max_new_tokens=10))
    assert rows and max(rows) <= 7                       # a verification block at most, never the 80-token prompt


def _random_tree(rng, vocab):
    tree = DraftTree()
    frontier = [-1]
    for _ in range(rng.randrange(1, 4)):
        new = []
        for node in frontier:
            q = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randrange(10**6))), -1)
            tree.set_draft_probs(node, q)
            for tok in torch.multinomial(q, rng.randrange(1, 4)).tolist():
                new.append(tree.add(node, tok))
        frontier = new
    return tree


@pytest.mark.parametrize("without_replacement", [True, False])
def test_rejection_sampling_computes_only_visited_rows(without_replacement):
    """Rows computed on demand give the very same (path, token) as the full matrix, seed for seed, and only
    the root and the accepted nodes are computed."""
    rng, vocab = random.Random(0), 12
    for seed in range(150):
        tree = _random_tree(rng, vocab)
        logits = torch.randn(len(tree) + 1, vocab, generator=torch.Generator().manual_seed(seed)) * 2
        sampling = SamplingConfig(temperature=0.9, top_p=0.8)
        full = recursive_rejection_sampling(tree, logits_to_probs(logits, sampling),
                                            torch.Generator().manual_seed(seed), without_replacement)
        asked = []
        lazy = recursive_rejection_sampling(tree, lambda e: asked.append(e) or logits_to_probs(logits[e], sampling),
                                            torch.Generator().manual_seed(seed), without_replacement)
        assert lazy == full
        assert asked == [0] + [i + 1 for i in lazy[0]]


def test_engine_processes_only_the_rows_the_rule_reads(monkeypatch):
    """RSD-C with 39-node trees: per round the target distribution is built for at most depth + 1 rows."""
    import speculant.engine.rounds as generator
    model = tiny_model(seed=11, scale=1.0, vocab=64, layers=3)
    rows = []
    real = generator.logits_to_probs
    monkeypatch.setattr(generator, "logits_to_probs",
                        lambda logits, cfg: rows.append(logits.numel() // logits.shape[-1]) or real(logits, cfg))
    gen = build_generator(model, method="rsd-c", exit_layer=1, branching="3,3,3")
    res = gen.generate([1, 2, 3], GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(temperature=1.0, seed=3)))
    assert res.stats.tree_nodes_max == 39
    assert set(rows) == {1}                              # one row at a time
    assert model.eos_token_ids == []                     # so no block is cut: accepted_tokens = the paths' lengths
    assert len(rows) == 1 + res.stats.rounds + res.stats.accepted_tokens    # first token + (root + path) per round


# ---------------------------------------------------------------- stop strings at the edges of characters (issue 27)
@pytest.fixture(scope="module")
def bytes_tok():
    """Byte-level BPE with one byte per token and one merge, ' ' + the lead byte 0xEC of many Hangul syllables
    ('Ġì'): a token that completes a space and starts a character."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["Ġì"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "ì")]))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


@pytest.mark.parametrize("blocks", ["one", "each"])
def test_stop_string_ending_before_a_split_character_keeps_the_fewest_tokens(bytes_tok, blocks):
    # "에 서울": 에 = EC 97 90, then ' ' + EC (one token 'Ġì'), then 84 9C (the rest of 서), ...
    ids = bytes_tok.encode("안녕에 서울", add_special_tokens=False)
    space = bytes_tok.convert_tokens_to_ids("Ġì")
    assert ids.count(space) == 1                  # the premise: one token holds the space and a partial character
    want = ids.index(space) + 1                    # the stop string "에 " is complete at that token
    text = StopStringText(bytes_tok, ("에 ",))
    shown = text.add(ids) if blocks == "one" else "".join(text.add([t]) for t in ids)
    shown += text.finish()
    assert text.stopped and len(text.token_ids) == want and text.token_ids == ids[:want]
    assert text.text == shown == "안녕"
    assert bytes_tok.decode(text.token_ids).startswith(text.text + "에 ")


def test_stop_string_with_a_replacement_character_completed_by_the_final_flush(bytes_tok):
    ids = bytes_tok.encode("ab", add_special_tokens=False) + [bytes_tok.convert_tokens_to_ids("ì")]  # ends mid-character
    assert bytes_tok.decode(ids) == "ab\ufffd"
    text = StopStringText(bytes_tok, ("b\ufffd",))
    shown = text.add(ids)
    assert not text.stopped                                   # the last character may still complete
    shown += text.finish()
    assert text.stopped and shown == text.text == "a" and text.token_ids == ids


def test_generator_reports_stop_for_a_stop_string_completed_by_the_final_flush(bytes_tok):
    """End to end: one new token that is an incomplete UTF-8 sequence; stop="\\ufffd" completes at the flush."""
    from speculant.models.loading import LoadedModel
    tiny = tiny_model(seed=3, vocab=len(bytes_tok))
    model = LoadedModel("tiny", tiny.decoder, bytes_tok, None)
    gen = build_generator(model, method="ar")
    prompt = next(([p] for p in range(len(bytes_tok))
                   if bytes_tok.decode(gen.generate([p], GenerationConfig(max_new_tokens=1)).token_ids) == "\ufffd"),
                  None)
    assert prompt is not None, "no prompt whose first token is an incomplete character"   # the premise
    r = gen.generate(prompt, GenerationConfig(max_new_tokens=1, stop=("\ufffd",)))
    assert r.stop_reason == "stop" and r.text == "" and r.stats.new_tokens == 1
