"""What transformers' GGUF loader makes of a file's metadata (its config dict, its tokenizer), made from one
:class:`~speculant.models.gguf_header.GGUFHeader` instead of its several full parses.

``load_gguf_checkpoint(return_tensors=False)`` parses the whole header with ``gguf.GGUFReader`` and every value of
it (the tokenizer's ~262k strings, scores and types for Gemma 3) to build a config of a dozen numbers, and
``AutoTokenizer.from_pretrained(gguf_file=...)`` does that once more to find the tokenizer class before reading the
vocabulary a third time.  :func:`config_dict` applies the loader's own tables (``GGUF_TO_TRANSFORMERS_MAPPING``,
``GGUF_CONFIG_DEFAULTS_MAPPING``) and its steps for the architectures we run to the header's metadata;
:func:`tokenizer` builds the class ``AutoTokenizer`` picks for the config's ``model_type`` directly from the file
(transformers' ``TokenizersBackend`` GGUF path: the vocabulary read once).  ``tests/test_gguf_files.py`` holds both
equal to transformers' own on files of every supported architecture.
"""

from __future__ import annotations

from pathlib import Path

from .gguf_header import GGUFHeader, StringArray


def config_dict(header: GGUFHeader) -> dict:
    """The ``config`` of ``load_gguf_checkpoint(path, return_tensors=False)`` for a llama, qwen2, qwen3 or gemma3
    file (transformers 5.24's steps: llama files named ``mistral`` load as Mistral; ``tie_word_embeddings`` when
    the file has no ``output.weight``; the architecture's defaults; ``gemma3`` -> ``gemma3_text``; ``vocab_size``
    from the token count when the metadata lacks it)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    arch = str(header.field("general.architecture"))
    updated = "mistral" if "llama" in arch and header.field("general.name") == "mistral" else arch
    conf: dict = {"tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        conf.setdefault(key, value)
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, value in header.metadata.items():
        prefix, _, rest = key.replace(arch, updated).partition(".")
        target = renames.get(prefix, {}).get(rest)
        if target is None or target == -1 or isinstance(value, StringArray):
            continue
        if isinstance(value, list) and len(value) == 1:
            value = value[0]                     # the loader's one-element lists read as their element
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        conf[target] = value
    if conf.get("model_type") == "gemma3":
        conf["model_type"] = "gemma3_text"       # the file holds the text model only
    tokens = header.field("tokenizer.ggml.tokens")
    if "vocab_size" not in conf and tokens is not None:
        conf["vocab_size"] = tokens.count if isinstance(tokens, StringArray) else len(tokens)
    return conf


def tokenizer(gguf: Path, model_type: str):
    """The tokenizer ``AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)`` returns, built from the file
    with the class transformers maps ``model_type`` to (``TOKENIZER_MAPPING_NAMES``; ``AutoTokenizer`` itself when
    it maps none).

    Raises:
        OSError, ValueError: an unreadable tokenizer (from transformers).
    """
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    cls = tokenizer_class_from_name(name) if name else None
    if cls is None:
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return cls.from_pretrained(str(gguf.parent), gguf_file=gguf.name, _from_auto=True)
