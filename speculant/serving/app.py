"""The OpenAI-compatible HTTP API (FastAPI): ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/health``, ``/metrics``.

Every request is tokenized here, checked (a prompt as long as the context is refused with HTTP 400
naming the limit), and handed to the :class:`~speculant.serving.scheduler.Scheduler`, whose thread decodes
it in the running batch; text comes back through an ``asyncio.Queue``.  Streams are server-sent events
(sse-starlette) in OpenAI's chunk format ending with ``data: [DONE]``.  A client that goes away (a closed
stream, or a dropped connection while a non-streaming request waits) cancels its sequence, which leaves the
batch before the next round.  Status codes: 400 malformed JSON or fields, 404 unknown model, 429 queue full,
503 shutting down, 500 internal error; bodies are OpenAI's error objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.batch import BatchedGenerator
from ..engine.generator import GenerationConfig
from ..errors import SpeculantError
from ..sampling.processors import SamplingConfig
from . import protocol as P
from .metrics import ServerMetrics
from .scheduler import Event, QueueFull, Scheduler, ShuttingDown, Submission

DISCONNECT_POLL_S = 0.25
"""How often a waiting non-streaming request checks whether its client is still there [s]."""


class ApiError(Exception):
    """An error answered with OpenAI's error JSON and HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class ServingEngine:
    """What the HTTP layer serves: one model, its tokenizer, the scheduler and the metrics.

    Args:
        name: the model id clients pass as ``model``.
        batched: the batched generator.
        scheduler: drives ``batched`` (started by the caller or by the app's lifespan).
        metrics: the registry ``/metrics`` exposes.
    """

    def __init__(self, name: str, batched: BatchedGenerator, scheduler: Scheduler, metrics: ServerMetrics):
        self.name = name
        self.batched = batched
        self.scheduler = scheduler
        self.metrics = metrics
        self.tokenizer = batched.model.tokenizer
        self.context = batched.model.config.context_length
        self.vocab_size = batched.model.config.vocab_size
        self.created = int(time.time())

    @property
    def draining(self) -> bool:
        return self.scheduler.draining

    def begin_shutdown(self) -> None:
        self.scheduler.begin_shutdown()

    # ---------------------------------------------------------------- requests -> token ids + config
    def check_model(self, model: str) -> None:
        if model != self.name:
            raise ApiError(404, f"model={model!r} does not exist; allowed: {self.name!r}", "model")

    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"prompt token id {bad} is invalid; allowed: 0..{self.vocab_size - 1}", "prompt")
        return list(prompt)

    def chat_ids(self, messages: list[P.ChatMessage]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, f"model {self.name!r} has no chat template; use /v1/completions", "messages")
        ids = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages],
                                                 add_generation_prompt=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def config(self, req: P.CompletionRequest | P.ChatCompletionRequest, ids: list[int],
               max_tokens: int | None) -> GenerationConfig:
        """The generation settings of ``req`` for prompt ``ids``; ``max_tokens=None`` means up to the context.

        Raises:
            ApiError: 400 for an empty prompt or one that leaves no room in the context.
        """
        prompt_len = len(ids)
        try:
            self.batched.check_prompt(ids)
        except SpeculantError as e:
            raise ApiError(400, str(e), "messages" if isinstance(req, P.ChatCompletionRequest) else "prompt") from None
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        sampling = SamplingConfig(temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p, seed=seed)
        return GenerationConfig(max_new_tokens=max_tokens or self.context - prompt_len, sampling=sampling,
                                stop=tuple(req.stop or ()))

    def submit(self, ids: list[int], config: GenerationConfig) -> Submission:
        sub = Submission(ids, config, asyncio.get_running_loop(), asyncio.Queue())
        try:
            self.scheduler.submit(sub)
        except QueueFull as e:
            raise ApiError(429, str(e)) from None
        except ShuttingDown as e:
            raise ApiError(503, str(e)) from None
        return sub


