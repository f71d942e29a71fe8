"""Structured output: a grammar masks the tokens that cannot continue a valid output, position by position.

Built on llguidance (Microsoft, https://github.com/guidance-ai/llguidance; an Earley parser over the
tokenizer's byte trie), chosen by measurement on this project's machines against xgrammar and outlines-core
(BENCHMARKS.md, "Structured output libraries").  One :class:`Grammar` is compiled per request; every
generation takes its own :class:`GrammarMatcher` (:meth:`Grammar.matcher`), which the engine moves along
the committed tokens and, for speculation, along each drafted path (consume, mask, roll back).

Kinds (``compile_grammar``):
    * ``json_object``: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
    * ``json_schema``: a JSON schema (a dict or its JSON text).
    * ``regex``: a regular expression the whole output must match (Rust ``regex`` syntax).
    * ``ebnf`` (alias ``grammar``, vLLM's name): a Lark grammar or a GBNF grammar (llama.cpp's format), as
      llguidance reads them.
    * ``choice``: a list of strings; the output is exactly one of them (vLLM's ``guided_choice``).
"""

from __future__ import annotations

import json
import sys
import weakref

import numpy as np
import torch

from ..errors import SpeculantError

KINDS = ("json_object", "json_schema", "regex", "ebnf", "grammar", "choice")

_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _ll_tokenizer(tokenizer, vocab_size: int | None, eos_token_ids):
    """The llguidance tokenizer of an HF fast tokenizer or a :class:`~speculant.models.tokenizer.FastTokenizer`
    (its ``tokenizers`` backend serialized, as ``llguidance.hf.from_tokenizer`` does for transformers' tokenizers,
    without importing transformers); building it costs ~0.5 s: kept per tokenizer object."""
    import llguidance

    from ..models.tokenizer import FastTokenizer
    if isinstance(tokenizer, llguidance.LLTokenizer):
        return tokenizer
    key = (vocab_size, tuple(eos_token_ids or ()))
    per_tok = _TOKENIZERS.setdefault(tokenizer, {})
    if key not in per_tok:
        eos = list(eos_token_ids) if eos_token_ids else None
        try:
            if isinstance(tokenizer, FastTokenizer):    # its backend has no padding or truncation (open_fast)
                per_tok[key] = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                      eos_token=eos if eos is not None else tokenizer.eos_token_id)
            else:
                import llguidance.hf
                per_tok[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except (ValueError, TypeError) as e:
            raise SpeculantError(f"tokenizer {type(tokenizer).__name__} is unsupported for structured output "
                                 f"({str(e).splitlines()[0]}); allowed: a fast (tokenizers-backed) tokenizer") from None
    return per_tok[key]


JSON_WHITESPACE = r"[\n]?[ \t]{0,24}"
"""Whitespace allowed between two JSON tokens (llguidance's ``x-guidance.whitespace_pattern``): at most one line
break and an indent of up to 24 spaces or tabs, so pretty-printed JSON stays possible but a sampled generation cannot
run away in whitespace until its token budget ends (seen with SmolLM2 at T = 1: a 300-character run after a value;
vLLM offers ``--disable-any-whitespace`` for the same trap).  A schema's own ``x-guidance`` options take precedence."""


def _with_bounded_whitespace(schema: dict) -> dict:
    return schema if "x-guidance" in schema else {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


def _grammar_text(kind: str, spec) -> str:
    """The llguidance grammar of ``spec`` (see the module docstring for each kind; JSON with
    :data:`JSON_WHITESPACE`)."""
    import llguidance
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_with_bounded_whitespace({"type": "object"}))
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise SpeculantError(f"json_schema is not valid JSON ({e}); allowed: a JSON schema object") from None
        if not isinstance(spec, dict):
            raise SpeculantError(f"json_schema={spec!r} is invalid; allowed: a JSON schema object")
        return llguidance.LLMatcher.grammar_from_json_schema(_with_bounded_whitespace(spec))
    if kind == "choice":
        if not isinstance(spec, (list, tuple)) or not spec or any(not isinstance(c, str) or not c for c in spec):
            raise SpeculantError(f"choice={spec!r} is invalid; allowed: a non-empty list of non-empty strings")
        return llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec))
    if not isinstance(spec, str) or not spec:
        raise SpeculantError(f"{kind}={spec!r} is invalid; allowed: a non-empty string")
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    return llguidance.grammar_from("ebnf", spec)


