"""A tokenizer read with the ``tokenizers`` library alone: what a later load needs without importing transformers.

Importing transformers costs ~1 s of a later load (its import structure, huggingface_hub) before a
``PreTrainedTokenizerFast`` is built around the very ``tokenizers.Tokenizer`` that ``tokenizer.json`` describes.
:class:`FastTokenizer` builds that ``tokenizers.Tokenizer`` directly and renders the chat template with ``jinja2``
as transformers does (``transformers.utils.chat_template_utils``: an ``ImmutableSandboxedEnvironment`` with
``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension, its ``tojson`` filter, ``raise_exception``
and ``strftime_now``; the named special tokens as template variables; the text then encoded without special
tokens).  :func:`open_fast` takes only directories whose ``tokenizer_config.json`` holds nothing transformers
would change the backend for (a generic fast class, of any vocabulary size: transformers' ``_patch_mistral_regex``
for vocabularies over 100000 tokens changes the pre-tokenizer only when asked with ``fix_mistral_regex``, a key
that :func:`open_fast` leaves to transformers; or a class that sets its own pipeline, :data:`CLASS_PIPELINES`, whose pipeline
``tokenizer.json`` already is: Gemma's, 262144 tokens, ~2 s less of a later load; named special tokens already
special added tokens, a stored post-processor, no truncation or padding); anything else is loaded by transformers.  Every other attribute, and ``apply_chat_template`` with
arguments beyond ``add_generation_prompt``/``tokenize``/``return_dict``, goes to transformers' own tokenizer of the
directory, built on first use.  ``tests/test_fast_tokenizer.py`` holds ids, texts and chat prompts equal to
transformers'.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""transformers' ``SPECIAL_TOKENS_ATTRIBUTES`` (the named special tokens)."""
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""``tokenizer_class`` values naming transformers' generic ``tokenizers``-backed class."""
_PLAIN_KEYS = {"backend", "is_local", "local_files_only", "model_max_length", "tokenizer_class", "chat_template",
               "clean_up_tokenization_spaces", "extra_special_tokens", "name_or_path", "model_input_names",
               "padding_side", "truncation_side", "split_special_tokens"} | set(SPECIAL_TOKENS)
"""``tokenizer_config.json`` keys :func:`open_fast` understands (checked values: see :func:`_plain_config`)."""


GEMMA_PIPELINE = {
    "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
    "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                                                 {"type": "ByteFallback"}, {"type": "Fuse"}]},
}
"""What transformers' ``GemmaTokenizer`` sets on its backend whatever ``tokenizer.json`` says (its ``__init__``:
the normalizer, the pre-tokenizer and the decoder; a BPE model with ``byte_fallback`` and ``fuse_unk``, no dropout),
as ``tokenizer.json`` serializes them."""


def _gemma_pipeline(backend) -> bool:
    """Whether ``backend`` is the pipeline transformers' ``GemmaTokenizer`` builds around its vocabulary and merges
    (:data:`GEMMA_PIPELINE`; the post-processor it keeps as the file has it unless ``tokenizer_config.json`` sets
    ``add_bos_token``/``add_eos_token``, keys :func:`_plain_config` refuses): then that class tokenizes as ``backend``
    does (``tests/test_fast_tokenizer.py`` and ``tests/test_gemma3_real.py`` compare the two)."""
    def state(component):          # one component's JSON, not the whole file (262k tokens: seconds to serialize)
        return None if component is None else json.loads(component.__getstate__())
    if any(state(getattr(backend, k)) != v for k, v in GEMMA_PIPELINE.items()):
        return False
    model = backend.model
    return type(model).__name__ == "BPE" and bool(model.byte_fallback) and bool(model.fuse_unk) and not model.dropout


CLASS_PIPELINES = {"GemmaTokenizer": _gemma_pipeline}
"""``tokenizer_class`` values of transformers classes that build their backend's pipeline themselves, each with the
check that ``tokenizer.json`` holds exactly that pipeline (then the class changes nothing)."""


def _plain_config(conf: dict, backend) -> bool:
    """Whether transformers' class named by the ``tokenizer_config.json`` ``conf`` would leave ``backend`` (a
    ``tokenizers.Tokenizer``) as it is: the generic class, or one of :data:`CLASS_PIPELINES` whose pipeline
    ``backend`` already is."""
    cls = conf.get("tokenizer_class")
    if set(conf) - _PLAIN_KEYS:
        return False
    if cls not in GENERIC_CLASSES and not (cls in CLASS_PIPELINES and CLASS_PIPELINES[cls](backend)):
        return False
    if conf.get("clean_up_tokenization_spaces") or conf.get("extra_special_tokens") or conf.get("split_special_tokens"):
        return False
    if conf.get("padding_side", "right") != "right" or conf.get("truncation_side", "right") != "right":
        return False
    if not isinstance(conf.get("chat_template", ""), str):
        return False
    if backend.post_processor is None or backend.truncation or backend.padding:
        return False
    added = {t.content: t for t in backend.get_added_tokens_decoder().values()}
    for key in SPECIAL_TOKENS:
        value = conf.get(key)
        if value is None:
            continue
        entry = added.get(value) if isinstance(value, str) else None
        if entry is None or not entry.special or entry.normalized:
            return False
    return True


