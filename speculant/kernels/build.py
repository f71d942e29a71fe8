"""Build and load our C kernels (``qgemm.c``, ``attention.c``, ``decode_step.c``) on the machine at hand, once per machine.

The sources are compiled with the C compiler inductor uses (``$CC``, ``cc``, ``gcc`` or ``clang``;
``-O3 -mavx2 -mfma -fopenmp -ffp-contract=off``, never ``-ffast-math``, which would let the compiler reorder sums;
no contraction of ``a * b + c`` into FMAs the compiler picks, so every operation is the one written) into one shared
library under ``$SPECULANT_CACHE/kernels/`` (atomic rename; keyed by the sources, the compiler's version, the flags
and the CPU's feature flags) and loaded with :mod:`ctypes`.  The library links the OpenMP runtime torch already
loaded (``libgomp.so.1``), so it runs on torch's thread pool with torch's thread count.

:func:`available` says whether the kernels can run here (x86-64 with AVX2 and FMA, a C compiler that builds
them); what needs them is left out (weight format ``w4a8``) or falls back (float64 attention) otherwise.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import SpeculantError

SOURCES = tuple(Path(__file__).with_name(n) for n in ("qgemm.c", "attention.c", "decode_step.c"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("simd.h", "kernels.h"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_LIB: ctypes.CDLL | None = None
_WHY_NOT: str | None = None


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compiler() -> str | None:
    names = [os.environ["CC"]] if os.environ.get("CC") else []
    return next((shutil.which(n) for n in names + ["cc", "gcc", "clang"] if shutil.which(n)), None)


def _build(cc: str) -> Path:
    """Compile :data:`SOURCES` (once per sources, compiler, flags and CPU) and return the shared library's path."""
    from ..models.loading import cache_root
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    cpu = " ".join(sorted(_cpu_flags()))
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + version.encode() + " ".join(FLAGS).encode()
                          + cpu.encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"speculant-kernels-{digest}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise SpeculantError(f"{cc} could not build the kernels: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load() -> ctypes.CDLL | None:
    """The loaded library (built on the first call), or ``None`` where it cannot run (see :func:`unavailable_reason`)."""
    global _LIB, _WHY_NOT
    if _LIB is not None or _WHY_NOT is not None:
        return _LIB
    flags = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= flags:
        _WHY_NOT = "needs an x86-64 CPU with AVX2 and FMA"
        return None
    cc = _compiler()
    if cc is None:
        _WHY_NOT = "needs a C compiler (cc, gcc or clang; $CC)"
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, SpeculantError, subprocess.SubprocessError) as e:
        _WHY_NOT = f"could not be built here: {e}"
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.spec_quantize_rows.argtypes = [p, i, i, p, p, p]
    lib.spec_quantize_rows.restype = None
    lib.spec_w4a8_f32.argtypes = [p, i, i, p, p, p, i, p]
    lib.spec_w8a8_f32.argtypes = [p, i, i, p, p, i, p]
    lib.spec_w4a8_f32.restype = lib.spec_w8a8_f32.restype = ctypes.c_int
    lib.spec_attention.argtypes = [p, p, p, i, p, i, i, i, i, i, ctypes.c_float, p]
    lib.spec_attention.restype = ctypes.c_int
    lib.spec_attention_ragged.argtypes = [i, p, p, p, p, p, p, i, p, p, p, p, i, i, i, ctypes.c_float, p]
    lib.spec_attention_ragged.restype = ctypes.c_int
    lib.spec_run_layers.argtypes = [p, i, i, i, p, p, p, p, p, p, p, p, p, p]
    lib.spec_run_layers.restype = ctypes.c_int
    _LIB = lib
    return lib


def available() -> bool:
    """Whether our kernels run on this machine (builds them on the first call)."""
    return load() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (``None`` when it is True)."""
    load()
    return _WHY_NOT


def require(what: str = "speculant's C kernels", allowed: str = "") -> ctypes.CDLL:
    """The loaded kernel library.

    Raises:
        SpeculantError: it cannot run here: "<what> <the reason>[; allowed here: <allowed>]".
    """
    lib = load()
    if lib is None:
        raise SpeculantError(f"{what} {_WHY_NOT}" + (f"; allowed here: {allowed}" if allowed else ""))
    return lib
