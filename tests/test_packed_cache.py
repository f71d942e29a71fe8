"""Packed copies of HF-format directories: the first load in a packed format saves one in the cache, later loads
read it (no re-quantization) and give the same logits; a changed weight file is packed again."""

import os

import pytest
import torch

from helpers import tiny_model
from speculant.models import loading
from speculant.models.loading import save_hf_dir
from speculant.runtime import formats, loader
from speculant.runtime.store import packed_path


def _logits(model, ids):
    with torch.inference_mode():
        return model.decoder(torch.tensor([ids])).float()


def _no_packing(*args, **kwargs):
    raise AssertionError("apply_weight_format ran: the packed copy was not read")


@pytest.mark.parametrize("fmt", ["int8", "w4a8"])
def test_hf_directory_packed_once_then_read(tmp_path, monkeypatch, fmt):
    if not formats.format_available(fmt):
        pytest.skip(f"{fmt} does not run on this machine")
    directory = save_hf_dir(tiny_model(seed=5, scale=2.0), tmp_path / "tiny")
    first = loader.load_model(str(directory), weights=fmt, compile=False)
    packed = packed_path(loading.packed_cache_dir(directory), fmt)
    assert packed.is_file(), "the first load saved no packed copy"
    ids = [1, 5, 9, 2, 7]
    monkeypatch.setattr(loader, "apply_weight_format", _no_packing)
    second = loader.load_model(str(directory), weights=fmt, compile=False)
    assert second.weights == fmt and second.path == directory and second.name == directory.name
    assert torch.equal(_logits(first, ids), _logits(second, ids))
    assert second.tokenizer.encode("hello") == first.tokenizer.encode("hello")


def test_changed_weights_are_packed_again(tmp_path, monkeypatch):
    directory = save_hf_dir(tiny_model(seed=6, scale=2.0), tmp_path / "tiny")
    loader.load_model(str(directory), weights="int8", compile=False)
    before = loading.packed_cache_dir(directory)
    save_hf_dir(tiny_model(seed=7, scale=2.0), directory)        # other weights, same place
    st = (directory / "model.safetensors").stat()
    os.utime(directory / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert loading.packed_cache_dir(directory) != before
    calls = []
    real = loader.apply_weight_format
    monkeypatch.setattr(loader, "apply_weight_format", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = loader.load_model(str(directory), weights="int8", compile=False)
    reference = loading.read_checkpoint(str(directory))
    formats.apply_weight_format(reference.decoder, "int8")
    assert calls, "changed weights were read from the old packed copy"
    assert torch.equal(_logits(model, [3, 4, 5]), _logits(reference, [3, 4, 5]))
