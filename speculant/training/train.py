"""``speculant train``: the early-exit training recipes, and the draft-head recipe (:mod:`.head`).

* ``--recipe exit-adapter`` (lossless, ours): the base model is frozen; an
  :class:`~speculant.drafters.exit_adapter.ExitAdapter` at exit E is trained by KL to
  the frozen model's own final distribution (top-k, cached once by
  :mod:`~speculant.training.features`), optionally over a reduced draft vocabulary.
* ``--recipe layerskip`` (Elhoushi et al. 2024, arXiv 2404.16710, Sec. 4): layer
  dropout (:mod:`.schedules`) + early-exit loss with the shared LM head (:mod:`.losses`)
  under a rotational or gradual curriculum (:mod:`.curricula`); full fine-tune or
  LoRA (``peft``) on ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``.
  Changes the model (and so its output); reports held-out perplexity before/after.
* ``--recipe draft-head`` (lossless): a feature-level draft head (EAGLE) on the frozen
  target's cached features; see :mod:`speculant.training.head`.

All recipes: seeds, tqdm with training tokens/s, a checkpoint in ``--out`` every
``--checkpoint-every`` steps and at the end, ``--resume``, and ``--max-minutes``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpeculantError, check_range
from .curricula import CURRICULA, enabled_exits
from .distributed import (SINGLE, Dist, check_batch, full_states, load_full_states, main_first, save_on_main,
                          unshard, wrap_ddp, wrap_fsdp)
from .losses import distill_totals, early_exit_loss, exit_scales, topk_distill_loss
from .run import RunConfig, check_positions, lr_at, optimize, read_checkpoint, seeded
from .arguments import RECIPES, add_train_args  # noqa: F401  (re-exported)
from .schedules import layer_dropout_rates, sample_keep_mask

__all__ = ["RECIPES", "ExitAdapterConfig", "LayerSkipConfig", "add_train_args", "lr_at", "train_exit_adapter",
           "train_layerskip", "train_from_args"]

LORA_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def select_vocab(t_idx: torch.Tensor, t_logp: torch.Tensor, size: int, vocab_size: int,
                 always: list[int] = ()) -> torch.Tensor:
    """The ``size`` token ids with the most teacher probability mass (summed over positions), plus ``always``.

    Args:
        t_idx, t_logp: ``[N, k]`` teacher top-k ids / log-probs.
    Returns:
        sorted int64 ``[size]`` token ids.
    """
    check_range("draft_vocab", size, 1, vocab_size)
    mass = torch.zeros(vocab_size, dtype=torch.float64, device=t_idx.device)
    mass.index_add_(0, t_idx.reshape(-1).long(), t_logp.float().exp().reshape(-1).double())
    for t in always:
        mass[t] = float("inf")
    return mass.topk(size).indices.sort().values


def remap(t_idx: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Teacher ids -> positions in the reduced vocabulary (-1 outside it); identity for ``None``."""
    if vocab_ids is None:
        return t_idx.long()
    table = torch.full((vocab_size,), -1, dtype=torch.long, device=t_idx.device)
    table[vocab_ids.to(t_idx.device)] = torch.arange(len(vocab_ids), device=t_idx.device)
    return table[t_idx.long()]


@torch.no_grad()
def evaluate_adapter(adapter, hidden: torch.Tensor, t_idx: torch.Tensor, t_logp: torch.Tensor,
                     vocab_size: int, batch: int = 1024) -> dict:
    """Top-1 agreement of the adapter with the teacher argmax, coverage of the draft vocabulary, and KL.

    Args:
        hidden: ``[N, D]`` exit hidden states; ``t_idx``/``t_logp``: ``[N, k]`` teacher top-k.
    Returns:
        ``{"top1": fraction, "coverage": fraction of teacher argmaxes inside the draft vocabulary,
        "kl_topk": mean KL [nats] to the truncated teacher, "positions": N}``.
    """
    was = adapter.training
    adapter.eval()
    agree, cover, kl, n = 0, 0, 0.0, hidden.shape[0]
    mapped = remap(t_idx, adapter.vocab_ids, vocab_size)
    for s in range(0, n, batch):
        logits = adapter(hidden[s:s + batch].float())
        top = logits.argmax(-1)
        tok = top if adapter.vocab_ids is None else adapter.vocab_ids[top]
        agree += int((tok == t_idx[s:s + batch, 0].long()).sum())
        cover += int((mapped[s:s + batch, 0] >= 0).sum())
        kl += float(topk_distill_loss(logits, mapped[s:s + batch], t_logp[s:s + batch])) * len(top)
    adapter.train(was)
    return {"top1": agree / n, "coverage": cover / n, "kl_topk": kl / n, "positions": n}


