"""``speculant serve``: load the model, check how large a batch stays exact, run uvicorn; SIGTERM drains.

On SIGTERM (or Ctrl-C) the server stops accepting connections, answers requests on open connections with
503, refuses queued requests with 503, lets running requests finish for up to ``--drain-timeout`` seconds
(streams included), then exits with code 0.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading

from ..engine.batch import BatchedGenerator
from ..errors import SpeculantError, check_range
from ..runtime import tune
from ..runtime.executor import executor_of
from .metrics import ServerMetrics
from .scheduler import Scheduler

BATCH_CHECK_ROWS = (32, 64, 128, 256, 512)
"""Row counts checked for batch invariance at startup, up to the largest round ``--max-batch`` allows."""


def exact_batch_limit(batched: BatchedGenerator, max_batch: int, log=None) -> int:
    """The largest batch (<= ``max_batch``) whose rounds stay within the rows the projections are
    batch-invariant at on this machine, so each sequence's logits are those it gets decoded alone.

    A round runs at most ``max_batch * rows_per_sequence`` rows through each projection; the model's
    kernels are checked at that count and the :data:`BATCH_CHECK_ROWS` below it
    (:func:`speculant.runtime.tune.invariant_rows`, on the first layer and the LM head).

    When even one sequence's block is not batch-invariant (a weight format that is not exact on this machine,
    e.g. ``--weights fp32`` where MKL's one-row and multi-row products round differently), batching is turned
    off (1): each request then gets exactly what ``speculant generate`` gives it in that format.
    """
    log = log or sys.stderr
    per = batched.rows_per_sequence
    needed = per * max_batch
    limits = sorted({r for r in BATCH_CHECK_ROWS if r < needed} | {needed})
    import torch
    with torch.inference_mode():
        ok = tune.invariant_rows(tune.invariance_sample(batched.model.decoder), limits)
    if ok >= needed:
        return max_batch
    fit = max(1, ok // per)
    print(f"speculant: --max-batch {max_batch} lowered to {fit}: the {getattr(batched.model, 'weights', '')} "
          f"projections are batch-invariant up to {ok} rows on this machine, and a round takes up to {per} rows per "
          "sequence" + ("" if ok else " (--weights auto picks a format that is)"), file=log, flush=True)
    return fit


SPECULATION = ("goodput", "always")
"""``--speculation``: draft in a round only when that pays at its batch size (:mod:`speculant.engine.goodput`), or
in every round."""


def check_speculation(value: str) -> None:
    """Raises :class:`SpeculantError` naming ``value`` unless it is one of :data:`SPECULATION`."""
    if value not in SPECULATION:
        raise SpeculantError(f"--speculation={value!r} is unknown; allowed: {', '.join(SPECULATION)}")


def build_engine(model, spec, name: str, max_batch: int, max_queue: int, drain_timeout: float, log=None,
                 prefix_cache_tokens: int = 0, speculation: str = "goodput"):
    """A :class:`~speculant.serving.app.ServingEngine` for ``model`` decoding with method ``spec``, keeping the KV
    of up to ``prefix_cache_tokens`` prompt tokens for reuse (:mod:`speculant.engine.prefix_cache`; 0: none);
    ``speculation`` is one of :data:`SPECULATION` (``goodput`` times the target's forwards here, ~0.5 s).

    Raises:
        SpeculantError: a bad option value (named, with what is allowed).
    """
    from ..engine.goodput import GoodputPolicy
    from ..engine.methods import build_generator
    from ..engine.prefix_cache import PrefixCache
    from .app import ServingEngine
    check_range("--max-batch", max_batch, 1)
    check_range("--max-queue", max_queue, 0)
    check_range("--drain-timeout", drain_timeout, 0.0)
    check_range("--prefix-cache-tokens", prefix_cache_tokens, 0)
    check_speculation(speculation)
    gen = build_generator(model, spec)
    batched = BatchedGenerator(model, gen.drafter, gen.builder,
                               PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None)
    max_batch = exact_batch_limit(batched, max_batch, log)
    if speculation == "goodput" and gen.builder is not None:
        batched.policy = GoodputPolicy.measure(executor_of(model), min(max_batch * batched.rows_per_sequence, 128))
    if not batched.matches_single_sequence(with_neighbours=max_batch > 1):
        print("speculant: warning: batched rounds do not reproduce the one-sequence forward bit for bit on this "
              "machine (a compiled model's layer halves may round differently from its fused step; --no-compile "
              "avoids that); greedy outputs may then differ from `speculant generate` at near-ties",
              file=log or sys.stderr, flush=True)
    metrics = ServerMetrics(name)
    scheduler = Scheduler(batched, model.tokenizer, metrics, max_batch, max_queue, drain_timeout)
    return ServingEngine(name, batched, scheduler, metrics)


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, which on SIGTERM/SIGINT first puts the engine into draining, and exits with
        code 0 after a SIGTERM (uvicorn re-raises the captured signal otherwise)."""

        engine = None
        announce = False

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.announce and self.started and self.servers:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"speculant: ready on http://{host}:{port}/v1", file=sys.stderr, flush=True)

        def handle_exit(self, sig, frame):
            if self.engine is not None:
                self.engine.begin_shutdown()
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    return DrainingServer


