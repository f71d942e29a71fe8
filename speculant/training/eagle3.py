"""``speculant train --recipe eagle3``: train an EAGLE-3 draft head on the target's own cached features.

Li et al. 2025 (EAGLE-3), Sec. 3: the target is frozen; over a make-data corpus it computes, once, its hidden states
at the head's three auxiliary boundaries and its next-token distribution (teacher forcing, batched, cached in shards
under ``$SPECULANT_CACHE/features``: :mod:`speculant.training.features`).  The head then trains on windows of
consecutive positions of one sequence with the *training-time test* (TTT): step 0 reads the target's fused states
``g_i``; step ``s >= 1`` reads, at entry ``i``, the head's own step ``s-1`` output of entry ``i-1`` (what it feeds
itself at draft depth ``s + 1``), attending, as when drafting, to the step-0 entries of positions ``<= i - s`` and to
its own chain ``(t, i - s + t)`` for ``t = 1 .. s``.  Every step predicts the same target distribution (that of
position ``i + 1``); EAGLE-3 drops EAGLE's feature regression, so the loss is only

    loss = sum_s decay^s * (KL(p || q_s) [+ hard CE on the target's argmax]) / sum_s decay^s

over the target's top-k, renormalised, on the head's draft vocabulary: the ``draft_vocab`` tokens with the most
teacher mass in the training split (FR-Spec / EAGLE-3's ``d2t``).  ``lm_head`` and ``norm`` start as the target's.
Held-out evaluation: teacher-forced top-1 agreement with the target's argmax at each TTT step (step 0: greedy
acceptance of the first drafted token).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.eagle3_head import AUX_IDS_KEY, Eagle3Head, check_aux_layer_ids, default_aux_layer_ids, load_eagle3, \
    new_eagle3, save_eagle3
from ..errors import SpeculantError, check_range
from ..models.llama import layer_output
from .distributed import SINGLE, Dist, check_batch, full_states, load_full_states, main_first, save_on_main, wrap_ddp
from .head import HEAD_FLAGS, HeadData, HeadRunConfig, device_name, draw_windows, head_data, head_train_loop, window_batch, window_targets
from .losses import distill_totals, topk_distill_loss
from .run import read_checkpoint, seeded


@dataclass(frozen=True)
class Eagle3Config(HeadRunConfig):
    """Settings of ``--recipe eagle3`` (flags ``--aux-layers``, ``--ttt-steps``, ``--ttt-decay``;
    :class:`~speculant.training.head.HeadRunConfig` has the ones shared with ``draft-head``).

    Attributes:
        aux_layers: the 3 hidden-state boundaries (``k``: entering target layer ``k``) the head reads; ``None``:
            :func:`~speculant.drafters.eagle3_head.default_aux_layer_ids`.  Written into the head's config.
        ttt_steps: training-time-test steps (1: the target's states only).
        ttt_decay: weight ``decay^s`` of step ``s``'s loss (the EAGLE-3 reference's 0.8).

    Raises:
        SpeculantError: a value out of range (one line naming it and what is allowed).
    """

    aux_layers: tuple[int, ...] | None = None
    ttt_steps: int = 3
    ttt_decay: float = 0.8

    def __post_init__(self):
        super().__post_init__()
        check_range("ttt_steps", self.ttt_steps, 1, 8)
        check_range("ttt_decay", self.ttt_decay, 0.0, 1.0)
        if self.aux_layers is not None:              # the range is checked against the target when it loads
            check_aux_layer_ids(list(self.aux_layers), max(max(self.aux_layers, default=1), 1))

    @classmethod
    def from_args(cls, args) -> "Eagle3Config":
        """From ``speculant train``'s parsed flags (:func:`speculant.training.train.add_train_args`; a bad value's
        error names its flag)."""
        from .train import _int_list
        aux = _int_list("--aux-layers", args.aux_layers) if args.aux_layers else None
        with cls.naming_flags(dict(HEAD_FLAGS, **{AUX_IDS_KEY: "--aux-layers"})):
            return cls(**HeadRunConfig.head_args_of(args), aux_layers=aux, ttt_steps=args.ttt_steps,
                       ttt_decay=args.ttt_decay)

    def settings(self, aux: list[int]) -> dict:
        """What a checkpoint must match to be resumed."""
        return {"aux_layers": list(aux), "draft_vocab": self.draft_vocab}


def aux_features(feats: dict, aux: list[int]) -> torch.Tensor:
    """bf16 ``[N, 3D]``: the cached hidden states at the three boundaries, concatenated (low, mid, high)."""
    return torch.cat([feats[f"hidden/{k}"] for k in aux], dim=-1)


def ttt_mask(t: int, step: int) -> torch.Tensor:
    """bool ``[T, (step + 1) T]``: what entry ``i`` of TTT step ``step`` attends (module docstring): step-0 keys
    ``j <= i - step`` and, for ``u = 1 .. step``, step-``u`` key ``i - step + u`` (itself at ``u = step``)."""
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    blocks = [j <= i - step] + [j == i - step + u for u in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def ttt_forward(head: Eagle3Head, x: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                steps: int) -> list[torch.Tensor]:
    """The head's pre-norm outputs ``[B, T, D]`` at each TTT step (module docstring), step 0 from the target's
    states ``x`` ``[B, T, 3D]``; the keys and values of earlier steps are kept, as the head's KV cache holds them
    while drafting."""
    outs, keys, values = [], [], []
    hidden = x
    for s in range(steps):
        fused, q, k, v = head.attention_inputs(hidden, tokens, positions)
        keys.append(k)
        values.append(v)
        mask = ttt_mask(x.shape[1], s).to(x.device)
        att = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                             enable_gqa=True)
        b, h, t, dh = att.shape
        out = layer_output(head.layer, fused, att.transpose(1, 2).reshape(b, t, h * dh))
        outs.append(out)
        hidden = torch.cat([out[:, :1], out[:, :-1]], dim=1)    # entry i of the next step reads entry i-1's output
    return outs


class TTTLogits(torch.nn.Module):
    """The head's logits at every TTT step as one module's forward, so that DistributedDataParallel (which reduces
    the gradients of what ran through its wrapper's forward) can wrap the training computation."""

    def __init__(self, head: Eagle3Head):
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                masks: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[n_s, V']`` logits of TTT step ``s`` at the entries ``masks[s]`` (bool ``[B, T]``), from the target's
        states ``x`` ``[B, T, 3D]`` (:func:`ttt_forward`)."""
        outs = ttt_forward(self.head, x, tokens, positions, len(masks))
        return [self.head.logits(out[m]) for out, m in zip(outs, masks)]


def eagle3_loss(net: torch.nn.Module, f: torch.Tensor, ids: torch.Tensor, t_map: torch.Tensor, t_logp: torch.Tensor,
                weight: torch.Tensor, spans, steps: int, decay: float, hard_weight: float,
                share: slice | None = None) -> tuple[torch.Tensor, dict]:
    """The TTT loss of a batch of windows ``spans`` (module docstring); returns ``(loss, {"p0": step-0 loss, ...})``
    (the parts as detached scalar tensors, for the TTT steps the batch has entries of).

    ``net``: a :class:`TTTLogits` (or it under DistributedDataParallel).  ``share``: the rows of ``spans`` (the global
    batch) this rank trains on (data parallelism, :mod:`.distributed`); each step's loss is then this share of the
    global batch's (sums divided by the global batch's counts), so the shares add up to the loss of one process on
    the whole batch.  ``None``: every row.
    """
    x, tok, pos, nxt, mask = window_batch(f, ids, weight, spans[share or slice(None)])
    masks = []
    for s in range(steps):
        m = mask.clone()
        m[:, :s] = False                         # entries without a step-s parent
        masks.append(m)
    logits = net(x.float(), tok, pos, masks)
    total, norm, parts = logits[0].sum() * 0.0, 0.0, {}       # a share with no counted entry still backpropagates
    for s, (lg, m) in enumerate(zip(logits, masks)):
        totals = distill_totals(t_map[window_targets(spans, weight, s)])
        if not totals[0]:                        # the global batch has no step-s entry
            continue
        target = nxt[m]
        loss = topk_distill_loss(lg, t_map[target], t_logp[target], hard_weight, totals)
        total, norm = total + decay ** s * loss, norm + decay ** s
        parts[f"p{s}"] = loss.detach()
    return total / max(norm, 1e-12), parts


@torch.no_grad()
def evaluate_eagle3(head: Eagle3Head, f: torch.Tensor, ids: torch.Tensor, t_idx: torch.Tensor, weight: torch.Tensor,
                    seqs: torch.Tensor, max_positions: int, steps: int, window: int = 256) -> dict:
    """Teacher-forced held-out top-1 agreement with the target's argmax at each TTT step: ``{"top1": step 0,
    "top1_by_step": [...], "positions": n}``."""
    was = head.training
    head.eval()
    agree, counts = [0] * steps, [0] * steps
    for s, length in seqs.tolist():
        for a in range(s, s + length - 1, window):
            t = min(window, s + length - 1 - a)
            x, tok, pos, nxt, mask = window_batch(f, ids, weight, [(s, a, t)])
            for k, out in enumerate(ttt_forward(head, x.float(), tok, pos, steps)):
                m = mask.clone()
                m[:, :k] = False
                top = head.vocab_ids[head.logits(out[m]).argmax(-1)]
                agree[k] += int((top == t_idx[nxt[m], 0].long()).sum())
                counts[k] += int(m.sum())
        if counts[0] >= max_positions:
            break
    head.train(was)
    by_step = [a / max(c, 1) for a, c in zip(agree, counts)]
    return {"top1": by_step[0], "top1_by_step": by_step, "positions": counts[0]}


def _resume(ckpt: Path, cfg: Eagle3Config, aux: list[int], head: Eagle3Head, named, opt, gen) -> tuple[int, list, int]:
    """Load ``ckpt`` (written with any world size) into the head, optimizer and generator; returns ``(step, history,
    positions seen)``.

    Raises:
        SpeculantError: ``ckpt`` missing, or of another recipe or settings.
    """
    st = read_checkpoint(ckpt)
    if st.get("recipe") != "eagle3" or st["settings"] != cfg.settings(aux):
        raise SpeculantError(f"checkpoint {str(ckpt)!r} is for {st.get('recipe')} {st.get('settings')}; "
                             f"allowed: recipe eagle3 with {cfg.settings(aux)}")
    head.load_state_dict(st["head"])
    if st.get("format") == "full-state":          # optimizer state by parameter name
        load_full_states(named, opt, st["head"], st["opt"])
    else:                                         # written before the recipe ran under torchrun: by index
        opt.load_state_dict(st["opt"])
    gen.set_state(st["gen"])
    return st["step"], st["history"], st["seen"]


def train_eagle3(model, corpora: list[str], out: str, config: Eagle3Config = Eagle3Config(),
                 dist: Dist = SINGLE) -> dict:
    """Train an EAGLE-3 head (recipe ``eagle3``); writes ``out/`` (the head in the engine layout, ``README.md``,
    ``metrics.json``, ``checkpoint.pt``).

    Args:
        corpora: make-data JSONL paths (train and held-out splits).
        dist: this process' rank in a data-parallel run (:mod:`.distributed`): rank 0 caches the features, the TTT
            computation (:class:`TTTLogits`) trains under DistributedDataParallel on each rank's share of every
            global batch, rank 0 evaluates and writes the checkpoints (by parameter name) and the head.
    Returns:
        metrics (held-out top-1 per TTT step before and after, the losses, throughput); on ranks other than 0 only
        ``rank`` and ``steps_done``.
    Raises:
        SpeculantError: bad auxiliary ids, no records of a split, ``resume`` without a compatible checkpoint, or fewer
            windows per step than processes.
    """
    cfg, out = config, Path(out)
    check_batch("head_batch", cfg.batch_seqs, dist)
    L = model.decoder.num_layers
    aux = check_aux_layer_ids(list(cfg.aux_layers), L) if cfg.aux_layers else default_aux_layer_ids(L)
    out.mkdir(parents=True, exist_ok=True)
    gen = seeded(cfg.seed)
    dev = model.decoder.device               # the head trains where the target runs (``speculant train --device``)
    data = main_first(dist, lambda: head_data(model, corpora, cfg, lambda f: aux_features(f, aux), aux)).to(dev)
    head = new_eagle3(model, aux, data.vocab_ids).to(dev).train()
    named = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    ckpt, last = out / "checkpoint.pt", {"loss": torch.tensor(float("nan")), "parts": {}}
    start, history, last["seen"] = _resume(ckpt, cfg, aux, head, named, opt, gen) if cfg.resume else (0, [], 0)
    net = wrap_ddp(TTTLogits(head), dist)
    ho = data.heldout

    def evaluate(h):
        return evaluate_eagle3(h, data.f_heldout, ho["ids"], ho["t_idx"], ho["response"], data.heldout_seqs,
                               cfg.eval_tokens, cfg.ttt_steps)

    def record(done):
        history.append({"step": done, "train_positions": last["seen"], "loss": last["loss"].item(), **last["parts"],
                        "eval": evaluate(head)})

    if start == 0 and dist.main:
        history.append({"step": 0, "train_positions": 0, "eval": evaluate(head)})
    lengths = (data.seqs[:, 1] - 1).double()

    def checkpoint(step):
        save_on_main(dist, lambda: {"recipe": "eagle3", "format": "full-state", "settings": cfg.settings(aux),
                                    "head": head.state_dict(), "opt": full_states(named, opt)[1], "gen": gen.get_state(),
                                    "step": step, "history": history, "seen": last["seen"]}, ckpt)

    def batch_loss(step):
        spans = draw_windows(data.seqs, lengths, cfg, gen)
        loss, parts = eagle3_loss(net, data.f_train, data.train["ids"], data.t_map, data.train["t_logp"],
                                  data.weight, spans, cfg.ttt_steps, cfg.ttt_decay, cfg.hard_weight,
                                  dist.share(len(spans)))
        sums = dist.all_sum(torch.stack(list(parts.values()))).tolist() if parts else []
        positions = sum(t for _, _, t in spans)
        last.update(parts=dict(zip(parts, sums)), seen=last["seen"] + positions)
        return loss, positions

    done, secs = head_train_loop(cfg, dist, opt, params, start, "train eagle3", batch_loss, record, checkpoint,
                                 history, last)
    if not dist.main:
        return {"rank": dist.rank, "steps_done": done}
    head.eval()
    return _save(model, head, out, _metrics(cfg, aux, corpora, data, params, history, last, done, secs), evaluate,
                 cfg.command)


def _metrics(cfg: Eagle3Config, aux: list[int], corpora, data: HeadData, params, history, last, done, secs) -> dict:
    return {"recipe": "eagle3", **cfg.settings(aux), "ttt_steps": cfg.ttt_steps, "ttt_decay": cfg.ttt_decay,
            "corpora": [str(c) for c in corpora], "topk": cfg.topk, "lr": cfg.lr, "seed": cfg.seed,
            "steps_done": done, "train_positions": int(data.train["tokens"]), "positions_seen": last["seen"],
            "parameters": sum(p.numel() for p in params), "train_seconds": secs,
            "trained_on": device_name(data.f_train.device),
            "first_loss": history[0].get("first_loss"), "last_loss": last["loss"].item(), "history": history}


def _save(model, head: Eagle3Head, out: Path, metrics: dict, evaluate, command: str) -> dict:
    """Write the head (bfloat16), evaluate what was written, then the card and the metrics."""
    save_eagle3(head, out)
    metrics["final"] = evaluate(load_eagle3(out, model, "fp32").float().to(model.decoder.device))
    save_eagle3(head, out, card=model_card(head, metrics, command), metrics=metrics)
    return {k: v for k, v in metrics.items() if k != "history"}


def model_card(head: Eagle3Head, m: dict, command: str) -> str:
    """README.md of a trained EAGLE-3 head."""
    c, final = head.config, m["final"]
    steps = ", ".join(f"{x:.3f}" for x in final["top1_by_step"])
    return f"""# EAGLE-3 draft head: {c['speculant']['base_model']}

EAGLE-3 head (Li et al. 2025) for speculant (`--draft-head DIR` with `--method eagle|rsd-c|rsd-s|specinfer`), stored
in the layout vLLM and SGLang load (`LlamaForCausalLMEagle3`).  The target is frozen, so decoding stays exact.

- auxiliary hidden states: boundaries {c['eagle_aux_hidden_state_layer_ids']} of {c['speculant']['target_num_hidden_layers']}
  ({c['speculant']['aux_ids_meaning']})
- draft vocabulary: {c['draft_vocab_size']} of {c['vocab_size']} tokens (`d2t`/`t2d`)
- recipe: training-time test with {m['ttt_steps']} steps (loss weights {m['ttt_decay']}^s), KL to the target's
  top-{m['topk']} + hard CE; AdamW lr {m['lr']}, {m['steps_done']} steps, {m['positions_seen']:,} positions seen of
  {m['train_positions']:,} cached; seed {m['seed']}; {m['train_seconds'] / 60:.1f} min on {m.get('trained_on', 'a CPU')}
- held-out, teacher-forced top-1 agreement with the target by TTT step (step 0 = the first drafted token): {steps}
  over {final['positions']:,} positions

```
{command}
```
"""
