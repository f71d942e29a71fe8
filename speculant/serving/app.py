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
from ..engine.multi import MAX_N
from ..engine.prompts import check_prompt_ids, encode_prompt
from ..errors import SpeculantError
from ..sampling.processors import SamplingConfig
from . import protocol as P
from .fields import RefusedField, settings_of
from .metrics import ServerMetrics
from .scheduler import QueueFull, Scheduler, ShuttingDown, Submission

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

    def prompt_ids(self, req: P.CompletionRequest | P.ChatCompletionRequest) -> list[int]:
        """The request's prompt ids by the one rule of :mod:`speculant.engine.prompts` (``/v1/completions``: raw text
        with the tokenizer's special tokens, or token ids; chat: the chat template), checked against the context
        and the vocabulary.

        Raises:
            ApiError: 400 for an empty prompt, invalid Unicode, a token id out of range, a prompt that leaves no room
                in the context, or chat messages on a model without a chat template.
        """
        chat = isinstance(req, P.ChatCompletionRequest)
        param = "messages" if chat else "prompt"
        try:
            if chat:
                if not getattr(self.tokenizer, "chat_template", None):
                    raise ApiError(400, f"model {self.name!r} has no chat template; use /v1/completions", param)
                ids = encode_prompt(self.tokenizer, [{"role": m.role, "content": m.text()} for m in req.messages],
                                    chat=True)
            elif isinstance(req.prompt, str):
                ids = encode_prompt(self.tokenizer, req.prompt, chat=False)
            else:
                ids = req.prompt
            return check_prompt_ids(ids, self.context, self.vocab_size)
        except SpeculantError as e:
            raise ApiError(400, str(e), param) from None

    def config(self, req: P.CompletionRequest | P.ChatCompletionRequest, ids: list[int]) -> tuple[GenerationConfig, int]:
        """The generation settings of ``req`` for prompt ``ids`` and its ``n``, mapped by the table of request fields
        (:func:`speculant.serving.fields.settings_of`); no ``max_tokens`` means up to the context.  A grammar
        (``response_format``, ``guided_*``, ``structured_outputs``) is compiled here for the model's vocabulary
        and EOS tokens.

        Raises:
            ApiError: 400 naming a refused field, or a value our configuration refuses.
        """
        endpoint = "chat" if isinstance(req, P.ChatCompletionRequest) else "completions"
        try:
            s = settings_of(req, endpoint, self.vocab_size)
            if s.sampling.get("seed") is None:
                s.sampling["seed"] = secrets.randbits(63)
            if s.n > MAX_N:
                raise RefusedField("n", f"n={s.n} is out of range; allowed: an integer in [1, {MAX_N}]")
            if s.grammar is not None:
                from ..sampling.grammar import compile_grammar
                s.generation["grammar"] = compile_grammar(*s.grammar, self.tokenizer, vocab_size=self.vocab_size,
                                                          eos_token_ids=self.batched.model.eos_token_ids)
            config = GenerationConfig(max_new_tokens=s.max_tokens or self.context - len(ids),
                                      sampling=SamplingConfig(**s.sampling), **s.generation)
            return config, s.n
        except RefusedField as e:
            raise ApiError(400, str(e), e.field) from None
        except SpeculantError as e:
            raise ApiError(400, str(e)) from None

    def submit(self, ids: list[int], config: GenerationConfig, n: int = 1) -> Submission:
        sub = Submission(ids, config, asyncio.get_running_loop(), asyncio.Queue(), n)
        try:
            self.scheduler.submit(sub)
        except QueueFull as e:
            raise ApiError(429, str(e)) from None
        except ShuttingDown as e:
            raise ApiError(503, str(e)) from None
        return sub


async def _disconnected(request: Request) -> None:
    """Return when the client of ``request`` goes away (uvicorn's ``http.disconnect``; the body is read already,
    so nothing else arrives on ``receive``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(sub: Submission, request: Request) -> list[dict]:
    """Wait for a whole (non-streaming) result: per choice (index order) its ``text``, final ``event`` and
    ``logprobs`` entries (``None``: not asked).  A client that goes away meanwhile cancels ``sub`` at once (its
    sequences leave the batch before the next round; a waiting one never starts).  The disconnect is awaited beside
    the events, not polled when they pause: a running request's events never pause."""
    choices = [{"parts": [], "logprobs": None, "event": None} for _ in range(sub.n)]
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while any(c["event"] is None for c in choices):
            get = asyncio.ensure_future(sub.events.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                raise asyncio.CancelledError("client disconnected")
            ev = get.result()
            if ev.kind == "error":
                raise ApiError(ev.status, ev.error)
            c = choices[ev.index]
            c["parts"].append(ev.text)
            if ev.logprobs is not None:
                c["logprobs"] = (c["logprobs"] or []) + ev.logprobs
            if ev.kind == "done":
                c["event"] = ev
        return [{"text": "".join(c["parts"]), "event": c["event"], "logprobs": c["logprobs"]} for c in choices]
    finally:
        gone.cancel()
        sub.cancel()          # a no-op once finished; frees the slot if we leave early


def _whole(engine: ServingEngine, rid: str, chat: bool, choices: list[dict], prompt_tokens: int) -> dict:
    """The non-streaming response of ``choices`` (:func:`_collect`); ``speculant``: the counters of the one
    choice, or ``{"choices": [...]}`` of each when ``n > 1``."""
    make = P.chat_choice if chat else P.completion_choice
    out = [make(i, c["text"], c["event"].finish_reason, c["logprobs"]) for i, c in enumerate(choices)]
    stats = [c["event"].stats for c in choices]
    tokens = sum(c["event"].completion_tokens for c in choices)
    return P.response(rid, engine.name, "chat.completion" if chat else "text_completion", out, prompt_tokens, tokens,
                      stats[0] if len(stats) == 1 else {"choices": stats})


class RefuseWhenDraining:
    """ASGI middleware: while the server drains, a ``POST /v1/...`` gets 503 in OpenAI's error JSON.

    A plain ASGI middleware, not ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` hands the endpoint
    a ``receive`` that does not pass the client's ``http.disconnect`` on, so a waiting non-streaming request never
    saw its client go (``request.is_disconnected()`` stayed false) and kept its batch slot to the end.
    """

    def __init__(self, app, engine: ServingEngine):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and self.engine.draining and scope["path"].startswith("/v1/")
                and scope["method"] == "POST"):
            await JSONResponse(P.error_body("the server is shutting down", 503), status_code=503)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _location(loc) -> str:
    """A pydantic error location as the request's field path (``messages.0.content``), without the ``body`` prefix
    and the union-member tags pydantic inserts (``str``, ``list[str]``, ``function-after[...]``)."""
    return ".".join(str(x) for x in loc if x != "body" and not (isinstance(x, str) and _is_tag(x)))