async def _next_event(sub: Submission, request: Request | None) -> Event:
    """The next event of ``sub``; with ``request``, cancels ``sub`` and raises when the client went away."""
    if request is None:
        return await sub.events.get()
    while True:
        try:
            return await asyncio.wait_for(sub.events.get(), timeout=DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                sub.cancel()
                raise asyncio.CancelledError("client disconnected")


async def _collect(sub: Submission, request: Request) -> tuple[str, Event]:
    """Wait for a whole (non-streaming) result: (text, the final event)."""
    parts = []
    try:
        while True:
            ev = await _next_event(sub, request)
            if ev.kind == "error":
                raise ApiError(ev.status, ev.error)
            parts.append(ev.text)
            if ev.kind == "done":
                return "".join(parts), ev
    finally:
        sub.cancel()          # a no-op once finished; frees the slot if we leave early


def create_app(engine: ServingEngine, start_scheduler: bool = True, drain_timeout: float = 30.0) -> FastAPI:
    """The FastAPI application serving ``engine``.

    Args:
        start_scheduler: start the scheduler's thread at startup (tests may leave it stopped to hold requests
            in the queue); it is stopped at shutdown either way.
        drain_timeout: how long an open stream may go on after shutdown began [s].
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_scheduler:
            engine.scheduler.start()
        yield
        engine.scheduler.stop()

    app = FastAPI(title="speculant", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(P.error_body(exc.message, exc.status, exc.param), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":      # its loc is a character offset, not a field
            message, where = f"malformed JSON body: {first.get('ctx', {}).get('error', msg)}", ""
        else:
            message = f"{where}: {msg}" if where else msg
        return JSONResponse(P.error_body(message, 400, where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(P.error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)

    @app.middleware("http")
    async def _refuse_when_draining(request: Request, call_next):
        if engine.draining and request.url.path.startswith("/v1/") and request.method == "POST":
            return JSONResponse(P.error_body("the server is shutting down", 503), status_code=503)
        return await call_next(request)

    @app.get("/health")
    async def health():
        snap = engine.scheduler.snapshot()
        snap["status"] = "draining" if snap["draining"] else "ok"
        return JSONResponse(snap, status_code=503 if snap["draining"] else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": engine.created,
                                            "owned_by": "speculant", "max_model_len": engine.context}]}

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, request: Request):
        engine.check_model(req.model)
        ids = engine.completion_ids(req.prompt)
        config = engine.config(req, ids, req.max_tokens)
        sub = engine.submit(ids, config)
        rid = P.new_id("cmpl")
        if req.stream:
            return _stream(engine, sub, rid, "text_completion", len(ids), req, drain_timeout)
        text, ev = await _collect(sub, request)
        return P.completion_response(rid, engine.name, text, ev.finish_reason, len(ids), ev.completion_tokens,
                                     ev.stats)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        engine.check_model(req.model)
        ids = engine.chat_ids(req.messages)
        config = engine.config(req, ids, req.max_completion_tokens or req.max_tokens)
        sub = engine.submit(ids, config)
        rid = P.new_id("chatcmpl")
        if req.stream:
            return _stream(engine, sub, rid, "chat.completion.chunk", len(ids), req, drain_timeout)
        text, ev = await _collect(sub, request)
        return P.chat_response(rid, engine.name, text, ev.finish_reason, len(ids), ev.completion_tokens, ev.stats)

    return app


def _stream(engine: ServingEngine, sub: Submission, rid: str, obj: str, prompt_tokens: int, req,
            drain_timeout: float) -> EventSourceResponse:
    """Server-sent events for ``sub`` in OpenAI's chunk format (``obj``: ``text_completion`` or
    ``chat.completion.chunk``), ending with ``data: [DONE]``."""
    created, model = int(time.time()), engine.name
    chat = obj == "chat.completion.chunk"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(text: str | None, finish_reason: str | None) -> str:
        if chat:
            delta = {} if text is None else {"content": text}
            return json.dumps(P.chat_chunk(rid, model, created, delta, finish_reason))
        return json.dumps(P.completion_chunk(rid, model, created, text or "", finish_reason))

    async def events():
        try:
            if chat:
                yield json.dumps(P.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None))
            while True:
                ev = await _next_event(sub, None)
                if ev.kind == "error":
                    yield json.dumps(P.error_body(ev.error, ev.status))
                    break
                if ev.text:
                    yield chunk(ev.text, None)
                if ev.kind == "done":
                    yield chunk(None, ev.finish_reason)
                    if include_usage:
                        yield json.dumps(P.usage_chunk(rid, model, created, obj, prompt_tokens, ev.completion_tokens))
                    break
            yield "[DONE]"
        finally:
            sub.cancel()      # the client went away (or we are done): the sequence leaves the batch

    return EventSourceResponse(events(), sep="\n", ping=15, shutdown_grace_period=drain_timeout)
