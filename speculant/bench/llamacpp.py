"""llama.cpp as a baseline: the same GGUF file, prompt ids, thread count and token budget, in the same run.

Runs llama.cpp in-process through the ``xllamacpp`` package (``pip install "speculant[llamacpp]"``: prebuilt
CPU wheels of llama.cpp with its server's request handlers; no HTTP socket is opened).  Methods:

* ``llamacpp``: plain decoding (greedy when the temperature is 0);
* ``llamacpp-lookup``: llama.cpp's own n-gram (prompt lookup) speculation, ``ngram_simple``
  (``N`` = n-gram size, ``K`` = longest draft).

Prompts are sent as our token ids (chat template already applied), so both engines start from the same
tokens.  The time is the wall time of the whole request (prefill included), like ours; llama.cpp's own
timings are kept too.  Its text is compared with ours (reported, not required: llama.cpp's kernels are
not batch-invariant, and its Q4_1 dot products round activations to 8 bits, so greedy texts part sooner
or later).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpeculantError
from ..models.loading import KNOWN_MODELS, LoadedModel, find_gguf

KINDS = ("llamacpp", "llamacpp-lookup")
INSTALL = 'pip install "xllamacpp==2026.10.11549"'


@dataclass
class LlamaCppRun:
    """One llama.cpp request: generated text, wall time [s], tokens generated, llama.cpp's own timings."""

    text: str
    seconds: float
    new_tokens: int
    timings: dict


def gguf_path_of(model: LoadedModel):
    """The GGUF file a known model was converted from.

    Raises:
        SpeculantError: the model is not a known GGUF model (llama.cpp needs the GGUF).
    """
    if model.name not in KNOWN_MODELS:
        raise SpeculantError(f"llamacpp baselines need a known GGUF model ({', '.join(KNOWN_MODELS)}); "
                             f"got {model.name!r}")
    return find_gguf(KNOWN_MODELS[model.name])


class LlamaCppMethod:
    """llama.cpp on ``model``'s GGUF file, in a worker process of its own.

    In one process with torch, llama.cpp's thread pool and torch's OpenMP threads spin against each other
    (measured: both engines ran at about half their separate speed), so llama.cpp runs in a spawned
    process that holds the model and answers one request at a time over a pipe.

    Args:
        kind: ``llamacpp`` or ``llamacpp-lookup``.
        threads: CPU threads for decoding and prefill.
        context: llama.cpp's context size [tokens].
        num_tokens: ``llamacpp-lookup``: longest draft (K); ``max_ngram``: its n-gram size (N).
    Raises:
        SpeculantError: unknown kind, a model without a GGUF, or ``xllamacpp`` not installed.
    """

    def __init__(self, model: LoadedModel, kind: str, threads: int, context: int = 2048,
                 num_tokens: int | None = None, max_ngram: int | None = None):
        import importlib.util
        import multiprocessing as mp

        if kind not in KINDS:
            raise SpeculantError(f"method={kind!r} is unknown; allowed: {', '.join(KINDS)}")
        if importlib.util.find_spec("xllamacpp") is None:
            raise SpeculantError(f"the {kind} baseline needs the xllamacpp package; install it with: {INSTALL}")
        from . import llamacpp_worker
        settings = {"model": str(gguf_path_of(model)), "context": context, "threads": threads,
                    "lookup": kind == "llamacpp-lookup", "num_tokens": num_tokens, "max_ngram": max_ngram}
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=llamacpp_worker.serve, args=(child, settings), daemon=True)
        self._proc.start()
        child.close()
        ready = self._conn.recv()
        if "error" in ready:
            self.close()
            raise SpeculantError(f"llama.cpp could not load {settings['model']}: {ready['error']}")
        self.kind = kind

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> LlamaCppRun:
        """Generate up to ``max_new_tokens`` after ``prompt_ids`` (stops at EOS like ours)."""
        request = {"prompt": list(prompt_ids), "max_tokens": max_new_tokens, "temperature": temperature,
                   "seed": seed, "cache_prompt": False}
        if temperature == 0:
            request["top_k"] = 1
        self._conn.send(request)
        out = self._conn.recv()
        if "error" in out:
            raise SpeculantError(f"llama.cpp refused the request: {out['error']}")
        return LlamaCppRun(out["text"], out["seconds"], out["new_tokens"], out["timings"])

    def close(self) -> None:
        """Stop the worker process."""
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
