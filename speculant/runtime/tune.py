"""Kernel choices made by measurement on the machine at hand, cached per machine.

What is fast differs between CPUs (an AVX2 AMD EPYC and an AVX-512 Intel Xeon disagree on the
float32 one-row route by 2x) and so does what is *exact*: greedy speculative decoding is
token-identical to autoregressive decoding only if a projection gives each row the same bits whether
it runs alone (a decoding step) or inside a block (a verification).  So :func:`measure`:

1. packs the projections of a sample of the layers (:func:`sample_layers`: up to :data:`SAMPLE_LAYERS`, evenly
   spaced, the first and last included) and the LM head's first rows in every weight format that runs here
   (:mod:`speculant.runtime.formats`; ``w4a8`` needs AVX2 and a C compiler): every layer runs the same kernels
   on the same shapes, and packing all formats of the whole model at once would need ~1 GB more memory;
2. checks each format's kernel for batch invariance: rows of a 2..16-row product must equal, bit for
   bit, the same rows computed one at a time (for ``fp32``, each route: plain ``F.linear``,
   ``(W x^T)^T`` for 2..16 rows, a one-row product padded to two columns); and records up to which of
   32 and 64 rows that still holds (the blocks of a batch of sequences, ``speculant serve``);
3. times one pass over the sampled layers and, separately, the LM head's sample (its first rows, at most
   :data:`HEAD_SAMPLE_BYTES` in float32: :func:`head_sample`) for 1, 2, 4, 5, 8 and 16 rows, formats
   interleaved (so each format's weights come from DRAM, as in decoding), and reports a pass over the whole model:
   the sampled layers' time scaled by ``layers / sampled layers`` plus the head sample's scaled by
   ``vocabulary / sampled rows``, best of the repeats (the
   minimum is the figure least disturbed by other work on a shared machine); a variant that failed the
   invariance check is timed once after the warm-up (it is never the default; the figure ranks it in the table);
4. times the chosen format's one-row pass (the same whole-model estimate) with 1..N torch threads, each timed pass
   after a pass over another format's weights (out of the caches again);
5. times a one-token step's attention (every layer, 256 and 1024 cached tokens) through our float32 row-by-row
   kernel and through float64 SDPA, both batch-invariant, and picks the faster as the KV cache's dtype
   (``attention``; only float64 where our kernels do not run);
6. once the model runs in a format with the fused step (``w4a8``), times a prompt's forward through the fused step
   and through the torch layer step at :data:`PROMPT_LENGTHS` tokens on the model itself
   (:func:`measure_prompt_route`, at the first load in that format) and keeps the fused step for prompts up to the
   longest length at which it was not slower (``fused_prompt_tokens``; a prompt whose first chunk of
   :data:`~speculant.runtime.executor.PREFILL_CHUNK` tokens it covers runs on the fused step a chunk at a time);
7. in that format too, times the model's one-token forward with the products prefetching their weights
   :data:`WEIGHT_PREFETCH_BYTES` ahead (:func:`measure_weight_prefetch`) and keeps the fastest distance
   (``weight_prefetch``; 0 = none);
8. in that format too, times the model's one-token forward over a float32 and a float16 KV cache of
   :data:`KV_CACHE_CONTEXT` tokens (:func:`measure_kv_cache`) and keeps the faster (``kv_cache``), the cache
   dtype of ``--kv-cache auto`` in that format;
9. in that format too, times a decode loop of the fused step with each thread count (:func:`measure_decode_threads`)
   and keeps the default count unless another is faster by more than the noise (``threads``);
10. in that format too, with that thread count, KV cache dtype and weight prefetch, times the model's forward over T
   new tokens, T in :data:`FORWARD_ROWS` (:func:`measure_forward_rows`, ``forward_ms``): the cost table that cost-aware speculation
   sizes its rounds from (:mod:`speculant.engine.speculation`).

Steps 6-10 are :func:`complete_for_fused`, run on an executor of the packed model (the first load in that format
calls it once).  The executor is then built from the result (:meth:`~speculant.runtime.executor.Executor.from_tune`);
nothing here changes a model or an executor.

The weight format is :func:`choose_format`'s: ``w4a8`` where our kernels run, unless another batch-invariant
format's one-row pass wins by more than the noise without losing the verification pass.  The result is
stored as JSON under ``$SPECULANT_CACHE/tune/`` keyed by CPU model and flags, torch version, thread
count and the model's projection shapes, and reused; ``speculant tune`` measures again and prints the
table.  Nothing is chosen from anyone's machine but the one it runs on.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from .. import cpu
from . import occupancy
from ..models import linear as fp32_linear
from ..models.linear import DEFAULT_ROUTES, DecodeLinear, Routes
from .formats import DRAFTER_FORMATS, FORMATS, PROJECTIONS, format_available, head_format, pack_linear

ROWS = (1, 2, 4, 5, 8, 16)
"""Row counts measured: a decoding step, verification blocks and tree frontiers."""
FP32_ROUTES = {"linear": Routes("linear", "linear"), "transposed": Routes("linear", "transposed"),
               "pad2+transposed": Routes("pad2", "transposed"), "pad2": Routes("pad2", "linear")}
BATCH_ROWS = (32, 64)
"""Row counts a batch of sequences reaches (one verification block per sequence, one forward): checked for
batch invariance only (the ``invariant_rows`` column), so the one-sequence choice of format is unchanged."""
SAMPLE_LAYERS = 6
"""Decoder layers whose projections are packed and timed (evenly spaced; every layer when the model has no more)."""
SAMPLE_BYTES = 32 << 20
"""float32 bytes of the sampled layers' projections at most (:func:`sample_layers`), at least one layer: every
format's copy of them is held at once while they are timed, on top of a first load's memory (issue 26 bounds it
by the file's size + 400 MB; BENCHMARKS.md BC, BG): SmolLM2 gets 2 layers, Gemma 3 270M 1, a 1B model 1.  The
formats are timed in turn, so each format's sample is read from memory after the others' (together over 100 MB
with :data:`HEAD_SAMPLE_BYTES`), not from the last-level cache."""
ATTENTION_CONTEXTS = (256, 1024)
"""Cached tokens at which the one-token step's attention is timed."""
PROMPT_LENGTHS = (128, 256)
"""Prompt lengths at which the two prompt routes are timed (:func:`measure_prompt_route`) [tokens]: up to the
fused step's chunk (:data:`speculant.runtime.executor.PREFILL_CHUNK`; a longer prompt runs as chunks of it, and a
longer timing was the top of a first load's memory, BENCHMARKS.md BC)."""
WEIGHT_PREFETCH_BYTES = (0, 512, 1024, 2048, 4096)
"""Weight prefetch distances timed (:func:`measure_weight_prefetch`) [bytes ahead; 0: none]."""
WEIGHT_PREFETCH_CONTEXT = 256
"""Cached tokens of the one-token forward that :func:`measure_weight_prefetch` times."""
KV_CACHE_CONTEXT = 512
"""Cached tokens of the one-token forward that :func:`measure_kv_cache` times."""
DECODE_THREAD_STEPS = 32
"""One-token steps of the decode loop that :func:`measure_decode_threads` times per thread count."""
DECODE_THREAD_SECONDS = 20.0
"""Wall time after which :func:`measure_decode_threads` times no further round [s]: on a machine where another
process keeps a core busy a thread count that waits for that core makes each step many times slower (one such
timing took 120 s), and the round already measured says so."""
CHOICE_NOISE = 0.05
"""A choice other than the default (a thread count other than torch's, a float32 KV cache, the torch layer step for
a prompt length) is taken only if it is faster by more than this fraction: timings of a shared machine differ by a
few percent between runs, and the KV cache dtype and the prompt route change the logits, so a choice within the noise
would change greedy text from one tune to the next.  Where a choice changes the logits, the default is the one
measured not slower on every machine so far (a float16 KV cache, the fused step up to 1024 tokens; BENCHMARKS.md
AS), so that a re-tune keeps it: a default that wins by about the noise (float32, the torch layer step at 1024
tokens) flipped between two first loads on one machine and changed the text."""
FORWARD_ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
"""New tokens T of the forwards :func:`measure_forward_rows` times (a decoding step, verification blocks, trees;
cost-aware speculation interpolates linearly in between)."""
FORWARD_CONTEXT = 256
"""Cached tokens of the forwards :func:`measure_forward_rows` times (``forward_ms``)."""
FORWARD_LONG_CONTEXT = 1024
"""Cached tokens of the second table :func:`measure_forward_rows` times (``forward_context_ms``): a step after 1024
cached tokens took 1.4-1.6x one after 256 on SmolLM2 (2-vCPU Zen 4, BENCHMARKS.md BL), so the cost-aware policy takes
its costs at the generation's context (linear in between and beyond)."""
FORWARD_REPEATS = 20
"""Timed sweeps over :data:`FORWARD_ROWS` in :func:`measure_forward_rows` (fewer once :data:`FORWARD_SECONDS` are
spent): on a shared 2-core VM a best of 3 may leave the multi-row forwards high (a kept table put T = 5 at 1.63 steps
where the best of 20 gave 1.16-1.25 in one process; three sweeps gave 1.13-1.42 there), and the cost-aware policy then
drafts too little (BENCHMARKS.md AX)."""
FORWARD_SECONDS = 5.0
"""Time after which :func:`measure_forward_rows` stops sweeping (after at least 5 timed sweeps) [s]."""
FORWARD_VERSION = 4
"""How ``forward_ms`` is measured (:attr:`TuneResult.forward_version`): 1, the best of 3 sweeps on the tuner's probe
executor; 2, the best of up to :data:`FORWARD_REPEATS` on an executor with the tuned choices; 3, ratios to ``T = 1``
paired within each sweep (:func:`measure_forward_rows`); 4, and a second table at :data:`FORWARD_LONG_CONTEXT` in the
same sweeps (``forward_context_ms``).  A tune measured otherwise has its ``forward_ms`` measured
again at the next load, and its drafters' ``draft_ms`` (figures relative to ``forward_ms``) with it."""
SCHEMA = 2


@dataclass
class TuneResult:
    """Measured kernel table and the choices made from it.

    Attributes:
        key: what the measurement is valid for (CPU model, flags digest, torch version, threads, model shapes).
        weights: the default weight format (:func:`choose_format`).
        fp32_route: name of the float32 route chosen (a key of :data:`FP32_ROUTES`).
        threads: torch threads chosen: the count measured with (all the cores torch uses by default) unless another
            was faster by more than :data:`CHOICE_NOISE`, on the fused step's decode loop where the model has one
            (``decode_thread_ms``), else on the one-row pass of ``weights`` (``thread_ms``).
        table: one row per (format, route): ``ms`` per row count [milliseconds per pass over all
            projections, estimated from :func:`sample_layers` and the LM head], ``batch_invariant`` [bool] (at :data:`ROWS`), ``invariant_rows`` [rows] (the
            largest checked row count up to which it stays invariant, :func:`invariant_rows`).
        thread_ms: one-row pass of ``weights`` per thread count [milliseconds].
        attention: the KV cache's dtype, ``float32`` (our row-by-row kernel) or ``float64`` (SDPA).
        attention_us: a one-token step's attention over all layers per variant, summed over
            :data:`ATTENTION_CONTEXTS` [microseconds].
        seconds: time the measurement took [s].
        fused_prompt_tokens: prompts of up to this many tokens run through the fused step (0: none; ``None``: not
            measured yet, :func:`measure_prompt_route` runs once the model's fused step exists) [tokens].
        prompt_ms: the two prompt routes' time per prompt length, ``{length: {"fused": ms, "layer step": ms}}``.
        weight_prefetch: how far ahead the weight-quantized products prefetch their codes [bytes; 0: none;
            ``None``: not measured yet, :func:`measure_weight_prefetch` runs once the model's fused step exists].
        weight_prefetch_ms: the one-token forward per distance, ``{bytes: ms}`` [milliseconds].
        kv_cache: the KV cache's dtype in the fused-step format (``float32`` or ``float16``; ``None``: not measured
            yet, :func:`measure_kv_cache` runs once the model's fused step exists).
        kv_cache_ms: the one-token forward per cache dtype, ``{dtype: ms}`` [milliseconds].
        decode_thread_ms: in the fused-step format, a :data:`DECODE_THREAD_STEPS`-step decode loop of the fused step
            per thread count, ``{threads: ms per step}`` (:func:`measure_decode_threads`; empty: not measured), from
            which ``threads`` was then chosen.
        forward_ms: the model's whole forward (all layers, final norm, LM head over every row) over T new tokens
            after :data:`FORWARD_CONTEXT` cached ones, ``{T: ms}`` for T in :data:`FORWARD_ROWS` [milliseconds]
            (:func:`measure_forward_rows`; empty: not measured, the model has no fused step).
        forward_context_ms: the same forwards after more cached tokens, ``{context: {T: ms}}`` (one table, at
            :data:`FORWARD_LONG_CONTEXT` or the model's last positions; empty: not measured, or the model's context
            ends before) [tokens: milliseconds], timed in the same sweeps as ``forward_ms``.
        forward_version: how ``forward_ms`` was measured (:data:`FORWARD_VERSION`; 0: before it was recorded).
        forward_kernels: the kernel library ``forward_ms`` was measured with (:func:`speculant.kernels.build.
            kernel_signature`: variant, build digest, pair threshold; ``""``: not recorded); another one (new
            kernels, another variant pick) has ``forward_ms`` measured again at the next load.
        draft_ms: what a draft call (one depth of drafting) adds to a round, per drafter, ``{drafter signature: ms}``
            [milliseconds], on the scale of ``forward_ms`` (cleared when it is measured again;
            :func:`speculant.engine.speculation.draft_seconds`: the tune step of a drafter, run by the method factory
            :func:`speculant.engine.methods.build_generator` the first time it builds that drafter on this machine
            under ``speculation="cost"``).
        acceptance: a drafter's acceptance per depth and round context on fixed prompts, per drafter signature
            and tree shape (and acceptance rule, ``+ " sampled"`` at temperature 1; the key of
            :func:`speculant.engine.speculation.acceptance_prior`), ``{key: [[context, [alpha_d], [count_d]], ...]}``
            (:func:`speculant.engine.speculation.acceptance_prior`: counts of tokens, no timing; what a generator's
            cost-aware rounds start from).
        drafter_weights: the weight format of a drafter's own projections per drafter shape,
            ``{"<kind>:<I>x<O>,...": {"weights": fmt, "ms": {fmt: one-row pass [ms]}}}``
            (:func:`measure_drafter_weights`: the tune step :func:`speculant.drafters.weights.tune_drafter`, run by
            the method factory the first time it builds such a drafter on this machine; loaders only read it).
        stored_weights: for GGUF files holding types only some formats take as stored (K-quants, Q5_0 ...; see
            :func:`speculant.models.loading.stored_weights`), per set of types (``"Q4_K, Q6_K"``):
            ``{"candidates": [default, ...], "ms": {fmt: one-row pass [ms]}, "weights": the format chosen}``
            (:func:`measure_stored_weights` on the file's own codes, :func:`keep_default_format`).
        busy_cores: the most work other processes did while :func:`load_or_measure` or :func:`complete_for_fused`
            measured [cores] (:func:`speculant.runtime.occupancy.other_cores`); from
            :data:`~speculant.runtime.occupancy.BUSY_CORE` on, the choices may not hold on a quiet machine and the
            measurement said so (:func:`note_busy`).
    """

    key: dict
    weights: str
    fp32_route: str
    threads: int
    table: list[dict] = field(default_factory=list)
    thread_ms: dict = field(default_factory=dict)
    attention: str = "float64"
    attention_us: dict = field(default_factory=dict)
    seconds: float = 0.0
    fused_prompt_tokens: int | None = None
    prompt_ms: dict = field(default_factory=dict)
    weight_prefetch: int | None = None
    weight_prefetch_ms: dict = field(default_factory=dict)
    drafter_weights: dict = field(default_factory=dict)
    kv_cache: str | None = None
    kv_cache_ms: dict = field(default_factory=dict)
    decode_thread_ms: dict = field(default_factory=dict)
    forward_ms: dict = field(default_factory=dict)
    forward_context_ms: dict = field(default_factory=dict)
    forward_version: int = 0
    forward_kernels: str = ""
    draft_ms: dict = field(default_factory=dict)
    acceptance: dict = field(default_factory=dict)
    stored_weights: dict = field(default_factory=dict)
    busy_cores: float = 0.0
    measured_at: str = ""
    schema: int = SCHEMA

    def row(self, fmt: str, route: str | None = None) -> dict:
        for r in self.table:
            if r["format"] == fmt and (route is None or r["route"] == route):
                return r
        raise KeyError(fmt)


def cpu_description() -> dict:
    """CPU model name and a digest of its feature flags (:func:`speculant.cpu.describe`)."""
    return cpu.describe()


def projection_shapes(cfg) -> list[tuple[int, int]]:
    """``[O, I]`` of a layer's projections (fused q/k/v, o, fused gate/up, down) and of the LM head."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    d, inter = cfg.hidden_size, cfg.intermediate_size
    return [(q + 2 * kv, d), (d, q), (2 * inter, d), (d, inter), (cfg.vocab_size, d)]


def tune_key(cfg, threads: int) -> dict:
    """The measurement's validity key for a model config ``cfg`` (see :class:`TuneResult`)."""
    from ..kernels import build
    cpu = cpu_description()
    return {"cpu": cpu["model"], "cpu_flags_sha1": cpu["flags_sha1"], "isa": cpu["isa"], "torch": torch.__version__,
            "threads": threads, "layers": cfg.num_hidden_layers, "shapes": projection_shapes(cfg),
            "kernels": build.requested_isa()}


def _key_digest(key: dict) -> str:
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(key: dict) -> Path:
    from ..paths import cache_root
    return cache_root() / "tune" / f"{_key_digest(key)}.json"


def _get(layer: nn.Module, dotted: str) -> nn.Module:
    a, b = dotted.split(".")
    return getattr(getattr(layer, a), b)


def sample_layers(num_layers: int, shapes=None, n: int = SAMPLE_LAYERS) -> list[int]:
    """Indices of the layers :func:`measure` times: ``n`` evenly spaced ones, the first and last included (all
    when ``num_layers <= n``), ``n`` lowered to what :data:`SAMPLE_BYTES` holds of layers of ``shapes``
    (:func:`projection_shapes`, the LM head last; ``None``: no bound), at least one (then the middle layer)."""
    if shapes is not None:
        layer_bytes = 4 * sum(o * i for o, i in list(shapes)[:-1])
        n = max(1, min(n, SAMPLE_BYTES // max(1, layer_bytes)))
    if num_layers <= n:
        return list(range(num_layers))
    if n == 1:
        return [num_layers // 2]
    return sorted({round(i * (num_layers - 1) / (n - 1)) for i in range(n)})


def _projections(decoder) -> list[nn.Module]:
    return [_get(layer, p) for layer in decoder.layers for p in PROJECTIONS] + [decoder.lm_head_proj]


def invariance_sample(decoder) -> list[nn.Module]:
    """The projections batch invariance is checked on: the first layer's and the LM head's (every layer runs
    the same kernels on the same shapes)."""
    mods = _projections(decoder)
    return mods[:len(PROJECTIONS)] + mods[-1:]


def _packed(modules: list[nn.Module], fmt: str, heads: dict | None = None) -> list[nn.Module]:
    """``modules`` (projections, the LM head last) packed in ``fmt``; ``heads`` (head format -> packed head) shares
    one packed LM head between formats whose heads are alike (``int4``'s is ``int8``)."""
    if fmt == "fp32":
        return modules
    heads = {} if heads is None else heads
    out = [pack_linear(fmt, m.weight, m.bias) for m in modules[:-1]]
    head, hfmt = modules[-1], head_format(fmt)
    if hfmt not in heads:
        heads[hfmt] = pack_linear(hfmt, head.weight, head.bias)
    return out + [heads[hfmt]]


def _pass(modules: list[nn.Module], inputs: dict[int, torch.Tensor]) -> None:
    for m in modules:
        m(inputs[m.in_features])


def set_routes(modules, routes: Routes) -> None:
    """Have the float32 projections among ``modules`` (:class:`DecodeLinear`) take ``routes``."""
    for m in modules:
        if isinstance(m, DecodeLinear):
            m.routes = routes


def _time_pass(modules, inputs, routes: Routes | None, scale: float = 1.0, head_scale: float = 1.0) -> float:
    """Seconds of a pass over ``modules`` (the LM head last) with the layers' part multiplied by ``scale``
    (layers of the model per layer in ``modules``) and the head's by ``head_scale`` (the head's rows per row of
    its sample, :func:`head_sample`): the whole model's pass estimated from a sample of its layers."""
    if routes is not None:
        set_routes(modules, routes)
    t = time.perf_counter()
    _pass(modules[:-1], inputs)
    t_head = time.perf_counter()
    _pass(modules[-1:], inputs)
    end = time.perf_counter()
    return (t_head - t) * scale + (end - t_head) * head_scale


HEAD_SAMPLE_BYTES = 32 << 20
"""float32 bytes of the LM head's rows :func:`measure` packs and times (:func:`head_sample`): with the layers' sample
(:data:`SAMPLE_BYTES`) and every format's copies, more than a last-level cache holds between two passes of one
format, and a small part of a large vocabulary's head (Gemma 3's 262144 x 640 is 671 MB: every format's copy of it
held at once, plus a float32 temporary while each is packed, was ~1.1 GB of a first load's peak memory; 64 MiB
samples were ~130 MiB of SmolLM2's, BENCHMARKS.md BG)."""


def head_sample(head: nn.Module, max_bytes: int | None = None) -> tuple[nn.Module, float]:
    """``(sample, scale)``: a float32 projection of the first rows of ``head`` (``[O, I]``; a view, no copy) with at
    most ``max_bytes`` of weights (default :data:`HEAD_SAMPLE_BYTES`), and ``O / rows`` (the head's time is that of
    its rows: each is one dot product over the same input); ``(head, 1.0)`` when the whole head is that small."""
    max_bytes = HEAD_SAMPLE_BYTES if max_bytes is None else max_bytes
    rows = max(1, min(head.out_features, max_bytes // (4 * head.in_features)))
    if rows == head.out_features:
        return head, 1.0
    with torch.device("meta"):
        sample = DecodeLinear(head.in_features, rows, bias=head.bias is not None)
    sample.weight = nn.Parameter(head.weight.detach()[:rows], requires_grad=False)
    if head.bias is not None:
        sample.bias = nn.Parameter(head.bias.detach()[:rows], requires_grad=False)
    return sample, head.out_features / rows


def batch_invariant(modules: list[nn.Module], rows=ROWS, seed: int = 0) -> bool:
    """Whether every module gives each row of a multi-row input the bits it gives that row alone."""
    g = torch.Generator().manual_seed(seed)
    for m in modules:
        x = torch.randn(max(rows), m.in_features, generator=g)
        alone = torch.cat([m(x[i:i + 1]) for i in range(x.shape[0])])
        for r in rows:
            if r > 1 and not torch.equal(m(x[:r]), alone[:r]):
                return False
    return True


def invariant_rows(modules: list[nn.Module], limits=BATCH_ROWS, seed: int = 0) -> int:
    """The largest of ``limits`` (row counts) up to which ``modules`` stay batch-invariant.

    A limit counts when every module gives each row of a 2..``limit``-row product the bits it gives that row
    alone, checked at :data:`ROWS` and at every limit up to it (row counts in between are not checked).
    Returns 0 when that fails already at :data:`ROWS`, ``max(ROWS)`` when it fails at the first limit above.
    """
    steps = sorted({max(ROWS), *limits})
    counts = sorted({r for r in ROWS if r > 1} | set(steps))
    first_bad = None
    g = torch.Generator().manual_seed(seed)
    for m in modules:
        x = torch.randn(counts[-1], m.in_features, generator=g)
        alone = torch.cat([m(x[i:i + 1]) for i in range(x.shape[0])])
        for r in counts:
            if first_bad is not None and r >= first_bad:
                break
            if not torch.equal(m(x[:r]), alone[:r]):
                first_bad = r
                break
    return max((s for s in steps if first_bad is None or s < first_bad), default=0) if \
        first_bad is None or first_bad > max(ROWS) else 0


# Over 80 lines: steps 1-5 of the module docstring in order, sharing the packed variants and the inputs; each
# step is a few lines, named by a comment, and a split would pass the variants and timings between the parts.
def measure(decoder, threads: int | None = None, repeats: int = 5, log=None) -> TuneResult:
    """Measure the kernel table on this machine for ``decoder`` (float32 :class:`DecodeLinear` projections).

    Takes ~5-20 s for SmolLM2-135M on 2 cores (progress on ``log``, default stderr).  Only the layers of
    :func:`sample_layers` and the LM head's first rows (:func:`head_sample`) are packed (all formats held at once
    for them);
    the table's figures are whole-model passes estimated from them (step 3 of the module docstring).
    """
    log = log or sys.stderr
    t0 = time.perf_counter()
    threads = threads or torch.get_num_threads()
    before_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    if not all(isinstance(m, DecodeLinear) for m in _projections(decoder)):
        raise ValueError("measure() needs a float32 model (load it with weights='fp32')")
    layers = sample_layers(len(decoder.layers), projection_shapes(decoder.config))
    scale = len(decoder.layers) / len(layers)
    head, head_scale = head_sample(decoder.lm_head_proj)
    base = [_get(decoder.layers[i], p) for i in layers for p in PROJECTIONS] + [head]
    print(f"speculant: measuring kernels on this machine (once per machine; {len(layers)} of "
          f"{len(decoder.layers)} layers and the LM head, {threads} thread{'s' if threads != 1 else ''}) ...",
          file=log, flush=True)
    variants: list[tuple[str, str, list, Routes | None]] = []
    with torch.inference_mode():
        heads: dict = {}
        for fmt in FORMATS:
            if not format_available(fmt):       # our own kernel, where it cannot be built or run here
                continue
            mods = _packed(base, fmt, heads)
            if fmt == "fp32":
                for name, routes in FP32_ROUTES.items():
                    variants.append((fmt, name, mods, routes))
            else:
                variants.append((fmt, "-", mods, None))
        sample = {}     # invariance on the first layer and the LM head (same kernels as the rest)
        batch_rows = {}  # rows up to which that holds, for batches of sequences (speculant serve)
        per_layer = len(PROJECTIONS)
        for fmt, route, mods, routes in variants:
            if routes is not None:
                set_routes(mods, routes)
            sample[(fmt, route)] = batch_invariant(mods[:per_layer] + mods[-1:])
            batch_rows[(fmt, route)] = invariant_rows(mods[:per_layer] + mods[-1:])
        times = {(fmt, route): {r: [] for r in ROWS} for fmt, route, _, _ in variants}
        g = torch.Generator().manual_seed(1)
        widths = sorted({m.in_features for m in base})
        for rep in range(repeats + 1):
            for r in ROWS:
                inputs = {w: torch.randn(r, w, generator=g) for w in widths}
                order = variants[rep % len(variants):] + variants[:rep % len(variants)]
                for fmt, route, mods, routes in order:
                    if rep > 1 and not sample[(fmt, route)]:
                        continue                  # never a default: one timed pass ranks it (saves ~7 s)
                    ms = _time_pass(mods, inputs, routes, scale, head_scale) * 1e3
                    if rep:                                   # the first round warms up
                        times[(fmt, route)][r].append(ms)
        table = [{"format": fmt, "route": route,
                  "ms": {str(r): round(min(v), 3) for r, v in times[(fmt, route)].items()},
                  "batch_invariant": sample[(fmt, route)], "invariant_rows": batch_rows[(fmt, route)]}
                 for fmt, route, _, _ in variants]
        fp32_rows = [row for row in table if row["format"] == "fp32"]
        fp32_pick = min(fp32_rows, key=lambda row: (not row["batch_invariant"], row["ms"]["1"] + row["ms"]["5"]))
        candidates = [row for row in table if row["format"] != "fp32" or row is fp32_pick]
        best = choose_format(candidates)
        fmt_mods = next(m for f, rt, m, _ in variants if f == best["format"] and (f != "fp32" or rt == fp32_pick["route"]))
        evict = next(m for f, _, m, _ in variants if f != best["format"])   # another format's weights
        set_routes(fmt_mods, FP32_ROUTES[fp32_pick["route"]])
        thread_ms: dict[str, list[float]] = {}
        options = sorted({1, threads} | {n for n in (2, 4, 8) if n < threads})
        inputs = {w: torch.randn(1, w, generator=g) for w in widths}
        for rep in range(2):
            for n in options:                     # a block of passes per count: switching threads costs a pass
                torch.set_num_threads(n)
                _pass(fmt_mods, inputs)
                for _ in range(repeats):
                    _pass(evict, inputs)          # the sample is smaller than the model: evict it from the caches
                    thread_ms.setdefault(str(n), []).append(_time_pass(fmt_mods, inputs, None, scale, head_scale) * 1e3)
        thread_ms = {n: round(min(v), 3) for n, v in thread_ms.items()}
        best_threads = keep_default_threads(thread_ms, threads)
        torch.set_num_threads(best_threads)
        attention_us = measure_attention(decoder.config, repeats)
    torch.set_num_threads(before_threads)
    set_routes(base, DEFAULT_ROUTES)        # the model's own projections, as they were
    result = TuneResult(key=tune_key(decoder.config, threads), weights=best["format"], fp32_route=fp32_pick["route"],
                        threads=best_threads, table=table, thread_ms=thread_ms,
                        attention=min(attention_us, key=attention_us.get), attention_us=attention_us,
                        seconds=round(time.perf_counter() - t0, 2),
                        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    print(f"speculant: kernels measured in {result.seconds:.1f} s: weights={result.weights}, "
          f"fp32 route={result.fp32_route}, threads={result.threads}, attention={result.attention}", file=log,
          flush=True)
    return result


def measure_stored_weights(decoder, codes, candidates, fp32_route: str = "linear", repeats: int = 5) -> dict:
    """One-row pass over the projections of :func:`sample_layers` and the LM head's first rows (:func:`head_sample`;
    the whole model's pass estimated as in :func:`measure`) in each of ``candidates`` (``w4a8``: packed from
    ``codes``, the GGUF's own codes as stored, :func:`~speculant.models.gguf_codes.read_group_quantized`; ``fp32``:
    the float32 projections on ``fp32_route``), formats alternated, best of ``repeats`` after a warm-up round
    [milliseconds]; ``decoder`` has float32 projections.  Returns ``{fmt: ms}``.  A large vocabulary's float32 head
    is read in its sample's rows only (a tied model's is mapped from its spooled embedding: read whole, all of it
    would be resident at a first load's peak)."""
    layers = sample_layers(len(decoder.layers), projection_shapes(decoder.config))
    scale = len(decoder.layers) / len(layers)
    head, head_scale = head_sample(decoder.lm_head_proj)
    keys = [f"layers.{i}.{p}" for i in layers for p in PROJECTIONS] + ["lm_head_proj"]
    base = [_get(decoder.layers[i], p) for i in layers for p in PROJECTIONS] + [head]
    codes = dict(_sample_codes(codes, keys, head.out_features)) if codes is not None else {}
    variants = {f: base if f == "fp32" else
                [pack_linear(f if k != "lm_head_proj" else head_format(f), m.weight, m.bias, codes.get(k))
                 for k, m in zip(keys, base)] for f in candidates}
    g = torch.Generator().manual_seed(2)
    inputs = {w: torch.randn(1, w, generator=g) for w in sorted({m.in_features for m in base})}
    best = {f: float("inf") for f in candidates}
    set_routes(base, FP32_ROUTES[fp32_route])
    try:
        with torch.inference_mode():
            for rep in range(repeats + 1):
                for f in candidates[rep % len(candidates):] + candidates[:rep % len(candidates)]:
                    ms = _time_pass(variants[f], inputs, None, scale, head_scale) * 1e3
                    if rep:                                        # the first round warms up
                        best[f] = min(best[f], ms)
    finally:
        set_routes(base, DEFAULT_ROUTES)
    return {f: round(v, 3) for f, v in best.items()}


def _sample_codes(codes, keys: list[str], head_rows: int):
    """``(key, codes)`` of ``codes`` (a mapping of GGUF codes by module name) for ``keys``, the LM head's restricted
    to its first ``head_rows`` rows (:func:`head_sample`'s); keys without codes left out."""
    for k in keys:
        if k not in codes:
            continue
        if k != "lm_head_proj":
            yield k, codes[k]
        elif hasattr(codes, "first_rows"):                 # GGUFCodes: those rows decoded alone
            yield k, codes.first_rows(k, head_rows)
        else:
            yield k, codes[k].rows(torch.arange(head_rows))


DEFAULT_FORMATS = ("w4a8", "int8")
"""The weight format :func:`choose_format` keeps unless another wins by more than the noise: the first of these
that the table has and that is batch-invariant (``w4a8``: our kernels, which also run the fused step)."""
VERIFY_ROWS = "5"
"""Rows of the verification pass (a 4-token draft's block) at which a challenger to the default format must not
be slower by more than the noise (:func:`choose_format`)."""


def choose_format(table: list[dict], noise: float = CHOICE_NOISE) -> dict:
    """The row of the tuner's table (one per format: ``{"format", "ms": {rows: ms}, "batch_invariant"}``) whose
    format the model loads in.  Only batch-invariant formats are candidates (greedy speculation's exactness rests on
    it), then :data:`DEFAULT_FORMATS`' first one is kept unless another's one-row pass is faster by more than
    ``noise`` (a fraction) and its :data:`VERIFY_ROWS`-row pass is not slower by more than ``noise``: the choice
    changes both decoding and verification, and the logits, so a pass timed on a loaded machine (a parallel build,
    a test worker) must not flip it.  Without a default, the fastest one-row pass (batch-invariant first)."""
    candidates = [row for row in table if row["batch_invariant"]] or table
    default = next((row for f in DEFAULT_FORMATS for row in candidates if row["format"] == f), None)
    fastest = min(candidates, key=lambda row: row["ms"]["1"])
    if default is None:
        return fastest
    best = min((row for row in candidates if row["ms"]["1"] < default["ms"]["1"] * (1 - noise)
                and row["ms"].get(VERIFY_ROWS, 0.0) <= default["ms"].get(VERIFY_ROWS, 0.0) * (1 + noise)),
               key=lambda row: row["ms"]["1"], default=None)
    return best or default


def keep_default_format(ms: dict, default: str, noise: float = CHOICE_NOISE) -> str:
    """The format of ``ms`` (``{fmt: ms}``) to load in: ``default`` unless another is faster by more than ``noise``
    (a fraction of ``default``'s time; then the fastest)."""
    fastest = min(ms, key=ms.get)
    return fastest if ms[fastest] < ms[default] * (1 - noise) else default


def measure_attention(cfg, repeats: int = 5) -> dict[str, float]:
    """A one-token step's attention over all ``cfg.num_hidden_layers`` layers, summed over
    :data:`ATTENTION_CONTEXTS` cached tokens, best of ``repeats`` [microseconds], per KV-cache dtype that runs here:
    ``float32`` (our row-by-row kernel, where it builds) and ``float64`` (SDPA)."""
    from ..kernels import attention as attention_kernel
    from .steps import cache_attention
    h, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dtypes = [torch.float64] + ([torch.float32] if attention_kernel.supports(dh) else [])
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, h, 1, dh, generator=g)
    out = {}
    for dtype in dtypes:
        total = 0.0
        for ctx in ATTENTION_CONTEXTS:
            keys, values = (torch.randn(1, hkv, ctx, dh, generator=g).to(dtype) for _ in range(2))
            mask = torch.ones(1, ctx, dtype=torch.bool)
            cache_attention(q, keys, values, mask)
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                for _ in range(cfg.num_hidden_layers):
                    cache_attention(q, keys, values, mask)
                best = min(best, time.perf_counter() - t)
            total += best
        out[str(dtype).replace("torch.", "")] = round(total * 1e6, 1)
    return out


def measure_prompt_route(executor, lengths=PROMPT_LENGTHS, log=None) -> tuple[int, dict]:
    """Time a prompt's forward through all layers both ways on the model itself: the fused step over a causal mask
    (:mod:`speculant.kernels.decode_step`: no per-op overhead, our row-by-row attention, quadratic in the length)
    and the torch layer step (:func:`~speculant.runtime.steps.prefill_layer_step`: SDPA's causal flash attention).
    Random tokens, each length below the context; best of 2 runs (1 above 256 tokens) after a warm-up.

    Returns:
        ``(limit, ms)``: the longest measured length up to which the torch layer step was not faster by more than
        :data:`CHOICE_NOISE` (0 when it was at the shortest: the fused step is the default) [tokens], and
        ``{length: {"fused": ms, "layer step": ms}}`` [milliseconds].
        ``(0, {})`` when the model has no fused step.
    """
    if executor.fused_layers() is None:
        return 0, {}
    lengths = [n for n in lengths if 1 < n < executor.config.context_length]
    if log is not None:
        print(f"speculant: timing the prompt routes ({', '.join(map(str, lengths))} tokens) ...", file=log, flush=True)
    g = torch.Generator().manual_seed(3)
    before, ms, limit, start = executor.fused_prompt_tokens, {}, 0, time.perf_counter()
    try:
        with torch.inference_mode():
            for i, n in enumerate(lengths):
                hidden = executor.embed(timing_tokens(executor, (1, n), g))
                positions, cache = torch.arange(n), executor.new_cache(n)
                best = {}
                for rep in range((3 if i == 0 else 2) if n <= 256 else 1):
                    for name, tokens in (("fused", n), ("layer step", 0)):
                        executor.fused_prompt_tokens = tokens
                        t = time.perf_counter()
                        executor.run_layers(hidden, 0, executor.num_layers, positions, None, cache, 0)
                        if rep or i:                                    # the first pass of all is a warm-up
                            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
                ms[str(n)] = {k: round(v * 1e3, 3) for k, v in best.items()}
                if ms[str(n)]["layer step"] < ms[str(n)]["fused"] * (1 - CHOICE_NOISE):   # the routes' bits differ: a
                    break                                        # choice within the noise would flip between tunes
                limit = n
    finally:
        executor.fused_prompt_tokens = before
    if log is not None:
        print(f"speculant: prompt routes timed in {time.perf_counter() - start:.1f} s: the fused step for prompts up "
              f"to {limit} tokens", file=log, flush=True)
    return limit, ms


def measure_weight_prefetch(executor, distances=WEIGHT_PREFETCH_BYTES, repeats: int = 15,
                            log=None) -> tuple[int, dict]:
    """Time the model's one-token forward (all layers, final norm, LM head; :data:`WEIGHT_PREFETCH_CONTEXT` cached
    tokens, fewer if the model's positions end sooner) with the weight-quantized products prefetching their codes each of ``distances`` bytes ahead
    (an executor of the same model per distance, :meth:`~speculant.runtime.executor.Executor.replace`): a one-token
    step reads every weight once from DRAM, and how far ahead to ask for it depends on the machine.  Distances
    alternated, best of ``repeats`` after a warm-up; ``executor`` is not changed.

    Returns:
        ``(best, ms)``: the fastest distance [bytes] and ``{bytes: ms}`` [milliseconds]; ``(0, {})`` when the model
        has no fused step.
    """
    if executor.fused_layers() is None:
        return 0, {}
    if log is not None:
        print(f"speculant: timing the weight prefetch ({', '.join(map(str, distances))} bytes ahead) ...", file=log,
              flush=True)
    g = torch.Generator().manual_seed(4)
    ctx, start = min(WEIGHT_PREFETCH_CONTEXT, executor.decoder.rope_cos.shape[0] - 1), time.perf_counter()   # a shorter model context: its longest
    best = {d: float("inf") for d in distances}
    runs = {d: executor.replace(weight_prefetch=d) for d in distances}
    with torch.inference_mode():
        cache = executor.new_cache(ctx + 1)
        fill_cache(executor, cache, ctx, g)
        ids = timing_tokens(executor, (1, 1), g)
        for rep in range(repeats + 1):
            for d in distances:
                t = time.perf_counter()
                runs[d](ids, None, None, cache, ctx)
                if rep:                                              # the first round is a warm-up
                    best[d] = min(best[d], time.perf_counter() - t)
    choice = min(distances, key=lambda d: best[d])
    if log is not None:
        print(f"speculant: weight prefetch timed in {time.perf_counter() - start:.1f} s: {choice} bytes ahead",
              file=log, flush=True)
    return choice, {str(d): round(v * 1e3, 3) for d, v in best.items()}


TIMING_VOCAB = 256
"""The timings draw their random token ids below this: what they measure does not depend on the ids, and ids from
the whole vocabulary would read a page of the token embedding per token (a later load maps it from the packed copy:
80 MiB of SmolLM2's 108 read for nothing)."""


def timing_tokens(model, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random token ids ``shape`` (int64) for a timing of ``model`` (anything with ``config.vocab_size``), drawn
    from ``g`` below :data:`TIMING_VOCAB`."""
    return torch.randint(min(model.config.vocab_size, TIMING_VOCAB), shape, generator=g)


FILL_CHUNK = 64
"""Tokens per forward of :func:`fill_cache`: a 512-token block's activations (a 1B model's ``[512, 8192]`` MLP
products among them) were ~130 MiB above a first load's memory (BENCHMARKS.md BG)."""


def fill_cache(model, cache, ctx: int, g: torch.Generator) -> None:
    """Write the keys/values of ``ctx`` random tokens (drawn from ``g``) to slots ``0 .. ctx-1`` of ``cache`` with
    ``model``'s layers (an :class:`~speculant.runtime.executor.Executor` or a decoder), :data:`FILL_CHUNK` tokens
    a forward, without the LM head: a prompt's ``[1, ctx, V]`` logits are 512 MiB for a 262k-token vocabulary at
    ``ctx`` = 512, and a timing only needs the cache."""
    ids = timing_tokens(model, (1, ctx), g)
    for start in range(0, ctx, FILL_CHUNK):
        end = min(ctx, start + FILL_CHUNK)
        model.run_layers(model.embed(ids[:, start:end]), 0, model.num_layers, torch.arange(start, end), None, cache,
                         start)


def measure_kv_cache(executor, repeats: int = 15, log=None) -> tuple[str, dict]:
    """Time the model's one-token forward (all layers, final norm, LM head) over :data:`KV_CACHE_CONTEXT` cached
    tokens (fewer if the model's positions end sooner) in a float32 and in a float16 KV cache (the same prompt's keys/values, rounded): a step reads the whole
    cache, and whether half its bytes pay for converting them back depends on the machine.  The two alternated,
    best of ``repeats`` after a warm-up; the executor's ``kv_dtype`` is restored.

    Returns:
        ``(choice, ms)``: ``"float16"`` unless float32 was faster by more than :data:`CHOICE_NOISE` (the default,
        as llama.cpp's, since the two give different logits), and ``{dtype: ms}`` [milliseconds];
        ``("float32", {})`` when the model has no fused step.
    """
    if executor.fused_layers() is None:
        return "float32", {}
    if log is not None:
        print("speculant: timing the KV cache in float32 and float16 ...", file=log, flush=True)
    g = torch.Generator().manual_seed(5)
    ctx = min(KV_CACHE_CONTEXT, executor.decoder.rope_cos.shape[0] - 1)      # a model with a shorter context: its longest
    before, start = executor.kv_dtype, time.perf_counter()
    best = {"float32": float("inf"), "float16": float("inf")}
    try:
        with torch.inference_mode():
            executor.kv_dtype = torch.float32
            caches = {"float32": executor.new_cache(ctx + 1)}
            fill_cache(executor, caches["float32"], ctx, g)
            executor.kv_dtype = torch.float16
            caches["float16"] = executor.new_cache(ctx + 1)
            caches["float16"].keys.copy_(caches["float32"].keys)          # what the prompt would store (rounded)
            caches["float16"].values.copy_(caches["float32"].values)
            ids = timing_tokens(executor, (1, 1), g)
            for rep in range(repeats + 1):
                for name, cache in caches.items():
                    t = time.perf_counter()
                    executor(ids, None, None, cache, ctx)
                    if rep:                                              # the first round is a warm-up
                        best[name] = min(best[name], time.perf_counter() - t)
    finally:
        executor.kv_dtype = before
    ms = {k: round(v * 1e3, 3) for k, v in best.items()}       # decided on the figures kept, so they explain it
    choice = "float32" if ms["float32"] < ms["float16"] * (1 - CHOICE_NOISE) else "float16"   # see CHOICE_NOISE
    if log is not None:
        print(f"speculant: KV cache timed in {time.perf_counter() - start:.1f} s: {choice}", file=log, flush=True)
    return choice, ms


def keep_default_threads(ms: dict, default: int, noise: float = CHOICE_NOISE) -> int:
    """The thread count to use from timings ``ms`` (``{threads: ms}``, keys str or int): ``default`` (all the cores
    torch uses by default) unless the fastest count beats it by more than ``noise`` (a fraction), or ``default`` was
    not timed."""
    times = {int(n): v for n, v in ms.items()}
    if not times:
        return default
    fastest = min(times, key=times.get)
    if default not in times or times[fastest] < times[default] * (1 - noise):
        return fastest
    return default


def measure_decode_threads(executor, options=None, steps: int = DECODE_THREAD_STEPS, rounds: int = 3,
                           log=None, seconds: float = DECODE_THREAD_SECONDS) -> tuple[int, dict]:
    """Time a decode loop of ``steps`` one-token steps of ``executor``'s fused step (all layers, final norm, LM head;
    a 64-token prompt first) with each thread count of ``options`` (default: 1, 2, 4, 8 below the count in force,
    and that count), counts alternated, best of ``rounds`` (of fewer once ``seconds`` of wall time have passed
    after a measured round); the count in force is restored.  A one-row pass timed
    in isolation misjudges threads (it picked 1 thread where 2 decoded 15-30 % faster end to end): the loop
    includes what a step does besides its products.

    Returns:
        ``(threads, ms)``: :func:`keep_default_threads` of the timings (the count in force unless another is faster
        by more than :data:`CHOICE_NOISE`) and ``{threads: ms per step}``; ``(count in force, {})`` when the model
        has no fused step.
    """
    before = torch.get_num_threads()
    if executor.fused_layers() is None:
        return before, {}
    options = sorted(set(options or ({before} | {n for n in (1, 2, 4, 8) if n < before})))
    if log is not None:
        print(f"speculant: timing decoding with {', '.join(map(str, options))} threads ...", file=log, flush=True)
    g = torch.Generator().manual_seed(6)
    ctx = min(64, executor.config.context_length - steps - 1)
    best = {n: float("inf") for n in options}
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            cache = executor.new_cache(ctx + steps + 1)
            fill_cache(executor, cache, ctx, g)
            ids = timing_tokens(executor, (1, 1), g)
            for r in range(rounds + 1):
                for n in options if r % 2 == 0 else options[::-1]:
                    torch.set_num_threads(n)
                    executor(ids, None, None, cache, ctx)                 # settle the thread pool
                    t = time.perf_counter()
                    for i in range(steps):
                        executor(ids, None, None, cache, ctx + i)
                    if r:                                                # the first round is a warm-up
                        best[n] = min(best[n], (time.perf_counter() - t) / steps)
                if r and time.perf_counter() - start > seconds:
                    break
    finally:
        torch.set_num_threads(before)
    ms = {str(n): round(v * 1e3, 3) for n, v in best.items()}
    choice = keep_default_threads(ms, before)
    if log is not None:
        print(f"speculant: decoding threads timed in {time.perf_counter() - start:.1f} s: {choice}", file=log,
              flush=True)
    return choice, ms


def complete_for_fused(result: TuneResult, executor, log=None, model: str | None = None) -> bool:
    """The measurements that need the model in its fused-step format, run on ``executor`` where ``result`` lacks
    them (once per machine and model: the first load in that format; ``speculant tune`` runs them again): the KV
    cache dtype, the weight prefetch distance, the prompt route, the decoding thread count and the T-row forward
    costs, each after the first with the KV cache dtype (and prefetch) measured before it, as decoding with
    ``--kv-cache auto`` runs (the tune is shared by every load of the model; an explicit ``--kv-cache`` does not
    change it).
    ``result`` is
    updated and saved; the executor is left as it was (the caller builds one from ``result``).  Returns whether
    anything was measured.  ``model``: the name or path the model was loaded by, for the advice of :func:`note_busy`."""
    from ..kernels import build
    if executor.fused_layers() is None:
        return False
    from ..heap import release_memory
    measured, start = False, occupancy.reading()
    # each measurement's caches and workspaces handed back before the next (glibc keeps freed heap otherwise, under
    # the next measurement's: BENCHMARKS.md BC)
    if result.kv_cache is None:
        result.kv_cache, result.kv_cache_ms = measure_kv_cache(executor, log=log)
        measured = True
        release_memory()

    def as_decoding(prefetch: bool = True):
        """``executor`` with the KV cache dtype (and ``prefetch``: the weight prefetch) decoding will use, where
        measured: each later measurement runs as decoding does (a float16 cache also holds half the bytes)."""
        choices = {"kv_dtype": getattr(torch, result.kv_cache)} if result.kv_cache else {}
        if prefetch and result.weight_prefetch is not None:
            choices["weight_prefetch"] = result.weight_prefetch
        return executor.replace(**choices) if choices else executor

    if result.weight_prefetch is None:
        result.weight_prefetch, result.weight_prefetch_ms = measure_weight_prefetch(as_decoding(prefetch=False),
                                                                                    log=log)
        measured = True
        release_memory()
    if result.fused_prompt_tokens is None:
        result.fused_prompt_tokens, result.prompt_ms = measure_prompt_route(as_decoding(), log=log)
        measured = True
        release_memory()
    if not result.decode_thread_ms:
        result.threads, result.decode_thread_ms = measure_decode_threads(as_decoding(), log=log)
        measured = True
        release_memory()
    if (not result.forward_ms or result.forward_version != FORWARD_VERSION
            or result.forward_kernels != build.kernel_signature()):
        before = torch.get_num_threads()
        torch.set_num_threads(result.threads or before)       # the T-row costs at the count decoding will use
        try:                                                  # ... and with the KV cache and prefetch it will use
            tables = measure_forward_rows(as_decoding(), log=log)
            result.forward_ms = tables.pop(str(min(map(int, tables))))
            result.forward_context_ms = tables
            result.forward_version = FORWARD_VERSION
            result.forward_kernels = build.kernel_signature()
            result.draft_ms = {}                              # relative to forward_ms: measured again when used
        finally:
            torch.set_num_threads(before)
        measured = True
    if measured:
        note_busy(result, occupancy.other_cores(start), log, model)
        save(result)
    return measured


def forward_contexts(context_length: int, rows=FORWARD_ROWS,
                     contexts: tuple[int, ...] = (FORWARD_CONTEXT, FORWARD_LONG_CONTEXT)) -> list[int]:
    """The cached tokens :func:`measure_forward_rows` times after: each of ``contexts`` lowered to where a model of
    ``context_length`` positions still has room for ``max(rows)`` new tokens (at least 1), one that then repeats
    or undercuts an earlier one left out [tokens]."""
    out: list[int] = []
    for c in contexts:
        c = max(1, min(c, context_length - max(rows)))
        if not out or c > out[-1]:
            out.append(c)
    return out


def measure_forward_rows(decoder, rows=FORWARD_ROWS, repeats: int = FORWARD_REPEATS, log=None,
                         seconds: float = FORWARD_SECONDS,
                         contexts: tuple[int, ...] = (FORWARD_CONTEXT, FORWARD_LONG_CONTEXT)) -> dict:
    """Time the model's forward (all layers, final norm, LM head over every row) over ``T`` new tokens after ``c``
    cached ones, for each ``T`` in ``rows`` and ``c`` in ``contexts`` (each lowered to where the model's positions
    end; one that then repeats a shorter one is left out): the T-row costs that cost-aware speculation decides from.
    Sweeps over the contexts and row counts (in turn forwards and backwards) after a warm-up one, ``repeats`` of
    them, fewer once ``seconds`` are spent (at least 5 or ``repeats``).  A decision compares costs, so each figure is
    kept as a ratio to ``T = 1`` after the first context taken within each sweep, the median over the sweeps (a shared
    VM's memory bandwidth drifts during the measurement: the least time of each ``T`` taken apart put ``T = 2``
    below ``T = 1`` in a kept table, where paired ratios gave 1.03-1.09, BENCHMARKS.md BB), times the least such
    ``T = 1`` time (the figure least disturbed by other work); ~4 s for SmolLM2-135M on 2 cores.  Random tokens: the
    cost does not depend on them.

    Returns:
        ``{c: {T: ms}}`` with string keys (as JSON stores them) [tokens: milliseconds].
    """
    start = time.perf_counter()
    ctxs = forward_contexts(decoder.config.context_length, rows, contexts)
    g = torch.Generator().manual_seed(5)
    order = [(c, r) for c in ctxs for r in rows]
    times: dict[tuple[int, int], list[float]] = {k: [] for k in order}
    with torch.inference_mode():
        cache = decoder.new_cache(ctxs[-1] + max(rows))
        fill_cache(decoder, cache, ctxs[-1], g)
        ids = {r: timing_tokens(decoder, (1, r), g) for r in rows}
        for rep in range(repeats + 1):
            for c, r in (order if rep % 2 else order[::-1]):
                t = time.perf_counter()
                decoder(ids[r], None, None, cache, c)
                if rep:                                                  # the first sweep is a warm-up
                    times[c, r].append(time.perf_counter() - t)
            if rep >= min(5, repeats) and time.perf_counter() - start > seconds:
                break
    one = times[order[0]]
    tables = {c: {r: min(one) * statistics.median(t / t1 for t, t1 in zip(times[c, r], one)) for r in rows}
              for c in ctxs}
    if log is not None:
        print(f"speculant: T-row forwards timed in {time.perf_counter() - start:.1f} s ("
              + "; ".join(f"{c} cached tokens: T = {rows[0]} {ms[rows[0]] * 1e3:.2f} ms, T = {rows[-1]} "
                          f"{ms[rows[-1]] * 1e3:.2f} ms" for c, ms in tables.items()) + ")", file=log, flush=True)
    return {str(c): {str(r): round(v * 1e3, 4) for r, v in ms.items()} for c, ms in tables.items()}


def _drafter_packed(fmt: str, projections):
    if fmt == "fp32":          # the float32 route the drafters' float projections take (DecodeLinear)
        return [lambda x, w=w, b=b: fp32_linear.small_batch_linear(x, w, b) for w, b in projections]
    return [pack_linear(fmt, w, b) for w, b in projections]


def measure_drafter_weights(projections: list[tuple[torch.Tensor, torch.Tensor | None]], evict, candidates=None,
                            repeats: int = 7) -> dict[str, float]:
    """One-row pass over ``projections`` (``(weight [O, I] float32, bias [O] or None)``) packed in each of
    ``candidates`` (default: :data:`DRAFTER_FORMATS` that run here), each timed pass after ``evict()`` (something
    that streams the target's weights, as a decoding step does), formats alternated, best of ``repeats``
    after a warm-up [milliseconds]: the tune step of a drafter's own projections
    (:func:`speculant.drafters.weights.tune_drafter`)."""
    from ..kernels import qgemm
    candidates = candidates or [f for f in DRAFTER_FORMATS if f != "w8a8" or qgemm.available()]
    mods = {f: _drafter_packed(f, projections) for f in candidates}
    g = torch.Generator().manual_seed(5)
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], generator=g) for w, _ in projections}
    best = {f: float("inf") for f in candidates}
    with torch.inference_mode():
        for rep in range(repeats + 1):
            for f in candidates:
                evict()
                t = time.perf_counter()
                for (w, _), m in zip(projections, mods[f]):
                    m(inputs[w.shape[1]])
                if rep:
                    best[f] = min(best[f], time.perf_counter() - t)
    return {f: round(v * 1e3, 3) for f, v in best.items()}


def attention_dtype(result: TuneResult) -> torch.dtype:
    """The KV cache's dtype ``result`` chose (:attr:`TuneResult.attention`)."""
    return torch.float32 if result.attention == "float32" else torch.float64


def save(result: TuneResult) -> Path:
    """Write ``result`` atomically to its cache path; returns the path."""
    path = cache_path(result.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(result), indent=1))
    tmp.replace(path)
    return path


def load(key: dict) -> TuneResult | None:
    """The cached result for ``key``, or ``None`` (absent, unreadable, or another schema/key)."""
    path = cache_path(key)
    try:
        data = json.loads(path.read_text())
        result = TuneResult(**data)
    except (OSError, ValueError, TypeError):
        return None
    if result.schema != SCHEMA or result.key != json.loads(json.dumps(key)):
        return None
    return result


def load_or_measure(decoder, threads: int | None = None, log=None, force: bool = False,
                    model: str | None = None) -> TuneResult:
    """The cached :class:`TuneResult` for this machine and model, measuring (and caching) it when absent or ``force``
    (with the work other processes did meanwhile, :func:`note_busy`; ``model``: the name or path it was loaded by)."""
    threads = threads or torch.get_num_threads()
    key = tune_key(decoder.config, threads)
    result = None if force else load(key)
    if result is None:
        start = occupancy.reading()
        result = measure(decoder, threads, log=log)
        note_busy(result, occupancy.other_cores(start), log, model)
        save(result)
    return result


def note_busy(result: TuneResult, others: float | None, log=None, model: str | None = None) -> None:
    """Record in ``result.busy_cores`` that other processes did ``others`` cores' worth of work while it was measured
    (:func:`speculant.runtime.occupancy.other_cores`; ``None``: unknown) and, from
    :data:`~speculant.runtime.occupancy.BUSY_CORE` on, say on ``log`` (else as a warning) that the choices may not
    hold on a quiet machine and how to measure again (``speculant tune --model`` with ``model``, the name or path the
    model was loaded by; ``None``: a placeholder): timings taken while a core is shared are noise (a first load
    beside another process once kept int8 and 1 thread, ~5x slower than the w4a8 a quiet re-tune chose)."""
    if others is None:
        return
    result.busy_cores = round(max(result.busy_cores, others), 2)
    if others >= occupancy.BUSY_CORE:
        msg = (f"speculant: other processes kept {others:.1f} of {os.cpu_count()} cores busy while this machine was "
               f"measured: its choices (weights {result.weights}, {result.threads} thread"
               f"{'s' if result.threads != 1 else ''}) may not hold when it is "
               f"quiet; run `speculant tune --model {shlex.quote(model) if model else 'MODEL'}` then")
        if log is not None:
            print(msg, file=log, flush=True)
        else:
            warnings.warn(msg, stacklevel=3)


def _kernel_variant(key: dict) -> str:
    """The C kernels' variant for a table's header: the one loaded, else the one the key asked for."""
    from ..kernels import build
    return build.describe() or key.get("kernels", "auto")


def format_table(result: TuneResult) -> str:
    """The measured table as Markdown (milliseconds per pass over all projections, estimated from the sampled
    layers and the LM head; step cost relative to 1 row)."""
    k = result.key
    layers = sample_layers(k["layers"], k.get("shapes"))
    covers = ("all layers timed" if len(layers) == k["layers"] else
              f"layers {', '.join(map(str, layers))} timed, scaled by {k['layers']}/{len(layers)}")
    lines = [f"CPU: {k['cpu']} ({', '.join(k['isa']) or 'no AVX2/AVX-512 flags'}), torch {k['torch']}, "
             f"{k['threads']} threads, kernels {_kernel_variant(k)}; measured {result.measured_at} in "
             f"{result.seconds} s" + (f" while other processes kept {result.busy_cores:.1f} cores busy (its "
                                      "choices may not hold on a quiet machine)"
                                      if result.busy_cores >= occupancy.BUSY_CORE else ""), "",
             f"[ms]: one pass over the projections of all {k['layers']} layers and the LM head ({covers}; "
             "the LM head timed in full)", "",
             "| format | route | batch-invariant | invariant up to [rows] | "
             + " | ".join(f"{r} row{'s' if r > 1 else ''} [ms]" for r in ROWS)
             + " | 5 rows / 1 row |", "|" + "---|" * (5 + len(ROWS))]
    for row in result.table:
        ms = row["ms"]
        chosen = (row["format"] == result.weights and (row["format"] != "fp32" or row["route"] == result.fp32_route))
        name = f"**{row['format']}**" if chosen else row["format"]
        lines.append(f"| {name} | {row['route']} | {'yes' if row['batch_invariant'] else 'no'} | "
                     f"{row.get('invariant_rows', '?')} | "
                     + " | ".join(f"{ms[str(r)]:.2f}" for r in ROWS) + f" | {ms['5'] / ms['1']:.2f} |")
    lines += ["", f"default weights: **{result.weights}**; float32 route: {result.fp32_route}; threads: "
              f"{result.threads} (one-row pass: " + ", ".join(f"{n} thread{'s' if int(n) != 1 else ''} {v:.2f} ms"
                                                 for n, v in result.thread_ms.items())
              + (("; decode loop of the fused step: " + ", ".join(f"{n} {v:.2f} ms/step"
                                                                for n, v in result.decode_thread_ms.items()))
                 if result.decode_thread_ms else "") + ")"]
    if result.attention_us:
        lines += [f"attention (KV cache): **{result.attention}** (a one-token step over {' and '.join(map(str, ATTENTION_CONTEXTS))} "
                  "cached tokens, all layers: " + ", ".join(f"{k} {v:.0f} us" for k, v in result.attention_us.items())
                  + ")"]
    if result.prompt_ms:
        lines += [f"prompts: fused step up to **{result.fused_prompt_tokens}** tokens, the torch layer step above ("
                  + ", ".join(f"{n} tokens: fused {v['fused']:.0f} ms, layer step {v['layer step']:.0f} ms"
                              for n, v in result.prompt_ms.items()) + ")"]
    for key, d in result.drafter_weights.items():
        lines += [f"drafter {key.split(':')[0]}: **{d['weights']}** (one-row pass over its projections: "
                  + ", ".join(f"{f} {v:.2f} ms" for f, v in d["ms"].items()) + ")"]
    if result.weight_prefetch_ms:
        lines += [f"weight prefetch: **{result.weight_prefetch}** bytes ahead (a one-token forward, "
                  f"{WEIGHT_PREFETCH_CONTEXT} cached tokens: "
                  + ", ".join(f"{'none' if d == '0' else d + ' B'} {v:.2f} ms" for d, v in result.weight_prefetch_ms.items())
                  + ")"]
    if result.forward_ms:
        one = result.forward_ms["1"]
        lines += [f"T-row forward ({FORWARD_CONTEXT} cached tokens; ms, and in one-token steps): "
                  + ", ".join(f"{t}: {v:.2f} ({v / one:.2f})" for t, v in result.forward_ms.items())]
        lines += [f"T-row forward ({c} cached tokens; ms, and in one-token steps after {FORWARD_CONTEXT}): "
                  + ", ".join(f"{t}: {v:.2f} ({v / one:.2f})" for t, v in ms.items())
                  for c, ms in result.forward_context_ms.items()]
    if result.kv_cache_ms:
        lines += [f"KV cache in the fused-step format (--kv-cache auto): **{result.kv_cache}** (a one-token forward, "
                  f"{KV_CACHE_CONTEXT} cached tokens: "
                  + ", ".join(f"{d} {v:.2f} ms" for d, v in result.kv_cache_ms.items()) + ")"]
    return "\n".join(lines)