def compile_grammar(kind: str, spec, tokenizer, *, vocab_size: int | None = None,
                    eos_token_ids=None) -> "Grammar":
    """Compile a constraint for ``tokenizer``.

    Args:
        kind: one of :data:`KINDS`.
        spec: ``None`` (json_object), a JSON-schema dict or str (json_schema), a regex str (regex), a Lark or
            GBNF grammar str (ebnf, grammar), a list of strings (choice).
        tokenizer: an HF fast tokenizer (or an ``llguidance.LLTokenizer``).
        vocab_size: the model's vocabulary (masks have this length; default: the tokenizer's).
        eos_token_ids: the tokens that end the output once the grammar is complete (default: the tokenizer's EOS).
    Raises:
        SpeculantError: unknown kind, a spec that does not parse (the parser's first message line).
    """
    if kind not in KINDS:
        raise SpeculantError(f"grammar kind={kind!r} is unknown; allowed: {', '.join(KINDS)}")
    import llguidance
    text = _grammar_text(kind, spec)
    lltok = _ll_tokenizer(tokenizer, vocab_size, eos_token_ids)
    err = llguidance.LLMatcher.validate_grammar(text, lltok)
    if err:
        raise SpeculantError(f"{kind} is invalid ({err.strip().splitlines()[0]}); allowed: a valid {kind}")
    return Grammar(kind, text, lltok, vocab_size or lltok.vocab_size)


class Grammar:
    """A compiled constraint (:func:`compile_grammar`); immutable, shared by any number of generations.

    Attributes:
        kind: what it was compiled from (:data:`KINDS`).
        vocab_size: length of the masks [tokens].
    """

    def __init__(self, kind: str, text: str, lltokenizer, vocab_size: int):
        self.kind, self.text, self.lltokenizer, self.vocab_size = kind, text, lltokenizer, vocab_size

    def matcher(self, vocab_size: int | None = None) -> "GrammarMatcher":
        """A new matcher at the start of the output; masks have ``vocab_size`` entries (default
        :attr:`vocab_size`; ids past the tokenizer's vocabulary are never allowed)."""
        import llguidance
        m = llguidance.LLMatcher(self.lltokenizer, self.text, log_level=0)
        if m.is_error():
            raise SpeculantError(f"{self.kind} is invalid ({m.get_error().splitlines()[0]}); allowed: a valid {self.kind}")
        return GrammarMatcher(m, self.lltokenizer.vocab_size, vocab_size or self.vocab_size,
                              set(self.lltokenizer.eos_tokens))

    def __repr__(self) -> str:
        return f"Grammar({self.kind!r})"


LITTLE_ENDIAN = sys.byteorder == "little"
"""The mask's int32 words are unpacked byte by byte, which reads bit t of word w at token 32 w + t on a
little-endian machine (x86-64, arm64); elsewhere the words are byte-swapped first."""


