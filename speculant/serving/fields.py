"""Every field a request to ``/v1/completions`` or ``/v1/chat/completions`` may carry, in ONE table:
its JSON type (checked strictly: ``max_tokens: true`` or ``stream: "yes"`` is a 400), whether we honour it,
and the setting of ours it maps to.

* **honoured**: mapped onto :class:`~speculant.sampling.processors.SamplingConfig` /
  :class:`~speculant.engine.generator.GenerationConfig` by the row's ``apply`` function.
* **refused**: a value that would change the output (anything but the row's ``neutral`` values, e.g.
  ``frequency_penalty: 0`` changes nothing) is answered with HTTP 400 naming the field, never silently dropped.
* **ignored**: fields that change nothing in the output (``user``, ``metadata``, ``store``, ...).

A field in no row is refused as OpenAI refuses it ("unrecognized request argument"): a field we do not know
might change the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from ..errors import SpeculantError

HONOURED, REFUSED, IGNORED = "honoured", "refused", "ignored"
STRICT = ConfigDict(strict=True, extra="forbid")


@dataclass
class Settings:
    """What a request asks for, in our configuration's terms; the rows' ``apply`` functions fill it.

    Attributes:
        vocab_size: the model's vocabulary size (token ids in requests are checked against it).
        sampling: keyword arguments of :class:`~speculant.sampling.processors.SamplingConfig`.
        generation: keyword arguments of :class:`~speculant.engine.generator.GenerationConfig`.
        max_tokens: the request's token limit (``None``: up to the context) [tokens].
        grammar: ``(kind, spec)`` for ``speculant.sampling.grammar.compile_grammar(kind, spec, tokenizer)``; kinds
            ``json_object`` (spec ``None``), ``json_schema`` (a JSON schema), ``regex``, ``grammar`` (EBNF text),
            ``choice`` (a list of strings).
        grammar_field: the request field that set ``grammar`` (a second one is refused).
        n: independent samples asked for.
    """

    vocab_size: int
    sampling: dict = field(default_factory=dict)
    generation: dict = field(default_factory=dict)
    max_tokens: int | None = None
    grammar: tuple[str, Any] | None = None
    grammar_field: str | None = None
    n: int = 1

    def set_grammar(self, name: str, kind: str, spec) -> None:
        """Record the constraint of field ``name``. Raises :class:`SpeculantError` if another field set one."""
        if self.grammar is not None:
            raise SpeculantError(f"{name} and {self.grammar_field} both constrain the output; allowed: one of them")
        self.grammar, self.grammar_field = (kind, spec), name


@dataclass(frozen=True)
class RequestField:
    """One row of :data:`FIELDS`.

    Attributes:
        name: the JSON field.
        type: its type (a pydantic annotation, validated strictly).
        default: the value when absent (``...``: required).
        status: :data:`HONOURED`, :data:`REFUSED` or :data:`IGNORED`.
        endpoints: ``'both'``, ``'chat'`` or ``'completions'``.
        maps_to: our setting (for the README table).
        apply: ``apply(value, settings)`` maps the value onto ``settings`` (called for honoured rows).
        neutral: values that change nothing; a refused row accepts them (default: ``None`` and ``default``).
    """

    name: str
    type: Any
    default: Any
    status: str
    endpoints: str
    maps_to: str
    apply: Callable[[Any, Settings], None] | None = None
    neutral: tuple = ()

    def is_neutral(self, value) -> bool:
        return value is None or value == self.default or any(value == v for v in self.neutral)


# ---------------------------------------------------------------- types
def _stop(v):
    if v is None:
        return []
    v = [v] if isinstance(v, str) else v
    if any(not s for s in v):
        raise ValueError("stop strings must be non-empty")
    return v


def _prompt(v):
    if isinstance(v, list) and v and isinstance(v[0], str):
        if len(v) != 1:
            raise ValueError(f"{len(v)} prompts in one request are not supported; allowed: 1")
        v = v[0]
    if not v or (isinstance(v, str) and not v.strip()):
        raise ValueError("prompt is empty")
    return v


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A chat message: ``content`` is required (a string or text parts); ``name`` is accepted and not used."""

    model_config = STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


Unit = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)] | None
Tokens = Annotated[int, Field(ge=1)] | None
Json = dict[str, Any] | None


# ---------------------------------------------------------------- mappings
def _to(section: str, key: str, convert=lambda v: v) -> Callable[[Any, Settings], None]:
    def apply(value, s: Settings) -> None:
        if value is not None:
            getattr(s, section)[key] = convert(value)
    apply.__doc__ = f"``{section}['{key}']``"
    return apply


