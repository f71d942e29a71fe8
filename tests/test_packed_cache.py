"""Packed copies of HF-format directories: the first load in a packed format saves one in the cache, later loads
read it (no re-quantization) and give the same logits; a changed weight file is packed again."""

import os

import pytest
import torch

from helpers import tiny_model
from speculant.models import child_process, loading
from speculant.models.loading import save_hf_dir
from speculant.runtime import formats, loader
from speculant.runtime.store import packed_path


def _logits(model, ids):
    with torch.inference_mode():
        return model.decoder(torch.tensor([ids])).float()


def _no_packing(*args, **kwargs):
    raise AssertionError("the model was read and packed again: the packed copy was not read")


@pytest.mark.parametrize("fmt", ["int8", "w4a8"])
def test_hf_directory_packed_once_then_read(tmp_path, monkeypatch, fmt):
    if not formats.format_available(fmt):
        pytest.skip(f"{fmt} does not run on this machine")
    directory = save_hf_dir(tiny_model(seed=5, scale=2.0), tmp_path / "tiny")
    first = loader.load_model(str(directory), weights=fmt, compile=False)
    packed = packed_path(loading.packed_cache_dir(directory), fmt)
    assert packed.is_file(), "the first load saved no packed copy"
    ids = [1, 5, 9, 2, 7]
    monkeypatch.setattr(loader, "_read_and_pack", _no_packing)
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
    after = loading.packed_cache_dir(directory)
    assert after != before
    model = loader.load_model(str(directory), weights="int8", compile=False)
    assert packed_path(after, "int8").is_file(), "changed weights were read from the old packed copy"
    reference = loading.read_checkpoint(str(directory))
    formats.apply_weight_format(reference.decoder, "int8")
    assert torch.equal(_logits(model, [3, 4, 5]), _logits(reference, [3, 4, 5]))


@pytest.mark.parametrize("fmt", ["int8", "int4", "w4a8"])
def test_first_load_streams_layer_by_layer(tmp_path, monkeypatch, fmt):
    """A first load in a packed format never reads the whole float32 model (read_checkpoint / load_hf_dir) and gives
    the logits of the whole read packed after it, bit for bit."""
    if not formats.format_available(fmt):
        pytest.skip(f"{fmt} does not run on this machine")
    directory = save_hf_dir(tiny_model(seed=8, scale=2.0, layers=5), tmp_path / "tiny")
    reference = loading.read_checkpoint(str(directory))
    formats.apply_weight_format(reference.decoder, fmt)

    def whole(*args, **kwargs):
        raise AssertionError("the whole float32 model was read")
    monkeypatch.setattr(loading, "read_checkpoint", whole)
    monkeypatch.setattr(loading, "load_hf_dir", whole)
    model = loader.load_model(str(directory), weights=fmt, compile=False)
    assert model.weights == fmt and model.decoder.weight_format == fmt
    assert not any(t.is_meta for t in [*model.decoder.parameters(), *model.decoder.buffers()]), "a tensor left unread"
    ids = [2, 3, 5, 7, 11, 13]
    assert torch.equal(_logits(model, ids), _logits(reference, ids))


def test_a_checkpoint_that_cannot_stream_is_read_whole(tmp_path):
    """A tied model with a saved copy of its LM head is not streamed (the copy is compared on the whole state) and
    still loads."""
    from safetensors.torch import load_file, save_file

    directory = save_hf_dir(tiny_model(seed=9, scale=2.0), tmp_path / "tiny")
    state = load_file(str(directory / "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(directory / "model.safetensors"))
    model = loader.load_model(str(directory), weights="int8", compile=False)
    reference = loading.read_checkpoint(str(directory))
    formats.apply_weight_format(reference.decoder, "int8")
    assert torch.equal(_logits(model, [1, 2, 3]), _logits(reference, [1, 2, 3]))


def test_the_child_progress_lines_are_passed_on(tmp_path):
    import io
    import threading
    import time

    out = io.StringIO()
    finished = threading.Event()
    with open(tmp_path / "err", "w+b") as f:
        relay = threading.Thread(target=child_process.relay_progress, args=(f.fileno(), out, finished))
        relay.start()
        f.write(b"noise\nspeculant:   3/9 tensors converted\npartial")
        f.flush()
        time.sleep(0.6)
        f.write(b" line\nspeculant: done\n")
        f.flush()
        finished.set()
        relay.join(timeout=10)
    assert out.getvalue().splitlines() == ["speculant:   3/9 tensors converted", "speculant: done"]


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "F16", "BF16"])
def test_dequantizing_by_rows_gives_the_readers_values(kind):
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize, quantize

    from speculant.models.gguf_tensors import dequantize_by_rows

    qtype = GGMLQuantizationType[kind]
    weights = np.random.default_rng(0).standard_normal((11, 64)).astype(np.float32)
    data = quantize(weights, qtype)
    whole = dequantize(data, qtype)
    by_rows = dequantize_by_rows(data, qtype, rows=4)
    assert by_rows.shape == whole.shape and by_rows.dtype == whole.dtype
    assert np.array_equal(by_rows, whole)


def test_write_safetensors_is_read_by_safetensors_with_a_tensor_copied_from_a_file(tmp_path):
    """Our writer (tensors one at a time, one copied file to file) makes a file safetensors' own reader takes."""
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import load_file

    from speculant.runtime.store import write_safetensors

    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(3, 5, generator=g), "b": torch.randint(-128, 127, (7,), dtype=torch.int8),
             "c": torch.randn(4, generator=g).half(), "empty": torch.zeros(0, 2), "big": torch.randn(33, 9, generator=g)}
    spooled = tempfile.TemporaryFile(dir=tmp_path)
    spooled.write(state["big"].numpy().tobytes())
    spooled.flush()
    write_safetensors(tmp_path / "x.safetensors", state, {"k": "v"}, {"big": spooled})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == state.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in state.items())
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.metadata() == {"k": "v"}