def open_fast(path: str | Path) -> FastTokenizer | None:
    """The :class:`FastTokenizer` of the HF-format directory ``path``, or ``None`` when transformers must load it
    (see the module docstring; also when a file is missing or unreadable: transformers then says what is wrong)."""
    path = Path(path)
    try:
        conf = json.loads((path / "tokenizer_config.json").read_text())
        if not isinstance(conf, dict) or (path / "additional_chat_templates").exists():
            return None
        if (path / "chat_template.json").is_file():
            return None
        from .tokenizer_store import open_tokenizer
        backend = open_tokenizer(path / "tokenizer.json")      # a BPE model from its arrays: less memory
        if not _plain_config(conf, backend):
            return None
        template_file = path / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else conf.get("chat_template")
    except Exception:                # tokenizers raises its own exception types for a bad tokenizer.json
        return None
    return FastTokenizer(path, backend, {k: conf[k] for k in SPECIAL_TOKENS if conf.get(k) is not None}, template)


class FastTokenizer:
    """transformers' ``TokenizersBackend`` of a plain directory (:func:`open_fast`), without transformers.

    Attributes:
        backend: the ``tokenizers.Tokenizer`` of ``tokenizer.json``.
        chat_template: the directory's chat template (``None``: none).
        name_or_path: the directory.
    """

    def __init__(self, path: Path, backend, special: dict[str, str], chat_template: str | None):
        self.name_or_path = str(path)
        self.backend = backend
        self.special_tokens_map = dict(special)
        self.chat_template = chat_template
        self._hf = None
        self._template = None

    # -- what the engine, CLI and server use ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the post-processor's special tokens when ``add_special_tokens``)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids`` (an int or a sequence of ints)."""
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True, **kwargs):
        """transformers' ``apply_chat_template`` for one conversation of plain ``{str: str}`` messages: the text
        (``tokenize=False``), else its ids (``{'input_ids', 'attention_mask'}`` when ``return_dict``).  Other
        arguments or messages go to transformers."""
        plain = (self.chat_template and not kwargs and isinstance(conversation, (list, tuple))
                 and all(isinstance(m, dict) and all(type(k) is str and type(v) is str for k, v in m.items())
                         and not {"reasoning_content", "thinking", "reasoning"} & set(m) for m in conversation))
        template = self._compiled() if plain else None
        if template is None:
            return self.hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                               tokenize=tokenize, return_dict=return_dict, **kwargs)
        text = template.render(messages=[dict(m) for m in conversation], tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    @property
    def vocab_size(self) -> int:
        """Tokens without the added ones."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included."""
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens):
        """Id of a token (the unknown token's, else ``None``, when absent), or a list of them."""
        if isinstance(tokens, str):
            i = self.backend.token_to_id(tokens)
            return i if i is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        """Token of an id, or a list of them (``skip_special_tokens``: transformers' own)."""
        if skip_special_tokens:
            return self.hf.convert_ids_to_tokens(ids, skip_special_tokens=True)
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(int(i)) for i in ids]

    def __getattr__(self, name: str):
        # bos_token_id, eos_token_id, ...: the named special tokens' ids
        if name.endswith("_token_id") and name[:-3] in SPECIAL_TOKENS:
            token = self.__dict__.get("special_tokens_map", {}).get(name[:-3])
            return None if token is None else self.backend.token_to_id(token)
        if name in SPECIAL_TOKENS:
            return self.__dict__.get("special_tokens_map", {}).get(name)
        if name.startswith("__") or name in ("_hf", "_template", "backend"):
            raise AttributeError(name)
        return getattr(self.hf, name)          # anything else: transformers' own tokenizer

    def __call__(self, *args, **kwargs):
        return self.hf(*args, **kwargs)

    def __bool__(self) -> bool:
        return True

    # -- transformers, when needed ---------------------------------------------------------------------------------
    @property
    def hf(self):
        """transformers' tokenizer of the directory (built on first use; importing transformers costs ~1 s)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast
            self._hf = PreTrainedTokenizerFast.from_pretrained(self.name_or_path)
        return self._hf

    def _compiled(self):
        """The chat template compiled as transformers compiles it, or ``None`` where it uses what only transformers
        provides (its ``{% generation %}`` tag)."""
        if self._template is None:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.exceptions.TemplateSyntaxError:
                self._template = False
        return self._template or None
