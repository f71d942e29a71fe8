"""Exit adapters: a small trainable head at early exit E of a frozen model (lossless self-speculation).

The base model stays frozen, so verification (and therefore the output) is
unchanged; only the draft distribution ``q`` at exit ``E`` is learned.  The
adapter maps the hidden state leaving layer ``E-1`` to draft logits::

    h -> h + MLP_j(RMSNorm_j(h))   for j = 1..num_blocks   (SwiGLU blocks, initialised from
                                                            the MLPs of layers E, E+1, ...)
      -> RMSNorm (initialised from the final norm)
      -> W_sub h + b                (W_sub = rows ``vocab_ids`` of the frozen tied LM head; b trained)

With a reduced vocabulary ``vocab_ids`` (``V' << V`` tokens covering most of the
teacher's mass) the draft head reads ``V'/V`` of the LM head's bytes; logits outside
it are ``-inf``.  Speculative decoding stays exact: the acceptance rules only need
``q`` to be a distribution (Leviathan et al. 2023, Sec. 2.3).

On disk an adapter is a directory with ``adapter.safetensors`` (trained tensors,
plus ``vocab_ids``), ``config.json`` and a ``README.md`` model card.  Named adapters
live under ``speculant/artifacts/exit_adapters/<model name>/<name>/``.  This module holds
what decoding needs (the forward and loading); :mod:`speculant.training.adapter` trains and saves.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SpeculantError
from ..runtime.formats import lm_head_rows_weight
from ..models.linear import DecodeLinear, small_batch_linear
from ..models.llama import RMSNorm
from .base import full_vocab_logits
from .artifacts import ARTIFACTS_ROOT, check_compatible, read_config, resolve_dir, shipped_names

FORMAT = "speculant-exit-adapter"
KIND = "exit_adapters"
ARTIFACTS = ARTIFACTS_ROOT / KIND


class ResidualMLP(nn.Module):
    """``h + down(silu(gate(n(h))) * up(n(h)))`` with ``n`` an RMSNorm: a decoder layer minus attention."""

    def __init__(self, hidden: int, intermediate: int, eps: float):
        super().__init__()
        self.inter = intermediate
        self.norm = RMSNorm(hidden, eps)
        self.gate_up_proj = DecodeLinear(hidden, 2 * intermediate, bias=False)
        self.down_proj = DecodeLinear(intermediate, hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(self.norm(h)).split(self.inter, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)


class ExitAdapter(nn.Module):
    """Trainable exit head at exit layer E.

    Args:
        config: dict with ``hidden_size``, ``intermediate_size``, ``num_blocks``, ``rms_norm_eps``,
            ``exit_layer``, ``vocab_size`` (full V).
        head_weight: frozen LM-head rows ``[V', D]`` (``V' = len(vocab_ids)``, or V).
        vocab_ids: int64 ``[V']`` token ids of the reduced vocabulary, or ``None`` (full vocabulary).

    ``forward(h [..., D]) -> logits [..., V']`` (fp32) over the adapter's own vocabulary.
    """

    def __init__(self, config: dict, head_weight: torch.Tensor, vocab_ids: torch.Tensor | None):
        super().__init__()
        self.config = dict(config)
        d, eps = config["hidden_size"], config["rms_norm_eps"]
        self.blocks = nn.ModuleList(ResidualMLP(d, config["intermediate_size"], eps)
                                    for _ in range(config["num_blocks"]))
        self.norm = RMSNorm(d, eps)
        self.register_buffer("head_weight", head_weight.detach().clone(), persistent=False)
        self.head_bias = nn.Parameter(torch.zeros(head_weight.shape[0], dtype=head_weight.dtype))
        self.register_buffer("vocab_ids", None if vocab_ids is None else vocab_ids.long().clone(), persistent=False)
        self.packed_head: nn.Module | None = None          # the head rows in a weight format (:meth:`pack`)
        self.weight_format = "fp32"

    @property
    def exit_layer(self) -> int:
        return int(self.config["exit_layer"])

    def pack(self, fmt: str) -> ExitAdapter:
        """Put the blocks' projections and the head rows (with the trained bias) in weight format ``fmt``
        (``int8``, ``w8a8``, ``bf16``; :func:`~speculant.runtime.formats.pack_linear`), in place, for decoding: in
        8 bits a draft call reads ~1/4 of the float32 bytes.  Exactness does not depend on it (the acceptance rules take
        whatever ``q`` the adapter gives); the draft distribution moves by the format's rounding.  The packed
        adapter cannot be trained or saved.

        Raises:
            SpeculantError: unknown format (``fp32`` leaves the adapter as it is).
        """
        from ..runtime.formats import pack_linear
        from .weights import check_drafter_format
        if check_drafter_format(fmt) == "fp32":
            return self
        if self.weight_format != "fp32":
            raise SpeculantError(f"exit adapter already packed in {self.weight_format}; "
                                 "allowed: pack a float adapter once")
        for b in self.blocks:
            b.gate_up_proj = pack_linear(fmt, b.gate_up_proj.weight)
            b.down_proj = pack_linear(fmt, b.down_proj.weight)
        self.packed_head = pack_linear(fmt, self.head_weight, self.head_bias)
        self.weight_format = fmt
        return self

    def float_projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``(weight, bias)`` of every projection a draft call reads (the blocks', then the head rows), float."""
        out = []
        for b in self.blocks:
            out += [(b.gate_up_proj.weight.detach().float(), None), (b.down_proj.weight.detach().float(), None)]
        return out + [(self.head_weight.float(), self.head_bias.detach().float())]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            h = b(h)
        if self.packed_head is not None:
            return self.packed_head(self.norm(h)).float()
        return small_batch_linear(self.norm(h), self.head_weight, self.head_bias).float()

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The tensors stored on disk (trainable ones + ``vocab_ids``).

        Raises:
            SpeculantError: the adapter was packed for decoding (:meth:`pack`).
        """
        if self.packed_head is not None:
            raise SpeculantError("a packed exit adapter cannot be saved; allowed: the float adapter it was packed from")
        sd = {k: v for k, v in self.state_dict().items()}
        if self.vocab_ids is not None:
            sd["vocab_ids"] = self.vocab_ids.to(torch.int32)
        return sd


class ExitHead:
    """Callable for :class:`~speculant.drafters.early_exit.EarlyExitDrafter`: hidden ``[..., D]`` leaving
    layer E-1 -> fp32 logits ``[..., V]`` over the full vocabulary (``-inf`` outside a reduced one)."""

    def __init__(self, adapter: ExitAdapter, vocab_size: int):
        self.adapter = adapter.eval().requires_grad_(False)
        self.vocab_size = vocab_size

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return full_vocab_logits(*self.reduced(h), self.vocab_size)

    def reduced(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logits [..., V'], vocab_ids [V'])`` over the adapter's own vocabulary (``vocab_ids`` ``None``: the
        full one), so that drafting samples over ``V'`` tokens only (:meth:`ModelDrafterBase.frontier_draft_logits`)."""
        return self.adapter(h), self.adapter.vocab_ids


def available_adapters(model_name: str) -> list[str]:
    """Names of the adapters shipped for ``model_name``."""
    return shipped_names(KIND, model_name)


def resolve_adapter_dir(name_or_path: str, model_name: str) -> Path:
    """A directory holding an adapter: ``name_or_path`` itself, or the shipped adapter of that name.

    Raises:
        SpeculantError: neither exists (the message lists the shipped names).
    """
    return resolve_dir(KIND, "exit adapter", name_or_path, model_name)


def load_adapter(path: str | Path, model) -> ExitAdapter:
    """Load an adapter directory for ``model`` (tensors cast to the model's dtype).

    Raises:
        SpeculantError: wrong format or a model whose shape differs from the one it was trained on.
    """
    from safetensors.torch import load_file
    path = Path(path)
    conf = read_config(path, FORMAT, "exit adapter")
    cfg = model.decoder.config
    check_compatible(conf, model, {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                                   "num_layers": model.decoder.num_layers}, path, "exit adapter")
    sd = load_file(str(path / "adapter.safetensors"))
    vocab_ids = sd.pop("vocab_ids", None)
    head = lm_head_rows_weight(model.decoder, None if vocab_ids is None else vocab_ids.long())
    ad = ExitAdapter(conf, head, vocab_ids)
    ad.load_state_dict({k: v for k, v in sd.items()}, strict=True)
    return ad.to(model.decoder.dtype).eval().requires_grad_(False)


def load_exit_adapter(name_or_path: str, model, exit_layer: int | None = None, weights: str | None = None):
    """Load an exit adapter by name (``default``) or directory for ``model``, for decoding: its projections in
    ``weights`` (``fp32``/``int8``/``w8a8``/``bf16``), by default what the tune step
    (:func:`~speculant.drafters.weights.tune_drafter`) chose on this machine for a quantized target, float32 for a
    float one or before that step ran (:func:`~speculant.drafters.weights.drafter_weight_format`; nothing is
    measured here; :meth:`ExitAdapter.pack`).

    Args:
        name_or_path: a shipped name (see :func:`available_adapters`) or an adapter directory.
        model: the :class:`~speculant.models.loading.LoadedModel` it drafts for.
        exit_layer: ``None`` takes the adapter's stored exit layer; otherwise it must equal it.
        weights: the adapter's weight format; ``None``: as above.
    Returns:
        ``(exit_head, exit_layer)``: ``exit_head`` maps hidden ``[..., D]`` leaving layer E-1 to fp32
        logits ``[..., V]`` (``-inf`` outside a reduced vocabulary).
    Raises:
        SpeculantError: unknown name, incompatible model, a conflicting ``exit_layer``, or an unknown ``weights``.
    """
    ad = load_adapter(resolve_adapter_dir(name_or_path, model.name), model)
    if exit_layer is not None and int(exit_layer) != ad.exit_layer:
        raise SpeculantError(f"exit_layer={exit_layer} conflicts with exit adapter {name_or_path!r}, trained for "
                             f"exit layer {ad.exit_layer}; allowed: {ad.exit_layer} (or leave --exit-layer unset)")
    from .weights import drafter_weight_format
    ad.pack(weights or drafter_weight_format(model, "exit-adapter", ad.float_projections()))
    return ExitHead(ad, model.decoder.config.vocab_size), ad.exit_layer


def default_adapter_exit_layer(model_name: str) -> int | None:
    """Exit layer of the ``default`` adapter shipped for ``model_name`` (``None`` when none ships)."""
    if "default" not in available_adapters(model_name):
        return None
    return int(json.loads((ARTIFACTS / model_name / "default" / "config.json").read_text())["exit_layer"])


def default_adapter_for(model_name: str, exit_layer: int | None = None) -> str | None:
    """``'default'`` when an adapter named default ships for ``model_name`` and was trained for
    ``exit_layer`` (any layer when ``None``), else ``None``."""
    e = default_adapter_exit_layer(model_name)
    return "default" if e is not None and (exit_layer is None or int(exit_layer) == e) else None