def _is_tag(x: str) -> bool:
    return x in TYPE_TAGS or "[" in x


TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "StreamOptions", "ChatMessage", "TextPart"}


def validation_message(errors: list[dict]) -> tuple[str, str]:
    """(message, field path) for the first of pydantic's ``errors``: a malformed body, a field in no row of the
    table (OpenAI's "unrecognized request argument"), or a value of the wrong type or range."""
    first = errors[0] if errors else {}
    where, msg = _location(first.get("loc", ())), first.get("msg", "invalid request")
    kind = first.get("type")
    if kind == "json_invalid":                  # its loc is a character offset, not a field
        return f"malformed JSON body: {first.get('ctx', {}).get('error', msg)}", ""
    if kind == "extra_forbidden":
        return (f"unrecognized request argument supplied: {where} (fields this server does not know are refused; "
                "README lists every field)"), where
    top = first.get("loc", ("",) * 2)[:2]
    tags = [x for e in errors if tuple(e.get("loc", ()))[:2] == tuple(top) for x in e.get("loc", ())
            if isinstance(x, str) and _is_tag(x)]
    if len(set(tags)) > 1:                      # no member of a union fits: name them all
        msg += f" (allowed types: {' | '.join(dict.fromkeys(tags))})"
    return (f"{where}: {msg}" if where else msg), where


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
        message, where = validation_message(exc.errors())
        return JSONResponse(P.error_body(message, 400, where or None), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):      # a bug: still OpenAI's error JSON
        return JSONResponse(P.error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(P.error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)

    app.add_middleware(RefuseWhenDraining, engine=engine)

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
        ids = engine.prompt_ids(req)
        config, n = engine.config(req, ids)
        sub = engine.submit(ids, config, n)
        rid = P.new_id("cmpl")
        if req.stream:
            return _stream(engine, sub, rid, "text_completion", len(ids), req, drain_timeout)
        return _whole(engine, rid, False, await _collect(sub, request), len(ids))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        engine.check_model(req.model)
        ids = engine.prompt_ids(req)
        config, n = engine.config(req, ids)
        sub = engine.submit(ids, config, n)
        rid = P.new_id("chatcmpl")
        if req.stream:
            return _stream(engine, sub, rid, "chat.completion.chunk", len(ids), req, drain_timeout)
        return _whole(engine, rid, True, await _collect(sub, request), len(ids))

    return app


def _stream(engine: ServingEngine, sub: Submission, rid: str, obj: str, prompt_tokens: int, req,
            drain_timeout: float) -> EventSourceResponse:
    """Server-sent events for ``sub`` in OpenAI's chunk format (``obj``: ``text_completion`` or
    ``chat.completion.chunk``), ending with ``data: [DONE]``."""
    created, model = int(time.time()), engine.name
    chat = obj == "chat.completion.chunk"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(text: str | None, finish_reason: str | None, index: int, logprobs=None) -> str:
        if chat:
            delta = {} if text is None else {"content": text}
            return json.dumps(P.chat_chunk(rid, model, created, delta, finish_reason, index, logprobs))
        return json.dumps(P.completion_chunk(rid, model, created, text or "", finish_reason, index, logprobs))

    async def events():
        try:
            if chat:
                for i in range(sub.n):
                    yield json.dumps(P.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None, i))
            done, tokens = 0, 0
            while done < sub.n:
                ev = await sub.events.get()
                if ev.kind == "error":
                    yield json.dumps(P.error_body(ev.error, ev.status))
                    break
                if ev.text or ev.logprobs:
                    yield chunk(ev.text, None, ev.index, ev.logprobs)
                if ev.kind == "done":
                    yield chunk(None, ev.finish_reason, ev.index)
                    done, tokens = done + 1, tokens + ev.completion_tokens
            if done == sub.n and include_usage:
                yield json.dumps(P.usage_chunk(rid, model, created, obj, prompt_tokens, tokens))
            yield "[DONE]"
        finally:
            sub.cancel()      # the client went away (or we are done): the sequences leave the batch

    return EventSourceResponse(events(), sep="\n", ping=15, shutdown_grace_period=drain_timeout)
