"""Which structured-output library is fastest here: xgrammar, llguidance, outlines-core (issue 27).

Times, on SmolLM2's tokenizer (49152 tokens): building the tokenizer info, compiling a JSON schema, and the
per-token cost of (mask for the next position + accept the token) along a valid output, plus a speculative
pattern (accept 4 draft tokens, masks at each, roll back 4).  Run: ``python benchmarks/grammar_libs.py TOKENIZER_DIR``.
"""

import json
import sys
import time

import torch
from transformers import AutoTokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]}
TEXT = json.dumps({"name": "Alice Smith", "age": 42, "tags": ["engineer", "cyclist", "reader"]})


def timed(fn, repeat=1):
    t = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return out, (time.perf_counter() - t) / repeat


def bench_xgrammar(tok, ids):
    import xgrammar as xgr
    info, t_info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    cg, t_comp = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    m = xgr.GrammarMatcher(cg)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    t = time.perf_counter()
    for i in ids:
        m.fill_next_token_bitmask(mask)
        assert m.accept_token(i), i
    t_tok = (time.perf_counter() - t) / len(ids)
    m.reset()
    t = time.perf_counter()
    for s in range(0, len(ids) - 4, 4):
        for i in ids[s:s + 4]:
            m.fill_next_token_bitmask(mask)
            m.accept_token(i)
        m.rollback(4)
        for i in ids[s:s + 4]:
            m.accept_token(i)
    t_spec = (time.perf_counter() - t) / len(ids)
    return t_info, t_comp, t_tok, t_spec


def bench_llguidance(tok, ids):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    lltok, t_info = timed(lambda: llguidance.hf.from_tokenizer(tok))
    grm, t_comp = timed(lambda: llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    m, t_first = timed(lambda: llguidance.LLMatcher(lltok, grm))
    mask = lt.allocate_token_bitmask(1, lltok.vocab_size)
    t = time.perf_counter()
    for i in ids:
        lt.fill_next_token_bitmask(m, mask)
        assert m.consume_token(i), (i, m.get_error())
    t_tok = (time.perf_counter() - t) / len(ids)
    m.reset()
    t = time.perf_counter()
    for s in range(0, len(ids) - 4, 4):
        for i in ids[s:s + 4]:
            lt.fill_next_token_bitmask(m, mask)
            m.consume_token(i)
        m.rollback(4)
        for i in ids[s:s + 4]:
            m.consume_token(i)
    t_spec = (time.perf_counter() - t) / len(ids)
    return t_info, t_comp + t_first, t_tok, t_spec


def bench_outlines(tok, ids):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    vocab, t_info = timed(lambda: Vocabulary.from_pretrained_tokenizer(tok) if hasattr(Vocabulary, "from_pretrained_tokenizer")
                          else _outlines_vocab(tok))
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    index, t_comp = timed(lambda: Index(regex, vocab))
    g = Guide(index)
    t = time.perf_counter()
    for i in ids:
        allowed = g.get_tokens()
        mask = torch.zeros(len(tok), dtype=torch.bool)
        mask[allowed] = True
        g.advance(i)
    t_tok = (time.perf_counter() - t) / len(ids)
    return t_info, t_comp, t_tok, float("nan")


def _byte_decoder():
    """GPT-2's byte-level alphabet (printable stand-ins for bytes) -> byte values."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _outlines_vocab(tok):
    from outlines_core import Vocabulary
    eos, dec = tok.eos_token_id, _byte_decoder()
    groups = {}
    for s, i in tok.get_vocab().items():
        if i != eos and all(ch in dec for ch in s):
            groups.setdefault(bytes(dec[ch] for ch in s), []).append(i)
    return Vocabulary(eos, groups)


def import_seconds(module):
    import importlib
    t = time.perf_counter()
    importlib.import_module(module)
    return time.perf_counter() - t


def main():
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    ids = tok.encode(TEXT, add_special_tokens=False)
    print(f"vocab {len(tok)}, {len(ids)} tokens")
    libs = [("xgrammar", "xgrammar", bench_xgrammar), ("llguidance", "llguidance.torch", bench_llguidance),
            ("outlines-core", "outlines_core", bench_outlines)]
    for name, module, fn in libs:
        print(f"{name:14s} import {import_seconds(module) * 1e3:8.1f} ms")
    for name, module, fn in libs * 2:
        try:
            t_info, t_comp, t_tok, t_spec = fn(tok, ids)
            print(f"{name:14s} tokenizer {t_info * 1e3:8.1f} ms  compile {t_comp * 1e3:8.1f} ms  "
                  f"mask+accept {t_tok * 1e6:8.1f} us/token  spec(4, rollback) {t_spec * 1e6:8.1f} us/token")
        except Exception as e:  # report and go on to the next library
            print(f"{name:14s} failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
