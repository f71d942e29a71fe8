"""Training losses: the LayerSkip early-exit loss and the exit-adapter distillation loss.

Early-exit loss (Elhoushi et al. 2024, arXiv 2404.16710, Sec. 4.2, Eqs. 2-4)::

    J = sum_l e~(t, l) * CE(LMHead(norm(x_l)), y)
    e(l)   = e_scale * sum_{i=0}^{l} i                   for l < L - 1
    e(L-1) = (L - 1) + e_scale * sum_{i=0}^{L-2} i
    e~(t, l) = C(t, l) e(l) / sum_i C(t, i) e(i)         (enabled exits, normalised to sum 1)

Every exit shares the model's final norm and LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import SpeculantError


def exit_scales(num_layers: int, enabled: list[int], e_scale: float = 1.0) -> dict[int, float]:
    """Normalised per-exit loss weights ``{layer: weight}`` (sum 1), growing with depth (Eq. 3-4).

    Raises:
        SpeculantError: empty ``enabled``, a layer outside ``[0, L-1]`` or ``e_scale < 0``.
    """
    if not enabled:
        raise SpeculantError("enabled exits is empty; allowed: at least one layer in [0, L-1]")
    if e_scale < 0:
        raise SpeculantError(f"e_scale={e_scale} is out of range; allowed: >= 0")
    raw = {}
    for layer in enabled:
        if not 0 <= layer < num_layers:
            raise SpeculantError(f"exit layer {layer} is out of range; allowed: 0..{num_layers - 1}")
        if layer == num_layers - 1:
            raw[layer] = (num_layers - 1) + e_scale * sum(range(num_layers - 1))
        else:
            raw[layer] = e_scale * sum(range(layer + 1))
    total = sum(raw.values())
    if total <= 0:                      # e.g. only exit 0 with e_scale small: weight it fully
        return {layer: 1.0 / len(raw) for layer in raw}
    return {layer: v / total for layer, v in raw.items()}


def early_exit_loss(exit_logits: dict[int, torch.Tensor], targets: torch.Tensor, scales: dict[int, float],
                    ignore_index: int = -100, total: int | None = None) -> torch.Tensor:
    """``sum_l scales[l] * CE(exit_logits[l], targets)`` (Eq. 2).

    Args:
        exit_logits: ``{layer: [N, V] logits}`` for the enabled exits.
        targets: ``[N]`` next-token ids (``ignore_index`` positions are skipped).
        scales: from :func:`exit_scales`.
        total: counted targets of the whole global batch these ``N`` are a share of (data parallelism,
            :mod:`.distributed`): the cross-entropies are then summed and divided by it, so the ranks' shares add
            up to the global batch's loss; ``None``: the mean over these targets.
    Returns:
        scalar loss [nats].
    """
    loss = targets.new_zeros((), dtype=torch.float32)
    for layer, logits in exit_logits.items():
        if total is None:
            ce = F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)
        else:
            ce = F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum") / max(total, 1)
        loss = loss + scales[layer] * ce
    return loss


def distill_totals(teacher_idx: torch.Tensor) -> tuple[int, int]:
    """``(positions, positions whose teacher argmax is inside the student's vocabulary)`` of ``teacher_idx``
    ``[N, k]`` (ids in the student's vocabulary, -1 outside): the ``totals`` of :func:`topk_distill_loss`."""
    return teacher_idx.shape[0], int((teacher_idx[:, 0] >= 0).sum()) if teacher_idx.numel() else 0


def topk_distill_loss(student_logits: torch.Tensor, teacher_idx: torch.Tensor, teacher_logp: torch.Tensor,
                      hard_weight: float = 0.0, totals: tuple[int, int] | None = None) -> torch.Tensor:
    """KL(p_teacher || q_student) with the teacher truncated to its top-k and renormalised (+ optional hard CE).

    Args:
        student_logits: ``[N, V']`` (fp32); ``V'`` the student's (possibly reduced) vocabulary.
        teacher_idx: ``[N, k]`` teacher top-k token ids *in the student's vocabulary*, -1 where the
            token is outside it (those entries are dropped before renormalising).
        teacher_logp: ``[N, k]`` teacher log-probabilities of those tokens (column 0 = argmax).
        hard_weight: weight of an extra CE term on the teacher's argmax (column 0, when inside).
        totals: :func:`distill_totals` of the whole global batch these ``N`` positions are a share of (data
            parallelism, :mod:`.distributed`): the KL and CE sums are divided by them, so the ranks' shares add up
            to the global batch's loss; ``None``: this batch's own.
    Returns:
        scalar mean loss [nats] over the ``N`` positions (over the global batch's, with ``totals``).
    """
    logq = F.log_softmax(student_logits.float(), dim=-1)
    valid = teacher_idx >= 0
    lp = teacher_logp.float().masked_fill(~valid, float("-inf"))
    p = torch.softmax(lp, dim=-1).nan_to_num(0.0)                       # renormalised over valid entries
    lq = logq.gather(-1, teacher_idx.clamp_min(0))
    plogp = torch.where(p > 0, p * p.clamp_min(1e-30).log(), torch.zeros_like(p))
    kl = (plogp - p * lq).masked_fill(~valid, 0.0).sum(-1)
    if totals is None:
        totals = distill_totals(teacher_idx)
    loss = kl.sum() / max(totals[0], 1)
    if hard_weight and totals[1]:
        loss = loss - hard_weight * lq[valid[:, 0], 0].sum() / totals[1]
    return loss
