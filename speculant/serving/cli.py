"""The ``serve`` sub-command's arguments, apart from the server so that the command line is parsed without torch."""

from __future__ import annotations


def _serve(args) -> int:
    from .server import cmd_serve
    return cmd_serve(args)


def register(sub, add_model_args, add_method_args) -> None:
    """Add the ``serve`` sub-command to the CLI."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with batched speculative decoding")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="most sequences decoded together in one round (default: 8; lowered at startup if the "
                        "projections are not batch-invariant at that many rows on this machine)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="most requests waiting to start; more get HTTP 429 (default: 64)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM (default: 30)")
    p.add_argument("--prefix-cache-tokens", type=int, default=2048,
                   help="prompt tokens whose KV is kept to prefill later prompts from their longest shared prefix "
                        "(automatic prefix caching; 0 turns it off; default: 2048, ~94 MB for SmolLM2-135M)")
    p.add_argument("--speculation", default="goodput", metavar="{goodput,always}",
                   help="goodput (default): greedy requests draft in a round only when the expected tokens per "
                        "second beat a round without drafts at that batch size (measured at startup and while "
                        "serving; vLLM's disable-by-batch-size, decided by measurement); always: every round drafts")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default: warning)")
    add_method_args(p)
    p.set_defaults(func=_serve)
