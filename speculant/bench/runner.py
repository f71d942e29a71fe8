"""Run a benchmark: every prompt x every method, interleaved, repeated, written as it goes.

Timing protocol:
    * one untimed warm-up generation per method (first prompt, 4 tokens) before anything is timed;
    * for each prompt, each repeat runs every method once, the method order rotated per prompt,
      so slow drifts of a shared machine hit all methods alike;
    * a record keeps every repeat's wall time [s] of the whole generation call (prefill
      included); ``tokens_per_second`` uses the median time, ``tokens_per_second_best`` the minimum.
    * ``results.json`` is rewritten after every prompt, so an interruption (Ctrl-C) leaves the
      finished prompts on disk (``meta.interrupted`` is then true).
Greedy outputs are compared token by token with our ``ar`` and with ``hf-ar`` (when run);
mismatches are counted in the summary, never dropped.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..drafters.draft_model import DraftModelDrafter
from ..drafters.eagle import DraftHeadDrafter
from ..drafters.early_exit import EarlyExitDrafter
from ..engine.generator import GenerationConfig, SpeculativeGenerator
from ..engine.methods import build_generator, default_exit_layer
from ..engine.stats import GenerationStats
from ..errors import SpeculantError, check_range
from ..models.loading import LoadedModel, is_gguf_source
from ..runtime.executor import executor_of
from ..sampling.processors import SamplingConfig, is_greedy
from .datasets import Prompt
from .mbsu import draft_cost_ratio, exit_head_bytes
from .specs import BenchMethod

SCHEMA_VERSION = 1
WARMUP_TOKENS = 4


@dataclass
class BenchConfig:
    """Settings of a benchmark run (``temperature`` 0 = greedy; ``repeats`` timed runs per prompt and method;
    ``ignore_eos``: every method generates ``max_new_tokens`` tokens, EOS included, so that sampled runs, whose
    outputs end at different lengths, are timed on equal work, prefill amortized alike)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    repeats: int = 1
    seed: int = 0
    warmup: bool = True
    ignore_eos: bool = False

    def __post_init__(self):
        check_range("max_new_tokens", self.max_new_tokens, 1)
        check_range("repeats", self.repeats, 1)
        check_range("temperature", self.temperature, 0.0)


class _Ours:
    def __init__(self, model: LoadedModel, method: BenchMethod):
        self.gen: SpeculativeGenerator = build_generator(model, method.spec)
        d = self.gen.drafter
        self.drafter = type(d).__name__ + (" + exit adapter" if getattr(d, "exit_head", None) is not None else "")
        if isinstance(d, DraftModelDrafter):
            self.cost_ratio = draft_cost_ratio(model.decoder, draft=d.model.decoder)
        elif isinstance(d, DraftHeadDrafter):
            self.cost_ratio = draft_cost_ratio(model.decoder, exit_layer=0, head_bytes=d.head.weight_bytes())
        elif isinstance(d, EarlyExitDrafter):
            self.cost_ratio = draft_cost_ratio(model.decoder, exit_layer=d.exit_layer,
                                               head_bytes=exit_head_bytes(d.exit_head))
        else:
            self.cost_ratio = 0.0

    def run(self, ids, cfg: BenchConfig, max_new: int):
        config = GenerationConfig(max_new_tokens=max_new, sampling=SamplingConfig(cfg.temperature, seed=cfg.seed),
                                  ignore_eos=cfg.ignore_eos)
        stats = GenerationStats()
        out: list[int] = []
        t0 = time.perf_counter()
        for block in self.gen.generate_blocks(list(ids), config, stats):
            out.extend(block)
        seconds = time.perf_counter() - t0
        d = stats.to_dict()
        d.pop("seconds"), d.pop("tokens_per_second"), d.pop("time_to_first_token_s")
        return out, seconds, d


class _HF:
    def __init__(self, model: LoadedModel, method: BenchMethod, hf_model):
        from .hf_baselines import HFMethod
        p = method.params
        e = p.get("E")
        if e is None and method.name == "hf-early-exit":
            e = default_exit_layer(model)              # the same default as our early-exit
        self.m = HFMethod(model, method.name, exit_layer=e, num_tokens=p.get("K"), max_ngram=p.get("N"),
                          hf_model=hf_model)
        self.cost_ratio = draft_cost_ratio(model.decoder, exit_layer=e) if e else 0.0
        self.drafter = method.name

    def run(self, ids, cfg: BenchConfig, max_new: int):
        r = self.m.run(list(ids), max_new, cfg.temperature, cfg.seed, cfg.ignore_eos)
        n = len(r.token_ids)
        stats = {"new_tokens": n, "target_forwards": r.target_forwards, "draft_forwards": r.draft_forwards,
                 "block_efficiency": n / r.target_forwards if r.target_forwards else 0.0}
        return r.token_ids, r.seconds, stats