@torch.no_grad()
def shared_head_top1(model, hidden: torch.Tensor, t_idx: torch.Tensor, batch: int = 1024) -> float:
    """Top-1 agreement of the untrained exit (shared final norm + LM head) with the teacher argmax."""
    from ..runtime.executor import executor_of
    dec = executor_of(model)
    agree = 0
    for s in range(0, hidden.shape[0], batch):
        h = hidden[s:s + batch].to(dec.dtype)
        agree += int((dec.lm_head(dec.final_norm(h)).argmax(-1) == t_idx[s:s + batch, 0].long()).sum())
    return agree / hidden.shape[0]


def _eval_subset(feats: dict, E: int, n: int, response_only: bool = True):
    sel = feats["response"] if response_only else torch.ones_like(feats["response"])
    idx = sel.nonzero().squeeze(1)[:n]
    return feats[f"hidden/{E}"][idx], feats["t_idx"][idx], feats["t_logp"][idx]


def model_card(conf: dict, metrics: dict, command: str) -> str:
    m = metrics
    return f"""# Exit adapter: {conf['base_model']} @ exit layer {conf['exit_layer']}

Lossless LayerSkip-style drafting head for speculant (`speculant generate --method early-exit
--exit-adapter default`). The base model is frozen; only this head is trained, so
speculative decoding with it is exact (output identical to the base model under greedy decoding).

## Architecture
hidden leaving layer {conf['exit_layer'] - 1} -> {conf['num_blocks']} residual SwiGLU block(s) (initialised from the MLPs of layers
{conf['exit_layer']}..{conf['exit_layer'] + conf['num_blocks'] - 1}) -> RMSNorm -> frozen tied LM-head rows of a
{conf['draft_vocab_size']}-token draft vocabulary (+ trained bias). Logits outside the draft vocabulary are -inf.
Stored tensors: {conf.get('stored_dtype', 'bfloat16')}.

## Recipe
Distillation to the frozen model's own final-layer distribution (KL to teacher top-{m['topk']},
renormalised, + {m['hard_weight']} x CE on the teacher argmax), AdamW, peak lr {m['lr']}, warm-up + cosine,
{m['steps_done']} steps x {m['batch_tokens']} positions, seed {m['seed']}.

## Data
`speculant make-data` self-distillation corpus: responses sampled from the base model (T=0.7, top-p 0.95)
for Spec-Bench-format dev prompts (first turn), HumanEval prompts and built-in instructions;
{m['train_positions']} training positions; prompts split train/held-out before generation.

## Metrics (held-out response positions, n={m['final']['positions']})
| | top-1 agreement with the final layer |
|---|---|
| shared head at exit {conf['exit_layer']} (untrained) | {m['baseline_shared_head_top1']:.3f} |
| this adapter | {m['final']['top1']:.3f} |

Draft-vocabulary coverage of the teacher argmax: {m['final']['coverage']:.3f}; KL to truncated teacher:
{m['final']['kl_topk']:.3f} nats. Training throughput: {m['train_tokens_per_second']:.0f} positions/s.

## Command
```
{command}
```
"""


@dataclass(frozen=True)
class ExitAdapterConfig(RunConfig):
    """Settings of ``--recipe exit-adapter`` (the flags of the same names; :class:`RunConfig` has the common ones).

    Attributes:
        exit_layer: exit layer E (the adapter reads the hidden state leaving layer E-1).
        blocks: residual SwiGLU blocks, initialised from the MLPs of layers E, E+1, ...
        draft_vocab: reduced draft vocabulary size (0: the full vocabulary).
        topk: teacher top-k log-probs cached per position.
        batch_tokens: positions per step.
        hard_weight: extra cross-entropy weight on the teacher's argmax.
        positions: train on ``all`` positions or ``response`` positions only.
        cache_dir: feature cache (``None``: ``out/cache``).
        max_train_tokens: training positions cached at most (``None``: the whole train split).
        cache_exits: extra exit layers cached in the same pass.
        command: the command line the model card records.

    Raises:
        SpeculantError: a value out of range (one line naming it and what is allowed).
    """

    exit_layer: int = 6
    blocks: int = 2
    draft_vocab: int = 8192
    topk: int = 32
    batch_tokens: int = 512
    hard_weight: float = 0.5
    positions: str = "all"
    cache_dir: str | None = None
    max_train_tokens: int | None = None
    cache_exits: tuple[int, ...] = ()
    command: str = ""

    def __post_init__(self):
        super().__post_init__()
        check_range("exit_layer", self.exit_layer, 1)
        check_range("blocks", self.blocks, 0)
        check_range("draft_vocab", self.draft_vocab, 0)
        check_range("topk", self.topk, 1)
        check_range("batch_tokens", self.batch_tokens, 1)
        check_positions(self.positions)

    @classmethod
    def from_args(cls, args) -> ExitAdapterConfig:
        """From ``speculant train``'s parsed flags (a bad value's error names its flag)."""
        with cls.naming_flags():
            return cls(**RunConfig.args_of(args, lr=1e-3), exit_layer=args.exit_layer, blocks=args.blocks,
                       draft_vocab=args.draft_vocab, topk=args.topk, batch_tokens=args.batch_tokens,
                       hard_weight=args.hard_weight, positions=args.positions, cache_dir=args.cache_dir,
                       max_train_tokens=args.max_train_tokens,
                       cache_exits=_int_list("--cache-exits", args.cache_exits), command=command_line())


