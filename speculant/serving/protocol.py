"""Request bodies of the OpenAI-compatible API (pydantic models built from the one table of request fields,
:data:`speculant.serving.fields.FIELDS`) and the response / error JSON we send.

Follows OpenAI's ``/v1/completions`` and ``/v1/chat/completions``.  Types are strict (``max_tokens: true``,
``stream: "yes"``, ``temperature: "1"`` are refused), a message needs ``content``, a field in no row of the table
is refused ("unrecognized request argument", as OpenAI does), and a refused field set to a value that would
change the output is refused naming it (:func:`speculant.serving.fields.settings_of`).  Errors are
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid

from pydantic import create_model

from .fields import STRICT, ChatMessage, StreamOptions, TextPart, rows

__all__ = ["ChatMessage", "StreamOptions", "TextPart", "CompletionRequest", "ChatCompletionRequest"]


def _request_model(name: str, endpoint: str):
    fields = {f.name: (f.type, f.default) for f in rows(endpoint)}
    return create_model(name, __config__=STRICT, **fields)


CompletionRequest = _request_model("CompletionRequest", "completions")
ChatCompletionRequest = _request_model("ChatCompletionRequest", "chat")


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error object for an HTTP ``status``."""
    kind = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
            503: "service_unavailable"}.get(status, "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
                        completion_tokens: int, stats: dict | None = None) -> dict:
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
           "usage": usage(prompt_tokens, completion_tokens)}
    if stats is not None:
        out["speculant"] = stats
    return out


def chat_response(rid: str, model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                  stats: dict | None = None) -> dict:
    out = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": finish_reason}],
           "usage": usage(prompt_tokens, completion_tokens)}
    if stats is not None:
        out["speculant"] = stats
    return out


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