def _max_tokens(value, s: Settings) -> None:
    if value is not None:
        s.max_tokens = value


def _logit_bias(value: dict, s: Settings) -> None:
    bias = {}
    for key, b in (value or {}).items():
        try:
            tok = int(key)
        except ValueError:
            tok = -1
        if not 0 <= tok < s.vocab_size:
            raise SpeculantError(f"logit_bias token id {key!r} is invalid; allowed: integers in "
                                 f"[0, {s.vocab_size - 1}]")
        bias[tok] = float(b)
    if bias:
        s.sampling["logit_bias"] = bias


def _chat_logprobs(value, s: Settings) -> None:
    if value:
        s.generation.setdefault("logprobs", 0)


def _top_logprobs(value, s: Settings) -> None:
    if value:
        if "logprobs" not in s.generation:
            raise SpeculantError("top_logprobs is set without logprobs: true; allowed: logprobs: true with it")
        s.generation["logprobs"] = value


def _response_format(value: dict, s: Settings) -> None:
    kind = (value or {}).get("type", "text")
    if kind == "json_object":
        s.set_grammar("response_format", "json_object", None)
    elif kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise SpeculantError("response_format.json_schema.schema is missing; allowed: a JSON schema object")
        s.set_grammar("response_format", "json_schema", schema)
    elif kind != "text":
        raise SpeculantError(f"response_format.type={kind!r} is unknown; allowed: text, json_object, json_schema")


def _guided(name: str, kind: str) -> Callable[[Any, Settings], None]:
    def apply(value, s: Settings) -> None:
        if value is not None:
            s.set_grammar(name, kind, value)
    return apply


def _structured_outputs(value: dict, s: Settings) -> None:
    kinds = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}
    for key, v in (value or {}).items():
        if key == "json_object" and v:
            s.set_grammar("structured_outputs", "json_object", None)
        elif key in kinds and v is not None:
            s.set_grammar("structured_outputs", kinds[key], v)
        elif key not in kinds and key != "json_object":
            raise SpeculantError(f"structured_outputs.{key} is unknown; allowed: json, regex, grammar, choice, "
                                 "json_object")


def _n(value, s: Settings) -> None:
    s.n = value


