"""Load a model ready for fast decoding: tuned kernel routes, a weight format, batch-invariant attention, compiled steps.

:func:`load_model` is what the CLI and ``speculant.load_model`` use.  Training and evaluation code that
needs trainable float32 ``nn.Linear`` projections uses :func:`speculant.models.loading.read_checkpoint`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from ..errors import SpeculantError
from ..heap import mapped_allocations, release_memory
from ..models import loading
from ..models.config import ModelConfig
from ..models.loading import DEFAULT_MODEL, LoadedModel
from .compiled import enable_compile
from .executor import Executor
from . import occupancy, tune
from .occupancy import ThreadGovernor
from .formats import FORMATS, apply_weight_format, check_format, format_available
from .store import load_packed, map_saved, packed_path, save_packed

WEIGHT_CHOICES = ("auto",) + FORMATS
_KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "float64": torch.float64}
KV_CACHE_CHOICES = ("auto",) + tuple(_KV_DTYPES)
"""Values of :func:`load_model`'s ``kv_cache`` (``--kv-cache``)."""


def user_threads() -> int | None:
    """``$SPECULANT_NUM_THREADS`` as an int, or ``None`` when unset.

    Raises:
        SpeculantError: the variable is set but not a positive integer.
    """
    raw = os.environ.get("SPECULANT_NUM_THREADS")
    if raw is None or raw == "":
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise SpeculantError(f"SPECULANT_NUM_THREADS={raw!r} is invalid; allowed: a positive integer")
    return n


def _cached_source(name_or_path: str) -> tuple[ModelConfig | None, Path | None, Path | None]:
    """(config, directory of its packed copies, HF-format directory of its config and tokenizer) of a model whose
    packed copies may be cached: a GGUF model (known or by path) already converted (both directories its conversion's,
    :func:`~speculant.models.loading.converted_dir`) or an HF-format directory (packed copies in
    :func:`~speculant.models.loading.packed_cache_dir`); ``(None, None, None)`` otherwise or when unreadable (the
    full load then says what is wrong)."""
    try:
        if loading.is_gguf_source(name_or_path):
            packed_dir = source = loading.converted_dir(name_or_path)
        elif os.path.isdir(name_or_path):
            source = Path(name_or_path)
            packed_dir = loading.packed_cache_dir(source)
        else:
            return None, None, None
        return ModelConfig.from_hf_dict(json.loads((source / "config.json").read_text())), packed_dir, source
    except (OSError, ValueError, KeyError):          # SpeculantError is a ValueError
        return None, None, None


def _from_packed(name_or_path: str, cfg: ModelConfig, packed_dir: Path, source: Path, fmt: str) -> LoadedModel | None:
    """The model read from its packed copy in format ``fmt`` (:func:`~speculant.runtime.store.load_packed`), or
    ``None`` when there is none for ``cfg``.

    Raises:
        SpeculantError: the tokenizer files of ``source`` are unreadable.
    """
    path = packed_path(packed_dir, fmt)
    if not path.is_file():
        return None
    tokenizer = loading.tokenizer_of(source)    # first: its parse's transient memory while the process is small
    decoder = load_packed(path, cfg)
    if decoder is None:
        return None
    name = name_or_path if loading.is_gguf_source(name_or_path) else source.name
    return LoadedModel(name, decoder, tokenizer, source)


