"""Start ``speculant serve``'s app on 127.0.0.1 (a free port) in a thread of the test process, and stop it."""

from __future__ import annotations

import re
import threading
import time

from speculant.serving.server import build_engine, make_server


class ServerThread:
    """A uvicorn server for an engine, bound to 127.0.0.1 on a port the OS picks (port 0)."""

    def __init__(self, engine, start_scheduler: bool = True, drain_timeout: float = 5.0):
        self.engine = engine
        self.server = make_server(engine, "127.0.0.1", 0, drain_timeout, start_scheduler=start_scheduler)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.scheduler.stop()


def serve_engine(model, spec, max_batch=8, max_queue=64, name="tiny", prefix_cache_tokens=2048, speculation="goodput"):
    """The engine `speculant serve` builds (its defaults: prefix cache budget, speculation by goodput)."""
    return build_engine(model, spec, name, max_batch, max_queue, drain_timeout=5.0,
                        prefix_cache_tokens=prefix_cache_tokens, speculation=speculation)


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
"""A plain chat template for the tiny models' word tokenizers (the turns' contents, space separated)."""


def chat_tiny_model(layers: int):
    """A tiny random model (tests/helpers.py's ``tiny_model``: vocabulary 64, context 1024) with :data:`CHAT_TEMPLATE`."""
    from helpers import tiny_model
    tiny = tiny_model(seed=11, scale=2.5, vocab=64, layers=layers, ctx=1024)
    tiny.tokenizer.chat_template = CHAT_TEMPLATE
    return tiny


def served_tiny_model(folder, layers: int):
    """:func:`chat_tiny_model` saved as an HF directory in ``folder`` and loaded as ``speculant serve --model DIR``
    loads it."""
    from speculant.models.loading import save_hf_dir
    from speculant.runtime.loader import load_model
    path = save_hf_dir(chat_tiny_model(layers), folder)
    return load_model(str(path), weights="auto", compile=False)


def openai_client(server, **kw):
    """The official ``openai`` client of ``server`` (a :class:`ServerThread`): no retries, 60 s timeout unless given."""
    import openai
    kw = {"timeout": 60, **kw}
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, **kw)


METRIC = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name + labels: value}."""
    out = {}
    for line in text.splitlines():
        m = METRIC.match(line)
        if m and not line.startswith("#"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out
