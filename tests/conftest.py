import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
# Tiny test models gain nothing from intra-op threads; one thread avoids OpenMP stalls on a busy machine.
torch.set_num_threads(1)
# The CLI compiles the decoder unless told not to; tests run eagerly except where they test compilation.
os.environ.setdefault("SPECULANT_COMPILE", "0")

SESSION_CACHE_VAR = "SPECULANT_TEST_SESSION_CACHE"
"""Set by the first process of a test session (the xdist controller, or the only process) to the cache every
process of the session shares; xdist workers inherit it from the controller's environment."""
PERSISTENT_CACHE_VAR = "SPECULANT_TEST_CACHE"
"""A cache directory kept between test sessions (the converted SmolLM2, built kernels, tune files), if set;
otherwise each session gets an empty temporary one, removed at its end."""


def pytest_configure(config):
    """Point ``SPECULANT_CACHE`` at the session's own cache, never the user's (``~/.cache/speculant`` or their
    ``$SPECULANT_CACHE``): tests build kernels, compile, tune and convert SmolLM2 into it.  Tests that set
    ``SPECULANT_CACHE`` themselves (monkeypatch) still do."""
    cache = os.environ.get(SESSION_CACHE_VAR)
    if not cache:
        cache = os.environ.get(PERSISTENT_CACHE_VAR)
        if cache:
            os.makedirs(cache, exist_ok=True)
        else:
            cache = tempfile.mkdtemp(prefix="speculant-test-cache-")
            config._speculant_temporary_cache = cache
        os.environ[SESSION_CACHE_VAR] = cache
    os.environ["SPECULANT_CACHE"] = cache
    _first_loads_in_process()
    _convert_known_models_once()
    _first_load_of_known_models_once()


def pytest_unconfigure(config):
    cache = getattr(config, "_speculant_temporary_cache", None)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)


def _first_loads_in_process() -> None:
    """First loads read, tune and pack in the test's own process (``loader.FIRST_LOAD_IN_CHILD``): tests patch those
    steps here, and a child interpreter per tiny model costs ~2 s.  The child route has its own tests
    (tests/test_first_load_child.py), and the CLI's tests run it (a ``speculant`` subprocess keeps the default)."""
    from speculant.runtime import loader

    loader.FIRST_LOAD_IN_CHILD = False


def _convert_known_models_once() -> None:
    """Serialize the first conversion of a known model (SmolLM2: ~60 s of one core) across the session's
    processes: the conversion is atomic (a temporary directory renamed into place), but two xdist workers
    loading SmolLM2 at once would both convert it; with a file lock the second one waits and reads the result."""
    from filelock import FileLock

    from speculant.models import loading

    convert = loading.convert_gguf_in_child

    def convert_once(name: str, out_dir: Path, meanwhile=None, progress=None, weights: bool = True) -> Path:
        out_dir = Path(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(out_dir) + ".lock"):
            if not (out_dir / ("model.safetensors" if weights else "gguf.json")).is_file():
                return convert(name, out_dir, meanwhile, progress, weights)
        if meanwhile is not None:
            meanwhile()
        return out_dir

    loading.convert_gguf_in_child = convert_once


def _first_load_of_known_models_once() -> None:
    """Serialize loads of a known model for decoding (:func:`speculant.load_model`) across the session's processes:
    the first one in an empty cache converts, measures the kernels (``speculant tune``, ~1 min for SmolLM2) and packs
    the weights; a worker loading at the same time waits and then reads the tune file and packed weights (measuring
    twice at once would cost the time twice and disturb both measurements)."""
    import speculant
    from filelock import FileLock

    from speculant.models import loading
    from speculant.runtime import loader

    load = loader.load_model

    def load_once(name_or_path=loading.DEFAULT_MODEL, *args, **kwargs):
        if name_or_path not in loading.KNOWN_MODELS:
            return load(name_or_path, *args, **kwargs)
        loading.cache_root().mkdir(parents=True, exist_ok=True)
        with FileLock(str(loading.cache_root() / f"{name_or_path}.load.lock")):
            return load(name_or_path, *args, **kwargs)

    loader.load_model = speculant.load_model = load_once


import pytest  # noqa: E402


@pytest.fixture
def in_process(monkeypatch):
    """Convert GGUF files in this process (no child interpreter: ~5 s less per file); the child route has its own
    tests (tests/test_gguf_files.py)."""
    from speculant.models import loading

    def convert(name, out_dir, meanwhile=None, progress=None, weights=True):
        if meanwhile is not None:
            meanwhile()
        return loading.convert_gguf(Path(name), Path(out_dir), weights)
    monkeypatch.setattr(loading, "convert_gguf_in_child", convert)