def _read_and_pack(name_or_path: str, dtype: torch.dtype, weights: str, result, threads: int, packed_dir, stored,
                   log, packed_only: bool = False):
    """The first load of a model in a format (no packed copy cached): read it, measure the kernels (when ``result``,
    the cached tune, is ``None``), pack it and save the packed copy in ``packed_dir`` (GGUF models and HF
    directories).  A float32 load in a format other than ``fp32`` streams (:func:`_stream_and_pack`).  ``stored``:
    the formats ``auto`` measures for a GGUF file (:func:`_stored_choice`), else ``None``; ``packed_only``: a load
    that only makes the packed copy (:func:`first_load_main`): a streamed model's tokenizer is read (its errors come
    first, and its copy as arrays is made) and dropped, and the model is not read where the format is ``fp32`` (no
    packed copy; the model is then ``None``).
    Returns ``(model, tune result or None, weight format)``."""
    index = None
    gguf = loading.is_gguf_source(name_or_path)
    if gguf and not (loading.converted_dir(name_or_path) / "gguf.json").is_file():
        print(f"speculant: reading the config and tokenizer of {loading.gguf_file_of(name_or_path).name} "
              "(first load only) ...", file=log, flush=True)
        index = _convert_overlapped(name_or_path, log)
    if dtype == torch.float32 and (weights != "fp32" or gguf):
        streamed = _stream_and_pack(name_or_path, weights, result, threads, index, stored, log, packed_only)
        if streamed is not None:
            model, result, fmt = streamed
            if model is not None and fmt != "fp32":
                _save(model, name_or_path, packed_dir, fmt)
            return model, result, fmt
    model = loading.read_checkpoint(name_or_path, dtype)
    if result is None and dtype == torch.float32:
        result = tune.load_or_measure(model.decoder, threads, log=log, model=name_or_path)
        release_memory(mkl=True)    # the tuner's packed copies and MKL's buffers, before the model is packed
    fmt = "fp32" if result is None else (result.weights if weights == "auto" else check_format(weights))
    if stored and result is not None:
        fmt = _stored_choice(name_or_path, model, result, stored, index, log)
    if fmt != "fp32":
        codes = _gguf_codes(name_or_path, model.config, index) if fmt in ("int4", "w4a8") else None
        apply_weight_format(model.decoder, fmt, codes)
        del codes
        release_memory()            # the float32 projections and the GGUF's unpacked codes
        _save(model, name_or_path, packed_dir, fmt)
    return model, result, fmt


def _save(model: LoadedModel, name_or_path: str, packed_dir, fmt: str) -> None:
    """Save ``model``'s packed copy in ``packed_dir`` (``None``: a GGUF model's conversion directory, an HF
    directory's :func:`~speculant.models.loading.packed_cache_dir`)."""
    if packed_dir is None:
        packed_dir = model.path if loading.is_gguf_source(name_or_path) else loading.packed_cache_dir(model.path)
    Path(packed_dir).mkdir(parents=True, exist_ok=True)
    path = save_packed(model.decoder, packed_path(packed_dir, fmt))
    try:
        map_saved(model.decoder, path)      # the float32 embedding from the copy, as later loads hold it
    except (OSError, ValueError):
        pass                                # kept in memory: a copy that cannot be read back changes no result


