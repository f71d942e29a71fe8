"""Build and load our C kernels (``qgemm.c``, ``attention.c``, ``decode_step.c``) on the machine at hand, once per machine.

The sources are compiled with the C compiler inductor uses (``$CC``, ``cc``, ``gcc`` or ``clang``;
``-O3 -mavx2 -mfma -fopenmp -ffp-contract=off``, never ``-ffast-math``, which would let the compiler reorder sums;
no contraction of ``a * b + c`` into FMAs the compiler picks, so every operation is the one written) into one shared
library under ``$SPECULANT_CACHE/kernels/`` (atomic rename; keyed by the sources, the compiler's version, the flags
and the CPU's feature flags) and loaded with :mod:`ctypes`.  The library links the OpenMP runtime torch already
loaded (``libgomp.so.1``), so it runs on torch's thread pool with torch's thread count.

The integer dot products of ``qgemm.c`` come in :data:`ISA_VARIANTS`: AVX2's ``vpmaddubsw``, and ``vpdpbusd`` where
the CPU has AVX512-VNNI or AVX-VNNI (one instruction for what takes two or three on AVX2, as llama.cpp's
``ggml-cpu`` quants use it), on 256-bit vectors or, with AVX-512, on 512-bit ones.  All variants compute the same
bits (exact integer sums, the same float operations after them), so any of them keeps decoding exact; where the CPU
has more than one, :func:`pick_variant` times them at the first load and keeps the fastest for that machine
(whether 512-bit vectors pay differs between CPUs).  ``$SPECULANT_KERNEL_ISA`` (``auto``, the default, or a
variant's name) forces one, to compare them (``benchmarks/step_ab.py --variant``) or to test the VNNI code with
``vpdpbusd`` emulated exactly on AVX2.

:func:`available` says whether the kernels can run here (x86-64 with AVX2 and FMA, a C compiler that builds
them); what needs them is left out (weight format ``w4a8``) or falls back (float64 attention) otherwise.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..cpu import cpu_flags
from ..errors import SpeculantError
from ..paths import cache_root

SOURCES = tuple(Path(__file__).with_name(n) for n in ("qgemm.c", "attention.c", "decode_step.c"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("simd.h", "kernels.h", "qgemm_pairs.h", "qgemm_amx.h"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mprefer-vector-width=256")
_AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
ISA_VARIANTS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx512-vnni": (_AVX512 + ("-DSPEC_DPBUSD=1", "-DSPEC_ZMM=1"), _AVX512_FLAGS),
    "avx512-vnni-ymm": (_AVX512 + ("-DSPEC_DPBUSD=1",), _AVX512_FLAGS),
    "avx-vnni": (("-mavxvnni", "-DSPEC_DPBUSD=2"), frozenset({"avx_vnni"})),
    "amx-int8": (_AVX512 + ("-mamx-tile", "-mamx-int8", "-DSPEC_DPBUSD=1", "-DSPEC_ZMM=1", "-DSPEC_AMX=1"),
                 _AVX512_FLAGS | {"amx_tile", "amx_int8"}),
    "avx2": ((), frozenset()),
    "vnni-emulated": (("-DSPEC_DPBUSD=3",), frozenset()),
    "zmm-emulated": (("-DSPEC_DPBUSD=3", "-DSPEC_ZMM=2"), frozenset()),
    "amx-emulated": (("-DSPEC_DPBUSD=3", "-DSPEC_ZMM=2", "-DSPEC_AMX=2"), frozenset()),
}
"""Kernel variant -> (extra compiler flags, CPU flags it needs besides AVX2/FMA/F16C).  ``amx-int8``: ``avx512-vnni``
with the integer sums of products of a few rows or more by AMX tiles (``qgemm_amx.h``); ``avx512-vnni``: 512-bit
products of two groups of 8 outputs (``qgemm_pairs.h``); ``avx512-vnni-ymm`` and ``avx-vnni``: ``vpdpbusd`` on
256-bit vectors; ``avx2``: ``vpmaddubsw``.  The ``-emulated`` ones (:data:`TEST_VARIANTS`) run the VNNI code
with ``vpdpbusd`` (and 512-bit vectors, and AMX tiles) emulated exactly by AVX2 instructions (and C), for tests."""
TEST_VARIANTS = frozenset({"vnni-emulated", "zmm-emulated", "amx-emulated"})
_LIB: ctypes.CDLL | None = None
_WHY_NOT: str | None = None
_ISA: str | None = None
_LOCK = threading.Lock()


def _cpu_flags() -> set[str]:
    return cpu_flags()


def _compiler() -> str | None:
    names = [os.environ["CC"]] if os.environ.get("CC") else []
    return next((shutil.which(n) for n in names + ["cc", "gcc", "clang"] if shutil.which(n)), None)


def requested_isa() -> str:
    """The kernel variant asked for: ``$SPECULANT_KERNEL_ISA``, or ``auto`` when it is unset or empty.

    Raises:
        SpeculantError: the value is not ``auto`` or a key of :data:`ISA_VARIANTS`.
    """
    name = os.environ.get("SPECULANT_KERNEL_ISA", "").strip().lower() or "auto"
    if name != "auto" and name not in ISA_VARIANTS:
        raise SpeculantError(f"SPECULANT_KERNEL_ISA={name!r} is not a kernel variant; allowed: auto, "
                             + ", ".join(ISA_VARIANTS))
    return name


def check_runs_here(isa: str, flags: set[str] | None = None, label: str | None = None) -> None:
    """Raise unless variant ``isa`` exists and a CPU with ``flags`` (default: this one's) has what it needs.

    Raises:
        SpeculantError: "<label> is not a kernel variant; allowed: ..." or "<label> needs the CPU flags ...,
            which this CPU lacks" (label: 'isa', or "kernel variant 'isa'", unless given).
    """
    if isa not in ISA_VARIANTS:
        raise SpeculantError(f"{label or repr(isa)} is not a kernel variant; allowed: {', '.join(ISA_VARIANTS)}")
    missing = ISA_VARIANTS[isa][1] - (_cpu_flags() if flags is None else flags)
    if missing:
        raise SpeculantError(f"{label or f'kernel variant {isa!r}'} needs the CPU flags {', '.join(sorted(missing))}, "
                             "which this CPU lacks")


def isa_candidates(flags: set[str] | None = None) -> list[str]:
    """The variants :func:`load` considers on a CPU with ``flags`` (default: this one's): under ``auto`` every
    variant the CPU has (:func:`pick_variant` times those that build), else the one requested.

    Raises:
        SpeculantError: :func:`requested_isa`'s, or the requested variant needs CPU flags these lack.
    """
    flags = _cpu_flags() if flags is None else flags
    name = requested_isa()
    if name == "auto":
        have = [n for n in ISA_VARIANTS if n not in TEST_VARIANTS and ISA_VARIANTS[n][1] <= flags]
        if "avx512-vnni-ymm" in have and "avx-vnni" in have:
            have.remove("avx-vnni")           # the same instruction on the same vectors, in another encoding
        return have
    check_runs_here(name, flags, f"SPECULANT_KERNEL_ISA={name!r}")
    return [name]


def loaded_isa() -> str | None:
    """The variant of the loaded library (``None`` before :func:`load` or where the kernels cannot run)."""
    return _ISA


def _digest(cc: str, isa: str) -> str:
    """What a build of variant ``isa`` depends on: the sources, the compiler's version, the flags, the CPU's flags."""
    flags = FLAGS + ISA_VARIANTS[isa][0]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    cpu = " ".join(sorted(_cpu_flags()))
    return hashlib.sha1(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + version.encode()
                        + " ".join(flags).encode() + cpu.encode()).hexdigest()[:16]


def _build(cc: str, isa: str = "avx2") -> Path:
    """Compile :data:`SOURCES` in variant ``isa`` (once per :func:`_digest`) and return the shared library's path.

    Raises:
        SpeculantError: the compiler failed (its last error lines).
    """
    out = cache_root() / "kernels" / f"speculant-kernels-{isa}-{_digest(cc, isa)}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, *ISA_VARIANTS[isa][0], *map(str, SOURCES), "-o", tmp], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise SpeculantError(f"{cc} could not build the kernels: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load() -> ctypes.CDLL | None:
    """The loaded library (built on the first call: of :func:`isa_candidates`, the one variant that builds, or the
    fastest of several, :func:`pick_variant`), or ``None`` where it cannot run (see :func:`unavailable_reason`).

    Raises:
        SpeculantError: ``$SPECULANT_KERNEL_ISA`` is not a variant, or names one this CPU lacks.
    """
    if _LIB is not None or _WHY_NOT is not None:
        return _LIB
    with _LOCK:                               # one load at a time (threads of a server, say)
        return _load()


def _load() -> ctypes.CDLL | None:
    global _LIB, _WHY_NOT, _ISA
    if _LIB is not None or _WHY_NOT is not None:
        return _LIB
    flags, cc = _cpu_flags(), _compiler()
    _WHY_NOT = _why_not_here(flags, cc)
    if _WHY_NOT is not None:
        return None
    libs: dict[str, ctypes.CDLL] = {}
    for isa, error in _build_all(cc, isa_candidates(flags)).items():
        try:
            if error is not None:
                raise error
            libs[isa] = load_variant(isa, cc)
        except (OSError, SpeculantError, subprocess.SubprocessError) as e:
            _WHY_NOT = f"could not be built here: {e}"
    if not libs:
        return None
    isa = next(iter(libs)) if len(libs) == 1 else pick_variant(libs, cc)
    _LIB, _ISA, _WHY_NOT = libs[isa], isa, None
    return _LIB


def _why_not_here(flags: set[str], cc: str | None) -> str | None:
    """Why our kernels cannot be built on a CPU with ``flags`` with compiler ``cc`` (``None``: they can)."""
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= flags:
        return "needs an x86-64 CPU with AVX2 and FMA"
    if cc is None:
        return "needs a C compiler (cc, gcc or clang; $CC)"
    return None


def _build_all(cc: str, candidates: list[str]) -> dict[str, Exception | None]:
    """Build what :func:`load` will load from ``candidates``: the cached pick, else all of them (side by side:
    a first load on a CPU with several variants).  Returns each variant's build error (``None``: built)."""
    picked = _cached_pick(cc, candidates) if len(candidates) > 1 else None
    todo = [picked] if picked else candidates
    if len(todo) > 1:
        print(f"speculant: building the kernel variants {', '.join(todo)} ...", file=sys.stderr, flush=True)
    with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1)) as pool:
        return dict(zip(todo, pool.map(lambda isa: _try_build(cc, isa), todo)))