@dataclass
class _AdapterData:
    """The exit-adapter recipe's tensors: training positions (``hidden [N, D]``, teacher top-k ``t_idx``/``t_logp``
    ``[N, k]``, ``t_map``: ``t_idx`` in the draft vocabulary), the held-out evaluation subset and the features."""

    hidden: torch.Tensor
    t_idx: torch.Tensor
    t_logp: torch.Tensor
    t_map: torch.Tensor
    vocab_ids: torch.Tensor | None
    heldout: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    train_features: dict
    heldout_features: dict


def _adapter_data(model, corpus: str, cfg: ExitAdapterConfig, cache_dir: Path) -> _AdapterData:
    from .features import cached_features

    V = model.config.vocab_size
    exits = sorted({cfg.exit_layer, *cfg.cache_exits})
    tr = cached_features(model, corpus, "train", exits, cfg.topk, cache_dir, cfg.max_train_tokens, cfg.progress)
    ho = cached_features(model, corpus, "heldout", exits, cfg.topk, cache_dir, None, cfg.progress)
    H = tr[f"hidden/{cfg.exit_layer}"]
    if cfg.positions == "response":
        keep = tr["response"].nonzero().squeeze(1)
        H, t_idx, t_logp = H[keep], tr["t_idx"][keep], tr["t_logp"][keep]
    else:
        t_idx, t_logp = tr["t_idx"], tr["t_logp"]
    vocab_ids = None
    if cfg.draft_vocab and cfg.draft_vocab < V:
        vocab_ids = select_vocab(t_idx, t_logp, cfg.draft_vocab, V, model.eos_token_ids)
    return _AdapterData(H, t_idx, t_logp, remap(t_idx, vocab_ids, V), vocab_ids,
                        _eval_subset(ho, cfg.exit_layer, cfg.eval_tokens), tr, ho)


def _resume_adapter(ckpt: Path, cfg: ExitAdapterConfig, adapter, opt, gen) -> tuple[int, list]:
    """Load ``ckpt`` into the adapter, optimizer and generator; returns ``(step, history)``."""
    st = read_checkpoint(ckpt)
    if st["recipe"] != "exit-adapter" or st["exit_layer"] != cfg.exit_layer:
        raise SpeculantError(f"checkpoint {str(ckpt)!r} is for {st['recipe']} at E={st['exit_layer']}; "
                             f"allowed: the same recipe and --exit-layer")
    adapter.load_state_dict(st["adapter"])
    opt.load_state_dict(st["opt"])
    gen.set_state(st["gen"])
    return st["step"], st["history"]


