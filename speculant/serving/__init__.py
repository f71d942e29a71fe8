"""``speculant serve``: an OpenAI-compatible HTTP server that decodes requests in speculative batches.

* :mod:`.scheduler` - the compute thread: continuous batching over :class:`~speculant.engine.batch.BatchedGenerator`.
* :mod:`.app` - the FastAPI routes (completions, chat completions, models, health, metrics).
* :mod:`.protocol` - request bodies and OpenAI's response / error JSON.
* :mod:`.metrics` - Prometheus counters and histograms (vLLM's names).
* :mod:`.server` - the CLI command: model loading, the exact batch limit, uvicorn with a SIGTERM drain.
"""
