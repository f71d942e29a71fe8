"""Trained drafting artefacts on disk: shipped ones by name, or any directory.

A trained artefact (an exit adapter, a draft head) is a directory with ``config.json``
(carrying a ``format`` string), a ``.safetensors`` file and a ``README.md`` model card.
Shipped artefacts live under ``speculant/artifacts/<kind>/<model name>/<name>/``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import SpeculantError

ARTIFACTS_ROOT = Path(__file__).resolve().parent.parent / "artifacts"


def shipped_names(kind: str, model_name: str) -> list[str]:
    """Names of the artefacts of ``kind`` (``exit_adapters``, ``draft_heads``) shipped for ``model_name``."""
    d = ARTIFACTS_ROOT / kind / model_name
    return sorted(p.name for p in d.iterdir() if (p / "config.json").is_file()) if d.is_dir() else []


def resolve_dir(kind: str, what: str, name_or_path: str, model_name: str) -> Path:
    """``name_or_path`` itself when it is an artefact directory, else the shipped artefact of that name.

    Args:
        what: how errors call it (``exit adapter``, ``draft head``).
    Raises:
        SpeculantError: neither exists (the message lists the shipped names).
    """
    p = Path(name_or_path)
    if (p / "config.json").is_file():
        return p
    q = ARTIFACTS_ROOT / kind / model_name / name_or_path
    if (q / "config.json").is_file():
        return q
    names = shipped_names(kind, model_name)
    recipe = {"draft_heads": "draft-head", "exit_adapters": "exit-adapter"}.get(kind)
    train = f"; train one with `speculant train --recipe {recipe}`" if recipe and not names else ""
    raise SpeculantError(f"{what} {name_or_path!r} not found for model {model_name!r}; allowed: "
                         f"{', '.join(names) if names else f'(no shipped {what}s)'} or a directory with config.json"
                         f"{train}")


def read_config(path: Path, fmt: str, what: str) -> dict:
    """``config.json`` of an artefact directory, checked to be of format ``fmt``.

    Raises:
        SpeculantError: another format.
    """
    conf = json.loads((path / "config.json").read_text())
    if conf.get("format") != fmt:
        raise SpeculantError(f"{str(path)!r} is not a {what} (format={conf.get('format')!r}; allowed: {fmt})")
    return conf


def check_compatible(conf: dict, model, keys: dict, path: Path, what: str) -> None:
    """Raise :class:`SpeculantError` unless ``conf[key] == value`` for every ``key, value`` of ``keys``."""
    for key, have in keys.items():
        if conf[key] != have:
            raise SpeculantError(f"{what} {str(path)!r} has {key}={conf[key]} but model {model.name!r} has "
                                 f"{have}; allowed: a {what} trained for this model")


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """``safetensors.torch.save_file``, then the file's mode set as an ordinary file's (``0o666`` less the umask):
    safetensors writes a private temporary file (mode 0600) and renames it, so trained weights would otherwise be
    unreadable to the other users of a shared folder.  Returns ``path``."""
    import os

    from safetensors.torch import save_file
    path = Path(path)
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())
    return path


def _umask() -> int:
    """This process' umask: from ``/proc/self/status`` where there is one (reading it leaves the umask alone, so
    no other thread ever creates a file under a changed one), else by setting it and setting it back."""
    import os
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_dir(out_dir: str | Path, weights_file: str, state: dict[str, torch.Tensor], dtype: torch.dtype,
              file_format: str, config: dict, metrics: dict | None = None, card: str | None = None) -> Path:
    """Write a trained artefact's directory: ``weights_file`` (``state``'s float tensors in ``dtype``, the others as
    they are; safetensors metadata ``{"format": file_format}``), ``config.json`` (``config``) and, given,
    ``metrics.json`` / ``README.md`` (the model card ``card``); returns the directory, created if needed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu() for k, v in state.items()}
    save_safetensors(sd, out / weights_file, metadata={"format": file_format})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return write_card(out, metrics, card)


def write_card(out: Path, metrics: dict | None = None, card: str | None = None) -> Path:
    """Write a trained artefact's ``metrics.json`` (``metrics``) and ``README.md`` (the model card ``card``), each
    when given, into the existing folder ``out``; returns ``out``."""
    if metrics is not None:
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if card is not None:
        (out / "README.md").write_text(card)
    return out
