"""``speculant train --recipe draft-head``: train a feature-level draft head (EAGLE) on cached target features.

Li et al. 2024 (EAGLE), Sec. 3.2-3.3: the target is frozen; over a corpus it computes, once, its last
hidden state ``f_i`` and its next-token distribution at every position (teacher forcing,
:mod:`speculant.training.features`, batched, cached in shards under ``$SPECULANT_CACHE/features``).
The head then trains on windows of consecutive positions of one sequence (it attends to earlier
entries, as when drafting): entry ``i`` reads ``(f_i + noise, x_{i+1})`` and is trained with

    loss = v_weight * SmoothL1(f^_{i+1}, f_{i+1})                  (feature regression, EAGLE's L_reg)
         + p_weight * KL(p_{i+1} || q_{i+1})  [+ hard CE on argmax]   (EAGLE's L_cls, here against the
                                                                      target's top-k, renormalised)

``q`` is the head's distribution over its draft vocabulary: the ``draft_vocab`` tokens with the
most teacher mass in the training split (FR-Spec's frequency ranking).  The input noise (uniform,
width ``noise`` times the features' RMS) is EAGLE's data augmentation against the drift of
features the head feeds itself while drafting.  Held-out evaluation is teacher-forced: top-1
agreement with the target's argmax (greedy acceptance of the first drafted token) and
``sum_x min(p, q)`` over the teacher's top-k (a lower bound of the first token's acceptance at T=1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.draft_head import DraftHead, load_head, new_head, save_head
from ..errors import SpeculantError, check_range
from .losses import distill_totals, topk_distill_loss
from .distributed import SINGLE, Dist, check_batch, main_first, save_on_main, wrap_ddp
from .run import RunConfig, check_positions, optimize, read_checkpoint, seeded


def corpus_list(text: str) -> list[str]:
    """``--corpus`` for this recipe: one path or several, comma-separated.

    Raises:
        SpeculantError: an empty list.
    """
    paths = [p.strip() for p in text.split(",") if p.strip()]
    if not paths:
        raise SpeculantError(f"--corpus={text!r} is empty; allowed: a make-data JSONL path (or several, comma-separated)")
    return paths


def default_cache_dir() -> Path:
    """``$SPECULANT_CACHE/features`` (default ``~/.cache/speculant/features``)."""
    from ..models.loading import cache_root
    return cache_root() / "features"


def load_split(model, corpora: list[str], split: str, topk: int, cache_dir, max_tokens: int | None,
               progress: bool, layers: list[int] | None = None) -> dict:
    """Cached target features of one split over several corpora, merged (``seq`` made unique per corpus);
    ``max_tokens`` is a budget over all of them, spent in the order given.  ``by_corpus``: tokens used per file.
    ``layers``: the hidden states kept (``hidden/<E>``, entering layer E; default the last layer's output).

    Raises:
        SpeculantError: no corpus has records of ``split``.
    """
    from .data import read_corpus
    from .features import cached_features, merge_features
    parts, offset, by_corpus = [], 0, {}
    for c in corpora:
        used = sum(p["tokens"] for p in parts)
        if not read_corpus(c, split) or (max_tokens is not None and used >= max_tokens):
            continue
        left = None if max_tokens is None else max_tokens - used
        f = cached_features(model, c, split, layers or [model.decoder.num_layers], topk, cache_dir, left, progress)
        f = dict(f, seq=f["seq"] + offset)
        offset = int(f["seq"].max()) + 1
        parts.append(f)
        by_corpus[Path(c).name] = int(f["tokens"])
    if not parts:
        raise SpeculantError(f"no {split!r} records in {', '.join(map(str, corpora))}; allowed: make-data corpora "
                             "(held-out records come from prompts, not --text-file)")
    return dict(merge_features(parts), by_corpus=by_corpus)


@torch.no_grad()
def head_inputs(model, feats: dict, feature: str, batch: int = 4096) -> torch.Tensor:
    """The features the head reads, bf16 ``[N, D]``: the cached pre-norm last hidden state, or
    the target's final norm of it (``post-norm``)."""
    h = feats[f"hidden/{model.decoder.num_layers}"]
    if feature == "pre-norm":
        return h
    from ..runtime.executor import executor_of
    norm, dev = executor_of(model).final_norm, model.decoder.device
    return torch.cat([norm(h[s:s + batch].to(dev).float()).to(torch.bfloat16).to(h.device)
                      for s in range(0, len(h), batch)])


def sequences(seq: torch.Tensor) -> torch.Tensor:
    """``[S, 2]`` (start, length) of each run of equal ``seq`` ids (a sequence's positions are contiguous)."""
    _, counts = torch.unique_consecutive(seq, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    return torch.stack([starts, counts], 1)


def window_batch(f: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, spans: list[tuple[int, int, int]]):
    """Training tensors for windows of entries.

    Args:
        f: ``[N, D]`` head-input features; ids: ``[N]`` tokens; weight: bool ``[N]`` which next-positions count.
        spans: ``(sequence start, first entry, entries)``: entries ``a .. a+T-1`` read ``(f_a, x_{a+1})``.
    Returns:
        ``inputs [B, T, D]``, ``tokens [B, T]``, ``positions [B, T]`` (entry index within its sequence),
        ``next_idx [B, T]`` (global index ``a+1..``, the regression and teacher targets), ``mask [B, T]``.
    """
    width = max(t for _, _, t in spans)
    b = len(spans)
    inputs = f.new_zeros(b, width, f.shape[1])
    tokens = torch.zeros(b, width, dtype=torch.long, device=f.device)
    positions = torch.zeros(b, width, dtype=torch.long, device=f.device)
    nxt = torch.zeros(b, width, dtype=torch.long, device=f.device)
    mask = torch.zeros(b, width, dtype=torch.bool, device=f.device)
    for r, (s, a, t) in enumerate(spans):
        inputs[r, :t] = f[a:a + t]
        tokens[r, :t] = ids[a + 1:a + t + 1].long()
        positions[r, :t] = torch.arange(a - s, a - s + t)
        nxt[r, :t] = torch.arange(a + 1, a + t + 1)
        mask[r, :t] = weight[a + 1:a + t + 1]
    return inputs, tokens, positions, nxt, mask


def window_targets(spans, weight: torch.Tensor, skip: int = 0) -> torch.Tensor:
    """int64 ``[n]``: global indices of the counted next-positions of windows ``spans`` (``a+1 .. a+t``, the first
    ``skip`` entries of each window left out), in span order: the regression and teacher targets of a global batch
    (:func:`head_loss`; the TTT steps of :func:`speculant.training.eagle3.eagle3_loss`)."""
    idx = torch.cat([torch.arange(a + 1 + skip, a + t + 1) for _, a, t in spans]).to(weight.device)
    return idx[weight[idx]]


def head_loss(head: DraftHead, f: torch.Tensor, ids: torch.Tensor, t_map: torch.Tensor, t_logp: torch.Tensor,
              weight: torch.Tensor, spans, v_weight: float, p_weight: float, hard_weight: float,
              noise: float = 0.0, generator: torch.Generator | None = None, unroll: int = 1,
              share: slice | None = None) -> tuple[torch.Tensor, dict]:
    """EAGLE's loss on a batch of windows (module docstring); returns ``(loss, {"v": .., "p": ..})`` (the parts as
    detached scalar tensors).

    ``unroll=2`` adds a second pass in which every entry after the first reads the head's own prediction of its
    feature instead of the target's (a two-step form of EAGLE-3's training-time test: the head learns to draft
    from its own outputs, as at depth >= 2); the two passes' losses are averaged.

    ``share``: the rows of ``spans`` (the global batch) this rank trains on (data parallelism,
    :mod:`.distributed`); the loss and its parts are then this share of the global batch's (sums divided by the
    global batch's counts), and the noise is drawn for the global batch, so the shares add up to the loss of one
    process on the whole batch.  ``None``: every row.  ``head`` may be wrapped in DistributedDataParallel: its
    first pass runs through the wrapper, the second pass and the logits through the head itself.
    """
    inner = getattr(head, "module", head)
    share = share or slice(None)
    width = max(t for _, _, t in spans)
    jitter = (torch.rand((len(spans), width, f.shape[1]), generator=generator) - 0.5) * noise if noise else None
    x, tok, pos, nxt, mask = window_batch(f, ids, weight, spans[share])
    x = x.float()
    if noise:
        x = x + jitter[share, :x.shape[1]].to(x.device)
    pred = head(x, tok, pos)
    passes = [(pred, mask, False)]
    if unroll >= 2:
        second = inner(torch.cat([x[:, :1], pred[:, :-1]], 1), tok, pos)
        passes.append((second, torch.cat([torch.zeros_like(mask[:, :1]), mask[:, 1:]], 1), True))
    v = p = 0.0
    for out, m, skip_first in passes:
        target = nxt[m]
        totals = distill_totals(t_map[window_targets(spans, weight, skip_first)])
        reg = F.smooth_l1_loss(out[m], f[target].float(), reduction="sum") / max(totals[0] * f.shape[1], 1)
        v = v + reg / len(passes)
        p = p + topk_distill_loss(inner.logits(out[m]), t_map[target], t_logp[target], hard_weight,
                                  totals) / len(passes)
    return v_weight * v + p_weight * p, {"v": v.detach(), "p": p.detach()}


@torch.no_grad()
def evaluate_head(head: DraftHead, f: torch.Tensor, ids: torch.Tensor, t_idx: torch.Tensor, t_logp: torch.Tensor,
                  weight: torch.Tensor, seqs: torch.Tensor, max_positions: int, window: int = 512) -> dict:
    """Teacher-forced held-out metrics of the first drafted token over up to ``max_positions`` positions.

    Returns ``{"top1": agreement with the target's argmax, "accept_t1": mean sum_x min(p, q) over the
    teacher's top-k (lower bound of the T=1 acceptance), "coverage": target argmax inside the draft
    vocabulary, "positions": n}``.
    """
    was = head.training
    head.eval()
    V = head.config["vocab_size"]
    agree, acc, cover, n = 0, 0.0, 0, 0
    dev = t_idx.device
    table = torch.full((V,), -1, dtype=torch.long, device=dev)
    if head.vocab_ids is not None:
        table[head.vocab_ids.to(dev)] = torch.arange(len(head.vocab_ids), device=dev)
    else:
        table = torch.arange(V, device=dev)
    for s, length in seqs.tolist():
        for a in range(s, s + length - 1, window):
            t = min(window, s + length - 1 - a)
            x, tok, pos, nxt, mask = window_batch(f, ids, weight, [(s, a, t)])
            nxt = nxt[mask]
            if not len(nxt):
                continue
            logits = head.logits(head(x.float(), tok, pos)[mask])
            q = torch.softmax(logits, -1)
            top = logits.argmax(-1)
            tok_top = top if head.vocab_ids is None else head.vocab_ids[top]
            agree += int((tok_top == t_idx[nxt, 0].long()).sum())
            mapped = table[t_idx[nxt].long()]
            p = t_logp[nxt].float().exp()
            qk = torch.where(mapped >= 0, q.gather(-1, mapped.clamp_min(0)), torch.zeros_like(p))
            acc += float(torch.minimum(p, qk).sum())
            cover += int((mapped[:, 0] >= 0).sum())
            n += len(nxt)
        if n >= max_positions:
            break
    head.train(was)
    n = max(n, 1)
    return {"top1": agree / n, "accept_t1": acc / n, "coverage": cover / n, "positions": n}


def vocab_coverage(t_idx_train: torch.Tensor, t_logp_train: torch.Tensor, t_idx_eval: torch.Tensor,
                   sizes: list[int], vocab_size: int) -> dict:
    """Held-out coverage of the target's argmax by the top-``size`` draft vocabularies (FR-Spec sizing)."""
    from .train import select_vocab
    out = {}
    for size in sizes:
        if size >= vocab_size:
            continue
        ids = select_vocab(t_idx_train, t_logp_train, size, vocab_size)
        inside = torch.zeros(vocab_size, dtype=torch.bool, device=t_idx_eval.device)
        inside[ids.to(inside.device)] = True
        out[str(size)] = float(inside[t_idx_eval[:, 0].long()].float().mean())
    return out


def plot_learning_curve(history: list[dict], path: Path) -> None:
    """``learning_curve.png``: held-out teacher-forced first-token acceptance vs training positions seen."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = [h["train_positions"] for h in history]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(x, [h["eval"]["top1"] for h in history], "o-", label="greedy (top-1 agreement)")
    ax.plot(x, [h["eval"]["accept_t1"] for h in history], "s-", label="T=1 (sum min(p, q), top-k)")
    ax.set_xlabel("training positions seen")
    ax.set_ylabel("first-token acceptance (held-out)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def model_card(conf: dict, m: dict, command: str) -> str:
    """README.md of a trained head: architecture, data, recipe, metrics, the learning curve."""
    curve = "\n".join(f"| {h['step']} | {h['train_positions']} | {h['eval']['top1']:.3f} | {h['eval']['accept_t1']:.3f} |"
                      for h in m["history"])
    final = m["final"]
    sources = ", ".join(f"{k}: {v:,}" for k, v in m["train_positions_by_corpus"].items())
    return f"""# Draft head (EAGLE): {conf['base_model']}

Feature-level draft head for speculant (`speculant generate --method eagle`, or
`--method rsd-s|rsd-c|specinfer --draft-head default`).  The base model is frozen; only this head
is trained, so decoding with it is exact (output identical to the base model under greedy decoding,
the base model's distribution when sampling).

## Architecture (EAGLE-1/2, Li et al. 2024)
input `fc([embed(x_(i+1)); f_i])` (Linear {2 * conf['hidden_size']} -> {conf['hidden_size']}, bias) -> one Llama decoder layer
(input RMSNorm dropped, {conf['num_attention_heads']} query / {conf['num_key_value_heads']} KV heads, SwiGLU {conf['intermediate_size']})
-> the target's frozen LM-head rows of a {conf['draft_vocab_size']}-token draft vocabulary (FR-Spec: ranked
by the target's probability mass on the training split; only the token ids are stored).
Features: `{conf['feature']}` last hidden state of the target.  Embedding and LM head are the target's
(not stored).  Trainable parameters: {m['parameters']:,}; stored as {conf.get('stored_dtype', 'bfloat16')}
safetensors.  Initialisation: `{m['init']}`.

## Data
`speculant make-data` corpora: the base model's own responses to prompts, and (records of `--text-file`
inputs) teacher-forced text; the labels are always the base model's own distribution.  Prompts are split
train / held-out (seeded, per source) before generation; held-out prompts are never trained on.
Files: {', '.join(Path(c).name for c in m['corpora'])} (state their sources and licences here).
Training positions: {m['train_positions']:,} ({sources}); held-out positions evaluated: {final['positions']:,}.

## Recipe
Loss `{m['v_weight']} * SmoothL1(feature) + {m['p_weight']} * (KL to target top-{m['topk']} + {m['hard_weight']} x CE on its argmax)`,
input-feature noise {m['noise']} x RMS, unrolled passes {m.get('unroll', 1)}, AdamW lr {m['lr']} (warm-up + cosine), {m['steps_done']} steps x
{m['batch_seqs']} windows of <= {m['seq_len']} positions (positions: {m['positions']}), seed {m['seed']};
{m['train_seconds'] / 60:.1f} min on {m.get('trained_on', 'a CPU')} ({m['train_positions_per_second']:.0f} positions/s).
Final training loss: {m['last_loss']:.4f} (feature {m['last_v']:.4f}, distribution {m['last_p']:.4f}).

## Held-out metrics (teacher-forced, first drafted token, stored bf16 head)
| metric | value |
|---|---|
| top-1 agreement with the target (greedy acceptance) | {final['top1']:.3f} |
| sum min(p, q) over target top-{m['topk']} (T=1 acceptance, lower bound) | {final['accept_t1']:.3f} |
| target argmax inside the draft vocabulary | {final['coverage']:.3f} |

Learning curve (held-out, teacher-forced; `learning_curve.png`):

| step | training positions seen | top-1 | T=1 acceptance |
|---|---|---|---|
{curve}

Decoding results (block efficiency, speed) are in BENCHMARKS.md ("Draft head (EAGLE)").

## Command
```
{command}
```
"""


HEAD_FLAGS = {"batch_seqs": "--head-batch", "seq_len": "--head-seq-len"}
"""The :class:`HeadRunConfig` fields whose ``speculant train`` flag is named otherwise."""


@dataclass(frozen=True)
class HeadRunConfig(RunConfig):
    """Settings shared by the feature-level head recipes (``draft-head``: :class:`DraftHeadConfig`, ``eagle3``:
    :class:`~speculant.training.eagle3.Eagle3Config`); flags ``--head-batch``/``--head-seq-len`` for
    ``batch_seqs``/``seq_len``, the others of the same names; :class:`RunConfig` has the common ones.

    Attributes:
        batch_seqs, seq_len: windows per step (the global batch) and entries per window [positions].
        draft_vocab: draft vocabulary size (0: the full vocabulary).
        topk: teacher top-k log-probs cached per position.
        hard_weight: weight of the hard cross-entropy on the teacher's argmax inside the distribution loss.
        positions: train on ``all`` positions or ``response`` positions only.
        cache_dir: feature cache (``None``: :func:`default_cache_dir`).
        max_train_tokens: training positions cached at most (``None``: every train split).
        command: the command line the model card records.

    Raises:
        SpeculantError: a value out of range (one line naming it and what is allowed).
    """

    checkpoint_every: int = 100
    eval_every: int = 100
    batch_seqs: int = 8
    seq_len: int = 256
    draft_vocab: int = 16384
    topk: int = 32
    hard_weight: float = 0.5
    positions: str = "all"
    cache_dir: str | None = None
    max_train_tokens: int | None = None
    command: str = ""

    def __post_init__(self):
        super().__post_init__()
        for name in ("batch_seqs", "seq_len", "topk"):
            check_range(name, getattr(self, name), 1)
        check_range("draft_vocab", self.draft_vocab, 0)
        check_positions(self.positions)

    @staticmethod
    def head_args_of(args) -> dict:
        """The common and the shared head fields from ``speculant train``'s parsed flags
        (:func:`speculant.training.train.add_train_args`)."""
        from .train import command_line
        return dict(RunConfig.args_of(args, lr=1e-3), batch_seqs=args.head_batch, seq_len=args.head_seq_len,
                    draft_vocab=args.draft_vocab, topk=args.topk, hard_weight=args.hard_weight,
                    positions=args.positions, cache_dir=args.cache_dir, max_train_tokens=args.max_train_tokens,
                    command=command_line())


@dataclass(frozen=True)
class DraftHeadConfig(HeadRunConfig):
    """Settings of ``--recipe draft-head`` (the flags of the same names, ``--feature-noise`` for ``noise``;
    :class:`HeadRunConfig` has the ones shared with ``eagle3``).

    Attributes:
        feature: target feature the head reads, ``post-norm`` or ``pre-norm``; init: ``random`` or ``last-layer``.
        v_weight, p_weight: weights of the feature regression and the distribution loss (:func:`head_loss`).
        noise: uniform input-feature noise, width in units of the features' RMS (EAGLE's augmentation).
        unroll: 1, or 2 for the second, self-fed pass of :func:`head_loss`.

    Raises:
        SpeculantError: a value out of range (one line naming it and what is allowed).
    """

    feature: str = "post-norm"
    init: str = "random"
    v_weight: float = 1.0
    p_weight: float = 1.0
    noise: float = 0.0
    unroll: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_range("unroll", self.unroll, 1, 2)

    @classmethod
    def from_args(cls, args) -> DraftHeadConfig:
        """From ``speculant train``'s parsed flags (:func:`speculant.training.train.add_train_args`; a bad value's
        error names its flag)."""
        with cls.naming_flags(dict(HEAD_FLAGS, noise="--feature-noise")):
            return cls(**HeadRunConfig.head_args_of(args), feature=args.feature, init=args.init,
                       v_weight=args.v_weight, p_weight=args.p_weight, noise=args.feature_noise, unroll=args.unroll)

    def settings(self) -> dict:
        """What a checkpoint must match to be resumed."""
        return {"feature": self.feature, "draft_vocab": self.draft_vocab, "init": self.init}


@dataclass
class HeadData:
    """The tensors of a feature-level head recipe (``draft-head``, ``eagle3``): features (``train``/``heldout``:
    :func:`load_split`), head inputs ``f_train``/``f_heldout`` ``[N, D']``, which positions count (``weight [N]``),
    sequences ``[S, 2]`` (training: of 2 or more positions), the draft vocabulary ``vocab_ids [V']`` (``None``: the
    full vocabulary) and the teacher's ids in it ``t_map [N, k]`` (-1 outside)."""

    train: dict
    heldout: dict
    f_train: torch.Tensor
    f_heldout: torch.Tensor
    weight: torch.Tensor
    seqs: torch.Tensor
    heldout_seqs: torch.Tensor
    vocab_ids: torch.Tensor | None
    t_map: torch.Tensor

    def to(self, device: torch.device) -> "HeadData":
        """The tensors training indexes with the head's outputs (features, targets, weights) on ``device``; the
        sequences and the draft vocabulary stay host tensors (windows are drawn, and heads built, on the host).  The
        splits' cached hidden states, already turned into ``f_train``/``f_heldout``, are dropped."""
        keep = ("ids", "t_idx", "t_logp", "response")
        split = [{k: (v.to(device) if k in keep else v) for k, v in d.items() if not k.startswith("hidden/")}
                 for d in (self.train, self.heldout)]
        return HeadData(split[0], split[1], self.f_train.to(device), self.f_heldout.to(device), self.weight.to(device),
                        self.seqs, self.heldout_seqs, self.vocab_ids, self.t_map.to(device))


def head_data(model, corpora: list[str], cfg, inputs, layers: list[int] | None = None) -> HeadData:
    """Load (caching on first use) both splits' target features over ``corpora`` and derive a head's training tensors.

    Args:
        cfg: the recipe's config (:class:`DraftHeadConfig` or :class:`~speculant.training.eagle3.Eagle3Config`:
            ``cache_dir``, ``topk``, ``max_train_tokens``, ``progress``, ``positions``, ``draft_vocab``).
        inputs: ``features -> [N, D']``, what the head reads from a split's cached features.
        layers: the hidden states cached (:func:`load_split`; default the last layer's output).
    Raises:
        SpeculantError: no records of a split.
    """
    from .train import remap, select_vocab
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    V = model.config.vocab_size
    tr = load_split(model, corpora, "train", cfg.topk, cache_dir, cfg.max_train_tokens, cfg.progress, layers)
    ho = load_split(model, corpora, "heldout", cfg.topk, cache_dir, None, cfg.progress, layers)
    weight = tr["response"] if cfg.positions == "response" else torch.ones_like(tr["response"])
    seqs = sequences(tr["seq"])
    vocab_ids = None
    if cfg.draft_vocab and cfg.draft_vocab < V:
        vocab_ids = select_vocab(tr["t_idx"], tr["t_logp"], cfg.draft_vocab, V, model.eos_token_ids)
    return HeadData(tr, ho, inputs(tr), inputs(ho), weight, seqs[seqs[:, 1] >= 2], sequences(ho["seq"]), vocab_ids,
                    remap(tr["t_idx"], vocab_ids, V))


def _resume_head(ckpt: Path, cfg: DraftHeadConfig, head, opt, gen) -> tuple[int, list, int]:
    """Load ``ckpt`` into the head, optimizer and generator; returns ``(step, history, positions seen)``."""
    st = read_checkpoint(ckpt)
    if st.get("recipe") != "draft-head" or st["settings"] != cfg.settings():
        raise SpeculantError(f"checkpoint {str(ckpt)!r} is for {st.get('recipe')} {st.get('settings')}; "
                             f"allowed: recipe draft-head with {cfg.settings()}")
    head.load_state_dict(st["head"], strict=False)
    opt.load_state_dict(st["opt"])
    gen.set_state(st["gen"])
    return st["step"], st["history"], st["seen"]


def draw_windows(seqs: torch.Tensor, lengths: torch.Tensor, cfg, gen) -> list[tuple[int, int, int]]:
    """``cfg.batch_seqs`` windows ``(sequence start, first entry, entries)`` (the global batch): sequences ``[S, 2]``
    drawn with probability proportional to ``lengths [S]`` (their entries), a window of up to ``cfg.seq_len`` entries
    at a uniform offset in each, all from ``gen``."""
    pick = torch.multinomial(lengths, cfg.batch_seqs, replacement=True, generator=gen)
    spans = []
    for s, length in seqs[pick].tolist():
        entries = length - 1
        t = min(cfg.seq_len, entries)
        a = s + int(torch.randint(entries - t + 1, (1,), generator=gen))
        spans.append((s, a, t))
    return spans


def train_draft_head(model, corpora: list[str], out: str, config: DraftHeadConfig = DraftHeadConfig(),
                     dist: Dist = SINGLE) -> dict:
    """Train a draft head (recipe ``draft-head``); writes ``out/`` (head + card + metrics + checkpoint).

    Args:
        corpora: make-data JSONL paths (train and held-out splits).
        dist: this process' rank in a data-parallel run (:mod:`.distributed`): rank 0 caches the features, the
            head trains under DistributedDataParallel on each rank's share of every batch, rank 0 evaluates and
            writes the checkpoints and the head.
    Returns:
        metrics (held-out top-1 / T=1 acceptance before and after, the learning curve, throughput); on ranks
        other than 0 only ``rank`` and ``steps_done``.
    Raises:
        SpeculantError: no records of a split, ``resume`` without a compatible checkpoint, or fewer windows per
            step than processes.
    """
    cfg = config
    check_batch("head_batch", cfg.batch_seqs, dist)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = seeded(cfg.seed)
    dev = model.decoder.device               # the head trains where the target runs (``speculant train --device``)
    data = main_first(dist, lambda: head_data(model, corpora, cfg, lambda f: head_inputs(model, f, cfg.feature)))
    data = data.to(dev)
    head = new_head(model, data.vocab_ids, cfg.feature, cfg.init).to(dev)
    noise_width = cfg.noise * float(data.f_train[:20000].float().pow(2).mean().sqrt())
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    ckpt = out / "checkpoint.pt"
    start, history, seen = _resume_head(ckpt, cfg, head, opt, gen) if cfg.resume else (0, [], 0)
    net = wrap_ddp(head, dist)
    ho = data.heldout
    last = {"loss": torch.tensor(float("nan")), "v": float("nan"), "p": float("nan"), "seen": seen}

    def evaluate(h):
        return evaluate_head(h, data.f_heldout, ho["ids"], ho["t_idx"], ho["t_logp"], ho["response"],
                             data.heldout_seqs, cfg.eval_tokens)

    def record(done):
        history.append({"step": done, "train_positions": last["seen"], "loss": last["loss"].item(), "v": last["v"],
                        "p": last["p"], "eval": evaluate(head)})

    if start == 0 and dist.main:
        history.append({"step": 0, "train_positions": 0, "eval": evaluate(head)})

    def checkpoint(step):
        save_on_main(dist, lambda: {"recipe": "draft-head", "settings": cfg.settings(), "head": head.state_dict(),
                                    "opt": opt.state_dict(), "gen": gen.get_state(), "step": step,
                                    "history": history, "seen": last["seen"]}, ckpt)

    lengths = (data.seqs[:, 1] - 1).double()

    def batch_loss(step):
        spans = draw_windows(data.seqs, lengths, cfg, gen)
        loss, parts = head_loss(net, data.f_train, data.train["ids"], data.t_map, data.train["t_logp"], data.weight,
                                spans, cfg.v_weight, cfg.p_weight, cfg.hard_weight, noise_width, gen, cfg.unroll,
                                dist.share(len(spans)))
        positions = sum(t for _, _, t in spans)
        v, p = dist.all_sum(torch.stack([parts["v"], parts["p"]])).tolist()
        last.update(v=v, p=p, seen=last["seen"] + positions)
        return loss, positions

    head.train()
    done, secs = head_train_loop(cfg, dist, opt, params, start, "train draft-head", batch_loss, record, checkpoint,
                                 history, last)
    if not dist.main:
        return {"rank": dist.rank, "steps_done": done}
    head.eval()
    metrics = _head_metrics(cfg, corpora, data, params, history, last, done, secs, model.config.vocab_size)
    return _save_head_and_card(model, head, out, cfg, metrics, evaluate)


def head_train_loop(cfg: HeadRunConfig, dist: Dist, opt, params: list, start: int, desc: str, batch_loss, record,
                    checkpoint, history: list, last: dict) -> tuple[int, float]:
    """:func:`~speculant.training.run.optimize` as the head recipes run it: ``last["loss"]`` set to each step's global
    loss, ``history[0]["first_loss"]`` after step 1, ``record(done)`` (rank 0: evaluate, append to ``history``) every
    ``cfg.eval_every`` steps and at the end, then a last ``checkpoint(done)``.  Returns ``(steps done, seconds)``."""
    def after_step(done, loss):
        last["loss"] = loss
        if done == 1 and dist.main:
            history[0]["first_loss"] = loss.item()
        if (done % cfg.eval_every == 0 or done == cfg.steps) and dist.main:
            record(done)

    done, _, secs = optimize(cfg, opt, params, start, desc, batch_loss, after_step, checkpoint, unit="pos_s",
                             dist=dist)
    if dist.main and history[-1]["step"] != done:
        record(done)
    checkpoint(done)
    return done, secs


def _head_metrics(cfg: DraftHeadConfig, corpora, data: HeadData, params, history, last, done, secs,
                  vocab_size: int) -> dict:
    tr, seen = data.train, last["seen"]
    return {"recipe": "draft-head", **cfg.settings(), "corpora": [str(c) for c in corpora], "topk": cfg.topk,
            "lr": cfg.lr, "v_weight": cfg.v_weight, "p_weight": cfg.p_weight, "hard_weight": cfg.hard_weight,
            "noise": cfg.noise, "unroll": cfg.unroll, "batch_seqs": cfg.batch_seqs, "seq_len": cfg.seq_len,
            "positions": cfg.positions, "seed": cfg.seed, "steps_done": done, "steps_planned": cfg.steps,
            "train_positions": int(tr["tokens"]), "train_positions_by_corpus": tr["by_corpus"],
            "parameters": sum(p.numel() for p in params), "positions_seen": seen,
            "feature_cache_tokens_per_second": tr["tokens"] / max(tr["seconds"], 1e-9),
            "train_positions_per_second": (seen - (history[0].get("train_positions", 0))) / max(secs, 1e-9),
            "train_seconds": secs, "first_loss": history[0].get("first_loss"), "last_loss": last["loss"].item(),
            "last_v": last["v"], "last_p": last["p"],
            "vocab_coverage": vocab_coverage(tr["t_idx"], tr["t_logp"], data.heldout["t_idx"],
                                             [4096, 8192, 16384, 32768], vocab_size),
            "trained_on": device_name(data.f_train.device), "history": history}


def device_name(device: torch.device) -> str:
    """What a model card says the training ran on: the accelerator's name (``one NVIDIA H200``) or ``a CPU (N
    threads)``."""
    if device.type == "cuda":
        return f"one {torch.cuda.get_device_name(device)}"
    return f"a CPU ({torch.get_num_threads()} threads)"


def _save_head_and_card(model, head, out: Path, cfg: DraftHeadConfig, metrics: dict, evaluate) -> dict:
    """Write the head, evaluate what was written (bfloat16 round trip, the model's dtype), write the card, the
    metrics and the learning curve."""
    save_head(head, out)
    stored = load_head(out, model)
    metrics["final"] = evaluate(stored.float().to(model.decoder.device))
    save_head(head, out, card=model_card(stored.config, metrics, cfg.command), metrics=metrics)
    plot_learning_curve(metrics["history"] + [{"train_positions": metrics["positions_seen"], "eval": metrics["final"]}],
                        out / "learning_curve.png")
    return {k: v for k, v in metrics.items() if k != "history"}