# ---------------------------------------------------------------- the table
_S, _G = "sampling", "generation"
FIELDS: tuple[RequestField, ...] = (
    # name, type, default, status, endpoints, maps to, apply, neutral
    RequestField("model", str, ..., HONOURED, "both", "must equal the served model's id (else 404)"),
    RequestField("prompt", Annotated[str | list[int] | list[str], AfterValidator(_prompt)], ..., HONOURED,
                 "completions", "prompt ids: text encoded raw, with the tokenizer's special tokens "
                 "(`speculant.engine.prompts`); or token ids"),
    RequestField("messages", Annotated[list[ChatMessage], Field(min_length=1)], ..., HONOURED, "chat",
                 "prompt ids: the tokenizer's chat template (`speculant.engine.prompts`)"),
    RequestField("max_tokens", Tokens, 16, HONOURED, "completions", "`GenerationConfig.max_new_tokens`",
                 _max_tokens),
    RequestField("max_tokens", Tokens, None, HONOURED, "chat", "`GenerationConfig.max_new_tokens` (default: up to "
                 "the context)", _max_tokens),
    RequestField("max_completion_tokens", Tokens, None, HONOURED, "chat",
                 "`GenerationConfig.max_new_tokens` (wins over `max_tokens`)", _max_tokens),
    RequestField("temperature", Annotated[float, Field(ge=0.0, le=2.0)], 1.0, HONOURED, "both",
                 "`SamplingConfig.temperature` (0: greedy)", _to(_S, "temperature")),
    RequestField("top_p", Annotated[float, Field(gt=0.0, le=1.0)], 1.0, HONOURED, "both", "`SamplingConfig.top_p`",
                 _to(_S, "top_p")),
    RequestField("top_k", Annotated[int, Field(ge=-1)], 0, HONOURED, "both",
                 "`SamplingConfig.top_k` (0 or -1: off; vLLM's extra field)", _to(_S, "top_k", lambda v: max(v, 0))),
    RequestField("seed", Annotated[int, Field(ge=0, le=2**63 - 1)] | None, None, HONOURED, "both",
                 "`SamplingConfig.seed` (absent: a random one)", _to(_S, "seed")),
    RequestField("stop", Annotated[str | list[str] | None, AfterValidator(_stop)], None, HONOURED, "both",
                 "`GenerationConfig.stop`", _to(_G, "stop", tuple)),
    RequestField("stream", bool, False, HONOURED, "both", "server-sent events"),
    RequestField("stream_options", StreamOptions | None, None, HONOURED, "both",
                 "`include_usage`: a last chunk with the usage"),
    # sampling controls, logprobs, n, structured output (issue 27): exact under every method
    RequestField("frequency_penalty", Penalty, 0.0, HONOURED, "both", "`SamplingConfig.frequency_penalty`",
                 _to(_S, "frequency_penalty")),
    RequestField("presence_penalty", Penalty, 0.0, HONOURED, "both", "`SamplingConfig.presence_penalty`",
                 _to(_S, "presence_penalty")),
    RequestField("repetition_penalty", Annotated[float, Field(gt=0.0)] | None, 1.0, HONOURED, "both",
                 "`SamplingConfig.repetition_penalty` (vLLM's extra field)", _to(_S, "repetition_penalty")),
    RequestField("min_p", Unit | None, 0.0, HONOURED, "both", "`SamplingConfig.min_p` (vLLM's extra field)",
                 _to(_S, "min_p")),
    RequestField("logit_bias", dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None, None, HONOURED, "both",
                 "`SamplingConfig.logit_bias` (token id -> bias)", _logit_bias, ({},)),
    RequestField("logprobs", bool | None, None, HONOURED, "chat", "`GenerationConfig.logprobs` (raw: the target's log-softmax before temperature, "
                 "penalties, bias and grammar)", _chat_logprobs,
                 (False,)),
    RequestField("top_logprobs", Annotated[int, Field(ge=0, le=20)] | None, None, HONOURED, "chat",
                 "`GenerationConfig.logprobs` (the number of alternatives)", _top_logprobs, (0,)),
    RequestField("logprobs", Annotated[int, Field(ge=0, le=20)] | None, None, HONOURED, "completions",
                 "`GenerationConfig.logprobs` (raw, as in chat; `tokens`, `token_logprobs`, `top_logprobs`, "
                 "`text_offset`)", _to(_G, "logprobs")),
    RequestField("n", Annotated[int, Field(ge=1)], 1, HONOURED, "both", "independent samples (seed + i), one shared prefill "
                 "(`BatchedGenerator.start_n`; at most 128)", _n),
    RequestField("response_format", Json, None, HONOURED, "both", "`GenerationConfig.grammar` (json_object, "
                 "json_schema)", _response_format, ({"type": "text"},)),
    RequestField("guided_json", dict[str, Any] | str | None, None, HONOURED, "both",
                 "`GenerationConfig.grammar` (vLLM's extra field)", _guided("guided_json", "json_schema")),
    RequestField("guided_regex", str | None, None, HONOURED, "both", "`GenerationConfig.grammar` (vLLM)",
                 _guided("guided_regex", "regex")),
    RequestField("guided_grammar", str | None, None, HONOURED, "both", "`GenerationConfig.grammar` (vLLM)",
                 _guided("guided_grammar", "grammar")),
    RequestField("guided_choice", list[str] | None, None, HONOURED, "both", "`GenerationConfig.grammar` (vLLM)",
                 _guided("guided_choice", "choice")),
    RequestField("structured_outputs", Json, None, HONOURED, "both", "`GenerationConfig.grammar` (vLLM: json, "
                 "regex, grammar, choice, json_object)", _structured_outputs, ({},)),
    RequestField("min_tokens", Annotated[int, Field(ge=0)] | None, 0, HONOURED, "both",
                 "`GenerationConfig.min_tokens` (vLLM's extra field)", _to(_G, "min_tokens")),
    RequestField("ignore_eos", bool | None, False, HONOURED, "both", "`GenerationConfig.ignore_eos` (vLLM)",
                 _to(_G, "ignore_eos")),
    RequestField("stop_token_ids", list[Annotated[int, Field(ge=0)]] | None, None, HONOURED, "both",
                 "`GenerationConfig.stop_token_ids` (vLLM)", _to(_G, "stop_token_ids", tuple), ([],)),
    # not planned: what the output would be is out of our scope
    RequestField("tools", list[dict[str, Any]] | None, None, REFUSED, "chat", "no tool calling", None, ([],)),
    RequestField("tool_choice", str | dict[str, Any] | None, None, REFUSED, "chat",
                 "no tool calling (`none`, `auto` accepted: without tools they change nothing)", None, ("none", "auto")),
    RequestField("functions", list[dict[str, Any]] | None, None, REFUSED, "chat", "no tool calling", None, ([],)),
    RequestField("function_call", str | dict[str, Any] | None, None, REFUSED, "chat", "no tool calling", None,
                 ("none", "auto")),
    RequestField("suffix", str | None, None, REFUSED, "completions", "no fill-in-the-middle", None, ("",)),
    RequestField("echo", bool, False, REFUSED, "completions", "the prompt is not echoed"),
    RequestField("best_of", Annotated[int, Field(ge=1)] | None, None, REFUSED, "completions", "one sample only",
                 None, (1,)),
    RequestField("modalities", list[str] | None, None, REFUSED, "chat", "text only", None, (["text"],)),
    RequestField("audio", Json, None, REFUSED, "chat", "text only"),
    RequestField("reasoning_effort", str | None, None, REFUSED, "chat", "not a reasoning model"),
    RequestField("verbosity", str | None, None, REFUSED, "chat", "not supported"),
    RequestField("web_search_options", Json, None, REFUSED, "chat", "no web search"),
    RequestField("skip_special_tokens", bool, True, REFUSED, "both", "special tokens are always skipped in text"),
    RequestField("include_stop_str_in_output", bool, False, REFUSED, "both", "the text ends before a stop string"),
    RequestField("use_beam_search", bool, False, REFUSED, "both", "no beam search"),
    RequestField("prompt_logprobs", Annotated[int, Field(ge=0)] | None, None, REFUSED, "both", "not supported"),
    # change nothing in the output
    RequestField("user", str | None, None, IGNORED, "both", "–"),
    RequestField("metadata", dict[str, str] | None, None, IGNORED, "both", "–"),
    RequestField("store", bool | None, None, IGNORED, "both", "– (nothing is stored)"),
    RequestField("service_tier", str | None, None, IGNORED, "both", "–"),
    RequestField("prompt_cache_key", str | None, None, IGNORED, "both", "– (prefix caching is automatic)"),
    RequestField("safety_identifier", str | None, None, IGNORED, "both", "–"),
    RequestField("parallel_tool_calls", bool | None, None, IGNORED, "chat", "– (no tools)"),
    RequestField("prediction", Json, None, IGNORED, "chat", "– (OpenAI's predicted outputs change only latency)"),
    RequestField("guided_decoding_backend", str | None, None, IGNORED, "both", "– (vLLM: which grammar library)"),
    RequestField("priority", int | None, None, IGNORED, "both", "– (vLLM; requests are served first come)"),
    RequestField("request_id", str | None, None, IGNORED, "both", "– (vLLM)"),
)


