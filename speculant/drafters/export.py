"""``speculant export``: a draft head in the layout other engines load.

- An EAGLE-3 head (:mod:`speculant.drafters.eagle3_head`) is stored in that layout already; the export checks it
  (auxiliary-layer ids written out, at the top level and under ``eagle_config``, as vLLM's and SGLang's loaders read
  them) and writes ``config.json`` + ``model.safetensors`` again.
- Our EAGLE-1/2-style head (:mod:`speculant.drafters.draft_head`, ``feature="post-norm"``: the shipped ``default``
  for SmolLM2) becomes vLLM's EAGLE-1 layout (``architectures: ["EagleLlamaForCausalLM"]``, SafeAILab EAGLE-1's
  tensor names): ``fc.weight``/``fc.bias`` over ``[embedding; feature]``, ``layers.0.self_attn.{q,k,v,o}_proj``,
  ``layers.0.mlp.{gate,up,down}_proj``, ``layers.0.post_attention_layernorm`` (no input norm: EAGLE drops it); the
  embedding and the LM head are the target's, shared by the engine.  Our reduced draft vocabulary has no place in
  that layout: it is kept in ``speculant_draft_vocab.json`` (for our loader), and an engine drafts over the whole
  vocabulary.  Loader code followed: vLLM ``llama_eagle.py`` / ``llama_eagle3.py`` and SGLang ``llama_eagle.py`` /
  ``llama_eagle3.py`` (README, "Exporting draft heads", names the commits).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..errors import SpeculantError

EAGLE1_ARCHITECTURE = "EagleLlamaForCausalLM"
EAGLE1_WEIGHTS = "model.safetensors"
VOCAB_FILE = "speculant_draft_vocab.json"


def eagle1_state(sd: dict[str, torch.Tensor], conf: dict) -> dict[str, torch.Tensor]:
    """Our head's stored tensors (``head.safetensors``) -> EAGLE-1 names (module docstring)."""
    d, hd = conf["hidden_size"], conf["head_dim"]
    qs, kvs = conf["num_attention_heads"] * hd, conf["num_key_value_heads"] * hd
    p = "layers.0."
    out = {"fc.weight": sd["fc.weight"], "fc.bias": sd["fc.bias"],
           p + "self_attn.o_proj.weight": sd["layer.self_attn.o_proj.weight"],
           p + "mlp.down_proj.weight": sd["layer.mlp.down_proj.weight"],
           p + "post_attention_layernorm.weight": sd["layer.post_attention_layernorm.weight"]}
    for n, w in zip("qkv", sd["layer.self_attn.qkv_proj.weight"].split([qs, kvs, kvs], dim=0)):
        out[p + f"self_attn.{n}_proj.weight"] = w
    gate, up = sd["layer.mlp.gate_up_proj.weight"].split(conf["intermediate_size"], dim=0)
    out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up})
    assert out["fc.weight"].shape[1] == 2 * d
    return {k: v.contiguous() for k, v in out.items()}