def _stream_and_pack(name_or_path: str, weights: str, result, threads: int, index, stored, log,
                     packed_only: bool = False):
    """Read the model layer by layer (:mod:`speculant.models.streaming`), each layer packed as soon as it is read:
    the whole model is never in float32 in memory (only its token embedding, final norm and LM head, and for the
    tuner, when ``result`` is ``None``, the float32 layers of :func:`tune.sample_layers`).  Returns ``(model, tune
    result, weight format)`` (``model`` ``None`` for ``packed_only`` where the format is ``fp32``), or ``None`` where
    the checkpoint cannot be streamed (a bad directory, a tied model's saved LM head copy, stored RoPE frequencies:
    :func:`~speculant.models.streaming.streamable`)."""
    from ..models import streaming
    from .formats import layer_codes, pack_head, pack_projections

    if loading.is_gguf_source(name_or_path):     # straight from the file: no float32 copy of the model anywhere
        from ..models.gguf_tensors import open_gguf
        source = loading.converted_dir(name_or_path)
        cfg = streaming.config_of(source)
        path = loading.gguf_file_of(name_or_path)
        tensors = open_gguf(path, cfg)
        loading.check_gguf_weights(tensors, cfg, path)
        opened = streaming.open_streamed(source, cfg, tensors, spool=source)
    else:
        source = Path(name_or_path)
        try:
            cfg = streaming.config_of(source) if os.path.isdir(source) else None
            opened = streaming.open_streamed(source, cfg) if cfg is not None else None
        except SpeculantError:
            opened = None                     # the whole read says what is wrong
    if opened is None:
        return None
    tokenizer = loading.tokenizer_of(source)    # first: its parse's transient memory while the process is small
    if packed_only:                             # read for its errors and its copy as arrays (the loading process's)
        tokenizer = None
        release_memory()
    decoder, checkpoint = opened
    layers = cfg.num_hidden_layers
    if result is None or stored:          # the tuner's sample (and that of the stored-format choice) in float32
        streaming.fill_layers(decoder, checkpoint, tune.sample_layers(layers, tune.projection_shapes(cfg)))
    if result is None:
        result = tune.load_or_measure(decoder, threads, log=log, model=name_or_path)
        release_memory(mkl=True)    # the tuner's packed copies and MKL's buffers, before the model is packed
    fmt = result.weights if weights == "auto" else check_format(weights)
    if stored:
        fmt = _stored_choice(name_or_path, LoadedModel(name_or_path, decoder, None, source), result, stored, index, log)
    if packed_only and fmt == "fp32":
        return None, result, fmt          # nothing to pack: the loading process reads the model itself
    decoder.spooled.drop_pages()          # the timings read a tied model's spooled embedding whole, as its LM head
    codes = _gguf_codes(name_or_path, cfg, index) if fmt in ("int4", "w4a8") else None
    progress = _Progress(log, f"reading {layers} layers" + ("" if fmt == "fp32" else f" into {fmt}"), layers)

    def pack(i, layer):
        if fmt != "fp32":
            pack_projections(layer, fmt, layer_codes(codes, i))
        progress.step()
    if fmt == "w4a8" and codes is not None:      # the projections packed from the file's codes are never dequantized
        checkpoint = streaming.WithoutWeights(checkpoint, _coded_weights(codes, checkpoint, layers))
    streaming.fill_layers(decoder, checkpoint, range(layers), pack)
    if fmt != "fp32":
        pack_head(decoder, fmt, codes)
    codes = checkpoint = None              # the GGUF's codes and the open weight files
    release_memory()
    progress.done()
    name = name_or_path if loading.is_gguf_source(name_or_path) else source.name
    return LoadedModel(name, decoder, tokenizer, source), result, fmt


def _coded_weights(codes, checkpoint, layers: int) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of the layer weights that ``w4a8`` packs from the GGUF's ``codes`` alone
    (:meth:`~speculant.models.gguf_codes.GGUFCodes.as_stored`: :func:`~speculant.runtime.formats.pack_linear` reads
    only their shape), of the checkpoint's (:class:`~speculant.models.gguf_tensors.GGUFTensors`) ``layers`` layers."""
    from ..models.streaming import PROJECTION_WEIGHTS

    shapes = {}
    for i in range(layers):
        for proj, parts in PROJECTION_WEIGHTS.items():
            if codes.as_stored(f"layers.{i}.{proj}"):
                for part in parts:
                    name = f"model.layers.{i}.{part}.weight"
                    shapes[name] = checkpoint.shape(name)
    return shapes


class _Progress:
    """Progress of ``total`` steps on ``log``: a line when started, one every :attr:`EVERY` seconds, one when done."""

    EVERY = 5.0

    def __init__(self, log, what: str, total: int):
        self.log, self.what, self.total, self.count = log, what, total, 0
        self.start = self.last = time.perf_counter()
        print(f"speculant: {what} ...", file=log, flush=True)

    def step(self) -> None:
        self.count += 1
        now = time.perf_counter()
        if now - self.last >= self.EVERY and self.count < self.total:
            self.last = now
            print(f"speculant:   {self.count}/{self.total}", file=self.log, flush=True)

    def done(self) -> None:
        print(f"speculant: {self.what}: done in {time.perf_counter() - self.start:.1f} s", file=self.log, flush=True)


