"""The llama.cpp worker process of :class:`speculant.bench.llamacpp.LlamaCppMethod` (no torch work here).

Protocol over a ``multiprocessing`` pipe: it first sends ``{"ready": True}`` (or ``{"error": ...}``), then
answers each request dict with ``{"text", "seconds", "new_tokens", "timings"}`` (or ``{"error": ...}``)
until it receives ``None``.  The time is measured here, around the call, so pipe latency is not counted.
"""

from __future__ import annotations

import time


def serve(conn, settings: dict) -> None:
    try:
        import xllamacpp as xlc
        p = xlc.CommonParams()
        p.model.path = settings["model"]
        p.n_ctx = settings["context"]
        p.n_parallel = 1
        p.cpuparams.n_threads = settings["threads"]
        p.cpuparams_batch.n_threads = settings["threads"]
        p.verbosity = -1
        if settings["lookup"]:
            spec = p.speculative
            spec.types = [xlc.common_speculative_type.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE]
            if settings.get("num_tokens"):
                spec.ngram_simple.size_m = settings["num_tokens"]
            if settings.get("max_ngram"):
                spec.ngram_simple.size_n = settings["max_ngram"]
        server = xlc.Server(p)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    conn.send({"ready": True})
    while True:
        request = conn.recv()
        if request is None:
            return
        try:
            t0 = time.perf_counter()
            out = server.handle_completions(request)
            seconds = time.perf_counter() - t0
            if isinstance(out, str):
                import json
                out = json.loads(out)
            if "error" in out:
                conn.send({"error": str(out["error"])})
                continue
            conn.send({"text": out["choices"][0]["text"], "seconds": seconds,
                       "new_tokens": int(out["usage"]["completion_tokens"]), "timings": out.get("timings", {})})
        except Exception as e:  # noqa: BLE001
            conn.send({"error": f"{type(e).__name__}: {e}"})