def make_server(engine, host: str, port: int, drain_timeout: float, start_scheduler: bool = True,
                log_level: str = "warning"):
    """A configured uvicorn server for ``engine`` (call ``.run()``; ``.should_exit = True`` stops it)."""
    import uvicorn
    from .app import create_app
    app = create_app(engine, start_scheduler=start_scheduler, drain_timeout=drain_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=drain_timeout + 5, lifespan="on")
    server = _server_class()(config)
    server.engine = engine
    return server


def check_port_free(host: str, port: int) -> None:
    """Raises :class:`SpeculantError` naming ``host`` and ``port`` when the server could not listen there (another
    process holds the port, or the host is not an address of this machine); port 0 (any free port) always passes.

    Binds and closes a socket with ``SO_REUSEADDR``, as uvicorn binds (so a port in ``TIME_WAIT`` passes, as it
    does for uvicorn); a process taking the port between this check and uvicorn's start is still reported by uvicorn.
    """
    if port == 0:
        return
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise SpeculantError(f"--host={host!r} cannot be resolved ({e.strerror}); allowed: an address or host name "
                             "of this machine") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise SpeculantError(f"--port={port} on {host} cannot be used ({e.strerror}); allowed: a free port "
                                 "(or 0: any free one)") from None


def cmd_serve(args) -> int:
    """``speculant serve``: see the module docstring."""
    from ..arguments import load_for_decoding, method_spec_from_args
    check_range("--port", args.port, 0, 65535)
    check_range("--max-batch", args.max_batch, 1)
    check_range("--max-queue", args.max_queue, 0)
    check_range("--drain-timeout", args.drain_timeout, 0.0)
    check_range("--prefix-cache-tokens", args.prefix_cache_tokens, 0)
    check_speculation(args.speculation)
    method_spec_from_args(args)                 # bad flag combinations fail before the model loads
    check_port_free(args.host, args.port)       # and a busy port too
    box, ready = {}, threading.Event()

    def compute() -> None:
        """Load, check and decode in one thread (see :meth:`Scheduler.run_here`); uvicorn runs in the main one."""
        try:
            model = load_for_decoding(args)
            spec = method_spec_from_args(args, model)
            name = args.served_model_name or model.name
            box["engine"] = build_engine(model, spec, name, args.max_batch, args.max_queue, args.drain_timeout,
                                         prefix_cache_tokens=args.prefix_cache_tokens, speculation=args.speculation)
            box["about"] = (f"speculant: serving {name!r} (method {spec.method}, weights "
                            f"{getattr(model, 'weights', '?')}, max batch {box['engine'].scheduler.max_batch}, "
                            f"queue {args.max_queue})")
        except BaseException as e:              # reported by the main thread (one-line error, exit 2)
            box["error"] = e
        ready.set()
        if "engine" in box:
            box["engine"].scheduler.run_here()

    threading.Thread(target=compute, name="speculant-compute", daemon=True).start()
    ready.wait()
    if "error" in box:
        raise box["error"]
    engine = box["engine"]
    server = make_server(engine, args.host, args.port, args.drain_timeout, start_scheduler=False,
                         log_level=args.log_level)
    server.announce = True
    print(box["about"], file=sys.stderr, flush=True)
    server.run()
    return 0