# Over 80 lines with its docstring (the public API: ~35 lines of arguments); the body is the load sequence:
# fast path from a packed copy, else read, tune, pack and save; then the fused-format measurements and the executor.
def load_model(name_or_path: str = DEFAULT_MODEL, weights: str = "auto", compile: bool = True,
               dtype: torch.dtype | str = torch.float32, threads: int | None = None, log=None,
               blocks: bool = True, kv_cache: str = "auto") -> LoadedModel:
    """Load ``name_or_path`` (a known name, a GGUF file or an HF-format directory) for decoding; a known model's own
    GGUF file by path loads as its name (:func:`~speculant.models.loading.known_name`).

    Args:
        weights: a weight format (``fp32``, ``bf16``, ``int8``, ``int4``, ``w4a8``; see
            :mod:`speculant.runtime.formats`) or ``auto``: ``w4a8`` where our kernels run unless another batch-invariant
            format is measured faster on this machine (:func:`tune.choose_format`) (:mod:`speculant.runtime.tune`, cached after the first load); for a GGUF file holding
            types torch's packed formats would requantize, the faster (measured here, once, on the file's own
            codes: :func:`tune.measure_stored_weights`) of ``w4a8`` and ``fp32`` where they all run as stored on our
            kernels (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and the kernels run here, ``w4a8`` unless ``fp32`` is faster by
            more than :data:`tune.CHOICE_NOISE`; else ``fp32`` (:func:`~speculant.models.loading.stored_weights`).
        compile: compile the decoding steps with ``torch.compile`` (eager without a C++ compiler); ``w4a8``
            weights need no compilation: their layers run as one call into our kernels
            (:mod:`speculant.kernels.decode_step`; ``LoadedModel.fused``); ``LoadedModel.executor`` runs the model.
        dtype: dtype of the float model; anything but float32 needs ``weights='fp32'`` (the legacy
            ``--dtype bfloat16`` path, activations in bfloat16 too).
        threads: torch threads; default ``$SPECULANT_NUM_THREADS``, else the count measured fastest
            here (the measurement itself runs with torch's default).
        log: where progress goes (default stderr).
        blocks: also compile the multi-token (verification block) graph at load; ``False`` for
            autoregressive decoding only (the graph is then compiled at the first block, if one ever runs).
        kv_cache: the KV cache's dtype (one of :data:`KV_CACHE_CHOICES`): ``auto`` (what the tuner measured
            faster here: in the fused-step format ``w4a8`` float32 or float16, :func:`tune.measure_kv_cache`;
            otherwise float32 through our attention kernel or float64 through SDPA), ``float32``, ``float64``,
            or ``float16`` (our kernel only: half the cache bytes, keys and values rounded to nearest even when
            stored and read back exactly, every sum in float32; llama.cpp's default cache type).  Greedy decoding
            is exact within the choice: every method reads the same cache.
    Returns:
        a :class:`LoadedModel` whose ``weights``, ``compiled``, ``fused`` and ``tune`` fields say what was chosen.
        Like torch's thread count, the process's ``malloc`` mmap threshold is set for decoding
        (:func:`speculant.heap.mapped_allocations`).
    Raises:
        SpeculantError: unknown model, format or KV cache dtype, a dtype/weights combination that does not exist,
            a bad GGUF file or a format that would requantize its weights, or ``kv_cache='float16'`` where our
            attention kernel does not run.
    """
    log = log or sys.stderr
    name_or_path = loading.known_name(name_or_path)     # a known model's own file by path: the name's caches
    if isinstance(dtype, str):
        dtype = loading.parse_dtype(dtype)
    if kv_cache not in KV_CACHE_CHOICES:
        raise SpeculantError(f"kv_cache={kv_cache!r} is not a KV cache dtype; allowed: {', '.join(KV_CACHE_CHOICES)}")
    if weights not in WEIGHT_CHOICES:
        raise SpeculantError(f"weights={weights!r} is not a weight format; allowed: {', '.join(WEIGHT_CHOICES)}")
    if dtype != torch.float32:
        if weights not in ("auto", "fp32"):
            raise SpeculantError(f"dtype={str(dtype).replace('torch.', '')} applies to weights='fp32' only; "
                                 f"for {weights} weights keep dtype=float32")
        weights = "fp32"
    kernels = format_available("w4a8") if weights == "auto" else True
    stored = _stored_formats(name_or_path, weights == "auto")
    weights = loading.weights_for(name_or_path, weights, None if stored else log, kernels=kernels)
    fixed_threads = threads or user_threads()
    threads = fixed_threads or torch.get_num_threads()
    torch.set_num_threads(threads)

    # fast path: a cached tune and a cached packed copy (a known model, a GGUF file, an HF directory); a first load
    # packs in a child process where it can, then takes the fast path (FIRST_LOAD_IN_CHILD)
    model, result, fmt = _cached_model(name_or_path, weights, threads, stored, log)
    if model is None and fmt != "fp32" and _first_load_in_child(name_or_path, dtype, weights, threads,
                                                                 stored is not None, log):
        model, result, fmt = _cached_model(name_or_path, weights, threads, stored, log)
    if model is None:
        _, packed_dir, _ = _cached_source(name_or_path)
        with mapped_allocations():      # large blocks mapped while packing; decoding's allocator setting after (heap)
            model, result, fmt = _read_and_pack(name_or_path, dtype, weights, result, threads, packed_dir, stored,
                                                log)
    model.weights = fmt
    model.tune = result
    explicit_kv = None if kv_cache == "auto" else kv_cache
    if result is not None:           # the measurements on the packed model itself: once per machine and model (tune)
        probe = Executor(model.decoder, _KV_DTYPES[explicit_kv] if explicit_kv else tune.attention_dtype(result))
        if explicit_kv:
            set_kv_cache(probe, explicit_kv)
        measured = tune.complete_for_fused(result, probe, log=log, model=name_or_path)
        del probe
        if measured:
            release_memory()        # the measurements' KV caches and workspaces, once they are dropped
    executor = Executor.from_tune(model.decoder, result, None if explicit_kv is None else _KV_DTYPES[explicit_kv])
    if explicit_kv:
        set_kv_cache(executor, explicit_kv)          # checks that our kernel reads it
    executor.activate(set_threads=fixed_threads is None)
    model.executor = executor
    # w4a8 layers run as one C call per forward (nothing left to compile); other formats through torch.compile
    model.fused = executor.fused_layers() is not None
    if model.fused and fixed_threads is None and torch.get_num_threads() > 1:
        # fewer threads while other processes keep cores busy (our kernels give the same bits with any count)
        executor.governor = ThreadGovernor(torch.get_num_threads())
    model.compiled = bool(compile) and not model.fused and enable_compile(executor, log=log, blocks=blocks)
    return model


