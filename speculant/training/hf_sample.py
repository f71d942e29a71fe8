"""``speculant make-data --engine transformers``: a self-distillation corpus sampled with HF transformers on an
accelerator, where our CPU engine would take hours.

Two stages, both batched ``generate`` calls of the target in its HF form (the known model's converted directory,
:func:`speculant.models.loading.converted_dir`):

1. **Self-instruct prompts** (Magpie; Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting
   Aligned LLMs with Nothing", Sec. 2.1): the target is given only its chat template's text up to where a user
   message begins and samples the user turn itself, up to its end-of-turn token.  No dataset is needed, so the
   runbook works on a machine with no network; the prompts are what this instruct model expects to be asked.
2. **Responses** to those prompts (and any given ones), encoded by our one prompt rule
   (:func:`speculant.engine.prompts.encode_prompt`), sampled at ``temperature`` / ``top_p``.

Records have :mod:`speculant.training.data`'s format and split, so ``speculant train`` reads them as it reads
``make-data``'s.  The responses follow the target's float weights on the accelerator, not the CPU runtime's
quantized activations: the head trains on the target's distribution either way (its features are recomputed by the
frozen target when the features are cached), and decoding stays exact whatever the head learned.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from ..errors import SpeculantError
from .data import Prompt, split_prompts

USER_MARK = "\x00speculant-user\x00"


def load_hf(model_name: str, device: str, dtype: torch.dtype | None = None):
    """``(hf_model, tokenizer)``: the target ``model_name`` (known name, GGUF path or HF directory) as a transformers
    causal LM in eval mode on ``device`` (default dtype: bfloat16 on an accelerator, float32 on a CPU).

    Raises:
        SpeculantError: an unknown model (:func:`~speculant.models.loading.read_checkpoint`'s errors).
    """
    import os

    from transformers import AutoModelForCausalLM

    from ..models.loading import convert_gguf_in_child, converted_dir, is_gguf_source, load_tokenizer
    if is_gguf_source(model_name):
        path = converted_dir(model_name)
        if not (path / "model.safetensors").is_file():
            convert_gguf_in_child(model_name, path)
    elif os.path.isdir(model_name):
        path = Path(model_name)
    else:
        raise SpeculantError(f"model {model_name!r} is neither a known model, a .gguf file nor an HF directory")
    dev = torch.device(device)
    dtype = dtype or (torch.float32 if dev.type == "cpu" else torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(dev).eval()
    return hf, load_tokenizer(path)


def pre_query_ids(tokenizer) -> list[int]:
    """Ids of the chat template's text before a user message's content (Magpie's pre-query template: the system
    turn the template adds by default, then the user turn's header).

    Raises:
        SpeculantError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise SpeculantError("the target's tokenizer has no chat template; allowed: an instruct model with one "
                             "(self-instruct prompts need its user-turn header)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": USER_MARK}], tokenize=False)
    if USER_MARK not in text:
        raise SpeculantError("the target's chat template drops the user message's text; allowed: a template that "
                             "writes it (self-instruct prompts need the text before it)")
    return tokenizer.encode(text[:text.index(USER_MARK)], add_special_tokens=False)


def _left_padded(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def generate_batch(hf, rows: list[list[int]], eos: list[int], max_new_tokens: int, temperature: float,
                   top_p: float) -> list[list[int]]:
    """Continuations of ``rows`` (non-empty token-id lists) from one ``generate`` call, left-padded with ``eos[0]``
    (the attention mask hides the padding; greedy rows equal those decoded one at a time): per row the new ids up to
    and including its first ``eos`` token, or ``max_new_tokens`` ids; sampled at ``temperature`` with nucleus
    ``top_p`` (no top-k), greedy when ``temperature`` is 0."""
    pad = eos[0]
    ids, mask = _left_padded(rows, pad, hf.device)
    kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else dict(do_sample=False)
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=eos,
                      pad_token_id=pad, **kw)[:, ids.shape[1]:].tolist()
    done = []
    for r in out:
        cut = next((i + 1 for i, t in enumerate(r) if t in eos), len(r))
        done.append(r[:cut])
    return done