def prebuild() -> None:
    """Compile the variants :func:`load` will need, without loading or timing them (which :func:`load` does
    later, on an otherwise quiet machine): the loader runs this while the model converts.  Quiet where the
    kernels cannot run here; errors are left for :func:`load`."""
    flags, cc = _cpu_flags(), _compiler()
    if _why_not_here(flags, cc) is None:
        try:
            _build_all(cc, isa_candidates(flags))
        except SpeculantError:
            pass


def _try_build(cc: str, isa: str) -> Exception | None:
    """:func:`_build`'s error, or ``None`` when the variant is built."""
    try:
        _build(cc, isa)
    except (OSError, SpeculantError, subprocess.SubprocessError) as e:
        return e
    return None


PICK_SHAPES = (("spec_w4a8_f32", 576, 3072), ("spec_w8a8_f32", 576, 8192))
"""Products timed by :func:`pick_variant` (entry point, inputs K, outputs N): a SmolLM2-sized fused gate/up
projection in 4 bits and a slice of an LM head in 8 bits, each for 1 and 5 rows (a step and a verification block)."""


def _pick_path(cc: str, candidates) -> Path:
    """Where the pick among ``candidates`` is kept: keyed by their builds' :func:`_digest` and torch's thread count."""
    import torch
    key = json.dumps({"variants": {isa: _digest(cc, isa) for isa in sorted(candidates)},
                      "threads": torch.get_num_threads()}, sort_keys=True)
    return cache_root() / "kernels" / f"pick-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def _cached_pick(cc: str, candidates) -> str | None:
    try:
        pick = json.loads(_pick_path(cc, candidates).read_text())["variant"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pick if pick in candidates else None


def time_variants(libs: dict[str, ctypes.CDLL], repeats: int = 30) -> dict[str, float]:
    """Seconds per pass over :data:`PICK_SHAPES` (1 and 5 rows each) for each loaded variant, the best of
    ``repeats`` passes, variants alternated (random codes, float16 scales of 0.1, normal activations)."""
    rng = random.Random(0)
    data = {}
    for entry, k, n in PICK_SHAPES:
        nbytes = n * k // 2 if entry == "spec_w4a8_f32" else n * k
        codes = (ctypes.c_uint8 * nbytes).from_buffer_copy(rng.randbytes(nbytes))
        scales = (ctypes.c_uint16 * (n * k // 32))(*([0x2E66] * (n * k // 32)))
        x = (ctypes.c_float * (5 * k))(*(rng.gauss(0.0, 1.0) for _ in range(5 * k)))
        data[entry] = (k, n, codes, scales, x, (ctypes.c_float * (5 * n))())
    best = {isa: float("inf") for isa in libs}
    for _ in range(repeats):
        for isa, lib in libs.items():
            t0 = time.perf_counter()
            for entry, (k, n, codes, scales, x, y) in data.items():
                extra = (scales,) if entry == "spec_w4a8_f32" else ()
                for m in (1, 5):
                    getattr(lib, entry)(x, m, k, codes, scales, *extra, n, y, 0)
            best[isa] = min(best[isa], time.perf_counter() - t0)
    return best


def pick_variant(libs: dict[str, ctypes.CDLL], cc: str) -> str:
    """The fastest of the loaded variants ``libs`` (:func:`time_variants`; they compute the same bits), measured
    once per machine and kept as JSON beside the builds (atomic rename); progress on stderr."""
    path = _pick_path(cc, libs)
    print(f"speculant: timing the kernel variants {', '.join(libs)} (once for this machine) ...", file=sys.stderr,
          flush=True)
    seconds = time_variants(libs)
    pick = min(seconds, key=seconds.get)
    print("speculant: " + ", ".join(f"{isa} {s * 1e3:.2f} ms" for isa, s in seconds.items()) + f"; using {pick}",
          file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump({"variant": pick, "ms": {isa: round(s * 1e3, 3) for isa, s in seconds.items()},
                   "shapes": PICK_SHAPES, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, f)
    os.replace(tmp, path)
    return pick


def load_variant(isa: str, cc: str | None = None) -> ctypes.CDLL:
    """Build (once per machine) and load the library in variant ``isa`` (a key of :data:`ISA_VARIANTS`), apart from
    the one :func:`load` put in use: tests and benchmarks compare variants with it.

    Raises:
        SpeculantError: not a variant, or one this CPU cannot run (:func:`check_runs_here`); no C compiler, or it
            could not build the variant.
        OSError: the library could not be loaded.
    """
    check_runs_here(isa)
    cc = cc or _compiler()
    if cc is None:
        raise SpeculantError("needs a C compiler (cc, gcc or clang; $CC)")
    lib = ctypes.CDLL(str(_build(cc, isa)))
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.spec_quantize_rows.argtypes = [p, i, i, p, p, p]
    lib.spec_quantize_rows.restype = None
    lib.spec_w4a8_f32.argtypes = [p, i, i, p, p, p, i, p, i]
    lib.spec_w8a8_f32.argtypes = lib.spec_w5a8_f32.argtypes = [p, i, i, p, p, i, p, i]
    lib.spec_w4a8_f32.restype = lib.spec_w8a8_f32.restype = lib.spec_w5a8_f32.restype = ctypes.c_int
    lib.spec_w4a8k_f32.argtypes = [p, i, i, p, p, p, i, p, i]
    lib.spec_w8a8k_f32.argtypes = [p, i, i, p, p, p, i, i, p, i]
    lib.spec_w4a8k_f32.restype = lib.spec_w8a8k_f32.restype = ctypes.c_int
    lib.spec_w6a8k_f32.argtypes = lib.spec_w4a8q4k_f32.argtypes = [p, i, i, p, p, p, i, p, i]
    lib.spec_w6a8k_f32.restype = lib.spec_w4a8q4k_f32.restype = ctypes.c_int
    lib.spec_attention.argtypes = [p, p, p, i, p, i, i, i, i, i, ctypes.c_float, i, p]
    lib.spec_attention.restype = ctypes.c_int
    lib.spec_attention_ragged.argtypes = [i, p, p, p, p, p, p, i, p, p, p, p, i, i, i, ctypes.c_float, i, p]
    lib.spec_attention_ragged.restype = ctypes.c_int
    lib.spec_run_layers.argtypes = [p, i, i, i, p, p, p, p, p, p, i, p, p, p, p, p, p, p]
    lib.spec_run_layers.restype = ctypes.c_int
    lib.spec_decode_layers.argtypes = [p, i, i, i, i, i, p, p, i, i, p, p, p, p, p, i, p, p, p]
    lib.spec_decode_layers.restype = ctypes.c_int
    lib.spec_draft_head.argtypes = [p, p, p, p, ctypes.c_float, i, p, p, i, p, i, i, p, p, i, i, p, p, p, i, p, i, p,
                                    p]
    lib.spec_draft_head.restype = ctypes.c_int
    lib.spec_rms_norm.argtypes = [p, p, i, i, ctypes.c_float, p]
    lib.spec_rms_norm.restype = None
    return lib


WEIGHT_PREFETCH_LIMIT = 65536
"""Largest weight prefetch distance the products accept [bytes]."""


def check_weight_prefetch(ahead: int) -> int:
    """``ahead`` if it is a weight prefetch distance the products take (the last argument of ``spec_w4a8_f32``,
    ``spec_w8a8_f32`` and the fused step's model struct: how many bytes ahead of the codes in use they prefetch; 0:
    none; ``qgemm.c``'s header).  The distance that pays depends on the machine
    (:func:`speculant.runtime.tune.measure_weight_prefetch`); results never depend on it.

    Raises:
        ValueError: ``ahead`` is not 0 or a multiple of 64 up to :data:`WEIGHT_PREFETCH_LIMIT`.
    """
    if isinstance(ahead, bool) or not isinstance(ahead, int) or not 0 <= ahead <= WEIGHT_PREFETCH_LIMIT \
            or ahead % 64:
        raise ValueError(f"weight prefetch distance {ahead!r}: allowed: 0 (none) or a multiple of 64 bytes up to "
                         f"{WEIGHT_PREFETCH_LIMIT}")
    return ahead


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