FIRST_LOAD_IN_CHILD = True
"""Whether :func:`load_model` reads, tunes, packs and saves a model without a packed copy in a child process
(:func:`_first_load_in_child`) and then reads the copy as a later load does: the first load's peak memory is then
that of the larger of the two processes, not the packing's with all it leaves behind under the measurements on the
packed model (issue 26 bounds it; BENCHMARKS.md BH).  ``False``: all in this process (the tests of the loader's
steps, which patch them here)."""


def _cached_tune(name_or_path: str, threads: int):
    """``(config, packed-copy directory, source directory, tune result)`` of :func:`_cached_source`, with the tune
    cached for the config at ``threads`` threads (``None`` where there is none)."""
    cfg, packed_dir, source = _cached_source(name_or_path)
    return cfg, packed_dir, source, tune.load(tune.tune_key(cfg, threads)) if cfg is not None else None


def _cached_model(name_or_path: str, weights: str, threads: int, stored, log):
    """``(model, tune result, weight format)`` from the cached tune and packed copy of ``name_or_path`` (a known
    model, a converted GGUF file or an HF directory); ``model`` ``None`` where either is missing (or the format is
    ``fp32``, which has no packed copy); the result, where there is one, is returned all the same.  Reads under
    :func:`~speculant.heap.mapped_allocations`."""
    cfg, packed_dir, source, result = _cached_tune(name_or_path, threads)
    if result is None:
        return None, None, None
    with mapped_allocations():
        fmt = result.weights if weights == "auto" else check_format(weights)
        if stored:
            fmt = _stored_choice(name_or_path, None, result, stored, None, log)
        model = _from_packed(name_or_path, cfg, packed_dir, source, fmt) if fmt not in (None, "fp32") else None
    return model, result, fmt