def train_exit_adapter(model, corpus: str, out: str, config: ExitAdapterConfig = ExitAdapterConfig(),
                       dist: Dist = SINGLE) -> dict:
    """Train an exit adapter (recipe ``exit-adapter``); writes ``out/`` (adapter + card + metrics + checkpoint).

    Args:
        dist: this process' rank in a data-parallel run (:mod:`.distributed`): rank 0 caches the features, the
            adapter trains under DistributedDataParallel on each rank's share of every batch, rank 0 evaluates
            and writes the checkpoints and the adapter.
    Returns:
        metrics dict (held-out top-1 agreement before/after, coverage, KL, training positions/s); on ranks other
        than 0 only ``rank`` and ``steps_done``.
    Raises:
        SpeculantError: ``resume`` without a checkpoint of this recipe and exit layer, or fewer positions per step
            than processes.
    """
    from .adapter import new_adapter

    cfg = config
    check_batch("batch_tokens", cfg.batch_tokens, dist)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = seeded(cfg.seed)
    V = model.config.vocab_size
    data = main_first(dist, lambda: _adapter_data(model, corpus, cfg, Path(cfg.cache_dir or out / "cache")))
    adapter = new_adapter(model, cfg.exit_layer, cfg.blocks, data.vocab_ids)
    params = [p for p in adapter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    ckpt = out / "checkpoint.pt"
    start, history = _resume_adapter(ckpt, cfg, adapter, opt, gen) if cfg.resume else (0, [])
    net = wrap_ddp(adapter, dist)
    eh, ei, el = data.heldout
    baseline = shared_head_top1(model, eh, ei) if dist.main else None
    if start:
        init_eval = history[0]["eval"]
    else:
        init_eval = evaluate_adapter(adapter, eh, ei, el, V) if dist.main else None     # rank 0 evaluates
        history.append({"step": 0, "eval": init_eval})

    def checkpoint(step):
        save_on_main(dist, lambda: {"recipe": "exit-adapter", "exit_layer": cfg.exit_layer,
                                    "adapter": adapter.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                                    "step": step, "history": history}, ckpt)

    def batch_loss(step):
        idx = torch.randint(data.hidden.shape[0], (cfg.batch_tokens,), generator=gen)   # the global batch
        mine = idx[dist.share(cfg.batch_tokens)]
        return topk_distill_loss(net(data.hidden[mine].float()), data.t_map[mine], data.t_logp[mine],
                                 cfg.hard_weight, distill_totals(data.t_map[idx])), cfg.batch_tokens

    def after_step(done, loss):
        if (done % cfg.eval_every == 0 or done == cfg.steps) and dist.main:
            history.append({"step": done, "loss": loss.item(), "eval": evaluate_adapter(adapter, eh, ei, el, V)})

    adapter.train()
    done, seen, secs = optimize(cfg, opt, params, start, "train exit-adapter", batch_loss, after_step, checkpoint,
                                dist=dist)
    checkpoint(done)
    if not dist.main:
        return {"rank": dist.rank, "steps_done": done}
    adapter.eval()
    metrics = {"recipe": "exit-adapter", "exit_layer": cfg.exit_layer, "blocks": cfg.blocks,
               "draft_vocab": cfg.draft_vocab, "topk": cfg.topk, "lr": cfg.lr, "hard_weight": cfg.hard_weight,
               "batch_tokens": cfg.batch_tokens, "seed": cfg.seed, "steps_done": done, "steps_planned": cfg.steps,
               "train_positions": int(data.hidden.shape[0]),
               "heldout_positions_total": int(data.heldout_features["response"].sum()),
               "feature_cache_tokens_per_second": data.train_features["tokens"] / max(data.train_features["seconds"],
                                                                                      1e-9),
               "train_tokens_per_second": seen / max(secs, 1e-9), "train_seconds": secs,
               "baseline_shared_head_top1": baseline, "init": init_eval, "history": history}
    return _save_adapter_and_card(model, adapter, out, metrics, data.heldout, cfg.command)


def _save_adapter_and_card(model, adapter, out: Path, metrics: dict, heldout, command: str) -> dict:
    """Write the adapter, evaluate what was written (the bfloat16 round trip) and write its card and metrics."""
    from ..drafters.exit_adapter import load_adapter
    from .adapter import save_adapter

    save_adapter(adapter, out, metrics=None)
    stored = load_adapter(out, model)
    metrics["final"] = evaluate_adapter(stored, *heldout, model.config.vocab_size)
    save_adapter(adapter, out, card=model_card(stored.config | {"stored_dtype": "bfloat16"}, metrics, command),
                 metrics=metrics)
    return {k: v for k, v in metrics.items() if k != "history"}


# ----------------------------------------------------------------------------- layerskip
def token_chunks(records: list[dict], seq_len: int, eos: int | None) -> torch.Tensor:
    """Pack records (prompt + response, separated by EOS) into ``[num_chunks, seq_len + 1]`` id rows."""
    stream: list[int] = []
    for r in records:
        stream += r["prompt_ids"] + r["response_ids"] + ([eos] if eos is not None else [])
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise SpeculantError(f"corpus has {len(stream)} tokens; allowed: at least seq_len+1={seq_len + 1}")
    return torch.tensor([stream[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])


def layerskip_forward(decoder, ids: torch.Tensor, keep: torch.Tensor | None, exits: list[int],
                      run: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """Training forward with layer dropout and early exits (Elhoushi et al. 2024, Sec. 4.1-4.2).

    Args:
        ids: ``[B, T]`` token ids.
        keep: bool ``[L, B]`` (False = skip layer l for sequence b: the residual stream passes
            through unchanged), or ``None`` (run every layer).
        exits: 0-based layers whose exits produce logits (shared final norm + LM head).
        run: bool ``[L]``: layers to run even where ``keep`` drops all of these rows (data parallelism: the layer
            keeps a row of another rank's share, so its parameters get a (zero) gradient here too, as DDP and FSDP
            pair the ranks' gradients); ``None``: ``keep``'s own.
    Returns:
        ``{layer: fp32 logits [B, T, V]}``.
    """
    pos = torch.arange(ids.shape[1], device=ids.device)
    h = decoder.embed(ids)
    out = {}
    want = set(exits)
    for layer in range(decoder.num_layers):
        if keep is None or bool(keep[layer].all()):
            h = decoder.run_layers(h, layer, layer + 1, pos)
        elif bool(keep[layer].any()) or (run is not None and bool(run[layer])):
            h = torch.where(keep[layer][:, None, None].to(h.device), decoder.run_layers(h, layer, layer + 1, pos), h)
        if layer in want:
            out[layer] = decoder.lm_head(decoder.final_norm(h))
    return out


@torch.no_grad()
def heldout_eval(decoder, records: list[dict], max_tokens: int, exit_layer: int | None) -> dict:
    """Last-layer perplexity on held-out response tokens, and top-1 agreement of the shared-head exit
    after layer ``exit_layer - 1`` with the last layer (response positions)."""
    import torch.nn.functional as F
    from .features import sequence_ids
    nll, n, agree = 0.0, 0, 0
    for r in records:
        ids, first = sequence_ids(r, decoder.config.max_position_embeddings)
        if len(ids) < 2 or first >= len(ids) - 1:
            continue
        x = torch.tensor([ids], device=decoder.device)
        exits = [decoder.num_layers - 1] + ([exit_layer - 1] if exit_layer else [])
        lg = layerskip_forward(decoder, x, None, exits)
        last = lg[decoder.num_layers - 1][0, first:-1]
        tgt = x[0, first + 1:]
        nll += float(F.cross_entropy(last, tgt, reduction="sum"))
        if exit_layer:
            agree += int((lg[exit_layer - 1][0, first:-1].argmax(-1) == last.argmax(-1)).sum())
        n += len(tgt)
        if n >= max_tokens:
            break
    return {"ppl": math.exp(nll / max(n, 1)), "nll": nll / max(n, 1), "tokens": n,
            "exit_layer": exit_layer, "exit_top1": agree / max(n, 1) if exit_layer else None}


def add_lora(decoder, rank: int, alpha: float):
    """Inject LoRA (``peft``) into our linear modules; only LoRA weights train."""
    from peft import LoraConfig, inject_adapter_in_model
    check_range("lora_rank", rank, 1)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=LORA_TARGETS, bias="none")
    decoder = inject_adapter_in_model(cfg, decoder)
    for n, p in decoder.named_parameters():
        p.requires_grad_("lora_" in n)
    return decoder


def save_lora(decoder, path: Path, cfg) -> Path:
    """Write the LoRA weights alone (``lora_A``/``lora_B`` of each adapted projection, float32, keyed by our
    decoder's module names; metadata: rank, alpha, targets): a few MB that travel where the merged model does not
    (``speculant train --recipe layerskip`` on a rented accelerator)."""
    from ..drafters.artifacts import save_safetensors
    sd = {n: p.detach().float().cpu().contiguous() for n, p in decoder.named_parameters() if "lora_" in n}
    save_safetensors(sd, path, metadata={"format": "speculant-lora", "rank": str(cfg.lora_rank),
                                        "alpha": str(cfg.lora_alpha), "targets": ",".join(LORA_TARGETS)})
    return path


def merge_lora(decoder):
    """Fold LoRA weights into the base linears and remove the wrappers (our decoder, plain again)."""
    for name, m in list(decoder.named_modules()):
        if hasattr(m, "base_layer") and hasattr(m, "merge"):
            m.merge()
            parent = decoder.get_submodule(name.rsplit(".", 1)[0])
            setattr(parent, name.rsplit(".", 1)[1], m.base_layer)
    return decoder


def save_hf_dir(model, out: Path) -> Path:
    """Our decoder -> an HF-format directory ``--model DIR`` loads (tied LM head dropped)."""
    from ..drafters.artifacts import save_safetensors
    from ..models.loading import ours_to_hf_state
    dec = model.decoder
    sd = ours_to_hf_state(dec)
    if dec.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors({k: v.detach().contiguous().cpu() for k, v in sd.items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(dec.config.to_hf_dict(), indent=2))
    if model.tokenizer is not None and hasattr(model.tokenizer, "save_pretrained"):
        model.tokenizer.save_pretrained(str(out))
    return out


@dataclass(frozen=True)
class LayerSkipConfig(RunConfig):
    """Settings of ``--recipe layerskip`` (Elhoushi et al. 2024, Sec. 4; the flags of the same names).

    Attributes:
        lora_rank: LoRA rank (0: full fine-tune); lora_alpha: LoRA's alpha.
        p_max: layer dropout at the last layer (:mod:`.schedules`, Eq. 1).
        dropout_curriculum: one of :data:`~.schedules.TIME_CURRICULA`; exit_curriculum: one of
            :data:`~.curricula.CURRICULA`; rotation: R of the rotational curriculum.
        e_scale: early-exit loss scale (:mod:`.losses`, Eq. 2).
        seq_len: tokens per training row; batch: rows per step.
        eval_exit: exit layer whose agreement with the last layer is reported (``None``: none).
        command: the command line the model card records.

    Raises:
        SpeculantError: a value out of range or an unknown curriculum (one line naming it and what is allowed).
    """

    steps: int = 100
    lr: float = 1e-4
    eval_tokens: int = 2000
    lora_rank: int = 8
    lora_alpha: float = 16.0
    p_max: float = 0.1
    dropout_curriculum: str = "constant"
    exit_curriculum: str = "rotational"
    rotation: int = 4
    e_scale: float = 1.0
    seq_len: int = 128
    batch: int = 4
    eval_exit: int | None = 8
    command: str = ""

    def __post_init__(self):
        super().__post_init__()
        check_range("p_max", self.p_max, 0.0, 1.0)
        check_range("lora_rank", self.lora_rank, 0)
        check_range("seq_len", self.seq_len, 1)
        check_range("batch", self.batch, 1)
        check_range("rotation", self.rotation, 1)       # checked at the first step otherwise, after the model loads
        check_range("e_scale", self.e_scale, 0.0)
        if self.exit_curriculum not in CURRICULA:
            raise SpeculantError(f"exit_curriculum={self.exit_curriculum!r} is unknown; "
                                 f"allowed: {', '.join(CURRICULA)}")
        layer_dropout_rates(1, self.p_max, 0, 1, self.dropout_curriculum)   # validates the curriculum's name

    @classmethod
    def from_args(cls, args) -> LayerSkipConfig:
        """From ``speculant train``'s parsed flags (a bad value's error names its flag)."""
        with cls.naming_flags():
            return cls(**RunConfig.args_of(args, lr=1e-4), lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                       p_max=args.p_max, dropout_curriculum=args.dropout_curriculum,
                       exit_curriculum=args.exit_curriculum, rotation=args.rotation, e_scale=args.e_scale,
                       seq_len=args.seq_len, batch=args.batch, eval_exit=args.eval_exit, command=command_line())


class LayerSkipNet(torch.nn.Module):
    """The decoder as one module whose forward is :func:`layerskip_forward`: what DistributedDataParallel and FSDP
    wrap (their hooks run around a module's forward)."""

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, ids, keep, exits, run=None):
        return layerskip_forward(self.decoder, ids, keep, exits, run)


def _resume_layerskip(ckpt: Path, named, opt, gen) -> tuple[int, list]:
    """Load ``ckpt`` into the trainable weights, optimizer and generator; returns ``(step, losses)``."""
    st = read_checkpoint(ckpt)
    if st["recipe"] != "layerskip":
        raise SpeculantError(f"checkpoint {str(ckpt)!r} is for recipe {st['recipe']}; allowed: layerskip")
    if st.get("format") != "full-state":
        raise SpeculantError(f"checkpoint {str(ckpt)!r} is of an older format; allowed: one written by this version")
    load_full_states(named, opt, st["trainable"], st["opt"])
    gen.set_state(st["gen"])
    return st["step"], st["losses"]


def _wrapped_layerskip(dec, cfg: LayerSkipConfig, dist: Dist):
    """``(net, named, opt)``: :class:`LayerSkipNet` under FSDP (full fine-tune on several processes: the weights,
    gradients and AdamW's moments sharded) or DDP (LoRA: only the small adapters train, replicated), its
    trainable parameters by the decoder's names, and their optimizer."""
    if cfg.lora_rank:
        add_lora(dec, cfg.lora_rank, cfg.lora_alpha)
    else:
        dec.requires_grad_(True)
    dec.train()
    inner = LayerSkipNet(dec)
    net = wrap_ddp(inner, dist, find_unused=True) if cfg.lora_rank else wrap_fsdp(inner, dist)
    named = [(n.removeprefix("decoder."), p) for n, p in inner.named_parameters() if p.requires_grad]
    return net, named, torch.optim.AdamW([p for _, p in named], lr=cfg.lr, weight_decay=0.0)


def train_layerskip(model, corpus: str, out: str, config: LayerSkipConfig = LayerSkipConfig(),
                    records: tuple[list[dict], list[dict]] | None = None, dist: Dist = SINGLE) -> dict:
    """LayerSkip fine-tuning (Elhoushi et al. 2024, Sec. 4); writes the merged model to ``out/model``.

    Args:
        records: ``(train, heldout)`` corpus records to use instead of reading ``corpus``.
        dist: this process' rank in a data-parallel run (:mod:`.distributed`): each rank trains on its share of
            every batch (full fine-tune under FSDP, LoRA under DDP); rank 0 evaluates, writes the checkpoints and
            the model.
    Returns:
        metrics: held-out last-layer perplexity and exit top-1 agreement before/after, tokens/s; on ranks other
        than 0 only ``rank`` and ``steps_done``.
    Raises:
        SpeculantError: a corpus shorter than one row, ``resume`` without a layerskip checkpoint, or fewer rows per
            step than processes.
    """
    from .data import read_corpus

    cfg = config
    check_batch("batch", cfg.batch, dist)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = seeded(cfg.seed)
    dec = model.decoder
    L = dec.num_layers
    tr_recs, ho_recs = records if records is not None else (read_corpus(corpus, "train"), read_corpus(corpus, "heldout"))
    eos = model.eos_token_ids[0] if model.eos_token_ids else None
    chunks = token_chunks(tr_recs, cfg.seq_len, eos)
    before = heldout_eval(dec, ho_recs, cfg.eval_tokens, cfg.eval_exit) if dist.main else None
    net, named, opt = _wrapped_layerskip(dec, cfg, dist)
    params = [p for _, p in named]
    ckpt = out / "checkpoint.pt"
    start, losses = _resume_layerskip(ckpt, named, opt, gen) if cfg.resume else (0, [])

    def checkpoint(step):
        model_state, opt_state = full_states(named, opt)       # under FSDP every rank takes part
        save_on_main(dist, lambda: {"recipe": "layerskip", "format": "full-state", "trainable": model_state,
                                    "opt": opt_state, "gen": gen.get_state(), "step": step, "losses": losses}, ckpt)

    def batch_loss(step):
        rows = chunks[torch.randint(len(chunks), (cfg.batch,), generator=gen)]      # the global batch
        rates = layer_dropout_rates(L, cfg.p_max, step, cfg.steps, cfg.dropout_curriculum)
        keep = sample_keep_mask(rates, cfg.batch, gen)
        mine = dist.share(cfg.batch)
        x, y = rows[mine, :-1].to(dec.device), rows[mine, 1:].to(dec.device)
        exits = enabled_exits(cfg.exit_curriculum, step, L, cfg.rotation, cfg.steps)
        logits = net(x, keep[:, mine], exits, keep.any(1))
        loss = early_exit_loss({layer: v.reshape(-1, v.shape[-1]) for layer, v in logits.items()}, y.reshape(-1),
                               exit_scales(L, exits, cfg.e_scale), total=cfg.batch * cfg.seq_len)
        return loss, cfg.batch * cfg.seq_len

    done, seen, secs = optimize(cfg, opt, params, start, "train layerskip", batch_loss,
                                lambda done, loss: losses.append(loss.item()), checkpoint, dist=dist)
    checkpoint(done)
    return _finish_layerskip(model, cfg, out, dist, ho_recs, before, done, seen, secs, losses)


def _finish_layerskip(model, cfg: LayerSkipConfig, out: Path, dist: Dist, ho_recs, before, done, seen, secs,
                      losses) -> dict:
    """Rank 0: the trained decoder made plain (FSDP's shards gathered, LoRA merged), evaluated and written to
    ``out/model`` with ``out/metrics.json``; the other ranks return ``rank`` and ``steps_done``."""
    from ..drafters.artifacts import write_card
    from .head import device_name
    dec = model.decoder
    if dist.active and not cfg.lora_rank:
        unshard(dec)
    if not dist.main:
        return {"rank": dist.rank, "steps_done": done}
    dec.eval()
    if cfg.lora_rank:
        save_lora(dec, out / "lora.safetensors", cfg)
        merge_lora(dec)
    dec.requires_grad_(False)
    after = heldout_eval(dec, ho_recs, cfg.eval_tokens, cfg.eval_exit)
    save_hf_dir(model, out / "model")
    metrics = {"recipe": "layerskip", "base_model": model.name, "steps_done": done, "steps_planned": cfg.steps,
               "lora_rank": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "p_max": cfg.p_max, "dropout_curriculum": cfg.dropout_curriculum,
               "exit_curriculum": cfg.exit_curriculum, "rotation": cfg.rotation, "e_scale": cfg.e_scale,
               "seq_len": cfg.seq_len, "batch": cfg.batch, "lr": cfg.lr, "seed": cfg.seed,
               "train_tokens_per_second": seen / max(secs, 1e-9), "train_seconds": secs,
               "first_losses": losses[:5], "last_losses": losses[-5:], "heldout_before": before,
               "heldout_after": after, "processes": dist.world, "trained_on": device_name(dec.device)}
    write_card(out, metrics, layerskip_card(metrics, cfg.command))
    return metrics


def layerskip_card(m: dict, command: str) -> str:
    """README.md of a LayerSkip run (``out/``): what ``lora.safetensors`` and ``model/`` are, the run's settings,
    held-out metrics before and after, what it was trained on, and the command."""
    before, after = m["heldout_before"], m["heldout_after"]
    lora = (f"- `lora.safetensors`: the LoRA weights alone (rank {m['lora_rank']}, alpha {m['lora_alpha']}, on\n"
            f"  {', '.join(LORA_TARGETS)}; float32, keyed by speculant's decoder module names)\n"
            "- `model/`: the base model with them merged (HF format)" if m["lora_rank"] else
            "- `model/`: the fully fine-tuned model (HF format)")
    exit_row = ("" if before["exit_top1"] is None else
                f"| top-1 agreement with the last layer at exit layer {before['exit_layer']} (shared LM head) | "
                f"{before['exit_top1']:.3f} | {after['exit_top1']:.3f} |\n")
    return f"""# LayerSkip fine-tune: {m['base_model']}

LayerSkip (Elhoushi et al. 2024, arXiv 2404.16710) fine-tune of {m['base_model']} for speculant: layer dropout and an
early-exit loss through the shared LM head train the early layers to predict the next token (early-exit
self-speculative decoding).  Unlike a draft head this changes the model: decoding the merged model is exact with
respect to it, not to the base model.

{lora}

## Settings
{m['steps_done']} of {m['steps_planned']} steps x {m['batch']} rows of {m['seq_len']} tokens, AdamW lr {m['lr']}
(warm-up + cosine), layer dropout p_max {m['p_max']} ({m['dropout_curriculum']}), exit curriculum
{m['exit_curriculum']} (R = {m['rotation']}), early-exit loss scale {m['e_scale']}, seed {m['seed']};
{m['train_seconds'] / 60:.1f} min on {m['trained_on']} ({m['train_tokens_per_second']:.0f} tokens/s,
{m['processes']} process{'es' if m['processes'] > 1 else ''}).

## Held-out metrics (response tokens of the corpus' held-out split, n={after['tokens']})
| | before | after |
|---|---|---|
| last-layer perplexity | {before['ppl']:.3f} | {after['ppl']:.3f} |
{exit_row}
## Command
```
{command}
```
"""


def _int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpeculantError(f"{flag}={text!r} is invalid; allowed: comma-separated integers, e.g. 6,8") from None


def command_line() -> str:
    """The command being run, as a model card records it (``speculant ...``)."""
    import sys
    return "speculant " + " ".join(sys.argv[1:])


DEVICES = "cpu, cuda, cuda:N"
"""The ``--device`` values training and the transformers sampler run on (as error messages list them)."""


def check_device(device: str, flag: str = "--device") -> torch.device:
    """``device`` as a torch device, checked without touching it (no CUDA context is made): ``cpu``, or ``cuda`` /
    ``cuda:N`` when this machine has that CUDA device.

    Raises:
        SpeculantError: one short line naming ``flag``, the value and what is allowed: another device type or a
            string torch does not parse, CUDA on a machine without it, or a CUDA index out of range.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise SpeculantError(f"{flag}={device!r} is not a device training runs on; allowed: {DEVICES}")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise SpeculantError(f"{flag}={device!r} is not available here (no CUDA device); allowed: cpu")
        if dev.index is not None and dev.index >= count:
            raise SpeculantError(f"{flag}={device!r} is not available here ({count} CUDA device"
                                 f"{'s' if count > 1 else ''}); allowed: cpu, cuda, cuda:0..{count - 1}")
    return dev


def on_device(model, device: str):
    """``model`` (in place; ``None`` only checks ``device``) with its decoder moved to the torch device ``device``:
    ``cpu``, ``cuda`` or ``cuda:N``; under torchrun plain ``cuda`` is ``cuda:LOCAL_RANK``.  On CUDA, float32 products
    use TF32 from then on (the teacher's cached features and top-k as well as training: labels, not decoding).

    Raises:
        SpeculantError: another device type, a name torch does not know, or a device this machine lacks
            (:func:`check_device`), or one that fails when first used.
    """
    import os
    if device == "cuda" and "LOCAL_RANK" in os.environ:     # under torchrun: this process' GPU
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    dev = check_device(device)
    try:
        torch.empty(0, device=dev)
    except RuntimeError as e:
        raise SpeculantError(f"--device={device!r} is not usable here ({str(e).strip().splitlines()[0][:200]}); "
                             "allowed: cpu") from None
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True     # training's products and its labels; never decoding
    if model is not None and dev.type != "cpu":
        model.decoder.to(dev)
        model.executor = None
    return model


def train_from_args(args) -> dict:
    """Dispatch ``speculant train`` by ``--recipe``: the recipe's config from the flags (checked before the model
    loads), then the recipe; under torchrun on each process (:mod:`.distributed`; progress bars on rank 0 only).

    Returns:
        the recipe's metrics (on ranks other than 0: ``rank`` and ``steps_done``).
    Raises:
        SpeculantError: unknown recipe, or a bad flag value.
    """
    from dataclasses import replace

    from ..models.loading import read_checkpoint
    from .distributed import close, from_env
    from .head import DraftHeadConfig, corpus_list, train_draft_head
    if args.recipe not in RECIPES:
        raise SpeculantError(f"--recipe={args.recipe!r} is unknown; allowed: {', '.join(RECIPES)}")
    if args.recipe in ("draft-head", "eagle3"):
        from .eagle3 import Eagle3Config, train_eagle3
        config, recipe = ((DraftHeadConfig.from_args(args), train_draft_head) if args.recipe == "draft-head" else
                          (Eagle3Config.from_args(args), train_eagle3))
        corpus = corpus_list(args.corpus)
    else:
        config = (ExitAdapterConfig if args.recipe == "exit-adapter" else LayerSkipConfig).from_args(args)
        if args.recipe == "exit-adapter" and args.device != "cpu":
            raise SpeculantError(f"--device={args.device!r} is not supported by --recipe exit-adapter; allowed: cpu")
        recipe, corpus = (train_exit_adapter if args.recipe == "exit-adapter" else train_layerskip), args.corpus
    check_device(args.device)                        # a bad --device fails before the model loads
    model = on_device(read_checkpoint(args.model, args.dtype), args.device)
    dist = from_env(model.decoder.device)
    if not dist.main:
        config = replace(config, progress=False)
    metrics = recipe(model, corpus, args.out, config, dist=dist)
    close(dist)          # not on an error: a rank that failed leaves, torchrun then stops the others
    return metrics
