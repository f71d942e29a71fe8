"""Build and load our C kernels (``qgemm.c``, ``attention.c``, ``decode_step.c``, ``sampling.c``) on the machine at
hand, once per machine.

The sources are compiled with the C compiler inductor uses (``$CC``, ``cc``, ``gcc`` or ``clang``;
``-O3 -mavx2 -mfma -fopenmp -ffp-contract=off``, never ``-ffast-math``, which would let the compiler reorder sums;
no contraction of ``a * b + c`` into FMAs the compiler picks, so every operation is the one written) into one shared
library under ``$SPECULANT_CACHE/kernels/`` (atomic rename; keyed by the sources, the compiler's version, the flags
and the CPU's feature flags) and loaded with :mod:`ctypes`.  The library links the OpenMP runtime torch already
loaded (``libgomp.so.1``), so it runs on torch's thread pool with torch's thread count.

The integer dot products of ``qgemm.c`` come in :data:`ISA_VARIANTS`: AVX2's ``vpmaddubsw``, and ``vpdpbusd`` where
the CPU has AVX512-VNNI or AVX-VNNI (one instruction for what takes two or three on AVX2, as llama.cpp's
``ggml-cpu`` quants use it), on 256-bit vectors or, with AVX-512, on 512-bit ones.  All variants compute the same
bits (exact integer sums, the same float operations after them), so any of them keeps decoding exact, and a product
may run on any of them: where the CPU has more than one, :func:`pick_variant` times them at the first load, on
products whose weights stream from memory as a decoding step's do, at row counts from one (a decoding step) to a
prefill chunk, and keeps per machine the variant for one row and, where another one wins from some row count on by
more than the noise, that one for blocks from that row count on (:func:`for_rows`: a CPU may run one row fastest
with AVX2's ``vpmaddubsw`` and a long prompt fastest with 512-bit ``vpdpbusd``; BENCHMARKS.md BA); the row count
from which a 512-bit variant pairs groups is measured first (:func:`measure_pair_rows`).  ``$SPECULANT_KERNEL_ISA``
(``auto``, the default, or a variant's name) forces one, to compare them (``benchmarks/step_ab.py --variant``) or to test the VNNI code with
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

SOURCES = tuple(Path(__file__).with_name(n) for n in ("qgemm.c", "attention.c", "decode_step.c",
                                                                 "sampling.c"))
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
products of two groups of 8 outputs (``qgemm_pairs.h``) from a row count measured per machine
(:func:`measure_pair_rows`), 256-bit groups below it; ``avx512-vnni-ymm`` and ``avx-vnni``: ``vpdpbusd`` on
256-bit vectors alone (not candidates beside ``avx512-vnni``, whose code below its threshold they are); ``avx2``:
``vpmaddubsw``.  The ``-emulated`` ones (:data:`TEST_VARIANTS`) run the VNNI code
with ``vpdpbusd`` (and 512-bit vectors, and AMX tiles) emulated exactly by AVX2 instructions (and C), for tests."""
TEST_VARIANTS = frozenset({"vnni-emulated", "zmm-emulated", "amx-emulated"})
_LIB: ctypes.CDLL | None = None
_WHY_NOT: str | None = None
_ISA: str | None = None
_LIB_MANY: ctypes.CDLL | None = None     # the variant for products of _MANY_ROWS rows or more (None: _LIB for all)
_MANY_ISA: str | None = None
_MANY_ROWS = 0
_SIGNATURE = ""
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
        if "avx512-vnni" in have and "avx512-vnni-ymm" in have:
            have.remove("avx512-vnni-ymm")    # avx512-vnni's own code below its measured pair threshold
        return have
    check_runs_here(name, flags, f"SPECULANT_KERNEL_ISA={name!r}")
    return [name]


def kernel_signature() -> str:
    """What distinguishes the loaded library's speed (its variant, its build's :func:`_digest`, its pair threshold),
    for measurements kept with it (``""`` where none is loaded)."""
    load()
    return _SIGNATURE


def loaded_isa() -> str | None:
    """The variant of the loaded library, the one for a single row (``None`` before :func:`load` or where the
    kernels cannot run)."""
    return _ISA


def many_rows() -> tuple[ctypes.CDLL, str, int] | None:
    """``(library, variant, rows)``: the variant :func:`load` keeps for products of ``rows`` rows or more, where
    one other than :func:`loaded_isa`'s wins there (``None``: the loaded library runs every row count)."""
    load()
    return None if _LIB_MANY is None else (_LIB_MANY, _MANY_ISA, _MANY_ROWS)


