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


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``
    from the scheduler's entries (:func:`speculant.serving.scheduler.token_entries`; ``None``: not asked)."""
    if entries is None:
        return None
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": b} for t, b, v in e["top"]]}
                        for e in entries]}


def completion_logprobs(entries: list[dict] | None) -> dict | None:
    """OpenAI's (legacy) completions ``logprobs``: ``{tokens, token_logprobs, top_logprobs, text_offset}``
    (``top_logprobs``: per token a mapping token text -> logprob; ``text_offset``: where each token's text starts
    in the choice's text [characters])."""
    if entries is None:
        return None
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t: v for t, _, v in e["top"]} for e in entries],
            "text_offset": [e["offset"] for e in entries]}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: list[dict] | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": completion_logprobs(logprobs), "finish_reason": finish_reason}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: list[dict] | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": chat_logprobs(logprobs),
            "finish_reason": finish_reason}


def response(rid: str, model: str, obj: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
             stats: dict | list | None = None) -> dict:
    """A whole response (``obj``: ``text_completion`` or ``chat.completion``); ``completion_tokens`` counts every
    choice's tokens, as OpenAI's usage does; ``stats`` is our ``speculant`` field."""
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices,
           "usage": usage(prompt_tokens, completion_tokens)}
    if stats is not None:
        out["speculant"] = stats
    return out


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None, index: int = 0,
                     logprobs: list[dict] | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [completion_choice(index, text, finish_reason, logprobs)]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None, index: int = 0,
               logprobs: list[dict] | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                         "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
