"""Prompts -> token ids, and the checks every prompt passes: one encoder and one validator for the CLI, the
Python API (:class:`~speculant.engine.generator.SpeculativeGenerator`), the batched path
(:class:`~speculant.engine.batch.BatchedGenerator`) and the server.

The rule for text:

* **chat** (``chat=True``, the default of ``speculant generate`` and of the API; always for the server's
  ``/v1/chat/completions``): the tokenizer's chat template with ``add_generation_prompt=True``; a string is one
  user message.  A string prompt on a tokenizer without a template falls back to raw; a list of messages needs
  a template.
* **raw** (``--raw``, ``GenerationConfig(chat=False)``, the server's ``/v1/completions``): ``tokenizer.encode(text,
  add_special_tokens=True)``, i.e. with the special tokens the tokenizer adds to every text (the BOS of
  Llama/Mistral tokenizers; none for SmolLM2's).

Text must be valid Unicode: a lone surrogate (``"\\ud800"``, which JSON and Python strings can hold but UTF-8
cannot) is refused by name instead of failing inside the tokenizer.
"""

from __future__ import annotations

import operator

from ..errors import SpeculantError


def check_text(text, what: str = "prompt") -> str:
    """``text`` if it is a string that UTF-8 can encode.

    Raises:
        SpeculantError: not a string, or a lone surrogate code point (its index is named).
    """
    if not isinstance(text, str):
        raise SpeculantError(f"{what}={text!r} is invalid; allowed: a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        cp = ord(text[e.start])
        raise SpeculantError(f"{what} holds a lone surrogate U+{cp:04X} at character {e.start}; allowed: valid "
                             "Unicode text (surrogates only in pairs, as in JSON's \\ud83d\\ude00)") from None
    return text


def _messages(messages) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SpeculantError(f"messages[{i}]={m!r} is invalid; allowed: {{'role': str, 'content': str}}")
        out.append({"role": m["role"], "content": check_text(m["content"], f"messages[{i}].content")})
    return out


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool = True) -> list[int]:
    """Token ids of ``prompt`` (a string, or chat messages ``[{'role', 'content'}, ...]``) by the module's rule.

    Raises:
        SpeculantError: an empty or whitespace-only prompt, no messages, invalid Unicode (lone surrogates),
            messages without a chat template or with ``chat=False``.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(prompt, str):
        if not check_text(prompt).strip():
            raise SpeculantError("prompt is empty; allowed: a non-empty string")
        if not (chat and template):
            return list(tokenizer.encode(prompt, add_special_tokens=True))
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)):
        if not prompt:
            raise SpeculantError("messages are empty; allowed: at least one message")
        if not chat or not template:
            raise SpeculantError("messages need the tokenizer's chat template"
                                 + ("; this tokenizer has none" if not template else "; chat=False given"))
        messages = _messages(prompt)
    else:
        raise SpeculantError(f"prompt={prompt!r} is invalid; allowed: a string or a list of messages")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def check_prompt_ids(ids, context_length: int, vocab_size: int) -> list[int]:
    """``ids`` as a list of ints, checked: 1 to ``context_length - 1`` tokens (one position is left to generate),
    each an integer (not a bool) in ``[0, vocab_size)``.

    Raises:
        SpeculantError: empty, too long (the context is named), or a token id out of range (the id is named).
    """
    ids = list(ids)
    if not ids:
        raise SpeculantError("prompt is empty; allowed: at least one token")
    if len(ids) >= context_length:
        raise SpeculantError(f"prompt length={len(ids)} tokens is too long; allowed: < {context_length} "
                             "(the model's context)")
    out = []
    for t in ids:
        try:
            v = None if isinstance(t, bool) else operator.index(t)
        except TypeError:
            v = None
        if v is None or not 0 <= v < vocab_size:
            raise SpeculantError(f"prompt token id {t!r} is invalid; allowed: integers in [0, {vocab_size - 1}]")
        out.append(v)
    return out
