"""Usage: python benchmarks/head_catchup_cost.py

Cost of the EAGLE head's catch-up over P prompt positions (one DraftHead.step over P rows) against the target's
prefill of P tokens and one target step, SmolLM2 with the shipped head, medians (BENCHMARKS.md AV).  Not a test."""
import time
import torch
import statistics
from speculant.drafters.draft_head import load_head
from speculant.runtime.loader import load_model
model = load_model("smollm2-135m")
head = load_head("default", model)
ex = model.executor
D = model.config.hidden_size
def med(fn, n=7):
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e3
with torch.inference_mode():
    for P in (64, 256, 900):
        model.decoder.ensure_rope(P + 8)
        ids = torch.randint(0, 49000, (1, P))
        cache = ex.new_cache(P + 8)
        tgt = med(lambda: ex(ids, None, None, cache, 0), 3)
        feats = torch.randn(P, D).to(head.dtype)
        toks = torch.randint(0, 49000, (P,))
        hc = head.new_cache(P + 8)
        h = med(lambda: head.step(feats, toks, torch.arange(P), None, hc, 0, 1))
        step = med(lambda: ex(ids[:, :1], None, None, cache, P - 1), 20)
        print(f"P={P}: target prefill {tgt:.1f} ms, head catch-up {h:.1f} ms ({h/step:.1f} target steps of {step:.2f} ms)")
