"""Cache of frozen computations for exit-adapter training.

The base model is frozen, so everything an adapter at exit E needs is computed
once per corpus: the hidden states leaving layer E-1 (bf16) and the frozen
model's own top-k next-token log-probabilities at the last layer (the
distillation target).  Training then never runs the base model again, which is
what makes training feasible on a 2-core CPU.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import SpeculantError


def sequence_ids(rec: dict, max_len: int) -> tuple[list[int], int]:
    """Prompt + response ids (truncated to ``max_len``) and the index of the first position whose
    next token is a response token."""
    ids = (rec["prompt_ids"] + rec["response_ids"])[:max_len]
    return ids, max(len(rec["prompt_ids"]) - 1, 0)


@torch.inference_mode()
def compute_features(model, records: list[dict], exit_layers: list[int], topk: int = 32,
                     max_tokens: int | None = None, progress: bool = True) -> dict:
    """Run the frozen model once over ``records``.

    Returns a dict of tensors over ``N`` positions:
        ``hidden/<E>``: bf16 ``[N, D]`` leaving layer E-1, for each E in ``exit_layers``;
        ``t_idx``: int32 ``[N, k]`` teacher top-k token ids (column 0 = argmax);
        ``t_logp``: fp16 ``[N, k]`` their log-probabilities [nats];
        ``seq``: int32 ``[N]`` record index; ``response``: bool ``[N]`` (next token is a response token);
        plus ``tokens`` (int) and ``seconds`` (float).
    Raises:
        SpeculantError: an exit layer outside ``[1, L-1]``.
    """
    from tqdm import tqdm
    dec = model.decoder
    L = dec.num_layers
    exits = sorted(set(exit_layers))
    for e in exits:
        if not 1 <= e < L:
            raise SpeculantError(f"exit_layer={e} is out of range; allowed: 1..{L - 1}")
    hid = {e: [] for e in exits}
    t_idx, t_logp, seq, resp = [], [], [], []
    n = 0
    t0 = time.perf_counter()
    bar = tqdm(records, desc="cache features", unit="seq", disable=not progress)
    for i, rec in enumerate(bar):
        ids, first_resp = sequence_ids(rec, dec.config.max_position_embeddings)
        if len(ids) < 2:
            continue
        x = torch.tensor([ids])
        pos = torch.arange(len(ids))
        h = dec.embed(x)
        start = 0
        for e in exits:
            h = dec.run_layers(h, start, e, pos)
            hid[e].append(h[0].to(torch.bfloat16))
            start = e
        h = dec.run_layers(h, start, L, pos)
        logp = F.log_softmax(dec.lm_head(dec.final_norm(h))[0], dim=-1)
        v, j = logp.topk(topk, dim=-1)
        t_idx.append(j.to(torch.int32))
        t_logp.append(v.to(torch.float16))
        seq.append(torch.full((len(ids),), i, dtype=torch.int32))
        r = torch.zeros(len(ids), dtype=torch.bool)
        r[first_resp:] = True
        resp.append(r)
        n += len(ids)
        bar.set_postfix(tok_s=f"{n / (time.perf_counter() - t0):.0f}")
        if max_tokens is not None and n >= max_tokens:
            break
    if n == 0:
        raise SpeculantError("no usable sequences in the corpus (need >= 2 tokens each)")
    out = {f"hidden/{e}": torch.cat(hid[e]) for e in exits}
    out.update(t_idx=torch.cat(t_idx), t_logp=torch.cat(t_logp), seq=torch.cat(seq), response=torch.cat(resp),
               tokens=n, seconds=time.perf_counter() - t0)
    return out


def cache_key(model_name: str, corpus: Path, split: str, exit_layers: list[int], topk: int,
              max_tokens: int | None) -> str:
    h = hashlib.sha1()
    st = corpus.stat()
    h.update(json.dumps([model_name, str(corpus.resolve()), st.st_size, int(st.st_mtime), split,
                         sorted(set(exit_layers)), topk, max_tokens]).encode())
    return h.hexdigest()[:16]


def cached_features(model, corpus: str | Path, split: str, exit_layers: list[int], topk: int, cache_dir: str | Path,
                    max_tokens: int | None = None, progress: bool = True) -> dict:
    """:func:`compute_features` on one split of a corpus, memoised under ``cache_dir`` (keyed by model,
    corpus file size/mtime, split, exits, k)."""
    from .data import read_corpus
    corpus = Path(corpus)
    recs = read_corpus(corpus, split)
    if not recs:
        raise SpeculantError(f"corpus {str(corpus)!r} has no {split!r} records")
    key = cache_key(model.name, corpus, split, exit_layers, topk, max_tokens)
    path = Path(cache_dir) / f"features-{split}-{key}.pt"
    if path.is_file():
        return torch.load(path)
    feats = compute_features(model, recs, exit_layers, topk, max_tokens, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(feats, tmp)
    tmp.rename(path)
    return feats