class _LlamaCpp:
    def __init__(self, model: LoadedModel, method: BenchMethod, context: int):
        from .llamacpp import LlamaCppMethod
        p = method.params
        self.m = LlamaCppMethod(model, method.name, torch.get_num_threads(), context, p.get("K"), p.get("N"))
        self.cost_ratio = 0.0
        self.drafter = method.name

    def run(self, ids, cfg: BenchConfig, max_new: int):
        r = self.m.run(list(ids), max_new, cfg.temperature, cfg.seed, cfg.ignore_eos)
        return r.token_ids, r.seconds, {"new_tokens": r.new_tokens, "llamacpp_timings": r.timings}


def _model_for(model: LoadedModel, method: BenchMethod, loaded: dict) -> LoadedModel:
    """The run's model, or the same model in the runtime of the method's ``rt=`` key (loaded once per runtime)."""
    from .specs import runtime_of
    rt = runtime_of(method)
    own_kv = str(executor_of(model).kv_dtype).removeprefix("torch.")
    if rt is None or (rt[:2] == (model.weights, model.compiled) and rt[2] in (None, own_kv)):
        return model
    if rt not in loaded:
        from ..runtime.loader import load_model
        loaded[rt] = load_model(model.name if is_gguf_source(model.name) else str(model.path), weights=rt[0],
                                compile=rt[1], kv_cache=rt[2] or own_kv)
    return loaded[rt]


def machine_info() -> dict:
    """Where the numbers were measured (CPU, cores, torch threads, versions, 1-minute load average at start)."""
    import transformers
    from ..cpu import cpu_model
    cpu = cpu_model()
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def encode_prompts(model: LoadedModel, prompts: list[Prompt], chat: bool = True) -> list[list[int]]:
    """Chat-templated prompt ids (the tokenizer's template; raw text when it has none) shared by all methods."""
    gen = SpeculativeGenerator(model)
    return [gen.encode(p.text, chat) for p in prompts]


def check_equality(results: dict) -> None:
    """Set ``equal_to_ar`` / ``equal_to_hf_ar`` on every record (``None`` when not greedy or no reference).

    A method is compared with the ``ar`` of its own runtime (``rt=``; the run's when it has none): greedy
    exactness holds within a weight format, and two formats' outputs may differ.  Token ids are compared,
    except for llama.cpp's records, whose text is compared (it returns text).
    """
    from .specs import LLAMACPP_METHODS
    greedy = is_greedy(results["meta"]["temperature"])
    runtime = {m["label"]: (m.get("params") or {}).get("rt") for m in results["meta"]["methods"]}
    refs: dict[tuple, dict] = {}
    for r in results["records"]:
        name = r["method"].split(":")[0]
        if name in ("ar", "hf-ar"):
            refs[(r["prompt_id"], name, runtime.get(r["method"]))] = r
    for r in results["records"]:
        by_text = r["method"].split(":")[0] in LLAMACPP_METHODS
        for ref, key in (("ar", "equal_to_ar"), ("hf-ar", "equal_to_hf_ar")):
            want = refs.get((r["prompt_id"], ref, runtime.get(r["method"]) if ref == "ar" else None))
            if not greedy or want is None:
                r[key] = None
            elif by_text:
                r[key] = r.get("text") == want.get("text")
            else:
                r[key] = r["token_ids"] == want["token_ids"]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _runners(model: LoadedModel, methods: list[BenchMethod], ids: list[list[int]], cfg: BenchConfig) -> dict:
    """One runner per method label: ours (in the method's runtime), transformers' or llama.cpp's."""
    runners: dict[str, object] = {}
    models: dict[tuple[str, bool], LoadedModel] = {}
    hf_model = None
    for m in methods:
        if m.is_hf:
            if hf_model is None:
                from .hf_baselines import hf_model_for
                hf_model = hf_model_for(model)
            runners[m.label] = _HF(model, m, hf_model)
        elif m.is_llamacpp:
            runners[m.label] = _LlamaCpp(model, m, max(map(len, ids)) + cfg.max_new_tokens + 16)
        else:
            runners[m.label] = _Ours(_model_for(model, m, models), m)
    return runners