def _first_load_in_child(name_or_path: str, dtype: torch.dtype, weights: str, threads: int, stored: bool,
                         log) -> bool:
    """Read, tune, pack and save ``name_or_path`` in ``weights`` (``auto`` or a packed format) with ``threads``
    threads in a child process (:func:`first_load_main`; its progress lines on ``log``), so that a later
    :func:`_cached_model` finds the tune and the packed copy; ``stored``: ``auto`` chooses among the formats that
    take the GGUF file's types as stored (:func:`~speculant.models.loading.stored_weights`), as this process does.
    Returns whether it ran: not for ``fp32`` weights or another ``dtype`` than float32 (no packed copy), nor where
    :data:`FIRST_LOAD_IN_CHILD` is off or no child process can be started here (then this process loads).

    Raises:
        SpeculantError: the child's error, in one line.
    """
    from ..models.child_process import can_run_children, run_in_child

    if not FIRST_LOAD_IN_CHILD or dtype != torch.float32 or weights == "fp32" or not can_run_children():
        return False
    try:
        run_in_child(__name__, "first_load_main", [name_or_path, weights, str(threads), "stored" if stored else "-"],
                     f"the first load of {name_or_path}", log)
    except OSError:                    # no child process here (a sandbox, an embedded interpreter): load here
        return False
    return True


def _stored_formats(name_or_path: str, auto: bool):
    """``--weights auto``'s candidates for a GGUF file whose types only some formats take as stored
    (:func:`~speculant.models.loading.stored_weights`: ``(candidates, types)``) where there is more than one;
    ``None`` otherwise or without ``auto``."""
    stored = loading.stored_weights(name_or_path, format_available("w4a8")) if auto else None
    return stored if stored is not None and len(stored[0]) > 1 else None


def first_load_main(argv: list[str]) -> None:
    """The child of :func:`_first_load_in_child`: ``argv`` = ``[model, weights, threads, "stored" or "-", the parent's
    pid]`` (:func:`~speculant.models.child_process.child_main`); the loader's own first load (:func:`_read_and_pack`,
    messages on stderr), without the measurements on the packed model (the parent makes them on the copy it reads)."""
    from ..models.child_process import child_main

    def first_load(args):
        name_or_path, weights, threads = args[0], args[1], int(args[2])
        torch.set_num_threads(threads)
        stored = _stored_formats(name_or_path, args[3] == "stored")
        _, packed_dir, _, result = _cached_tune(name_or_path, threads)
        with mapped_allocations():
            _read_and_pack(name_or_path, torch.float32, weights, result, threads, packed_dir, stored, sys.stderr,
                           packed_only=True)
    child_main(argv, first_load)


