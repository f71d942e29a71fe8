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


METRIC = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name + labels: value}."""
    out = {}
    for line in text.splitlines():
        m = METRIC.match(line)
        if m and not line.startswith("#"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out