def self_instruct_prompts(hf, tokenizer, eos: list[int], n: int, batch: int = 512, max_new_tokens: int = 96,
                          temperature: float = 1.0, top_p: float = 0.99, max_minutes: float | None = None,
                          progress: bool = True, exclude: set[str] = frozenset()) -> list[Prompt]:
    """Up to ``n`` distinct user prompts sampled by the target from its pre-query template (module docstring), in
    ``generate`` calls of ``batch`` rows, at most ``4 n`` rows in all; a turn that did not end within
    ``max_new_tokens`` tokens, is shorter than 8 characters, repeats an earlier one or is in ``exclude`` (the other
    sources' texts) is dropped.  No call starts after ``max_minutes`` [minutes].  Ids ``selfinstruct-<k>`` in the
    order kept, source ``self-instruct``.

    Raises:
        SpeculantError: the tokenizer has no chat template (:func:`pre_query_ids`).
    """
    from tqdm import tqdm
    head, seen, out, t0 = pre_query_ids(tokenizer), set(exclude), [], time.perf_counter()
    bar = tqdm(total=n, desc="self-instruct", unit="prompt", disable=not progress)
    tries = 0
    while len(out) < n and tries < 4 * n:
        if max_minutes is not None and time.perf_counter() - t0 > max_minutes * 60:
            break
        rows = generate_batch(hf, [head] * batch, eos, max_new_tokens, temperature, top_p)
        tries += batch
        for r in rows:
            if not r or r[-1] not in eos:
                continue
            text = tokenizer.decode(r[:-1], skip_special_tokens=True).strip()
            if len(text) >= 8 and text not in seen and len(out) < n:
                seen.add(text)
                out.append(Prompt(f"selfinstruct-{len(out)}", "self-instruct", text))
                bar.update(1)
    bar.close()
    return out


def sample_corpus(hf, tokenizer, prompts: list[Prompt], out_path: str | Path, eos: list[int],
                  max_new_tokens: int = 256, temperature: float = 0.7, top_p: float = 0.95, batch: int = 512,
                  heldout_fraction: float = 0.02, split_seed: int = 0, greedy_fraction: float = 0.0,
                  max_minutes: float | None = None, progress: bool = True, seed: int = 0) -> dict:
    """Sample one response per prompt and write make-data records to ``out_path`` (overwritten; flushed after each
    batch, so a run stopped early leaves whole records).

    Prompts are encoded by :func:`~speculant.engine.prompts.encode_prompt` (those that leave no room for
    ``max_new_tokens`` in the model's context are skipped) and decoded in ``generate`` calls of ``batch`` prompts of
    similar length, the calls in a seeded random order (``seed``), so that a time limit drops prompts of every length,
    not the longest.  Batch k decodes greedily when ``floor((k + 1) g) > floor(k g)`` for ``g = greedy_fraction``
    (exactly that share of the batches, spread evenly: what greedy speculation meets), else it samples.  No batch
    starts after ``max_minutes`` [minutes].

    Returns:
        summary: records and tokens per split, generated tokens, seconds, ``prompts_skipped`` (too long, or not
        reached in the time).
    Raises:
        SpeculantError: no prompts, duplicate prompt ids, or no record written (the time ran out first).
    """
    from tqdm import tqdm

    from ..engine.prompts import encode_prompt
    if not prompts:
        raise SpeculantError("no prompts to sample; allowed: --self-instruct N or prompt sources")
    if len({p.id for p in prompts}) != len(prompts):
        raise SpeculantError("prompt ids are not unique; allowed: each source at most once")
    import random
    split = split_prompts(prompts, heldout_fraction, split_seed)
    room = int(getattr(hf.config, "max_position_embeddings", 10 ** 9)) - max_new_tokens
    encoded = [(p, ids) for p, ids in ((p, encode_prompt(tokenizer, p.text, True)) for p in prompts) if len(ids) < room]
    encoded.sort(key=lambda x: len(x[1]))
    batches = [encoded[a:a + batch] for a in range(0, len(encoded), batch)]
    random.Random(seed).shuffle(batches)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    counts = {"records": {"train": 0, "heldout": 0}, "tokens": {"train": 0, "heldout": 0}, "generated": 0}
    t0 = time.perf_counter()
    written = 0
    with out_path.open("w") as f, tqdm(total=len(encoded), desc="responses", unit="prompt",
                                       disable=not progress) as bar:
        for k, group in enumerate(batches):
            if max_minutes is not None and time.perf_counter() - t0 > max_minutes * 60:
                break
            greedy = math.floor((k + 1) * greedy_fraction) > math.floor(k * greedy_fraction)
            temp = 0.0 if greedy else temperature
            for (p, ids), resp in zip(group, generate_batch(hf, [i for _, i in group], eos, max_new_tokens, temp,
                                                            top_p)):
                s = split[p.id]
                f.write(json.dumps({"id": p.id, "source": p.source, "split": s, "prompt": p.text, "prompt_ids": ids,
                                    "response_ids": resp, "temperature": temp,
                                    "text": tokenizer.decode(resp, skip_special_tokens=True)}) + "\n")
                counts["records"][s] += 1
                counts["tokens"][s] += len(ids) + len(resp)
                counts["generated"] += len(resp)
                written += 1
            f.flush()
            bar.update(len(group))
    if not written:
        raise SpeculantError(f"no record was written to {str(out_path)!r}: the time ran out before the first batch; "
                             "allowed: a larger --max-minutes")
    secs = time.perf_counter() - t0
    return {"path": str(out_path), **counts, "prompts_skipped": len(prompts) - written, "seconds": round(secs, 1),
            "generated_tokens_per_second": round(counts["generated"] / max(secs, 1e-9), 1)}