def for_rows(rows: int) -> ctypes.CDLL | None:
    """The loaded library that runs products of ``rows`` rows (:func:`many_rows` from its row count on, else
    :func:`load`'s); ``None`` where the kernels cannot run.  Every library computes the same bits."""
    lib = _LIB if _LIB is not None else load()
    return _LIB_MANY if _LIB_MANY is not None and rows >= _MANY_ROWS else lib


def describe() -> str | None:
    """The variants in use, for reports: ``"avx2"``, or ``"avx2; avx512-vnni from 3 rows"`` (``None``: none
    loaded)."""
    load()
    if _ISA is None:
        return None
    return _ISA + (f"; {_MANY_ISA} from {_MANY_ROWS} rows" if _LIB_MANY is not None else "")


def _digest(cc: str, isa: str) -> str:
    """What a build of variant ``isa`` depends on: the sources, the compiler's version, the flags, the CPU's flags."""
    flags = FLAGS + ISA_VARIANTS[isa][0]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    cpu = " ".join(sorted(_cpu_flags()))
    return hashlib.sha1(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + version.encode()
                        + " ".join(flags).encode() + cpu.encode()).hexdigest()[:16]


def _built_path(cc: str, isa: str) -> Path:
    """Where variant ``isa``'s build is kept."""
    return cache_root() / "kernels" / f"speculant-kernels-{isa}-{_digest(cc, isa)}.so"


def _build(cc: str, isa: str = "avx2") -> Path:
    """Compile :data:`SOURCES` in variant ``isa`` (once per :func:`_digest`) and return the shared library's path.

    Raises:
        SpeculantError: the compiler failed (its last error lines).
    """
    out = _built_path(cc, isa)
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
    global _LIB, _WHY_NOT, _ISA, _SIGNATURE, _LIB_MANY, _MANY_ISA, _MANY_ROWS
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
    kept = _kept_pick(cc, isa_candidates(flags))
    if kept is not None and all(v in libs for v in _kept_variants(kept)):   # measured before: picks, pair thresholds
        isa, many = kept["variant"], kept["many"]
        for v in _kept_variants(kept):
            libs[v].spec_set_pair_rows(int(kept["pair_rows"].get(v, 1)))
    elif len(libs) == 1 and not _has_pairs(next(iter(libs))):
        isa, many = next(iter(libs)), None                     # nothing to measure
    else:
        isa, many = pick_variant(libs, cc)
    _LIB, _ISA, _WHY_NOT = libs[isa], isa, None
    _LIB_MANY, _MANY_ISA, _MANY_ROWS = (libs[many["variant"]], many["variant"], int(many["from_rows"])) if many \
        else (None, None, 0)
    _SIGNATURE = f"{isa}-{_digest(cc, isa)}-pairs{_LIB.spec_pair_rows()}" + (
        f"+{_MANY_ISA}-{_digest(cc, _MANY_ISA)}-pairs{_LIB_MANY.spec_pair_rows()}-from{_MANY_ROWS}" if many else "")
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
    todo = picked or candidates
    unbuilt = [isa for isa in todo if not _built_path(cc, isa).is_file()]
    if len(unbuilt) > 1:
        print(f"speculant: building the kernel variants {', '.join(unbuilt)} ...", file=sys.stderr, flush=True)
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


STREAM_SHAPES = (("spec_w4a8_f32", 2048, 2048), ("spec_w8a8_f32", 1024, 2048))
"""Products timed by :func:`pick_variant` and :func:`measure_pair_rows` (entry point, inputs K, outputs N): a 4-bit
projection and an 8-bit one (LM head), in copies read in turn whose codes (:data:`STREAM_BYTES` in all) do not fit the
caches, as a decoding step streams its weights from memory: a variant's speed in the caches is not its speed there."""
STREAM_BYTES = 64 << 20
PAIR_ROWS_GRID = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64)
"""Row counts at which :func:`measure_pair_rows` times 256-bit groups against 512-bit pairs: every count up to 8,
where verification blocks lie and where the two routes cross (BENCHMARKS.md BA.3)."""
ROWS_GRID = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)
"""Row counts at which :func:`time_variants` times each variant: a decoding step (1), verification blocks and trees
(2-16), prefill chunks (64: bound by arithmetic as a 512-token prompt is)."""
VARIANT_MARGIN = 0.03
"""How much faster [fraction of the time] another variant must be than the default (at one row) or than the one-row
pick (from a row count on) to be used there: more than the spread of repeated timings."""


