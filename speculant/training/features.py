"""Cache of frozen computations for exit-adapter and draft-head training.

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


def _batches(records: list[dict], max_len: int, batch_tokens: int):
    """Consecutive groups of ``(record index, ids, first response index)`` whose padded size
    (rows x longest) stays within ``batch_tokens`` (a single longer sequence forms its own group)."""
    group, longest = [], 0
    for i, rec in enumerate(records):
        ids, first = sequence_ids(rec, max_len)
        if len(ids) < 2:
            continue
        if group and (len(group) + 1) * max(longest, len(ids)) > batch_tokens:
            yield group
            group, longest = [], 0
        group.append((i, ids, first))
        longest = max(longest, len(ids))
    if group:
        yield group


@torch.inference_mode()
def compute_features(model, records: list[dict], exit_layers: list[int], topk: int = 32,
                     max_tokens: int | None = None, progress: bool = True, batch_tokens: int | None = None) -> dict:
    """Run the frozen model once over ``records``, batched (right-padded rows of up to ``batch_tokens`` tokens;
    default 2048 on a CPU, 16384 on an accelerator), on the model's device; the results are host tensors.

    Args:
        exit_layers: layers E whose incoming hidden states are kept; ``E = L`` (the number of layers)
            keeps the hidden state leaving the last layer, before the final norm.
    Returns a dict of tensors over ``N`` positions (each sequence's positions contiguous):
        ``hidden/<E>``: bf16 ``[N, D]`` leaving layer E-1, for each E in ``exit_layers``;
        ``t_idx``: int32 ``[N, k]`` teacher top-k token ids (column 0 = argmax);
        ``t_logp``: fp16 ``[N, k]`` their log-probabilities [nats];
        ``ids``: int32 ``[N]`` the token at each position;
        ``seq``: int32 ``[N]`` record index; ``response``: bool ``[N]`` (next token is a response token);
        plus ``tokens`` (int) and ``seconds`` (float).
    Raises:
        SpeculantError: an exit layer outside ``[1, L]``; no usable sequence.
    """
    from tqdm import tqdm

    from ..runtime.executor import executor_of
    dec = executor_of(model)
    L = dec.num_layers
    exits = sorted(set(exit_layers))
    for e in exits:
        if not 1 <= e <= L:
            raise SpeculantError(f"exit_layer={e} is out of range; allowed: 1..{L}")
    hid = {e: [] for e in exits}
    t_idx, t_logp, seq, resp, tok = [], [], [], [], []
    n = 0
    t0 = time.perf_counter()
    bar = tqdm(total=len(records), desc="cache features", unit="seq", disable=not progress)
    if batch_tokens is None:
        batch_tokens = 2048 if dec.device.type == "cpu" else 16384
    for group in _batches(records, dec.config.max_position_embeddings, batch_tokens):
        width = max(len(ids) for _, ids, _ in group)
        x = torch.zeros(len(group), width, dtype=torch.long)
        for row, (_, ids, _) in enumerate(group):
            x[row, :len(ids)] = torch.tensor(ids)
        pos = torch.arange(width, device=dec.device)
        h = dec.embed(x.to(dec.device))  # causal attention: right padding never reaches a real position
        start, at = 0, {}
        for e in exits:
            h = dec.run_layers(h, start, e, pos)
            at[e] = h.to(torch.bfloat16).cpu()      # the cache lives in host memory, whatever the model's device
            start = e
        h = dec.run_layers(h, start, L, pos)
        logp = F.log_softmax(dec.lm_head(dec.final_norm(h)), dim=-1)
        v, j = (a.cpu() for a in logp.topk(topk, dim=-1))
        for row, (i, ids, first_resp) in enumerate(group):
            t = len(ids)
            for e in exits:
                hid[e].append(at[e][row, :t].clone())
            t_idx.append(j[row, :t].to(torch.int32))
            t_logp.append(v[row, :t].to(torch.float16))
            tok.append(torch.tensor(ids, dtype=torch.int32))
            seq.append(torch.full((t,), i, dtype=torch.int32))
            r = torch.zeros(t, dtype=torch.bool)
            r[first_resp:] = True
            resp.append(r)
            n += t
        bar.update(len(group))
        bar.set_postfix(tok_s=f"{n / (time.perf_counter() - t0):.0f}")
        if max_tokens is not None and n >= max_tokens:
            break
    bar.close()
    if n == 0:
        raise SpeculantError("no usable sequences in the corpus (need >= 2 tokens each)")
    out = {f"hidden/{e}": torch.cat(hid[e]) for e in exits}
    out.update(t_idx=torch.cat(t_idx), t_logp=torch.cat(t_logp), ids=torch.cat(tok), seq=torch.cat(seq),
               response=torch.cat(resp), tokens=n, seconds=time.perf_counter() - t0)
    return out


def cache_key(model_name: str, corpus: Path, split: str, exit_layers: list[int], topk: int,
              device_type: str = "cpu") -> str:
    """Name of a corpus split's feature cache: changes with the model, the corpus file (path, size,
    mtime), the split, the cached layers, k and the device type that computes them (the CPU's keys as before)."""
    h = hashlib.sha1()
    st = corpus.stat()
    key = [2, model_name, str(corpus.resolve()), st.st_size, int(st.st_mtime), split, sorted(set(exit_layers)), topk,
           None]
    if device_type != "cpu":                # features computed elsewhere (TF32 products on CUDA) are not the CPU's
        key.append(device_type)
    h.update(json.dumps(key).encode())
    return h.hexdigest()[:16]


SHARD_RECORDS = 64
"""Records per feature shard: an interrupted extraction loses at most one shard of work."""


def merge_features(parts: list[dict]) -> dict:
    """Concatenate :func:`compute_features` outputs (``seq`` indices already global)."""
    out = {k: torch.cat([p[k] for p in parts]) for k, v in parts[0].items() if isinstance(v, torch.Tensor)}
    out["tokens"] = sum(p["tokens"] for p in parts)
    out["seconds"] = sum(p["seconds"] for p in parts)
    return out


def cached_features(model, corpus: str | Path, split: str, exit_layers: list[int], topk: int, cache_dir: str | Path,
                    max_tokens: int | None = None, progress: bool = True) -> dict:
    """:func:`compute_features` on one split of a corpus, memoised under ``cache_dir`` (keyed by model,
    corpus file size/mtime, split, exits, k) in shards of :data:`SHARD_RECORDS` records, each written
    atomically, so a rerun after an interruption resumes from the last finished shard.  ``max_tokens``
    stops after the first shards holding at least that many tokens (shards are never cut, so a
    smaller budget reuses the shards of a larger one)."""
    from .data import read_corpus
    corpus = Path(corpus)
    recs = read_corpus(corpus, split)
    if not recs:
        raise SpeculantError(f"corpus {str(corpus)!r} has no {split!r} records")
    key = cache_key(model.name, corpus, split, exit_layers, topk, model.decoder.device.type)
    folder = Path(cache_dir) / f"features-{split}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    parts, n = [], 0
    for k, a in enumerate(range(0, len(recs), SHARD_RECORDS)):
        if max_tokens is not None and n >= max_tokens:
            break
        path = folder / f"shard-{k:05d}.pt"
        if path.is_file():
            part = torch.load(path)
        else:
            try:
                part = compute_features(model, recs[a:a + SHARD_RECORDS], exit_layers, topk, None, progress)
            except SpeculantError:           # a shard without a usable sequence
                continue
            part["seq"] = part["seq"] + a
            tmp = path.with_suffix(".tmp")
            torch.save(part, tmp)
            tmp.rename(path)
        parts.append(part)
        n += part["tokens"]
    if not parts:
        raise SpeculantError(f"corpus {str(corpus)!r} has no usable {split!r} sequences (need >= 2 tokens each)")
    return merge_features(parts)
