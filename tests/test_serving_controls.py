"""Issue 27 over HTTP, with the official ``openai`` client: penalties, min-p, logit bias, logprobs, ``n`` and
structured output are honoured by the batched server under a speculative method, and equal what the engine
(:class:`~speculant.engine.generator.SpeculativeGenerator`) gives with the same config.

The tiny model has a byte-level BPE tokenizer (GPT-2/SmolLM2 style), which the grammar library needs.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from helpers import byte_tokenizer, tiny_model
from serving_helpers import ServerThread, serve_engine

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.engine.methods import MethodSpec
from speculant.models.loading import LoadedModel, save_hf_dir
from speculant.runtime.loader import load_model
from speculant.sampling.grammar import compile_grammar

PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3,"
LOOKUP = MethodSpec(method="draft-model", draft_model="truncated:1", num_speculations=3, speculation="always")
"""The server's drafting: its batched policy drafts every round, as ``speculation="always"`` does for one sequence
(a seeded sample depends on which rounds drafted, not its law)."""
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}   # a random model would wander in whitespace otherwise


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tok = byte_tokenizer()
    tiny = tiny_model(seed=4, scale=2.0, vocab=len(tok), layers=2, ctx=1024, eos=tok.eos_token_id)
    path = save_hf_dir(LoadedModel("tiny", tiny.decoder, tok, None), tmp_path_factory.mktemp("serve_controls"))
    return load_model(str(path), weights="auto", compile=False)


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(serve_engine(model, LOOKUP, max_batch=4, speculation="always")) as s:
        yield s


@pytest.fixture(scope="module")
def ar_server(model):
    with ServerThread(serve_engine(model, MethodSpec(method="ar"), max_batch=4)) as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def engine_output(model, spec=LOOKUP, max_new_tokens=24, **kw):
    """What the one-sequence engine gives for PROMPT (raw text, as /v1/completions encodes it)."""
    gen_keys = {"logprobs", "grammar", "min_tokens", "ignore_eos", "stop_token_ids"}
    gen = {k: v for k, v in kw.items() if k in gen_keys}
    sampling = SamplingConfig(**{k: v for k, v in kw.items() if k not in gen_keys})
    return build_generator(model, spec).generate(PROMPT, GenerationConfig(max_new_tokens, sampling, chat=False, **gen))


def complete(server, **kw):
    return client(server).completions.create(model="tiny", prompt=PROMPT, **{"max_tokens": 24, **kw})


# ---------------------------------------------------------------- penalties, min-p, logit bias
@pytest.mark.parametrize("controls", [
    dict(frequency_penalty=2.0), dict(presence_penalty=2.0), dict(repetition_penalty=1.8),
    dict(frequency_penalty=1.0, presence_penalty=1.0, repetition_penalty=1.5),
], ids=str)
def test_penalties_change_the_output_and_equal_the_engine(server, model, controls):
    plain = complete(server, temperature=0, max_tokens=48).choices[0].text
    extra = {k: v for k, v in controls.items() if k == "repetition_penalty"}
    std = {k: v for k, v in controls.items() if k != "repetition_penalty"}
    r = complete(server, temperature=0, max_tokens=48, extra_body=extra, **std)
    assert r.choices[0].text != plain
    assert r.choices[0].text == engine_output(model, max_new_tokens=48, **controls).text == engine_output(
        model, MethodSpec(method="ar"), 48, **controls).text


def test_sampled_penalties_and_min_p_equal_the_engine_with_the_seed(server, model):
    controls = dict(temperature=1.0, frequency_penalty=0.7, min_p=0.1, seed=17)
    r = complete(server, frequency_penalty=0.7, temperature=1.0, seed=17, extra_body={"min_p": 0.1})
    assert r.choices[0].text == engine_output(model, **controls).text


def test_logit_bias_forces_a_token(server, model):
    tok = model.tokenizer.convert_tokens_to_ids("cat")
    r = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                          logit_bias={str(tok): 100}, logprobs=0)
    assert r.choices[0].text == "cat" * 5
    assert r.choices[0].logprobs.tokens == ["cat"] * 5
    c = client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=3, temperature=1.0, seed=4, logit_bias={str(tok): 100})
    assert c.choices[0].message.content == "cat" * 3


# ---------------------------------------------------------------- logprobs
def test_completion_logprobs_of_speculation_equal_ar_bit_for_bit(server, ar_server, model):
    spec = complete(server, temperature=0, logprobs=3)
    ar = complete(ar_server, temperature=0, logprobs=3)
    lp, want = spec.choices[0].logprobs, engine_output(model, MethodSpec(method="ar"), logprobs=3)
    assert spec.model_extra["speculant"]["accepted_tokens"] > 0
    assert lp.token_logprobs == ar.choices[0].logprobs.token_logprobs == [t.logprob for t in want.logprobs]
    assert lp.tokens == [model.tokenizer.decode([t]) for t in want.token_ids]
    assert lp.top_logprobs == [{model.tokenizer.decode([a]): v for a, v in t.top} for t in want.logprobs]
    text = spec.choices[0].text
    assert lp.text_offset[0] == 0 and all(text[o:o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens)
                                          if "\ufffd" not in t)     # a token inside a character decodes to U+FFFD
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(spec.choices[0].text)


def test_chat_logprobs_are_read_by_the_client_and_equal_ar(server, ar_server):
    kw = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0,
              logprobs=True, top_logprobs=2)
    spec, ar = client(server).chat.completions.create(**kw), client(ar_server).chat.completions.create(**kw)
    content = spec.choices[0].logprobs.content
    assert len(content) == 12 and all(len(c.top_logprobs) == 2 for c in content)
    assert [(c.token, c.logprob, c.bytes) for c in content] == \
        [(c.token, c.logprob, c.bytes) for c in ar.choices[0].logprobs.content]
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    streamed = [lp for ch in client(server).chat.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs for lp in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_logprobs_stop_at_a_stop_string(server, model):
    plain = engine_output(model)
    stop = next(c for c in plain.text[3:] if c.isascii() and c.isalnum())    # a stop string inside the output
    r = complete(server, temperature=0, logprobs=1, stop=[stop])
    lp = r.choices[0].logprobs
    assert r.choices[0].finish_reason == "stop" and plain.text.index(stop) == len(r.choices[0].text)
    assert len(lp.tokens) == r.usage.completion_tokens < len(plain.token_ids)
    assert lp.token_logprobs == [t.logprob for t in engine_output(model, logprobs=0).logprobs[:len(lp.tokens)]]


# ---------------------------------------------------------------- n
def test_n_gives_n_choices_deterministic_under_seed(server, model):
    kw = dict(temperature=1.0, seed=123, n=3)
    a, b = complete(server, **kw), complete(server, **kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1
    want = build_generator(model, LOOKUP).generate_n(PROMPT, GenerationConfig(
        24, SamplingConfig(temperature=1.0, seed=123), chat=False), 3)
    assert texts == [w.text for w in want]
    assert a.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    streamed = ["", "", ""]
    for ch in client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    chat = client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                  max_tokens=8, **kw)
    assert [c.index for c in chat.choices] == [0, 1, 2]


def test_n_above_the_limit_is_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        complete(server, n=129)
    assert e.value.body["param"] == "n"


# ---------------------------------------------------------------- structured output
def valid(doc: dict) -> bool:
    """SCHEMA checked by hand: exactly the keys ok (bool) and n (1, 2 or 3)."""
    return set(doc) == {"ok", "n"} and isinstance(doc["ok"], bool) and doc["n"] in (1, 2, 3) and \
        not isinstance(doc["n"], bool)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_response_format_json_schema_parses_and_validates(server, model, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    r = client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=64, temperature=1.0, seed=seed, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    assert valid(json.loads(r.choices[0].message.content))


def test_grammar_output_equals_the_engine_under_speculation(server, model):
    grammar = compile_grammar("json_schema", SCHEMA, model.tokenizer, vocab_size=model.config.vocab_size,
                              eos_token_ids=model.eos_token_ids)
    r = complete(server, temperature=0, max_tokens=64, extra_body={"guided_json": SCHEMA})
    want = engine_output(model, max_new_tokens=64, grammar=grammar)
    assert r.choices[0].text == want.text == engine_output(model, MethodSpec(method="ar"), 64, grammar=grammar).text
    assert valid(json.loads(r.choices[0].text))


def test_json_object_regex_and_choice(server):
    r = complete(server, temperature=1.0, seed=5, max_tokens=64, extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.startswith("{")        # a random model may wander in whitespace up to max_tokens
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    r = complete(server, temperature=1.0, seed=5, extra_body={"guided_regex": "(cat|mat) [0-9]{2}"})
    import re
    assert re.fullmatch("(cat|mat) [0-9]{2}", r.choices[0].text)
    r = complete(server, temperature=1.0, seed=5, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].text in ("yes", "no", "maybe")
    r = complete(server, temperature=1.0, seed=5, extra_body={"structured_outputs": {"regex": "[0-9]+!"}})
    assert re.fullmatch("[0-9]+!", r.choices[0].text) or r.choices[0].finish_reason == "length"


def test_bad_grammar_is_400(server):
    with pytest.raises(openai.BadRequestError, match="regex is invalid"):
        complete(server, extra_body={"guided_regex": "(unclosed"})


# ---------------------------------------------------------------- min_tokens, ignore_eos, stop_token_ids
def test_min_tokens_ignore_eos_and_stop_token_ids(server, model):
    eos = model.tokenizer.eos_token_id
    r = complete(server, temperature=0, logprobs=0, max_tokens=10, logit_bias={str(eos): 100},
                 extra_body={"min_tokens": 4})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"
    r = complete(server, temperature=0, max_tokens=6, logit_bias={str(eos): 100}, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    plain = engine_output(model, max_new_tokens=12)
    stop_id = plain.token_ids[3]
    r = complete(server, temperature=0, max_tokens=12, extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == plain.token_ids.index(stop_id) + 1


def test_fields_we_cannot_honour_stay_refused(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as e:
        complete(server, suffix="z")
    assert e.value.body["param"] == "suffix"
