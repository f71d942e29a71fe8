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
import random
import time
from pathlib import Path

import torch

from ..errors import SpeculantError, check_range
from .curricula import CURRICULA, enabled_exits
from .losses import early_exit_loss, exit_scales, topk_distill_loss
from .schedules import TIME_CURRICULA, layer_dropout_rates, sample_keep_mask

RECIPES = ("layerskip", "exit-adapter", "draft-head")
LORA_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def add_train_args(p) -> None:
    """Flags of ``speculant train``."""
    p.add_argument("--recipe", required=True, help=f"one of: {', '.join(RECIPES)}")
    p.add_argument("--corpus", required=True, help="JSONL from `speculant make-data` (train + heldout splits); "
                   "draft-head takes several, comma-separated")
    p.add_argument("--out", required=True, help="output directory (checkpoint, metrics, trained weights)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3 adapter, 1e-4 layerskip)")
    p.add_argument("--warmup", type=float, default=0.05, help="warm-up fraction of --steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None, help="stop (and checkpoint) after this wall time")
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-tokens", type=int, default=4000, help="held-out positions used for evaluation")
    p.add_argument("--no-progress", action="store_true")
    a = p.add_argument_group("exit-adapter and draft-head")
    a.add_argument("--exit-layer", type=int, default=6, help="exit layer E (hidden leaving layer E-1)")
    a.add_argument("--blocks", type=int, default=2, help="residual SwiGLU blocks (init from layers E, E+1, ...)")
    a.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary size (0 = full)")
    a.add_argument("--topk", type=int, default=32, help="teacher top-k log-probs cached per position")
    a.add_argument("--batch-tokens", type=int, default=512)
    a.add_argument("--hard-weight", type=float, default=0.5, help="extra CE weight on the teacher's argmax")
    a.add_argument("--positions", default="all", help="train on 'all' positions or 'response' positions only")
    a.add_argument("--cache-dir", default=None,
                   help="feature cache (default: --out/cache; draft-head: $SPECULANT_CACHE/features)")
    a.add_argument("--max-train-tokens", type=int, default=None)
    a.add_argument("--cache-exits", default="", help="extra exit layers to cache in the same pass, e.g. 6,8,10")
    h = p.add_argument_group("draft-head")
    h.add_argument("--feature", default="post-norm", help="target feature the head reads: post-norm or pre-norm")
    h.add_argument("--init", default="random", help="head init: random (as EAGLE) or last-layer (copy of the target's)")
    h.add_argument("--head-batch", type=int, default=8, help="windows (of one sequence each) per step")
    h.add_argument("--head-seq-len", type=int, default=256, help="positions per window")
    h.add_argument("--v-weight", type=float, default=1.0, help="weight of the feature regression (SmoothL1)")
    h.add_argument("--p-weight", type=float, default=1.0, help="weight of the distribution loss (KL + hard CE)")
    h.add_argument("--feature-noise", type=float, default=0.0,
                   help="uniform input-feature noise, width in units of the features' RMS (EAGLE's augmentation)")
    h.add_argument("--unroll", type=int, default=1,
                   help="2 = also train on the head's own predicted features (two-step training-time test)")
    ls = p.add_argument_group("layerskip")
    ls.add_argument("--lora-rank", type=int, default=8, help="LoRA rank (0 = full fine-tune)")
    ls.add_argument("--lora-alpha", type=float, default=16.0)
    ls.add_argument("--p-max", type=float, default=0.1, help="layer dropout at the last layer")
    ls.add_argument("--dropout-curriculum", default="constant", help=f"one of: {', '.join(TIME_CURRICULA)}")
    ls.add_argument("--exit-curriculum", default="rotational", help=f"one of: {', '.join(CURRICULA)}")
    ls.add_argument("--rotation", type=int, default=4, help="R of the rotational curriculum")
    ls.add_argument("--e-scale", type=float, default=1.0)
    ls.add_argument("--seq-len", type=int, default=128)
    ls.add_argument("--batch", type=int, default=4)
    ls.add_argument("--eval-exit", type=int, default=8, help="exit layer whose agreement is reported")


def lr_at(step: int, steps: int, warmup: float) -> float:
    """Linear warm-up then cosine decay to 10%: a multiplier of the peak learning rate."""
    w = max(1, int(steps * warmup))
    if step < w:
        return (step + 1) / w
    t = (step - w) / max(1, steps - w)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def check_positions(positions: str) -> None:
    """Raise :class:`SpeculantError` unless ``positions`` (which positions train) is ``all`` or ``response``."""
    if positions not in ("all", "response"):
        raise SpeculantError(f"positions={positions!r} is unknown; allowed: all, response")


def _seed(seed: int) -> torch.Generator:
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- exit adapter
def select_vocab(t_idx: torch.Tensor, t_logp: torch.Tensor, size: int, vocab_size: int,
                 always: list[int] = ()) -> torch.Tensor:
    """The ``size`` token ids with the most teacher probability mass (summed over positions), plus ``always``.

    Args:
        t_idx, t_logp: ``[N, k]`` teacher top-k ids / log-probs.
    Returns:
        sorted int64 ``[size]`` token ids.
    """
    check_range("draft_vocab", size, 1, vocab_size)
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    mass.index_add_(0, t_idx.reshape(-1).long(), t_logp.float().exp().reshape(-1).double())
    for t in always:
        mass[t] = float("inf")
    return mass.topk(size).indices.sort().values


def remap(t_idx: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Teacher ids -> positions in the reduced vocabulary (-1 outside it); identity for ``None``."""
    if vocab_ids is None:
        return t_idx.long()
    table = torch.full((vocab_size,), -1, dtype=torch.long)
    table[vocab_ids] = torch.arange(len(vocab_ids))
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
    dec = model.decoder
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


def train_exit_adapter(model, corpus: str, out: str, *, exit_layer: int = 6, blocks: int = 2, draft_vocab: int = 8192,
                       topk: int = 32, steps: int = 1000, lr: float = 1e-3, warmup: float = 0.05,
                       batch_tokens: int = 512, hard_weight: float = 0.5, positions: str = "all", seed: int = 0,
                       max_minutes: float | None = None, resume: bool = False, checkpoint_every: int = 200,
                       eval_every: int = 200, eval_tokens: int = 4000, cache_dir: str | None = None,
                       max_train_tokens: int | None = None, cache_exits: tuple[int, ...] = (), progress: bool = True,
                       command: str = "") -> dict:
    """Train an exit adapter (recipe ``exit-adapter``); writes ``out/`` (adapter + card + metrics + checkpoint).

    Returns:
        metrics dict (held-out top-1 agreement before/after, coverage, KL, training positions/s).
    Raises:
        SpeculantError: bad settings (message names the value and what is allowed).
    """
    from tqdm import tqdm

    from .adapter import new_adapter, save_adapter
    from .features import cached_features

    check_range("steps", steps, 1)
    check_range("batch_tokens", batch_tokens, 1)
    check_positions(positions)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(cache_dir) if cache_dir else out / "cache"
    gen = _seed(seed)
    V = model.config.vocab_size
    exits = sorted({exit_layer, *cache_exits})
    tr = cached_features(model, corpus, "train", exits, topk, cache_dir, max_train_tokens, progress)
    ho = cached_features(model, corpus, "heldout", exits, topk, cache_dir, None, progress)
    H = tr[f"hidden/{exit_layer}"]
    if positions == "response":
        keep = tr["response"].nonzero().squeeze(1)
        H, T_idx, T_logp = H[keep], tr["t_idx"][keep], tr["t_logp"][keep]
    else:
        T_idx, T_logp = tr["t_idx"], tr["t_logp"]
    vocab_ids = None
    if draft_vocab and draft_vocab < V:
        vocab_ids = select_vocab(T_idx, T_logp, draft_vocab, V, model.eos_token_ids)
    adapter = new_adapter(model, exit_layer, blocks, vocab_ids)
    T_map = remap(T_idx, vocab_ids, V)
    eh, ei, el = _eval_subset(ho, exit_layer, eval_tokens)
    params = [p for p in adapter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    start, history = 0, []
    ckpt = out / "checkpoint.pt"
    if resume:
        if not ckpt.is_file():
            raise SpeculantError(f"--resume given but {str(ckpt)!r} does not exist; allowed: a previous --out")
        st = torch.load(ckpt, weights_only=False)
        if st["recipe"] != "exit-adapter" or st["exit_layer"] != exit_layer:
            raise SpeculantError(f"checkpoint {str(ckpt)!r} is for {st['recipe']} at E={st['exit_layer']}; "
                                 f"allowed: the same recipe and --exit-layer")
        adapter.load_state_dict(st["adapter"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        start, history = st["step"], st["history"]
    baseline = shared_head_top1(model, eh, ei)
    init_eval = evaluate_adapter(adapter, eh, ei, el, V) if start == 0 else history[0]["eval"]
    if start == 0:
        history.append({"step": 0, "eval": init_eval})

    def checkpoint(step):
        torch.save({"recipe": "exit-adapter", "exit_layer": exit_layer, "adapter": adapter.state_dict(),
                    "opt": opt.state_dict(), "gen": gen.get_state(), "step": step, "history": history}, ckpt)

    t0 = time.perf_counter()
    seen, done = 0, start
    N = H.shape[0]
    adapter.train()
    bar = tqdm(range(start, steps), desc="train exit-adapter", unit="step", disable=not progress)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr * lr_at(step, steps, warmup)
        idx = torch.randint(N, (batch_tokens,), generator=gen)
        loss = topk_distill_loss(adapter(H[idx].float()), T_map[idx], T_logp[idx], hard_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        seen += batch_tokens
        tps = seen / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tps:.0f}")
        done = step + 1
        if done % eval_every == 0 or done == steps:
            history.append({"step": done, "loss": loss.item(), "eval": evaluate_adapter(adapter, eh, ei, el, V)})
        if done % checkpoint_every == 0:
            checkpoint(done)
        if max_minutes is not None and time.perf_counter() - t0 > max_minutes * 60:
            break
    checkpoint(done)
    adapter.eval()
    metrics = {"recipe": "exit-adapter", "exit_layer": exit_layer, "blocks": blocks, "draft_vocab": draft_vocab,
               "topk": topk, "lr": lr, "hard_weight": hard_weight, "batch_tokens": batch_tokens, "seed": seed,
               "steps_done": done, "steps_planned": steps, "train_positions": int(N),
               "heldout_positions_total": int(ho["response"].sum()),
               "feature_cache_tokens_per_second": tr["tokens"] / max(tr["seconds"], 1e-9),
               "train_tokens_per_second": seen / max(time.perf_counter() - t0, 1e-9),
               "train_seconds": time.perf_counter() - t0,
               "baseline_shared_head_top1": baseline, "init": init_eval, "history": history}
    save_adapter(adapter, out, metrics=None)
    from ..drafters.exit_adapter import load_adapter   # evaluate what was written (bf16 round trip)
    stored = load_adapter(out, model)
    metrics["final"] = evaluate_adapter(stored, eh, ei, el, V)
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


def layerskip_forward(decoder, ids: torch.Tensor, keep: torch.Tensor | None, exits: list[int]) -> dict[int, torch.Tensor]:
    """Training forward with layer dropout and early exits (Elhoushi et al. 2024, Sec. 4.1-4.2).

    Args:
        ids: ``[B, T]`` token ids.
        keep: bool ``[L, B]`` (False = skip layer l for sequence b: the residual stream passes
            through unchanged), or ``None`` (run every layer).
        exits: 0-based layers whose exits produce logits (shared final norm + LM head).
    Returns:
        ``{layer: fp32 logits [B, T, V]}``.
    """
    pos = torch.arange(ids.shape[1])
    h = decoder.embed(ids)
    out = {}
    want = set(exits)
    for layer in range(decoder.num_layers):
        if keep is None or bool(keep[layer].all()):
            h = decoder.run_layers(h, layer, layer + 1, pos)
        elif bool(keep[layer].any()):
            h = torch.where(keep[layer][:, None, None], decoder.run_layers(h, layer, layer + 1, pos), h)
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
        x = torch.tensor([ids])
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
    from safetensors.torch import save_file
    from ..models.loading import ours_to_hf_state
    dec = model.decoder
    sd = ours_to_hf_state(dec)
    if dec.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(dec.config.to_hf_dict(), indent=2))
    if model.tokenizer is not None and hasattr(model.tokenizer, "save_pretrained"):
        model.tokenizer.save_pretrained(str(out))
    return out


def train_layerskip(model, corpus: str, out: str, *, steps: int = 100, lr: float = 1e-4, warmup: float = 0.05,
                    lora_rank: int = 8, lora_alpha: float = 16.0, p_max: float = 0.1,
                    dropout_curriculum: str = "constant", exit_curriculum: str = "rotational", rotation: int = 4,
                    e_scale: float = 1.0, seq_len: int = 128, batch: int = 4, seed: int = 0,
                    max_minutes: float | None = None, resume: bool = False, checkpoint_every: int = 200,
                    eval_tokens: int = 2000, eval_exit: int | None = 8, progress: bool = True,
                    records: tuple[list[dict], list[dict]] | None = None) -> dict:
    """LayerSkip fine-tuning (Elhoushi et al. 2024, Sec. 4); writes the merged model to ``out/model``.

    Returns:
        metrics: held-out last-layer perplexity and exit top-1 agreement before/after, tokens/s.
    Raises:
        SpeculantError: bad settings.
    """
    from tqdm import tqdm

    from .data import read_corpus
    check_range("steps", steps, 1)
    check_range("p_max", p_max, 0.0, 1.0)
    if exit_curriculum not in CURRICULA:
        raise SpeculantError(f"exit_curriculum={exit_curriculum!r} is unknown; allowed: {', '.join(CURRICULA)}")
    layerskip_check = layer_dropout_rates(1, p_max, 0, 1, dropout_curriculum)   # validates the curriculum name
    del layerskip_check
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = _seed(seed)
    dec = model.decoder
    L = dec.num_layers
    tr_recs, ho_recs = records if records is not None else (read_corpus(corpus, "train"), read_corpus(corpus, "heldout"))
    eos = model.eos_token_ids[0] if model.eos_token_ids else None
    chunks = token_chunks(tr_recs, seq_len, eos)
    before = heldout_eval(dec, ho_recs, eval_tokens, eval_exit)
    if lora_rank:
        add_lora(dec, lora_rank, lora_alpha)
    else:
        dec.requires_grad_(True)
    dec.train()
    params = [p for p in dec.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    start, losses = 0, []
    ckpt = out / "checkpoint.pt"

    def trainable_state():
        return {n: p.detach().clone() for n, p in dec.named_parameters() if p.requires_grad}

    if resume:
        if not ckpt.is_file():
            raise SpeculantError(f"--resume given but {str(ckpt)!r} does not exist; allowed: a previous --out")
        st = torch.load(ckpt, weights_only=False)
        if st["recipe"] != "layerskip":
            raise SpeculantError(f"checkpoint {str(ckpt)!r} is for recipe {st['recipe']}; allowed: layerskip")
        dec.load_state_dict(st["trainable"], strict=False)
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        start, losses = st["step"], st["losses"]

    def checkpoint(step):
        torch.save({"recipe": "layerskip", "trainable": trainable_state(), "opt": opt.state_dict(),
                    "gen": gen.get_state(), "step": step, "losses": losses}, ckpt)

    t0 = time.perf_counter()
    seen, done = 0, start
    bar = tqdm(range(start, steps), desc="train layerskip", unit="step", disable=not progress)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr * lr_at(step, steps, warmup)
        rows = chunks[torch.randint(len(chunks), (batch,), generator=gen)]
        x, y = rows[:, :-1], rows[:, 1:]
        rates = layer_dropout_rates(L, p_max, step, steps, dropout_curriculum)
        keep = sample_keep_mask(rates, batch, gen)
        exits = enabled_exits(exit_curriculum, step, L, rotation, steps)
        logits = layerskip_forward(dec, x, keep, exits)
        loss = early_exit_loss({layer: v.reshape(-1, v.shape[-1]) for layer, v in logits.items()}, y.reshape(-1),
                               exit_scales(L, exits, e_scale))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        seen += x.numel()
        done = step + 1
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{seen / (time.perf_counter() - t0):.0f}")
        if done % checkpoint_every == 0:
            checkpoint(done)
        if max_minutes is not None and time.perf_counter() - t0 > max_minutes * 60:
            break
    checkpoint(done)
    secs = time.perf_counter() - t0
    dec.eval()
    if lora_rank:
        merge_lora(dec)
    dec.requires_grad_(False)
    after = heldout_eval(dec, ho_recs, eval_tokens, eval_exit)
    save_hf_dir(model, out / "model")
    metrics = {"recipe": "layerskip", "steps_done": done, "steps_planned": steps, "lora_rank": lora_rank,
               "p_max": p_max, "dropout_curriculum": dropout_curriculum, "exit_curriculum": exit_curriculum,
               "rotation": rotation, "e_scale": e_scale, "seq_len": seq_len, "batch": batch, "lr": lr,
               "seed": seed, "train_tokens_per_second": seen / max(secs, 1e-9), "train_seconds": secs,
               "first_losses": losses[:5], "last_losses": losses[-5:], "heldout_before": before,
               "heldout_after": after}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def _int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpeculantError(f"{flag}={text!r} is invalid; allowed: comma-separated integers, e.g. 6,8") from None


def train_from_args(args) -> dict:
    """Dispatch ``speculant train`` by ``--recipe``.

    Raises:
        SpeculantError: unknown recipe.
    """
    import sys

    from ..models.loading import load_model
    if args.recipe not in RECIPES:
        raise SpeculantError(f"recipe={args.recipe!r} is unknown; allowed: {', '.join(RECIPES)}")
    model = load_model(args.model, args.dtype)
    common = dict(steps=args.steps, warmup=args.warmup, seed=args.seed, max_minutes=args.max_minutes,
                  resume=args.resume, checkpoint_every=args.checkpoint_every, progress=not args.no_progress)
    if args.recipe == "draft-head":
        from .head import train_head_from_args
        return train_head_from_args(model, args, common)
    if args.recipe == "exit-adapter":
        return train_exit_adapter(model, args.corpus, args.out, exit_layer=args.exit_layer, blocks=args.blocks,
                                  draft_vocab=args.draft_vocab, topk=args.topk, lr=args.lr or 1e-3,
                                  batch_tokens=args.batch_tokens, hard_weight=args.hard_weight,
                                  positions=args.positions, eval_every=args.eval_every, eval_tokens=args.eval_tokens,
                                  cache_dir=args.cache_dir, max_train_tokens=args.max_train_tokens,
                                  cache_exits=_int_list("--cache-exits", args.cache_exits),
                                  command="speculant " + " ".join(sys.argv[1:]), **common)
    return train_layerskip(model, args.corpus, args.out, lr=args.lr or 1e-4, lora_rank=args.lora_rank,
                           lora_alpha=args.lora_alpha, p_max=args.p_max, dropout_curriculum=args.dropout_curriculum,
                           exit_curriculum=args.exit_curriculum, rotation=args.rotation, e_scale=args.e_scale,
                           seq_len=args.seq_len, batch=args.batch, eval_tokens=args.eval_tokens,
                           eval_exit=args.eval_exit, **common)