def rows(endpoint: str) -> list[RequestField]:
    """The rows of ``endpoint`` (``'chat'`` or ``'completions'``)."""
    return [f for f in FIELDS if f.endpoints in ("both", endpoint)]


def settings_of(req: BaseModel, endpoint: str, vocab_size: int) -> Settings:
    """Map a validated request onto :class:`Settings` by the table.

    Raises:
        RefusedField: a refused field set to a value that would change the output (the field is named).
        SpeculantError: a value a mapping rejects (named, with what is allowed).
    """
    s = Settings(vocab_size)
    for f in rows(endpoint):
        value = getattr(req, f.name)
        if f.status == REFUSED and not f.is_neutral(value):
            raise RefusedField(f.name, f"{f.name}={value!r} is not supported by this server; allowed: "
                                       f"{_neutral_text(f)}")
        if f.status == HONOURED and f.apply is not None:
            f.apply(value, s)
    return s


def _neutral_text(f: RequestField) -> str:
    vals = [f.default] + list(f.neutral)
    return " or ".join(dict.fromkeys(repr(v) for v in vals if v is not ...)) + " (or leave it out)"


class RefusedField(SpeculantError):
    """A refused request field was set (``field``: its name)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.field = name


def markdown_table() -> str:
    """The README's table of request fields (one row per field and endpoint kind)."""
    lines = ["| field | endpoint | status | maps to |", "|---|---|---|---|"]
    for f in FIELDS:
        where = {"both": "both", "chat": "chat", "completions": "completions"}[f.endpoints]
        lines.append(f"| `{f.name}` | {where} | {f.status} | {f.maps_to} |")
    return "\n".join(lines)
