"""What the server accepts (issue 27): strict types, every request field in one table (honoured, refused with a 400
naming it, or ignored because it changes nothing), lone surrogates, disconnects of non-streaming clients, the drain
timeout's finish_reason, and the one prompt rule shared with the CLI and the Python API (issue 24)."""

from __future__ import annotations

import asyncio
import re
import socket
import time
import types
from pathlib import Path

import httpx
import openai
import pytest
from helpers import one_line_error, word_tokenizer
from serving_helpers import CHAT_TEMPLATE, ServerThread, parse_metrics, serve_engine, served_tiny_model
from serving_helpers import openai_client as client

from speculant import GenerationConfig, SpeculantError, build_generator
from speculant.engine.batch import BatchedGenerator
from speculant.engine.methods import MethodSpec
from speculant.engine.prompts import check_prompt_ids, encode_prompt
from speculant.models.loading import LoadedModel
from speculant.serving import fields as F
from speculant.serving import protocol as P
from speculant.serving.app import ServingEngine

AR = MethodSpec(method="ar")
MSG = [{"role": "user", "content": "t1 t2 t3"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return served_tiny_model(tmp_path_factory.mktemp("serve_fields"), layers=2)


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(serve_engine(model, AR, max_batch=4, speculation="always")) as s:
        yield s


def post(server, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    return httpx.post(server.url + path, json=body, timeout=30)


def completion(**kw) -> dict:
    return {"model": "tiny", "prompt": "t1 t2 t3", "max_tokens": 4, "temperature": 0, **kw}


def chat(**kw) -> dict:
    return {"model": "tiny", "messages": MSG, "max_tokens": 4, "temperature": 0, **kw}


# ---------------------------------------------------------------- strict types
@pytest.mark.parametrize("body,param", [
    (completion(max_tokens=True), "max_tokens"), (completion(stream="yes"), "stream"),
    (completion(temperature="0"), "temperature"), (completion(seed=1.5), "seed"), (completion(stop=5), "stop"),
    (completion(prompt=[1, True]), "prompt"), (chat(messages=[{"role": "user"}]), "messages.0.content"),
    (chat(messages=[{"role": "user", "content": None}]), "messages.0.content"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "messages.0.content"),
    (chat(messages=[{"role": "robot", "content": "t1"}]), "messages.0.role"),
    (completion(no_such_field=1), "no_such_field"), (chat(stream_options={"include_usage": 1}),
                                                      "stream_options.include_usage"),
])
def test_lax_types_are_400_naming_the_field(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and param in err["message"]


def test_unknown_field_is_refused_as_openai_refuses_it(server):
    with pytest.raises(openai.BadRequestError, match="unrecognized request argument supplied: frobnicate"):
        client(server).completions.create(model="tiny", prompt="t1", max_tokens=2, extra_body={"frobnicate": 1})


# ---------------------------------------------------------------- refused fields
REFUSED = [     # (endpoint, field, a value that would change the output); the issue-27 controls are honoured
    # (tests/test_serving_controls.py)
    ("chat", "tools", [{"type": "function", "function": {"name": "f"}}]), ("chat", "tool_choice", "required"),
    ("completions", "suffix", "t9"), ("completions", "echo", True),
    ("completions", "best_of", 2), ("chat", "modalities", ["text", "audio"]), ("both", "skip_special_tokens", False),
]


@pytest.mark.parametrize("endpoint,name,value", REFUSED, ids=lambda x: str(x))
def test_fields_we_cannot_honour_are_400_naming_them(server, endpoint, name, value):
    c = client(server)
    for kind in (("chat", "completions") if endpoint == "both" else (endpoint,)):
        with pytest.raises(openai.BadRequestError) as e:
            if kind == "chat":
                c.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, extra_body={name: value})
            else:
                c.completions.create(model="tiny", prompt="t1", max_tokens=2, extra_body={name: value})
        assert e.value.body["param"] == name and e.value.body["message"].startswith(f"{name}=")


def test_refused_fields_are_those_of_the_table():
    listed = {(e, n) for e, n, _ in REFUSED}
    for f in F.FIELDS:
        if f.status == F.REFUSED and f.name not in {"functions", "function_call", "audio", "reasoning_effort",
                                                    "verbosity", "web_search_options", "include_stop_str_in_output",
                                                    "use_beam_search", "prompt_logprobs"}:
            assert (f.endpoints, f.name) in listed, f.name        # every refusal above is tried over HTTP


def test_neutral_and_harmless_fields_change_nothing(server):
    c = client(server)
    want = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0).choices[0].message
    same = c.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=6, temperature=0, frequency_penalty=0, presence_penalty=0, n=1,
        logprobs=False, logit_bias={}, response_format={"type": "text"}, tool_choice="none", user="u",
        metadata={"k": "v"}, store=False, service_tier="auto", parallel_tool_calls=True,
        extra_body={"repetition_penalty": 1.0, "min_p": 0, "min_tokens": 0, "ignore_eos": False,
                    "stop_token_ids": [], "prompt_cache_key": "x", "priority": 0, "skip_special_tokens": True})
    assert same.choices[0].message.content == want.content
    r = c.completions.create(model="tiny", prompt="t1 t2", max_tokens=3, temperature=0, suffix="", echo=False,
                             best_of=1, user="u")
    assert r.usage.completion_tokens == 3


def test_mappings_of_the_refused_controls_give_the_engine_names():
    """The rows waiting for the engine (issue 27) map onto SamplingConfig / GenerationConfig keywords and grammar
    kinds already, so that turning a row to honoured is the only change on the request side."""
    def mapped(name, value, endpoint="chat", vocab=64):
        row = next(f for f in F.rows(endpoint) if f.name == name)
        s = F.Settings(vocab)
        row.apply(value, s)
        return s

    assert mapped("frequency_penalty", 0.5).sampling == {"frequency_penalty": 0.5}
    assert mapped("presence_penalty", -1.0).sampling == {"presence_penalty": -1.0}
    assert mapped("repetition_penalty", 1.3).sampling == {"repetition_penalty": 1.3}
    assert mapped("min_p", 0.2).sampling == {"min_p": 0.2}
    assert mapped("logit_bias", {"5": 100.0, "7": -3.0}).sampling == {"logit_bias": {5: 100.0, 7: -3.0}}
    with pytest.raises(SpeculantError, match="logit_bias token id '64'"):
        mapped("logit_bias", {"64": 1.0})
    assert mapped("logprobs", 3, "completions").generation == {"logprobs": 3}
    s = mapped("logprobs", True)
    next(f for f in F.rows("chat") if f.name == "top_logprobs").apply(4, s)
    assert s.generation == {"logprobs": 4}
    with pytest.raises(SpeculantError, match="top_logprobs"):
        mapped("top_logprobs", 2)
    assert mapped("min_tokens", 3).generation == {"min_tokens": 3}
    assert mapped("ignore_eos", True).generation == {"ignore_eos": True}
    assert mapped("stop_token_ids", [5, 6]).generation == {"stop_token_ids": (5, 6)}
    assert mapped("n", 3).n == 3
    assert mapped("response_format", {"type": "json_object"}).grammar == ("json_object", None)
    schema = {"type": "object"}
    assert mapped("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
                  ).grammar == ("json_schema", schema)
    assert mapped("guided_regex", "t[0-9]").grammar == ("regex", "t[0-9]")
    assert mapped("guided_choice", ["a", "b"]).grammar == ("choice", ["a", "b"])
    assert mapped("guided_grammar", "root ::= 'a'").grammar == ("grammar", "root ::= 'a'")
    assert mapped("guided_json", schema).grammar == ("json_schema", schema)
    assert mapped("structured_outputs", {"json": schema}).grammar == ("json_schema", schema)
    s = mapped("guided_regex", "a")
    with pytest.raises(SpeculantError, match="both constrain"):
        next(f for f in F.rows("chat") if f.name == "response_format").apply({"type": "json_object"}, s)


def test_readme_lists_every_request_field():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert F.markdown_table() in readme


# ---------------------------------------------------------------- lone surrogates
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"model": "tiny", "prompt": "t1 \\ud800 t2", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "t1 \\ud800"}]}'),
])
def test_lone_surrogate_is_400_json_and_the_connection_stays(server, path, body):
    with httpx.Client(base_url=server.url, timeout=30) as h:
        r = h.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "U+D800" in r.json()["error"]["message"]
        assert r.headers.get("connection") != "close"
        assert h.post("/v1/completions", json=completion()).status_code == 200     # same keep-alive connection