def _new_results(model: LoadedModel, prompts: list[Prompt], ids: list[list[int]], methods: list[BenchMethod],
                 runners: dict, cfg: BenchConfig, dataset: str) -> dict:
    """The results dict before any record (``meta`` and ``prompts`` filled in)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "meta": {"model": model.name, "dataset": dataset, "dtype": str(model.decoder.dtype).replace("torch.", ""),
                 "weights": model.weights, "compiled": model.compiled, "fused": model.fused,
                 "num_layers": model.decoder.num_layers, **asdict(cfg),
                 "methods": [{"label": m.label, "name": m.name, "params": m.params,
                              "spec": asdict(m.spec) if m.spec else None,
                              "drafter": runners[m.label].drafter,
                              "cost_ratio": runners[m.label].cost_ratio} for m in methods],
                 "machine": machine_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "finished": None, "interrupted": False},
        "prompts": [{"id": p.id, "category": p.category, "subcategory": p.subcategory, "prompt_tokens": len(i)}
                    for p, i in zip(prompts, ids)],
        "records": [],
        "summary": {},
    }


def _run_prompt(runners: dict, p: Prompt, pid: list[int], order: list[BenchMethod], cfg: BenchConfig,
                bar) -> dict[str, dict]:
    """``cfg.repeats`` rounds of every method of ``order`` on one prompt: a record per method label, with every
    repeat's wall time [s].  Each method's generator keeps its greedy acceptance history across prompts and repeats
    (as a server's generator does), so a record's rounds follow the generations that ran before it."""
    recs: dict[str, dict] = {}
    for _ in range(cfg.repeats):
        for m in order:
            bar.set_description(f"{p.category}/{p.id} {m.label}")
            toks, seconds, stats = runners[m.label].run(pid, cfg, cfg.max_new_tokens)
            r = recs.setdefault(m.label, {"prompt_id": p.id, "category": p.category, "method": m.label,
                                          "token_ids": toks, "seconds": [], "stats": stats})
            r["seconds"].append(seconds)
            if toks != r["token_ids"]:
                r["repeat_outputs_differ"] = True   # would be a determinism bug; kept visible
            bar.update(1)
    return recs


def _finish_record(model: LoadedModel, r: dict) -> dict:
    """Add the record's token count, text and speeds (median and best of its repeats)."""
    n = r["stats"].get("new_tokens", len(r["token_ids"]))
    r["new_tokens"] = n
    r["text"] = model.tokenizer.decode(r["token_ids"], skip_special_tokens=True)
    r["seconds_median"] = statistics.median(r["seconds"])
    r["seconds_min"] = min(r["seconds"])
    r["tokens_per_second"] = n / r["seconds_median"] if r["seconds_median"] > 0 else 0.0
    r["tokens_per_second_best"] = n / r["seconds_min"] if r["seconds_min"] > 0 else 0.0
    return r


def run_benchmark(model: LoadedModel, prompts: list[Prompt], methods: list[BenchMethod], cfg: BenchConfig,
                  out_dir: str | Path | None = None, dataset: str = "", progress: bool = True,
                  chat: bool = True, reports: bool = True) -> dict:
    """Benchmark ``methods`` on ``prompts`` with an already loaded ``model``.

    Args:
        out_dir: where ``results.json`` (after every prompt), ``report.md`` and the PNGs go; ``None`` writes nothing.
        chat: apply the tokenizer's chat template to the prompts.
        reports: also write ``report.md`` and the plots at the end (or on interruption).
    Returns:
        the results dict (schema: ``meta``, ``prompts``, ``records``, ``summary``; see :mod:`speculant.bench.report`).
    Raises:
        SpeculantError: no prompts or methods, or a method that cannot be built.
        KeyboardInterrupt: after writing the partial results.
    """
    from tqdm import tqdm
    from .report import summarize, write_report

    if not prompts or not methods:
        raise SpeculantError("nothing to run: need at least one prompt and one method")
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    ids = encode_prompts(model, prompts, chat)
    runners = _runners(model, methods, ids, cfg)
    results = _new_results(model, prompts, ids, methods, runners, cfg, dataset)
    torch.manual_seed(cfg.seed)
    bar = tqdm(total=len(prompts) * len(methods) * cfg.repeats, disable=not progress, unit="gen", dynamic_ncols=True)
    try:
        if cfg.warmup:
            for m in methods:
                bar.set_description(f"warm-up {m.label}")
                runners[m.label].run(ids[0], cfg, min(WARMUP_TOKENS, cfg.max_new_tokens))
        for pi, (p, pid) in enumerate(zip(prompts, ids)):
            order = methods[pi % len(methods):] + methods[:pi % len(methods)]
            recs = _run_prompt(runners, p, pid, order, cfg, bar)
            results["records"] += [_finish_record(model, recs[m.label]) for m in methods]
            check_equality(results)
            if out is not None:
                results["summary"] = summarize(results)
                _write_json(out / "results.json", results)
        results["meta"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    except KeyboardInterrupt:
        results["meta"]["interrupted"] = True
        raise
    finally:
        bar.close()
        for r in runners.values():
            if isinstance(r, (_HF, _LlamaCpp)):
                r.m.close()
        check_equality(results)
        results["summary"] = summarize(results)
        if out is not None:
            _write_json(out / "results.json", results)
            if reports and results["records"]:
                write_report(results, out)
    return results