class GrammarMatcher:
    """One generation's parser state over the committed tokens, with look-ahead along drafted paths.

    ``allowed(path)`` is the mask after the committed tokens and then ``path``; the parser consumes the path
    and rolls it back, so the committed state is unchanged (llguidance's rollback is exact: it restores the
    parser state the tokens were consumed from).
    """

    def __init__(self, matcher, tokenizer_vocab: int, vocab_size: int, end_tokens: set[int]):
        import llguidance.torch as lt
        self._m = matcher
        self.tokenizer_vocab, self.vocab_size, self.end_tokens = tokenizer_vocab, vocab_size, end_tokens
        self._bits = lt.allocate_token_bitmask(1, tokenizer_vocab)
        self._fill = lt.fill_next_token_bitmask
        self._ended = False

    def fork(self) -> "GrammarMatcher":
        """An independent copy at the same state."""
        new = GrammarMatcher(self._m.deep_copy(), self.tokenizer_vocab, self.vocab_size, self.end_tokens)
        new._ended = self._ended
        return new

    @property
    def stopped(self) -> bool:
        """The output is complete (an end token was accepted) or the parser cannot continue."""
        return self._ended or self._m.is_stopped()

    def accept(self, tokens: list[int]) -> None:
        """Commit ``tokens``; an end token the grammar accepts ends the output (:meth:`_advance`).

        Raises:
            SpeculantError: a token the grammar forbids there (the engine never emits one; a bug if raised).
        """
        if self._ended:
            return
        _, self._ended = self._advance(list(tokens), "tokens")

    def _advance(self, tokens: list[int], what: str) -> tuple[int, bool]:
        """Consume ``tokens`` up to the first end token; returns ``(tokens consumed, whether an end token
        followed)``.  The end token itself is not consumed: once the output is complete llguidance may have
        stopped its parser already (nothing can follow), and then it refuses to consume anything, EOS included.

        Raises:
            SpeculantError: a token the grammar forbids there.
        """
        end = next((i for i, t in enumerate(tokens) if t in self.end_tokens), None)
        body = tokens if end is None else tokens[:end]
        if self.valid_prefix(tokens[:len(body) + (end is not None)]) < len(body) + (end is not None) or \
                (body and not self._m.consume_tokens(body)):
            raise SpeculantError(f"grammar rejected {what} {tokens} ({self._m.get_error()})")
        return len(body), end is not None

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar allows from the committed state (an end token counts
        where the grammar is complete before it; nothing is allowed after it)."""
        tokens = list(tokens)
        if not tokens or self._ended:
            return 0
        n = self._m.validate_tokens(tokens)
        if n < len(tokens) and tokens[n] in self.end_tokens:
            ok = self._m.consume_tokens(tokens[:n]) if n else True
            complete = ok and self._m.is_accepting()
            if n:
                self._m.rollback(n)
            n += int(complete)
        end = next((i for i, t in enumerate(tokens[:n]) if t in self.end_tokens), None)
        return n if end is None else end + 1

    def allowed(self, path: tuple[int, ...] | list[int] = ()) -> torch.Tensor:
        """Bool ``[V]``: the tokens allowed after the committed tokens and ``path``.  After an end token (the
        output is over; no position there is ever emitted) only the end tokens, so that no row is empty.

        Raises:
            SpeculantError: ``path`` holds a token the grammar forbids (a bug in the caller).
        """
        path = list(path)
        consumed, ended = (0, True) if self._ended else self._advance(path, "the drafted path")
        if ended:
            if consumed:
                self._m.rollback(consumed)
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[[t for t in self.end_tokens if t < self.vocab_size]] = True
            return mask
        try:
            self._fill(self._m, self._bits)
        finally:
            if consumed:
                self._m.rollback(consumed)
        # the bitmask (int32 words, token t at bit t % 32 of word t // 32) unpacked by numpy: 0.015 ms for SmolLM2's
        # 49k tokens where shifting the words in torch took 4 ms per mask (benchmarks/grammar_speed.py, BENCHMARKS AA)
        words = self._bits[0].numpy() if LITTLE_ENDIAN else self._bits[0].numpy().byteswap()
        bits = torch.from_numpy(np.unpackbits(words.view(np.uint8), bitorder="little").view(np.bool_))
        bits = bits[:self.tokenizer_vocab]
        if len(bits) >= self.vocab_size:
            return bits[:self.vocab_size]
        return torch.cat([bits, bits.new_zeros(self.vocab_size - len(bits))])