def from_eagle1_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`eagle1_state`; raises ``KeyError`` naming a missing tensor."""
    p = "layers.0."
    return {"fc.weight": sd["fc.weight"], "fc.bias": sd["fc.bias"],
            "layer.self_attn.o_proj.weight": sd[p + "self_attn.o_proj.weight"],
            "layer.mlp.down_proj.weight": sd[p + "mlp.down_proj.weight"],
            "layer.post_attention_layernorm.weight": sd[p + "post_attention_layernorm.weight"],
            "layer.self_attn.qkv_proj.weight": torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
            "layer.mlp.gate_up_proj.weight": torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])}


def eagle1_config(conf: dict) -> dict:
    """Our head's ``config.json`` -> an EAGLE-1 Llama config (one layer, ``bias: true`` for ``fc``'s bias as in
    SafeAILab EAGLE-1), our own keys kept under ``"speculant"``."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size")
    out = {"architectures": [EAGLE1_ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
           "hidden_act": "silu", "tie_word_embeddings": False, "bias": True, "attention_bias": False,
           "mlp_bias": False, "torch_dtype": conf.get("stored_dtype", "bfloat16")}
    out.update({k: conf[k] for k in keys})
    out["speculant"] = {k: v for k, v in conf.items() if k not in keys}
    return out


def is_eagle1_dir(path: Path) -> bool:
    """True when ``path/config.json`` names vLLM's EAGLE-1 architecture."""
    f = Path(path) / "config.json"
    return f.is_file() and EAGLE1_ARCHITECTURE in (json.loads(f.read_text()).get("architectures") or [])


def read_eagle1(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """An exported EAGLE-1 directory -> (our head config, our stored tensors incl. ``vocab_ids`` where kept).

    Raises:
        SpeculantError: a missing tensor (named).
    """
    from safetensors.torch import load_file
    conf = json.loads((path / "config.json").read_text())
    ours = dict(conf.get("speculant") or {})
    ours.update({k: v for k, v in conf.items() if k not in ("speculant", "architectures", "model_type", "bias",
                                                             "num_hidden_layers", "hidden_act", "torch_dtype",
                                                             "tie_word_embeddings", "attention_bias", "mlp_bias")})
    ours.setdefault("feature", "post-norm")
    ours["format"] = "speculant-draft-head"
    try:
        sd = from_eagle1_state(load_file(str(path / EAGLE1_WEIGHTS)))
    except KeyError as e:
        raise SpeculantError(f"EAGLE-1 head {str(path)!r} lacks tensor {e.args[0]!r}; allowed: an exported head") \
            from None
    vocab = path / VOCAB_FILE
    if vocab.is_file():
        sd["vocab_ids"] = torch.tensor(json.loads(vocab.read_text()), dtype=torch.long)
    ours["draft_vocab_size"] = len(sd["vocab_ids"]) if "vocab_ids" in sd else ours["vocab_size"]
    return ours, sd


def export_eagle1(src: Path, out: Path) -> dict:
    """Write our EAGLE-1/2-style head in ``src`` as vLLM's EAGLE-1 layout into ``out``.

    Raises:
        SpeculantError: a pre-norm head (an EAGLE-1 engine feeds the post-norm feature and no final norm).
    """
    from safetensors.torch import load_file

    from .artifacts import save_safetensors
    conf = json.loads((src / "config.json").read_text())
    if conf.get("feature") != "post-norm":
        raise SpeculantError(f"draft head {str(src)!r} has feature={conf.get('feature')!r}; allowed for an EAGLE-1 "
                             "export: post-norm (the engines feed the target's post-norm feature)")
    sd = load_file(str(src / "head.safetensors"))
    vocab_ids = sd.pop("vocab_ids", None)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(eagle1_state(sd, conf), out / EAGLE1_WEIGHTS, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(eagle1_config(conf), indent=2))
    if vocab_ids is not None:
        (out / VOCAB_FILE).write_text(json.dumps(vocab_ids.tolist()))
    return {"architecture": EAGLE1_ARCHITECTURE, "out": str(out), "draft_vocab_kept_in": VOCAB_FILE
            if vocab_ids is not None else None}


def export_eagle3(src: Path, out: Path) -> dict:
    """Check the EAGLE-3 head in ``src`` and write its engine layout into ``out`` (the ids at the top level and
    under ``eagle_config``).

    Raises:
        SpeculantError: no auxiliary-layer ids (never guessed), or bad ones.
    """
    from .eagle3_head import AUX_IDS_KEY, ARCHITECTURE, WEIGHTS_FILE, aux_layer_ids, check_aux_layer_ids
    conf = json.loads((src / "config.json").read_text())
    layers = (conf.get("speculant") or {}).get("target_num_hidden_layers")
    ids = aux_layer_ids(conf, f"EAGLE-3 head {str(src)!r}")
    ids = check_aux_layer_ids(ids, layers) if layers else ids
    conf[AUX_IDS_KEY] = ids
    conf["eagle_config"] = dict(conf.get("eagle_config") or {}, **{AUX_IDS_KEY: ids, "use_aux_hidden_state": True})
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != src.resolve():
        shutil.copyfile(src / WEIGHTS_FILE, out / WEIGHTS_FILE)
        for extra in ("README.md", "metrics.json"):
            if (src / extra).is_file():
                shutil.copyfile(src / extra, out / extra)
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    return {"architecture": ARCHITECTURE, "out": str(out), AUX_IDS_KEY: ids}


def export_head(src: Path, out: Path) -> dict:
    """Export the head in directory ``src`` (EAGLE-3, or our EAGLE-1/2-style head) into ``out``; returns a summary.

    Raises:
        SpeculantError: ``src`` is neither kind, or see :func:`export_eagle1` / :func:`export_eagle3`.
    """
    from .eagle3_head import is_eagle3_dir
    if is_eagle3_dir(src):
        return export_eagle3(src, out)
    conf = json.loads((src / "config.json").read_text())
    if conf.get("format") == "speculant-draft-head":
        return export_eagle1(src, out)
    raise SpeculantError(f"{str(src)!r} is not a draft head (format={conf.get('format')!r}, architectures="
                         f"{conf.get('architectures')}); allowed: a speculant draft head or an EAGLE-3 head")
