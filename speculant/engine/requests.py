"""What a generation request asks beyond sampling: checks of the fields and the per-generation controls
they make (:class:`~speculant.sampling.controls.SequenceControls`)."""

from __future__ import annotations

import numbers

from ..errors import SpeculantError
from ..sampling.controls import SequenceControls


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_controls(config, max_top_logprobs: int) -> None:
    """Check a :class:`~speculant.engine.generator.GenerationConfig`'s ``logprobs``, ``grammar``,
    ``min_tokens``, ``ignore_eos`` and ``stop_token_ids`` (normalised to a tuple of ints in place).

    Raises:
        SpeculantError: a value out of range or of the wrong type (the message names it).
    """
    from ..sampling.grammar import Grammar
    if config.logprobs is not None and (not _is_int(config.logprobs) or not 0 <= config.logprobs <= max_top_logprobs):
        raise SpeculantError(f"logprobs={config.logprobs!r} is out of range; allowed: None (off) or an integer "
                             f"in [0, {max_top_logprobs}]")
    if config.grammar is not None and not isinstance(config.grammar, Grammar):
        raise SpeculantError(f"grammar={config.grammar!r} is invalid; allowed: None or a Grammar (compile_grammar)")
    if not _is_int(config.min_tokens) or not 0 <= config.min_tokens <= config.max_new_tokens:
        raise SpeculantError(f"min_tokens={config.min_tokens!r} is out of range; allowed: an integer in "
                             f"[0, max_new_tokens={config.max_new_tokens}]")
    if not isinstance(config.ignore_eos, bool):
        raise SpeculantError(f"ignore_eos={config.ignore_eos!r} is invalid; allowed: true or false")
    ids = config.stop_token_ids
    ids = () if ids is None else ((ids,) if _is_int(ids) else ids)
    if not isinstance(ids, (tuple, list)) or any(not _is_int(t) or t < 0 for t in ids):
        raise SpeculantError(f"stop_token_ids={config.stop_token_ids!r} is invalid; allowed: a list of token ids >= 0")
    config.stop_token_ids = tuple(int(t) for t in ids)


def stop_token_set(config, model_eos) -> set[int]:
    """The tokens that end the output: the model's EOS tokens (unless ``ignore_eos``; with a grammar they
    stay, as the grammar only allows them once the output is complete) and ``stop_token_ids``."""
    eos = set(model_eos) if (not config.ignore_eos or config.grammar is not None) else set()
    return eos | set(config.stop_token_ids)


def make_controls(config, model, prompt_ids: list[int]) -> SequenceControls | None:
    """The :class:`SequenceControls` of one generation of ``config`` on ``model`` (``None`` when the request
    asks for nothing they do).

    Raises:
        SpeculantError: a ``logit_bias`` or ``stop_token_ids`` id outside the model's vocabulary.
    """
    vocab = model.config.vocab_size
    sampling = config.sampling
    for name, ids in (("logit_bias", sampling.logit_bias or {}), ("stop_token_ids", config.stop_token_ids)):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise SpeculantError(f"{name} token id {bad[0]} is out of range; allowed: [0, {vocab - 1}]")
    if not (sampling.penalized or config.grammar is not None or config.min_tokens > 0 or config.logprobs is not None):
        return None
    matcher = config.grammar.matcher(vocab) if config.grammar is not None else None
    return SequenceControls(sampling, vocab, prompt_ids, matcher, config.min_tokens,
                            stop_token_set(config, model.eos_token_ids), config.logprobs)
