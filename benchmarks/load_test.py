"""Bounded load test of `speculant serve` on loopback: concurrent streams, throughput, TTFT, inter-token latency.

For each server configuration (``--server "METHOD ARGS"``, e.g. ``"ar"`` or ``"prompt-lookup"``) it starts
``speculant serve`` on 127.0.0.1 (a free port), then for each concurrency level C (``--concurrency 1,4,8,16``)
runs C client streams at once; each stream sends ``--requests`` chat completions in a row (streamed,
``max_tokens`` fixed, greedy).  Per level it reports the aggregate throughput (completion tokens / wall time),
p50/p95 time to first token and inter-token latency (gaps between consecutive content chunks, client side;
a speculative round may deliver several tokens in one chunk), and failures.  Then it stops the server with
SIGTERM.

``--soak SECONDS`` instead keeps C streams busy for that long (bounded by ``--max-soak-requests`` too),
samples the server's resident memory (RSS, /proc) every ``--rss-every`` seconds, and reports failed and lost
requests and the RSS trend.

Every loop is bounded in count and in time; all traffic is to 127.0.0.1.  Example (SmolLM2, ~10 min on 2 cores)::

    python benchmarks/load_test.py --model smollm2-135m --server ar --server prompt-lookup \\
        --concurrency 1,4,8,16 --requests 3 --max-tokens 64 --out runs/load.json
    python benchmarks/load_test.py --model smollm2-135m --server prompt-lookup --soak 300 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in three sentences.",
    "List five fruits and one fact about each.",
    "Translate to French: 'The weather is nice today and we are going to the park.'",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "Give three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle for a ten-year-old.",
    "Write an email asking a colleague to review a document by Friday.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "Explain recursion with an example.",
    "What are the planets of the solar system, in order?",
    "Write a haiku about winter mornings.",
    "How does a bicycle stay upright?",
    "Name three famous painters and one painting by each.",
]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` [bytes] (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Server:
    """`speculant serve` in a subprocess on 127.0.0.1 (port chosen by the OS), stopped with SIGTERM."""

    def __init__(self, model: str, method_args: str, extra: list[str], log_path: Path, start_timeout: float):
        cmd = [sys.executable, "-m", "speculant.cli", "serve", "--model", model, "--served-model-name", model,
               "--host", "127.0.0.1", "--port", "0",
               "--method", *shlex.split(method_args), *extra]
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ,
                                                                                              PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + start_timeout
        self.url = None
        while self.url is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start; log:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.25)
            for line in log_path.read_text().splitlines():
                if line.startswith("speculant: ready on http://127.0.0.1:"):
                    self.url = line.split("ready on ", 1)[1].strip().removesuffix("/v1")

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      timeout: float) -> dict:
    """One streamed chat completion; returns timings [s] and counts, or an ``error``."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, tokens, done, finish = [], 0, False, None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return {"error": chunk["error"]["message"]}
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        if choice["delta"].get("content"):
                            times.append(time.perf_counter())
                        finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, TimeoutError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if not done:
        return {"error": "stream ended without [DONE]"}
    end = time.perf_counter()
    return {"ttft": (times[0] - t0) if times else float("nan"), "gaps": [b - a for a, b in zip(times, times[1:])],
            "tokens": tokens, "seconds": end - t0, "finish": finish}