def _stored_choice(name_or_path: str, model, result, stored: tuple, index, log) -> str | None:
    """``--weights auto`` for a GGUF file whose types only some formats take as stored (``stored``:
    :func:`~speculant.models.loading.stored_weights`, ``(candidates, types)``, the default first): the choice
    recorded in the tune ``result`` (:attr:`tune.TuneResult.stored_weights`), else measured on ``model`` (float32,
    :func:`tune.measure_stored_weights` on the file's own codes; ``index``: its tensor table, if read) with the
    default kept unless another is faster by more than :data:`tune.CHOICE_NOISE`, recorded and saved; ``None`` when
    not recorded and no ``model`` is given.  Says the choice and why in one line on ``log`` when it measures."""
    candidates, types = stored
    entry = result.stored_weights.get(types)
    if entry is not None and entry.get("candidates") == list(candidates):
        return entry["weights"]                   # said once, when it was measured
    if model is None:
        return None
    since = occupancy.reading()
    ms = tune.measure_stored_weights(model.decoder, _gguf_codes(name_or_path, model.config, index), candidates,
                                     result.fp32_route)
    others = occupancy.other_cores(since)
    busy = others is not None and others >= occupancy.BUSY_CORE
    # the formats give different text: a choice from timings of a shared core (w4a8 measured 22x its quiet
    # time beside another process, and fp32 was taken) keeps the default; `speculant tune` measures again
    entry = {"candidates": list(candidates), "ms": ms, "busy_cores": None if others is None else round(others, 2),
             "weights": candidates[0] if busy else tune.keep_default_format(ms, candidates[0])}
    result.stored_weights[types] = entry
    tune.save(result)
    release_memory(mkl=True)          # the sample's packed copies and MKL's buffers
    timings = ", ".join(f"{f} {entry['ms'][f]:.2f} ms" for f in candidates)
    print(f"speculant: {name_or_path} holds {types} weights, taken as stored by {' and '.join(candidates)}: weights auto loads "
          f"{entry['weights']} (one-row pass measured here: {timings}; {candidates[0]} unless another is faster by "
          f"more than {tune.CHOICE_NOISE:.0%}"
          + (", and kept while other processes kept a core busy" if (entry.get("busy_cores") or 0)
             >= occupancy.BUSY_CORE else "") + ")", file=log)
    return entry["weights"]


def set_kv_cache(executor, kv_cache: str) -> None:
    """Make the new KV caches of ``executor`` (a :class:`~speculant.runtime.executor.Executor`) ``kv_cache`` (``float32``, ``float16`` or ``float64``; see
    :func:`load_model`).

    Raises:
        SpeculantError: another value, or ``float16`` where our attention kernel does not run (it is the only
            reader of a float16 cache).
    """
    from ..kernels import attention as attention_kernel
    if kv_cache not in _KV_DTYPES:
        raise SpeculantError(f"kv_cache={kv_cache!r} is not a KV cache dtype; allowed: {', '.join(_KV_DTYPES)}")
    if kv_cache == "float16" and not attention_kernel.supports(executor.config.head_dim, torch.float16):
        from ..kernels import build
        raise SpeculantError("kv_cache='float16' needs our attention kernel "
                             f"({build.unavailable_reason() or 'a head size that is a multiple of 8, at most 256'}); "
                             "allowed here: auto, float32, float64")
    executor.kv_dtype = _KV_DTYPES[kv_cache]


def _gguf_codes(name_or_path: str, cfg: ModelConfig, index=None):
    """The GGUF's own group-wise codes of a known model or GGUF file (``None`` for HF directories); ``index``: the
    file's tensor table, if :func:`_convert_overlapped` read it."""
    path = loading.gguf_file_of(name_or_path)
    if path is None:
        return None
    from ..models.gguf_codes import read_group_quantized
    return read_group_quantized(path, cfg, index)


def _convert_overlapped(name: str, log=None):
    """Describe the GGUF model ``name``, known or a file's path, as an HF-format directory without its weights
    (:func:`~speculant.models.loading.convert_gguf_in_child`),
    and, while the child converts, read the GGUF's tensor table here and compile our kernels in a thread
    (:func:`~speculant.kernels.build.prebuild`; timing a CPU's variants waits for a quiet machine): work the
    first load needs anyway, on the core the conversion leaves idle.  Returns the tensor table.

    Raises:
        SpeculantError: as the conversion (a kernel build's errors surface later, where the kernels are loaded).
    """
    from ..kernels import build
    from ..models.gguf_codes import index_tensors
    index = []

    def meanwhile():
        kernels = threading.Thread(target=build.prebuild, daemon=True)
        kernels.start()
        index.append(index_tensors(loading.gguf_file_of(name)))
        kernels.join()
    loading.convert_gguf_in_child(name, loading.converted_dir(name), meanwhile, progress=log, weights=False)
    return index[0] if index else None