# ---------------------------------------------------------------- disconnects and the drain
def slowed(engine, seconds: float):
    """Make every round of ``engine`` take at least ``seconds`` (so a request runs long enough to be cut)."""
    step = engine.batched.step

    def slow_step(seqs):
        time.sleep(seconds)
        step(seqs)
    engine.batched.step = slow_step
    return engine


def test_non_streaming_client_that_disconnects_frees_its_slot(model):
    engine = slowed(serve_engine(model, AR, max_batch=1), 0.02)
    with ServerThread(engine) as s:
        with pytest.raises(httpx.ReadTimeout):        # `curl -m 1` on a long request
            httpx.post(s.url + "/v1/completions", json=completion(max_tokens=1000), timeout=1.0)
        t0 = time.monotonic()
        while httpx.get(s.url + "/health", timeout=30).json()["running"]:
            assert time.monotonic() - t0 < 5, "the request of the client that went away still runs"
            time.sleep(0.05)
        m = parse_metrics(httpx.get(s.url + "/metrics", timeout=30).text)
        assert m['speculant:request_success_total{finished_reason="abort",model_name="tiny"}'] == 1
        assert m['speculant:generation_tokens_total{model_name="tiny"}'] < 1000
        r = client(s).completions.create(model="tiny", prompt="t3", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5                       # the one slot is free


def test_drain_timeout_ends_streams_with_an_openai_finish_reason(model):
    engine = slowed(serve_engine(model, AR, max_batch=1), 0.02)
    engine.scheduler.drain_timeout = 0.3
    with ServerThread(engine) as s:
        async def run():
            ac = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
            stream = await ac.completions.create(model="tiny", prompt="t1 t2", max_tokens=1000, temperature=0,
                                                 stream=True)
            chunks = []
            async for ch in stream:
                if not chunks:
                    engine.begin_shutdown()          # what SIGTERM does first
                chunks.append(ch)
            return chunks
        chunks = asyncio.run(run())
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert reasons == ["length"]                     # cut by the drain: OpenAI's value, not "abort"
    assert sum(len(ch.choices[0].text) for ch in chunks if ch.choices) < 1000 * 2


# ---------------------------------------------------------------- one prompt rule (issue 24)
def bos_tokenizer():
    from tokenizers.processors import TemplateProcessing
    tok = word_tokenizer(64)
    tok._tokenizer.post_processor = TemplateProcessing(single="t1 $A", special_tokens=[("t1", 1)])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_raw_text_gets_the_same_ids_from_the_api_and_the_server(model):
    tok = bos_tokenizer()
    with_bos = LoadedModel("tiny", model.decoder, tok, None)
    served = types.SimpleNamespace(tokenizer=tok, context=1024, vocab_size=64, name="tiny")
    req = P.CompletionRequest.model_validate({"model": "tiny", "prompt": "t5 t6"})
    assert ServingEngine.prompt_ids(served, req) == build_generator(with_bos).encode("t5 t6", chat=False) == [1, 5, 6]
    chat_req = P.ChatCompletionRequest.model_validate({"model": "tiny", "messages": MSG})
    assert ServingEngine.prompt_ids(served, chat_req) == build_generator(with_bos).encode(MSG) \
        == encode_prompt(tok, "t1 t2 t3", chat=True)


def test_one_validator_for_every_path(model):
    for bad, needle in (([], "empty"), ([1, 64], "token id 64"), ([1, True], "token id True"),
                        ([1] * 1024, "< 1024")):
        with pytest.raises(SpeculantError, match=re.escape(needle)):
            check_prompt_ids(bad, 1024, 64)
        with pytest.raises(SpeculantError, match=re.escape(needle)):
            BatchedGenerator(model).check_prompt(bad)                  # the batched path checks ids too
        with pytest.raises(SpeculantError, match=re.escape(needle)):
            build_generator(model).generate(bad, GenerationConfig(max_new_tokens=2))
    seqs = BatchedGenerator(model).start_many([([1, 99], GenerationConfig(max_new_tokens=2)),
                                               ([1, 2], GenerationConfig(max_new_tokens=2))])
    assert isinstance(seqs[0], SpeculantError) and not isinstance(seqs[1], SpeculantError)
    for bad in ("", "  ", "t1 \ud800"):
        with pytest.raises(SpeculantError):
            encode_prompt(model.tokenizer, bad, chat=False)
    with pytest.raises(SpeculantError, match="lone surrogate U\\+DFFF"):
        build_generator(model).generate([{"role": "user", "content": "\udfff"}])


# ---------------------------------------------------------------- CLI edges
def test_cli_huge_seed_is_one_line(capsys, tmp_path):
    from speculant.cli import main
    assert main(["generate", "t1", "--model", str(tmp_path / "nope"), "--seed", "99999999999999999999999"]) == 2
    err = capsys.readouterr().err
    assert one_line_error(err) and "--seed=99999999999999999999999" in err


def test_serve_on_a_busy_port_fails_before_loading(capsys):
    from speculant.cli import main
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        assert main(["serve", "--model", "no-such-model", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert one_line_error(err) and f"--port={port}" in err and time.monotonic() - t0 < 10


def test_models_and_bench_describe_what_runs(capsys):
    from speculant.cli import build_parser, main
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "dequantized to fp32" not in out and "--weights" in out
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    limit = next(a for a in bench._actions if a.dest == "limit")
    assert "in each category" in limit.help
