"""Rotary position embedding tables (Su et al. 2021, "RoFormer", Eq. 34) and the RoPE scaling types of
Llama-family checkpoints.

Supported ``rope_type`` values (``config.json``: ``rope_parameters`` or the older ``rope_scaling``):

* ``default``: ``inv_freq_i = theta^(-2i / head_dim)``.
* ``linear`` (position interpolation, Chen et al. 2023, Eq. 4): ``inv_freq / factor``.
* ``llama3`` (Meta's Llama 3.1 reference ``apply_scaling``): frequencies whose wavelength exceeds
  ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those shorter than
  ``original_max_position_embeddings / high_freq_factor`` are kept, and the band between is
  interpolated linearly in ``original_max_position_embeddings / wavelength``.
* ``dynamic`` (dynamic NTK scaling): the base becomes
  ``theta * (factor * seq_len / max_position_embeddings - (factor - 1)) ** (head_dim / (head_dim - 2))``
  with ``seq_len = max(sequence length, max_position_embeddings)``, as in transformers'
  ``_compute_dynamic_ntk_parameters``.  For every position below ``max_position_embeddings`` that factor
  is exactly 1, so the table equals the unscaled one; our context never passes
  ``max_position_embeddings`` (prompt + output are capped at it), so this is transformers' behaviour for
  every sequence we run.

None of these types scales cos/sin (transformers' ``attention_factor`` is 1 for all four).  Any other
type (``yarn``, ``longrope``...) or parameter is refused with :class:`~speculant.errors.SpeculantError`.
The formulas follow transformers 5.24 ``modeling_rope_utils.py``; tests compare logits with it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..errors import SpeculantError

if TYPE_CHECKING:
    from .config import ModelConfig

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
_PARAMS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_OPTIONAL = {"dynamic": ("attention_factor",)}      # read by transformers' validator, unused by its dynamic RoPE


def normalize_rope_scaling(params: dict | None, max_position_embeddings: int) -> dict | None:
    """Validated RoPE scaling parameters: ``None`` for unscaled RoPE, else ``{"rope_type": ..., <its parameters>}``.

    Args:
        params: ``rope_parameters`` / ``rope_scaling`` from ``config.json`` (``type`` is read as
            ``rope_type``; ``rope_theta`` is ignored here, it is a field of the config).
        max_position_embeddings: default of llama3's ``original_max_position_embeddings`` [tokens].
    Raises:
        SpeculantError: a type other than default/linear/dynamic/llama3, a missing, unknown or
            non-positive parameter, or ``partial_rotary_factor`` other than 1.
    """
    if not params:
        return None
    if not isinstance(params, dict):
        raise SpeculantError(f"rope scaling={params!r} is invalid; allowed: a dict with rope_type {'/'.join(ROPE_TYPES)}")
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    params.pop("rope_theta", None)
    if rope_type not in ROPE_TYPES:
        raise SpeculantError(f"rope_type={rope_type!r} is not supported; allowed: {', '.join(ROPE_TYPES)}")
    prf = params.pop("partial_rotary_factor", 1.0)
    if prf not in (None, 1, 1.0):
        raise SpeculantError(f"partial_rotary_factor={prf!r} is not supported; allowed: 1.0 (RoPE on the whole head)")
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
    for key in _OPTIONAL.get(rope_type, ()):
        params.pop(key, None)
    unknown = sorted(set(params) - set(_PARAMS[rope_type]))
    if unknown:
        raise SpeculantError(f"rope parameter(s) {', '.join(unknown)} are not supported with rope_type={rope_type!r}; "
                             f"allowed: {', '.join(_PARAMS[rope_type]) or 'none'}")
    out = {"rope_type": rope_type}
    for key in _PARAMS[rope_type]:
        value = params.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
            raise SpeculantError(f"rope parameter {key}={value!r} (rope_type={rope_type!r}) is invalid; "
                                 "allowed: a finite number > 0")
        out[key] = value
    return None if rope_type == "default" else out


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None = None,
                    max_position_embeddings: int | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32, radians per position) of RoPE with ``scaling``.

    ``max_position_embeddings`` is needed by ``dynamic`` only (see the module docstring).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "dynamic":
        seq_len = max_position_embeddings         # the longest sequence we run never passes it
        base = theta * ((scaling["factor"] * seq_len / max_position_embeddings) - (scaling["factor"] - 1)) ** (
            head_dim / (head_dim - 2))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


ROPE_BLOCK_VALUES = 32768
"""Values of one block of table rows computed in one pass [count]: torch's parallel grain
(``at::internal::GRAIN_SIZE``), so each block is computed by one thread in one vectorized loop and a row's bits do
not depend on the thread count or on which rows were computed first."""


def rope_block_rows(head_dim: int) -> int:
    """Rows of a RoPE table computed together by :func:`fill_rope_rows` (blocks start at multiples of it)."""
    return max(1, ROPE_BLOCK_VALUES // head_dim)


def fill_rope_rows(cos: torch.Tensor, sin: torch.Tensor, inv_freq: torch.Tensor, start: int, end: int) -> None:
    """Compute rows ``start .. end-1`` of the tables ``cos``/``sin`` ``[P, Dh]`` in place (any dtype or device: the
    rows are computed in float32 on the CPU and copied in), whole blocks of :func:`rope_block_rows` rows at a time
    (``start`` a block boundary; the last block may end at ``P``): cos, and sin with the first half negated, of
    ``position * inv_freq`` (``inv_freq`` ``[Dh / 2]`` float32, :func:`inv_frequencies`)."""
    step = rope_block_rows(cos.shape[1])
    for a in range(start, min(end, cos.shape[0]), step):
        b = min(a + step, cos.shape[0])
        freqs = torch.outer(torch.arange(a, b, dtype=torch.float32, device="cpu"), inv_freq)
        cos[a:b].copy_(torch.cat((freqs, freqs), dim=-1).cos())
        sin[a:b].copy_(torch.cat((-freqs.sin(), freqs.sin()), dim=-1))


def rope_inv_frequencies(cfg: "ModelConfig") -> torch.Tensor:
    """``inv_freq`` ``[head_dim / 2]`` float32 of ``cfg``'s RoPE base and scaling (:func:`inv_frequencies`)."""
    return inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)


def rope_tables(cfg: "ModelConfig") -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``[cfg.context_length, head_dim]`` (fp32), every row computed (:func:`fill_rope_rows`): cos, and
    sin with the first half negated (so rotate_half becomes a roll, see :func:`speculant.models.llama.apply_rope`)."""
    cos, sin = (torch.empty(cfg.context_length, cfg.head_dim) for _ in range(2))
    fill_rope_rows(cos, sin, rope_inv_frequencies(cfg), 0, cfg.context_length)
    return cos, sin