def _has_pairs(isa: str) -> bool:
    """Whether variant ``isa`` runs 512-bit pairs (qgemm_pairs.h), whose row threshold :func:`measure_pair_rows`
    measures."""
    return any(f.startswith("-DSPEC_ZMM") for f in ISA_VARIANTS[isa][0])


class _Streams:
    """:data:`STREAM_SHAPES`' copies (random codes, fp16 scales of 0.01) and float32 rows for up to
    ``max(PAIR_ROWS_GRID)`` rows: what :func:`time_variants` and :func:`measure_pair_rows` time."""

    def __init__(self, total: int = STREAM_BYTES):
        import torch
        g = torch.Generator().manual_seed(0)
        rows = max(PAIR_ROWS_GRID)
        self.sets = []
        for entry, k, n in STREAM_SHAPES:
            nbytes = n * k // 2 if entry == "spec_w4a8_f32" else n * k
            copies = max(2, total // len(STREAM_SHAPES) // nbytes)
            codes = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(copies)]
            scales = torch.full((n * k // 32,), 0.01, dtype=torch.float16)
            self.sets.append((entry, k, n, codes, scales, torch.randn(rows, k, generator=g),
                              torch.empty(rows, n)))

    def run(self, lib: ctypes.CDLL, rows: int, share: float = 1.0) -> float:
        """Seconds for one pass of ``rows``-row products over the first ``share`` of each set's copies."""
        t0 = time.perf_counter()
        for entry, k, n, codes, scales, x, y in self.sets:
            extra = (0,) if entry == "spec_w4a8_f32" else ()          # Q4_0: no stored mins
            for c in codes[:max(1, round(len(codes) * share))]:
                getattr(lib, entry)(x.data_ptr(), rows, k, c.data_ptr(), scales.data_ptr(), *extra, n, y.data_ptr(), 0)
        return time.perf_counter() - t0


def measure_pair_rows(lib: ctypes.CDLL, streams: "_Streams | None" = None, repeats: int = 5,
                      margin: float = 0.03) -> int:
    """The row count from which a 512-bit variant's products run on pairs of groups (``spec_set_pair_rows``; fewer
    rows: on 256-bit groups alone), measured here: at each of :data:`PAIR_ROWS_GRID` both routes time
    :class:`_Streams`' products, alternated, best of ``repeats``; the threshold is one above the largest row count
    at which groups beat pairs by more than ``margin`` (1: pairs everywhere, the default).  Both routes compute the
    same bits.  Leaves the library at the threshold."""
    streams = streams or _Streams()
    best = {(m, route): float("inf") for m in PAIR_ROWS_GRID for route in ("groups", "pairs")}
    for m in PAIR_ROWS_GRID:
        share = min(1.0, 8 / m)               # many rows are bound by arithmetic: fewer copies time them as well
        for _ in range(repeats):
            for route, threshold in (("groups", m + 1), ("pairs", 1)):
                lib.spec_set_pair_rows(threshold)
                best[m, route] = min(best[m, route], streams.run(lib, m, share))
    won = [m for m in PAIR_ROWS_GRID if best[m, "groups"] < (1 - margin) * best[m, "pairs"]]
    threshold = max(won) + 1 if won else 1
    lib.spec_set_pair_rows(threshold)
    return threshold


def _pick_path(cc: str, candidates) -> Path:
    """Where the pick among ``candidates`` is kept: keyed by their builds' :func:`_digest` and torch's thread count."""
    import torch
    key = json.dumps({"variants": {isa: _digest(cc, isa) for isa in sorted(candidates)},
                      "threads": torch.get_num_threads()}, sort_keys=True)
    return cache_root() / "kernels" / f"pick-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def _kept_pick(cc: str, candidates) -> dict | None:
    """The kept pick among ``candidates`` (:func:`pick_variant`'s JSON), or ``None`` (none, or one measured another
    way than :func:`pick_variant` measures now: on products in the caches, without a pair threshold, or without
    the variant for many rows)."""
    try:
        kept = json.loads(_pick_path(cc, candidates).read_text())
        current = kept.get("stream_bytes") == STREAM_BYTES and isinstance(kept.get("pair_rows"), dict) \
            and "many" in kept and kept.get("rows_grid") == list(ROWS_GRID) \
            and kept.get("pair_rows_grid") == list(PAIR_ROWS_GRID)
        return kept if current and all(v in candidates for v in _kept_variants(kept)) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _kept_variants(kept: dict) -> list[str]:
    """The variants a kept pick loads: the one-row pick, and the one for many rows if any."""
    return [kept["variant"]] + ([kept["many"]["variant"]] if kept["many"] else [])


def _cached_pick(cc: str, candidates) -> list[str] | None:
    kept = _kept_pick(cc, candidates)
    return None if kept is None else _kept_variants(kept)


def time_variants(libs: dict[str, ctypes.CDLL], repeats: int = 10, streams: "_Streams | None" = None
                  ) -> dict[str, dict[int, float]]:
    """``{variant: {rows: seconds}}``: seconds per pass over :class:`_Streams`' products of each row count of
    :data:`ROWS_GRID` (fewer copies from 8 rows on, which are bound by arithmetic) for each loaded variant (at its
    pair-row threshold as set), the best of ``repeats`` passes, variants alternated."""
    streams = streams or _Streams()
    best = {isa: {m: float("inf") for m in ROWS_GRID} for isa in libs}
    for m in ROWS_GRID:
        share = min(1.0, 8 / m)
        for _ in range(repeats):
            for isa, lib in libs.items():
                best[isa][m] = min(best[isa][m], streams.run(lib, m, share))
    return best


def split_by_rows(seconds: dict[str, dict[int, float]], margin: float = VARIANT_MARGIN) -> tuple[str, dict | None]:
    """The variants to use from :func:`time_variants`' ``seconds``: ``(one_row, many)`` where ``one_row`` is the
    default (``avx2``, the code every CPU our kernels run on has, where timed; else the first) unless another is
    faster at one row by more than ``margin``, and ``many`` ``{"variant": v, "from_rows": r}`` names the variant fastest at the largest row count
    where it beats ``one_row`` by more than ``margin`` at every grid row count from ``r`` on (``None``: none
    does)."""
    default = "avx2" if "avx2" in seconds else next(iter(seconds))
    best = min(seconds, key=lambda isa: seconds[isa][1])
    one_row = best if seconds[best][1] < (1 - margin) * seconds[default][1] else default
    top = max(ROWS_GRID)
    many = min(seconds, key=lambda isa: seconds[isa][top])
    from_rows = None
    for m in sorted(ROWS_GRID, reverse=True):
        if many == one_row or not seconds[many][m] < (1 - margin) * seconds[one_row][m]:
            break
        from_rows = m
    return one_row, (None if from_rows is None else {"variant": many, "from_rows": from_rows})


def pick_variant(libs: dict[str, ctypes.CDLL], cc: str) -> tuple[str, dict | None]:
    """The variants to use among the loaded ``libs`` (:func:`split_by_rows` of :func:`time_variants`, each 512-bit
    variant at its measured :func:`measure_pair_rows`; they compute the same bits): ``(one_row, many)``, measured
    once per machine and kept as JSON beside the builds (atomic rename); progress on stderr."""
    path = _pick_path(cc, libs)
    print(f"speculant: timing the kernel variants {', '.join(libs)} (once for this machine) ...", file=sys.stderr,
          flush=True)
    streams = _Streams()
    pair_rows = {isa: measure_pair_rows(lib, streams) for isa, lib in libs.items() if _has_pairs(isa)}
    seconds = time_variants(libs, streams=streams)
    pick, many = split_by_rows(seconds)
    print("speculant: " + "; ".join(f"{isa} " + ", ".join(f"{s[m] * 1e3:.2f}" for m in (1, 5, max(ROWS_GRID)))
                                    for isa, s in seconds.items())
          + f" ms (1, 5, {max(ROWS_GRID)} rows); using {pick}"
          + (f" (512-bit pairs from {pair_rows[pick]} rows on)" if pick in pair_rows else "")
          + (f", {many['variant']} from {many['from_rows']} rows on" if many else ""), file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump({"variant": pick, "many": many, "rows_grid": list(ROWS_GRID), "pair_rows_grid": list(PAIR_ROWS_GRID),
                   "ms": {isa: {str(m): round(t * 1e3, 3) for m, t in s.items()} for isa, s in seconds.items()},
                   "pair_rows": pair_rows, "shapes": STREAM_SHAPES, "stream_bytes": STREAM_BYTES,
                   "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, f)
    os.replace(tmp, path)
    return pick, many


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
    lib.spec_softmax_rows.argtypes = [p, i, i, ctypes.c_float, p]
    lib.spec_softmax_rows.restype = None
    lib.spec_draw.argtypes = [p, i, p, p, i, ctypes.c_double, p]
    lib.spec_draw.restype = i
    lib.spec_set_pair_rows.argtypes = [i]
    lib.spec_set_pair_rows.restype = None
    lib.spec_pair_rows.restype = i
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
