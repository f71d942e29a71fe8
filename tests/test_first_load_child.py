"""A model's first load reads, tunes, packs and saves in a child process (``loader.FIRST_LOAD_IN_CHILD``, the
default; the rest of the tests run it in process, see conftest); this process then reads the packed copy as a later
load does."""

from __future__ import annotations

import io

import pytest
import torch
from gguf_helpers import write_tiny_gguf

from speculant.errors import SpeculantError
from speculant.models import loading
from speculant.runtime import loader, tune
from speculant.runtime.store import packed_path


def _greedy(model, ids, n=12):
    from speculant.engine.methods import build_generator
    from speculant.engine.generator import GenerationConfig
    return build_generator(model).generate(ids, GenerationConfig(max_new_tokens=n, ignore_eos=True)).token_ids


def test_a_first_load_packs_in_a_child_and_gives_the_in_process_model(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "c.gguf", "Q4_1", layers=3, seed=5)
    # in process, in a cache of its own
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "here"))
    here = loader.load_model(str(path), weights="w4a8", compile=False, log=io.StringIO())
    # through the child, in another cache: nothing is read, tuned or packed in this process
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "child"))
    monkeypatch.setattr(loader, "FIRST_LOAD_IN_CHILD", True)

    def refuse(*a, **k):
        raise AssertionError("the first load ran in this process")
    monkeypatch.setattr(loader, "_read_and_pack", refuse)
    monkeypatch.setattr(tune, "measure", refuse)
    log = io.StringIO()
    child = loader.load_model(str(path), weights="w4a8", compile=False, log=log)
    lines = log.getvalue().splitlines()
    assert "speculant: reading 3 layers into w4a8 ..." in lines             # the child's progress, passed on
    assert any(line.startswith("speculant: T-row forwards timed") for line in lines)   # measured here, on the copy
    assert packed_path(loading.converted_dir(str(path)), "w4a8").is_file()
    assert child.weights == here.weights == "w4a8" and child.tune is not None
    ours, theirs = here.decoder.state_dict(), child.decoder.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    ids = here.tokenizer.encode("hello there")
    assert _greedy(child, ids) == _greedy(here, ids)


def test_a_first_load_that_fails_in_the_child_says_its_error_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "FIRST_LOAD_IN_CHILD", True)
    monkeypatch.setattr(loader, "_read_and_pack", lambda *a, **k: pytest.fail("read in this process"))
    path = write_tiny_gguf(tmp_path / "b.gguf", "Q8_0", extra=("blk.0.attn_output.bias",))
    with pytest.raises(SpeculantError, match=r"^GGUF file .* has unexpected ones \['blk.0.attn_output.bias'\].*"
                                             r"allowed: exactly the config's weights$"):
        loader.load_model(str(path), weights="w4a8", compile=False, log=io.StringIO())
    assert not loading.converted_dir(str(path)).exists()


def test_fp32_weights_load_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "FIRST_LOAD_IN_CHILD", True)
    from speculant.models import child_process
    real = child_process.run_in_child

    def run(module, function, *a, **k):
        assert function != "first_load_main", "fp32 has no packed copy to read"
        return real(module, function, *a, **k)                # the GGUF's conversion child
    monkeypatch.setattr(child_process, "run_in_child", run)
    path = write_tiny_gguf(tmp_path / "f.gguf", "Q8_0", seed=2)
    model = loader.load_model(str(path), weights="fp32", compile=False, log=io.StringIO())
    assert model.weights == "fp32"


def test_an_hf_directory_by_a_relative_path_packs_in_a_child(tmp_path, monkeypatch):
    from helpers import tiny_model

    from speculant.models.loading import save_hf_dir

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "FIRST_LOAD_IN_CHILD", True)
    directory = save_hf_dir(tiny_model(seed=5, scale=2.0), tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loader, "_read_and_pack", lambda *a, **k: pytest.fail("read and packed in this process"))
    model = loader.load_model("tiny", weights="int8", compile=False, log=io.StringIO())
    assert model.weights == "int8" and model.name == "tiny" and model.tokenizer is not None
    assert packed_path(loading.packed_cache_dir(directory), "int8").is_file()


def test_later_loads_and_a_tune_that_takes_fp32_start_no_child(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "FIRST_LOAD_IN_CHILD", True)
    path = write_tiny_gguf(tmp_path / "l.gguf", "Q4_1", layers=2, seed=3)
    first = loader.load_model(str(path), compile=False, log=io.StringIO())
    assert first.weights not in (None, "fp32")                  # a packed format: measured fastest here
    children = []
    monkeypatch.setattr(loader, "_first_load_in_child", lambda *a: children.append(a) or False)
    loader.load_model(str(path), compile=False, log=io.StringIO())
    result = tune.load(first.tune.key)
    result.weights = "fp32"                                   # auto's choice on a machine where fp32 won
    tune.save(result)
    again = loader.load_model(str(path), compile=False, log=io.StringIO())
    assert again.weights == "fp32" and children == []


def test_an_hf_directory_without_a_tokenizer_fails_before_anything_is_packed(tmp_path, monkeypatch):
    from helpers import tiny_model

    from speculant.models.loading import save_hf_dir

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "FIRST_LOAD_IN_CHILD", True)
    directory = save_hf_dir(tiny_model(seed=4, scale=2.0), tmp_path / "notok")
    for f in directory.glob("tokenizer*"):
        f.unlink()
    log = io.StringIO()
    with pytest.raises(SpeculantError) as e:
        loader.load_model(str(directory), weights="int8", compile=False, log=log)
    assert "\n" not in str(e.value) and "tokenizer" in str(e.value).lower()
    assert "reading" not in log.getvalue()                      # failed before the weights were read
    assert not packed_path(loading.packed_cache_dir(directory), "int8").exists()


def test_a_child_killed_by_a_signal_is_named(tmp_path, monkeypatch):
    from speculant.models.child_process import run_in_child

    (tmp_path / "dies.py").write_text("import os, signal, sys\n"
                                      "def main(argv):\n"
                                      "    print('speculant: working ...', file=sys.stderr, flush=True)\n"
                                      "    os.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    log = io.StringIO()
    killed = r"^the work failed: its process was killed by SIGKILL \(out of memory\?\)$"
    with pytest.raises(SpeculantError, match=killed):
        run_in_child("dies", "main", [], "the work", log)
    assert log.getvalue() == "speculant: working ...\n"
