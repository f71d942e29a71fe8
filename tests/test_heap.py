"""The C heap around a model's load (speculant.heap): large blocks mapped while packing, decoding's setting after."""

import platform
import subprocess
import sys

import pytest
import torch

from speculant import heap

GLIBC = platform.libc_ver()[0] == "glibc"
MALLINFO2 = GLIBC and hasattr(__import__("ctypes").CDLL("libc.so.6"), "mallinfo2")     # glibc 2.33 and later


_CHILD = """
import ctypes, torch
from speculant import heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
size = 4 * heap.LOAD_MMAP_THRESHOLD                  # over the load's threshold, under decoding's
assert size < heap.DECODE_MMAP_THRESHOLD
with heap.mapped_allocations():
    before = libc.mallinfo2().hblkhd
    block = torch.empty(size, dtype=torch.uint8)
    print(libc.mallinfo2().hblkhd - before >= size)  # a mapping of its own
    del block
    print(libc.mallinfo2().hblkhd - before < size)   # ... handed back when freed
before = libc.mallinfo2().hblkhd
block = torch.empty(size, dtype=torch.uint8)
print(libc.mallinfo2().hblkhd - before < size)       # from the heap under decoding's threshold
"""


@pytest.mark.skipif(not MALLINFO2, reason="glibc's mallopt and mallinfo2 (glibc 2.33 and later) only")
def test_blocks_over_the_load_threshold_are_mapped_inside_and_not_after():
    """In a fresh interpreter: a block over the threshold is mapped only where no free heap chunk fits it (a
    process's earlier frees may leave one)."""
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "True", "True"]


class _FakeLibc:
    """glibc's ``mallopt`` and ``malloc_trim``, recording their calls."""

    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1

    def malloc_trim(self, pad):
        self.calls.append(("trim", pad))
        return 1


@pytest.fixture
def fake_libc(monkeypatch):
    libc = _FakeLibc()
    monkeypatch.setattr(heap, "_LIBC", libc)
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    return libc


def test_the_decoding_setting_is_restored_when_the_load_raises(fake_libc):
    calls = fake_libc.calls
    with pytest.raises(RuntimeError, match="bad file"):
        with heap.mapped_allocations():
            assert calls == [(heap.M_MMAP_THRESHOLD, heap.LOAD_MMAP_THRESHOLD),
                             (heap.M_TRIM_THRESHOLD, 2 * heap.LOAD_MMAP_THRESHOLD)]
            raise RuntimeError("bad file")
    assert calls[2:] == [(heap.M_MMAP_THRESHOLD, heap.DECODE_MMAP_THRESHOLD),
                         (heap.M_TRIM_THRESHOLD, 2 * heap.DECODE_MMAP_THRESHOLD)]
    heap.release_memory()
    assert calls[-1] == ("trim", 0)


def test_without_glibc_nothing_is_set(monkeypatch):
    monkeypatch.setattr(heap, "_LIBC", False)
    assert heap.set_mmap_threshold(1 << 20) is False
    with heap.mapped_allocations():
        pass
    heap.release_memory()                                      # collects only


def test_mkl_buffers_are_freed_only_when_asked(monkeypatch):
    freed = []
    monkeypatch.setattr(heap, "_MKL_FREE", lambda: freed.append(1))
    heap.release_memory()
    assert freed == []                                         # another thread may be running MKL
    heap.release_memory(mkl=True)
    assert freed == [1]


@pytest.mark.skipif(not (torch.__version__.split("+")[0] == "2.13.0" and platform.system() == "Linux"
                         and platform.machine() == "x86_64"), reason="the pinned torch's Linux x86-64 wheel only")
def test_the_pinned_torch_exports_mkls_free(monkeypatch):
    """The project pins torch 2.13.0, whose CPU library links MKL statically and exports ``mkl_serv_free_buffers``
    (other builds may not: then nothing is freed, and nothing fails)."""
    monkeypatch.setattr(heap, "_MKL_FREE", None)
    found = heap._mkl_free_buffers()
    assert found is not None
    a = torch.randn(256, 256)
    _ = a @ a                                                  # MKL's buffers in use, then freed
    found()


def test_thresholds_the_user_set_are_left_as_set(fake_libc, monkeypatch):
    calls = fake_libc.calls
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
    assert heap.set_mmap_threshold(1 << 20) and calls
    calls.clear()
    for name, value in (("MALLOC_MMAP_THRESHOLD_", "65536"), ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert heap.set_mmap_threshold(1 << 20) is False
    assert calls == []