async def run_level(url: str, model: str, streams: int, requests: int, max_tokens: int, deadline_s: float,
                    timeout: float, offset: int = 0) -> dict:
    """``streams`` concurrent clients, each sending ``requests`` requests in a row (or until the deadline)."""
    results: list[dict] = []
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=streams + 2, max_keepalive_connections=streams + 2)

    async def stream_worker(k: int, client: httpx.AsyncClient):
        for i in range(requests):
            if time.perf_counter() - start > deadline_s:
                break
            prompt = PROMPTS[(offset + k * requests + i) % len(PROMPTS)]
            results.append(await one_request(client, url, model, prompt, max_tokens, timeout))

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        await asyncio.gather(*[stream_worker(k, client) for k in range(streams)])
    wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    gaps = [g for r in ok for g in r["gaps"]]
    ttft = [r["ttft"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    return {"streams": streams, "requests": len(results), "failed": len(results) - len(ok),
            "errors": sorted({r["error"] for r in results if "error" in r})[:5], "completion_tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
            "ttft_p50_s": round(percentile(ttft, 0.5), 4), "ttft_p95_s": round(percentile(ttft, 0.95), 4),
            "itl_p50_s": round(percentile(gaps, 0.5), 4), "itl_p95_s": round(percentile(gaps, 0.95), 4),
            "tokens_per_chunk": round(tokens / max(1, len(gaps) + len(ok)), 2)}


async def soak(server: Server, model: str, streams: int, seconds: float, max_requests: int, max_tokens: int,
               timeout: float, rss_every: float) -> dict:
    """Keep ``streams`` streams busy for ``seconds`` (at most ``max_requests`` requests); sample the server's RSS."""
    start = time.perf_counter()
    samples: list[tuple[float, int]] = [(0.0, rss_bytes(server.proc.pid))]
    sent = [0]
    results: list[dict] = []

    async def sampler():
        while time.perf_counter() - start < seconds:
            await asyncio.sleep(rss_every)
            samples.append((round(time.perf_counter() - start, 1), rss_bytes(server.proc.pid)))

    async def worker(k: int, client: httpx.AsyncClient):
        while time.perf_counter() - start < seconds and sent[0] < max_requests:
            sent[0] += 1
            results.append(await one_request(client, server.url, model, PROMPTS[sent[0] % len(PROMPTS)],
                                             max_tokens, timeout))

    async with httpx.AsyncClient(timeout=timeout) as client:
        await asyncio.gather(sampler(), *[worker(k, client) for k in range(streams)])
    wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    rss = [b for _, b in samples]
    half = len(rss) // 2
    return {"streams": streams, "seconds": round(wall, 1), "sent": sent[0], "completed": len(ok),
            "failed": len(results) - len(ok), "lost": sent[0] - len(results),
            "errors": sorted({r["error"] for r in results if "error" in r})[:5],
            "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 2),
            "rss_mib_first": round(rss[0] / 2**20, 1), "rss_mib_last": round(rss[-1] / 2**20, 1),
            "rss_mib_max": round(max(rss) / 2**20, 1),
            "rss_mib_second_half_growth": round((rss[-1] - rss[half]) / 2**20, 1) if len(rss) > 2 else 0.0,
            "rss_samples": [(t, round(b / 2**20, 1)) for t, b in samples]}


def table(rows: list[dict]) -> str:
    lines = ["| server | streams | requests | failed | tokens/s | vs 1 stream | TTFT p50 [s] | TTFT p95 [s] | "
             "ITL p50 [s] | ITL p95 [s] | tokens/chunk |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        if r["streams"] == 1:
            base[r["server"]] = r["tokens_per_s"]
        ratio = r["tokens_per_s"] / base[r["server"]] if base.get(r["server"]) else float("nan")
        lines.append(f"| {r['server']} | {r['streams']} | {r['requests']} | {r['failed']} | {r['tokens_per_s']:.1f} | "
                     f"{ratio:.2f}x | {r['ttft_p50_s']:.3f} | {r['ttft_p95_s']:.3f} | {r['itl_p50_s']:.3f} | "
                     f"{r['itl_p95_s']:.3f} | {r['tokens_per_chunk']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--server", action="append", default=None,
                   help="method and its options for one server, e.g. 'ar' or 'early-exit --exit-layer 8' "
                        "(repeatable; default: ar and prompt-lookup)")
    p.add_argument("--serve-args", default="", help="more `speculant serve` options for every server, e.g. '--no-compile'")
    p.add_argument("--concurrency", default="1,4,8,16", help="concurrent streams per level (comma-separated)")
    p.add_argument("--requests", type=int, default=3, help="requests per stream per level (default 3)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--level-timeout", type=float, default=300, help="stop starting requests in a level after this [s]")
    p.add_argument("--request-timeout", type=float, default=300, help="one request's limit [s]")
    p.add_argument("--start-timeout", type=float, default=600, help="server start limit (first load compiles) [s]")
    p.add_argument("--soak", type=float, default=0, help="soak for this many seconds instead of the levels")
    p.add_argument("--max-soak-requests", type=int, default=5000)
    p.add_argument("--rss-every", type=float, default=5.0, help="RSS sampling period in the soak [s]")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    servers = args.server or ["ar", "prompt-lookup"]
    out_dir = Path(args.out).parent if args.out else Path(".")
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"model": args.model, "max_tokens": args.max_tokens, "levels": [], "soak": []}
    for method_args in servers:
        max_batch = ["--max-batch", str(max(levels))]
        log_path = out_dir / f"serve-{method_args.split()[0]}.log"
        server = Server(args.model, method_args, max_batch + shlex.split(args.serve_args), log_path, args.start_timeout)
        try:
            print(f"# {method_args}: server ready at {server.url}", file=sys.stderr, flush=True)
            asyncio.run(run_level(server.url, args.model, 1, 1, 8, 60, args.request_timeout))     # warm-up
            if args.soak:
                res = asyncio.run(soak(server, args.model, levels[-1], args.soak, args.max_soak_requests,
                                       args.max_tokens, args.request_timeout, args.rss_every))
                res["server"] = method_args
                report["soak"].append(res)
                print(json.dumps({k: v for k, v in res.items() if k != "rss_samples"}), flush=True)
            else:
                for i, c in enumerate(levels):
                    res = asyncio.run(run_level(server.url, args.model, c, args.requests, args.max_tokens,
                                                args.level_timeout, args.request_timeout, offset=i))
                    res["server"] = method_args
                    report["levels"].append(res)
                    print(json.dumps(res), flush=True)
        finally:
            code = server.stop()
            print(f"# {method_args}: server exited with code {code}", file=sys.stderr, flush=True)
    if report["levels"]:
        print(table(report["levels"]))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    failed = sum(r["failed"] for r in report["levels"]) + sum(r["failed"] + r["lost"] for r in report["soak"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
