"""The process's C heap around a model's load: large blocks mapped while a model is packed, free memory handed back.

glibc serves a ``malloc`` at or above its mmap threshold with a mapping of its own, returned to the system when freed,
and smaller ones from the heap, whose freed parts stay resident until reused or trimmed.  The threshold is dynamic:
each freed mapping under 32 MiB raises it to that block's size.  A first load packs a model tensor by tensor, so after
its first large free every packed buffer and temporary under 32 MiB came from the heap, and the heap's freed
temporaries added to the load's peak (a 1B-parameter file's first load peaked ~160 MiB higher; BENCHMARKS.md BG).
:func:`mapped_allocations` serves blocks of :data:`LOAD_MMAP_THRESHOLD` and more by mappings while a model is read and
packed (those that no free heap chunk fits: glibc takes a fitting one first), and then sets
:data:`DECODE_MMAP_THRESHOLD`, where the dynamic threshold ends, for decoding: every load (the first, which measures
the machine's timings, and the later ones, which reuse them) leaves decoding under the same allocator setting.  Both
are process-wide, like torch's thread count; elsewhere than glibc nothing changes, and where the user set glibc's
thresholds (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or ``glibc.malloc`` tunables in
``GLIBC_TUNABLES``) they are left as set.

Below everything: imports nothing of speculant.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters (``malloc.h``): the free memory at the heap's top kept rather than returned to the
system, and the mmap threshold; setting either turns their dynamic adjustment off."""
LOAD_MMAP_THRESHOLD = 1 << 20
"""Blocks mapped while a model is read and packed [bytes]: at least a few pages, so that the many small allocations of
reading a file's tensor table stay on the heap."""
DECODE_MMAP_THRESHOLD = 32 << 20
"""The threshold after a load [bytes]: glibc's ceiling for its dynamic threshold on 64-bit systems
(``DEFAULT_MMAP_THRESHOLD_MAX``), the value it reaches once a 32 MiB mapping was freed; decoding's temporaries under
it (logits, verification blocks) reuse the heap instead of faulting in fresh pages on every step."""

_LIBC: object = None


def user_set_thresholds() -> bool:
    """Whether the environment sets glibc's mmap or trim threshold (then :func:`set_mmap_threshold` leaves them)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) or any(
        name in tunables for name in ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold"))


def _libc():
    """glibc's handle (``None`` elsewhere: then :func:`release_memory` only collects and nothing else changes)."""
    global _LIBC
    if _LIBC is None:
        try:
            lib = ctypes.CDLL("libc.so.6")
            _LIBC = lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else False
        except OSError:
            _LIBC = False
    return _LIBC or None


_MKL_FREE: object = None


def _mkl_free_buffers():
    """MKL's ``mkl_serv_free_buffers`` in torch's CPU library where torch links MKL (``None`` elsewhere)."""
    global _MKL_FREE
    if _MKL_FREE is None:
        _MKL_FREE = False
        try:
            import torch

            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
            _MKL_FREE = lib.mkl_serv_free_buffers
            _MKL_FREE.restype, _MKL_FREE.argtypes = None, []
        except (OSError, AttributeError, ImportError):
            pass
    return _MKL_FREE or None


def release_memory(mkl: bool = False) -> None:
    """Collect garbage and hand the C heap's free pages back to the system (glibc ``malloc_trim``): after a large
    model copy is dropped, so that the next large allocation does not add to a peak of memory the process keeps but no
    longer uses.  ``mkl``: also have MKL free the buffers its memory manager keeps (the tuner's float32 products leave
    ~25 MiB there): only where no other thread can be running MKL (the loader, after the tuner)."""
    gc.collect()
    free = _mkl_free_buffers() if mkl else None
    if free is not None:
        free()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve ``malloc`` blocks of ``nbytes`` [bytes] and more by mappings of their own and keep up to twice that free
    at the heap's top (glibc's dynamic rule: a block just under the threshold, freed and allocated again each step,
    is not returned and faulted in again each time); ``False`` where not glibc or where the user set them
    (:func:`user_set_thresholds`)."""
    libc = _libc()
    if libc is None or user_set_thresholds():
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(nbytes))) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 * int(nbytes)))


@contextlib.contextmanager
def mapped_allocations():
    """Blocks of :data:`LOAD_MMAP_THRESHOLD` bytes and more mapped inside the ``with`` (a model's read and packing),
    :data:`DECODE_MMAP_THRESHOLD` after it, also when it raises (see the module docstring)."""
    set_mmap_threshold(LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        set_mmap_threshold(DECODE_MMAP_THRESHOLD)
