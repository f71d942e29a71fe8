"""Request bodies of the OpenAI-compatible API (pydantic) and the response / error JSON we send.

Follows OpenAI's ``/v1/completions`` and ``/v1/chat/completions``: ``max_tokens`` (``max_completion_tokens``
for chat), ``temperature`` (default 1; 0 = greedy), ``top_p``, ``seed``, ``stop`` (a string or a list),
``stream`` (+ ``stream_options.include_usage``), ``n`` = 1 only; ``top_k`` is an extra field (0 or -1 = off),
as in vLLM.  Unknown fields are ignored (clients send many); fields we cannot honour (``n > 1``, ``logprobs``,
``echo``, ``best_of > 1``) are refused with HTTP 400.  Errors are ``{"error": {"message", "type", "param",
"code"}}``.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v != 1:
            raise ValueError(f"n={v} is not supported; allowed: 1")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return v


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError(f"{len(v)} prompts in one request are not supported; allowed: 1")
            v = v[0]
        if not v or (isinstance(v, str) and not v.strip()):
            raise ValueError("prompt is empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of={self.best_of} is not supported; allowed: 1")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


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
