"""Our W4A8/W8A8 kernel (speculant/kernels/qgemm.c): the products it computes, batch invariance by
construction, and what happens where it cannot run."""

import json

import pytest
import torch

from helpers import use_kernels

from speculant.errors import SpeculantError
from speculant.kernels import build, qgemm
from speculant.runtime import formats, tune
from speculant.runtime.formats import W4A8Linear, W8A8Linear, pack_linear, quantize_q4, quantize_q8
from speculant.runtime.executor import executor_of

needs_kernel = pytest.mark.skipif(not qgemm.available(), reason=f"w4a8 kernel: {qgemm.unavailable_reason()}")


def reference_quantize(x):
    """llama.cpp's Q8_1 in torch: per block of 32, d = max|x| / 127, q = round-half-even(x / d), s = d * sum(q)."""
    m, k = x.shape
    blocks = x.view(m, -1, 32)
    d = blocks.abs().amax(-1) / 127.0
    q = torch.round(blocks * torch.where(d > 0, 1.0 / d, torch.zeros_like(d))[..., None])
    return q.to(torch.int8).view(m, k), d, d * q.sum(-1)


@needs_kernel
def test_activation_quantization_is_llama_cpp_q8_1():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 256, generator=g) * torch.logspace(-3, 2, 256)      # blocks of very different ranges
    x[3, 32:64] = 0.0                                                       # an all-zero block: d = 0, q = 0
    got, want = qgemm.quantize_rows(x), reference_quantize(x)
    assert torch.equal(got[0], want[0])
    assert torch.allclose(got[1], want[1], rtol=1e-6, atol=0) and torch.allclose(got[2], want[2], rtol=1e-5, atol=0)
    assert int(got[0].abs().max()) == 127 and float(got[1][3, 1]) == 0.0


def _dequantized_rows(x):
    q, d, _ = reference_quantize(x)
    return (q.double().view(x.shape[0], -1, 32) * d.double()[..., None]).view_as(x)


@needs_kernel
@pytest.mark.parametrize("n", [4, 7, 96])                # 7: outputs past a multiple of 4 take the single path
def test_w4a8_and_w8a8_compute_the_dequantized_product(n):
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, 128, generator=g), torch.randn(6, 128, generator=g)
    x_deq = _dequantized_rows(x)
    for lin, kind in ((W4A8Linear(quantize_q4(w)), "w4a8"), (W8A8Linear(quantize_q8(w)), "w8a8")):
        want = x_deq @ lin.dequantized_weight().double().t()
        got = lin(x)
        assert lin.format == kind and got.dtype == torch.float32
        # float32 accumulation of exact integer block sums: relative error ~1e-6 of the output scale
        assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max()), kind
        # and the dequantized weight really is the layer's weight, quantized (guards the reference)
        assert float((lin.dequantized_weight() - w).abs().max()) < (0.5 if kind == "w4a8" else 0.03)


@needs_kernel
def test_every_row_gets_the_bits_it_gets_alone():
    """Batch invariance by construction: 1..70 rows (blocks of 4 and single rows), any output count."""
    g = torch.Generator().manual_seed(1)
    for n in (8, 13):
        w, x = torch.randn(n, 96, generator=g), torch.randn(70, 96, generator=g)
        for lin in (W4A8Linear(quantize_q4(w)), W8A8Linear(quantize_q8(w))):
            alone = torch.cat([lin(x[i:i + 1]) for i in range(70)])
            for rows in (2, 3, 4, 5, 8, 9, 16, 33, 70):
                assert torch.equal(lin(x[:rows]), alone[:rows]), (type(lin).__name__, n, rows)
            assert tune.batch_invariant([lin])


@needs_kernel
def test_the_weight_prefetch_distance_never_changes_a_result():
    """Every distance (none, the tuner's, and the largest, which reaches far past the end of the codes) gives the
    same bits, for 1..9 rows; the distance is the projection's own."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(29, 160, generator=g), torch.randn(9, 160, generator=g)
    layers = (W4A8Linear(quantize_q4(w)), W8A8Linear(quantize_q8(w)))
    want = [lin(x) for lin in layers]
    for ahead in (64, *tune.WEIGHT_PREFETCH_BYTES, build.WEIGHT_PREFETCH_LIMIT):
        for lin, y in zip(layers, want):
            lin.prefetch = ahead
            assert torch.equal(lin(x), y), (type(lin).__name__, ahead)
            assert torch.equal(lin(x[:1]), y[:1])


@pytest.mark.parametrize("bad", [-64, 100, build.WEIGHT_PREFETCH_LIMIT + 64, True, 1.5, "1024"])
def test_a_weight_prefetch_distance_that_is_not_allowed_is_refused(bad):
    with pytest.raises(ValueError, match=r"weight prefetch distance .*allowed: 0 \(none\) or a multiple of 64"):
        build.check_weight_prefetch(bad)


@needs_kernel
def test_gguf_codes_are_used_as_stored():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=g)
    codes = quantize_q4(w)
    lin = pack_linear("w4a8", w + 1.0, codes=codes)               # the codes win over the float weight
    assert torch.equal(lin.dequantized_weight(), codes.dequantize())
    q8 = quantize_q8(w)
    head = pack_linear("w8a8", w + 1.0, codes=q8)
    assert torch.equal(head.dequantized_weight(), q8.dequantize())
    rows = head.select_rows(torch.tensor([3, 0, 9]))             # a draft head's reduced-vocabulary LM head
    x = torch.randn(2, 64, generator=g)
    assert torch.equal(rows(x), head(x)[:, [3, 0, 9]])


@needs_kernel
def test_interleaved_layout_round_trips_and_every_output_is_computed_alike():
    """float16 scales, rows interleaved by groups of 8 outputs (the last N % 8 row by row): ``group_quantized`` gives
    the codes back, and an output gets the same bits in a group of 8 as among the last N % 8 (regrouped by select_rows)."""
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(21, 96, generator=g), torch.randn(5, 96, generator=g)
    for codes, cls in ((quantize_q4(w), W4A8Linear), (quantize_q8(w), W8A8Linear)):
        lin = cls(codes)
        assert lin.scales.dtype == torch.float16 and lin.codes.shape[0] == 21
        back = lin.group_quantized()
        assert torch.equal(back.codes, codes.codes) and torch.equal(back.scale, codes.scale)
        assert (back.offset is None) == (codes.offset is None)
        assert codes.offset is None or torch.equal(back.offset, codes.offset)
        full = lin(x)
        for index in ([3, 20, 0], [16, 17, 18, 19, 20, 5, 6, 7, 1], list(range(21))[::-1]):
            rows = lin.select_rows(torch.tensor(index))
            assert torch.equal(rows(x), full[:, index]), (cls.__name__, index)


@needs_kernel
def test_vnni_code_gives_the_avx2_bits(monkeypatch):
    """The VNNI variants' code (int32 sums by vpdpbusd; 512-bit products of two groups of 8 outputs) run with
    vpdpbusd and 512-bit vectors emulated exactly by AVX2 instructions: every product, and a model's whole w4a8
    forward (fused layers, LM head), bit for bit what the AVX2 variant gives.  The variant in use is compared too:
    on a CPU with VNNI, that is the real instruction against AVX2."""
    from helpers import tiny_model
    in_use = build.load()
    libs = {"in use": in_use, **{isa: build.load_variant(isa) for isa in ("vnni-emulated", "zmm-emulated",
                                                                          "amx-emulated")}}
    avx2 = build.load_variant("avx2")
    g = torch.Generator().manual_seed(5)
    for n in (8, 29, 48):                                 # 1 group; 1 pair, 1 group, 5 outputs; 3 pairs
        w = torch.randn(n, 96, generator=g) * 3.0
        w[0, :32] = -w[0, :32].abs().max()                # a block of Q8 codes -127 (the largest products)
        w[1, 32:64] = 0.0                                 # and of codes 0
        x = torch.randn(20, 96, generator=g) * 10.0
        for lin in (W4A8Linear(quantize_q4(w)), W8A8Linear(quantize_q8(w))):
            for rows in (1, 2, 5, 6, 8, 9, 16, 17, 20):      # row tiles of 3..8 rows; AMX tiles from 8 rows
                use_kernels(monkeypatch, avx2)              # the library the products call
                want = lin(x[:rows])
                for name, lib in libs.items():
                    use_kernels(monkeypatch, lib)
                    assert torch.equal(lin(x[:rows]), want), (name, type(lin).__name__, n, rows)
    model = tiny_model(seed=11, scale=2.0, vocab=96, layers=3)
    formats.apply_weight_format(model.decoder, "w4a8")
    dec, ids = executor_of(model), torch.tensor([[4, 8, 15, 16, 23, 42, 7, 1, 2, 3, 9, 9, 5]])
    fused = dec.fused_layers()
    assert fused is not None
    logits = {}
    in_use_many, real_many = fused.lib_many, build._LIB_MANY         # "in use": the split by row count, if any
    with torch.inference_mode():
        for name, lib in (("avx2", avx2), *libs.items()):
            use_kernels(monkeypatch, lib)
            fused.lib, fused.lib_many = lib, None
            if name == "in use":
                fused.lib_many = in_use_many
                monkeypatch.setattr(build, "_LIB_MANY", real_many)
            cache = dec.new_cache(32)
            logits[name] = torch.cat([dec(ids[:, :8], None, None, cache, 0), dec(ids[:, 8:], None, None, cache, 8)], 1)
    fused.lib, fused.lib_many = in_use, in_use_many
    for name in libs:
        assert torch.equal(logits[name], logits["avx2"]), name


@needs_kernel
def test_groups_and_pairs_compute_the_same_bits_and_the_pair_threshold_is_measured(monkeypatch):
    """A 512-bit variant runs products of fewer rows than its pair threshold on 256-bit groups, of more on pairs:
    both routes give every row the same bits (4-bit and 8-bit codes, a partial group of outputs); the threshold is
    measured (one above the largest row count at which groups win, 1: pairs everywhere) and left set."""
    lib = build.load_variant("zmm-emulated")
    use_kernels(monkeypatch, lib)
    g = torch.Generator().manual_seed(3)
    lins = [pack_linear("w4a8", torch.randn(40 + 3, 256, generator=g) * 0.05),
            W8A8Linear(quantize_q8(torch.randn(43, 256, generator=g) * 0.05))]
    x = torch.randn(17, 256, generator=g)
    for lin in lins:
        lib.spec_set_pair_rows(1)
        pairs = lin(x)
        lib.spec_set_pair_rows(100)
        groups = lin(x)
        assert torch.equal(pairs, groups)
        for rows in (1, 5, 9):
            lib.spec_set_pair_rows(rows)
            assert torch.equal(lin(x), pairs) and torch.equal(lin(x[:rows - 1 or 1]), pairs[:rows - 1 or 1])
    threshold = build.measure_pair_rows(lib, build._Streams(total=1 << 20), repeats=1)
    assert threshold in {1, *(m + 1 for m in build.PAIR_ROWS_GRID)} and lib.spec_pair_rows() == threshold


def _times(one_row: dict[str, float], from_rows: dict[str, tuple[int, float]]) -> dict[str, dict[int, float]]:
    """Fake :func:`build.time_variants` seconds: each variant's time at one row, times its factor from a row count
    on (``from_rows[isa] = (rows, factor)``), times the row count."""
    return {isa: {m: t * m * (from_rows[isa][1] if isa in from_rows and m >= from_rows[isa][0] else 1.0)
                  for m in build.ROWS_GRID} for isa, t in one_row.items()}


def test_the_variants_are_split_by_row_count_where_another_wins_by_more_than_the_noise():
    # one variant everywhere: no split
    assert build.split_by_rows(_times({"avx512-vnni": 1.0, "avx2": 1.0}, {})) == ("avx2", None)
    # faster at one row by less than the margin: the default (avx2) kept; faster from 3 rows on: used from there
    one_row, many = build.split_by_rows(_times({"avx512-vnni": 0.99, "avx2": 1.0}, {"avx512-vnni": (3, 0.6)}))
    assert one_row == "avx2" and many == {"variant": "avx512-vnni", "from_rows": 3}
    # faster at one row by more than the margin, and everywhere: one variant
    assert build.split_by_rows(_times({"avx512-vnni": 0.9, "avx2": 1.0}, {})) == ("avx512-vnni", None)
    # a win at some row count but not at every count above it: from the count above the last loss
    t = _times({"amx-int8": 1.0, "avx2": 1.0}, {"amx-int8": (2, 0.5)})
    t["amx-int8"][8] = t["avx2"][8]
    assert build.split_by_rows(t) == ("avx2", {"variant": "amx-int8", "from_rows": 12})
    # the fastest at the top row count is the one used there, among three
    t = _times({"avx512-vnni": 1.0, "amx-int8": 1.0, "avx2": 1.0}, {"avx512-vnni": (4, 0.7), "amx-int8": (16, 0.4)})
    assert build.split_by_rows(t) == ("avx2", {"variant": "amx-int8", "from_rows": 16})


@needs_kernel
def test_the_variants_are_measured_once_per_machine(monkeypatch, tmp_path):
    """Where the CPU has several variants, the first load times them and keeps the pick (one variant for a row,
    another from the row count where it wins); later loads build and time nothing; another thread count is another
    measurement."""
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECULANT_KERNEL_ISA", raising=False)
    monkeypatch.setattr(build, "TEST_VARIANTS", frozenset({"vnni-emulated", "amx-emulated"}))  # zmm-emulated counts as this CPU's
    real_flags = build._cpu_flags()       # a CPU with AVX2 alone: its real variants are avx2 (+ zmm-emulated here)
    monkeypatch.setattr(build, "_cpu_flags", lambda: real_flags - {"avx512f", "avx512_vnni", "avx_vnni", "amx_tile"})
    timed = []

    def fake_times(libs, repeats=10, streams=None):
        timed.append(sorted(libs))
        return _times({isa: 1.0 for isa in libs}, {"zmm-emulated": (4, 0.5)})
    monkeypatch.setattr(build, "time_variants", fake_times)
    measured = []

    def fake_pair_rows(lib, streams=None):
        measured.append(lib)
        lib.spec_set_pair_rows(7)
        return 7
    monkeypatch.setattr(build, "measure_pair_rows", fake_pair_rows)

    def fresh_load():
        for name, value in (("_LIB", None), ("_WHY_NOT", None), ("_ISA", None), ("_LIB_MANY", None),
                            ("_MANY_ISA", None), ("_MANY_ROWS", 0)):
            monkeypatch.setattr(build, name, value)
        return build.load()
    build.prebuild()                                   # what the loader runs while a model converts: builds only
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 2 and not timed
    assert not list((tmp_path / "kernels").glob("pick-*.json"))
    assert fresh_load() is not None and build.describe() == "avx2; zmm-emulated from 4 rows"
    assert timed == [["avx2", "zmm-emulated"]]
    lib, isa, rows = build.many_rows()
    assert isa == "zmm-emulated" and rows == 4 and lib is not build.load()
    assert build.for_rows(1) is build.for_rows(3) is build.load() and build.for_rows(4) is build.for_rows(512) is lib
    picks = list((tmp_path / "kernels").glob("pick-*.json"))
    kept = json.loads(picks[0].read_text())
    assert len(picks) == 1 and kept["variant"] == "avx2" and kept["many"] == {"variant": "zmm-emulated",
                                                                               "from_rows": 4}
    assert len(measured) == 1 and lib.spec_pair_rows() == 7                   # zmm-emulated's pairs: measured
    signature = build.kernel_signature()
    assert signature.startswith("avx2-") and "+zmm-emulated-" in signature and signature.endswith("-pairs7-from4")
    assert fresh_load() is not None and build.describe() == "avx2; zmm-emulated from 4 rows" and len(timed) == 1
    assert len(measured) == 1 and build.many_rows()[0].spec_pair_rows() == 7   # kept with the pick
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        fresh_load()
    finally:
        torch.set_num_threads(threads)
    assert len(timed) == 2 and len(list((tmp_path / "kernels").glob("pick-*.json"))) == 2
    old = max((tmp_path / "kernels").glob("pick-*.json"), key=lambda f: f.stat().st_mtime)
    kept = json.loads(old.read_text())
    del kept["many"]
    old.write_text(json.dumps(kept))                  # a pick of before the split by row count
    torch.set_num_threads(threads + 1)
    try:
        fresh_load()
    finally:
        torch.set_num_threads(threads)
    assert len(timed) == 3 and '"many"' in old.read_text()       # measured again
    # one variant wins everywhere: the pick is that one alone, and only it is built for later loads
    monkeypatch.setattr(build, "time_variants", lambda libs, repeats=10, streams=None: _times(
        {isa: (0.5 if isa == "zmm-emulated" else 1.0) for isa in libs}, {}))
    for f in (tmp_path / "kernels").glob("pick-*.json"):
        f.unlink()
    assert fresh_load() is not None and build.describe() == "zmm-emulated" and build.many_rows() is None
    assert build.for_rows(64) is build.load()
    for so in (tmp_path / "kernels").glob("*avx2*.so"):
        so.unlink()                                                    # a later load needs only the pick
    assert fresh_load() is not None and build.loaded_isa() == "zmm-emulated"
    assert not list((tmp_path / "kernels").glob("*avx2*.so"))


class _Spy:
    """A kernel library whose entry points record the row counts they are called with (``M``, or the fused step's
    ``T``), then run the library's."""

    def __init__(self, lib):
        self.lib, self.calls = lib, []

    def __getattr__(self, entry):
        fn = getattr(self.lib, entry)

        def call(*args):
            rows = args[3] if entry == "spec_decode_layers" else args[1] if entry.endswith("_f32") else None
            self.calls.append((entry, rows))
            return fn(*args)
        return call


@needs_kernel
def test_a_split_by_row_count_gives_the_bits_of_one_library(monkeypatch):
    """The fused step and the LM head with one variant below a row count and another from it on
    (``build.for_rows``): the logits of every prompt, step and block are those of one library alone, and each
    variant ran exactly the row counts it was kept for."""
    from helpers import tiny_model
    avx2, zmm = build.load_variant("avx2"), build.load_variant("zmm-emulated")
    zmm.spec_set_pair_rows(1)
    model = tiny_model(seed=12, scale=2.0, vocab=96, layers=2)
    formats.apply_weight_format(model.decoder, "w4a8")
    dec = executor_of(model)
    fused = dec.fused_layers()
    assert fused is not None
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 1, 2, 3, 9, 9, 5, 60, 61]])
    chunks = ((0, 6), (6, 7), (7, 9), (9, 12), (12, 15))           # a prompt of 6, a step, blocks of 2, 3, 3
    logits, spies = {}, {}
    with torch.inference_mode():
        for name in ("one library", "split"):
            spies[name] = spy = _Spy(zmm)
            use_kernels(monkeypatch, avx2)
            fused.lib, fused.lib_many, fused.many_from = avx2, None, 0
            if name == "split":
                monkeypatch.setattr(build, "_LIB_MANY", spy)
                monkeypatch.setattr(build, "_MANY_ROWS", 3)
                fused.lib_many, fused.many_from = spy, 3
            cache = dec.new_cache(32)
            logits[name] = torch.cat([dec(ids[:, a:b], None, None, cache, a) for a, b in chunks], 1)
    assert torch.equal(logits["split"], logits["one library"])
    assert not spies["one library"].calls
    steps = [rows for entry, rows in spies["split"].calls if entry == "spec_decode_layers"]
    products = [rows for entry, rows in spies["split"].calls if entry.endswith("_f32")]
    # the prompt through the torch layer step's products, blocks of 3 through the fused step and the LM head; the
    # step and the 2-row block stayed on avx2
    assert steps == [3, 3] and set(products) == {6, 3}
@needs_kernel
def test_every_vnni_variant_compiles_here():
    """Built, not run (this CPU may lack the instructions): a compiler error shows on any machine, not only on
    the first one with VNNI."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda isa: build._build(build._compiler(), isa),
                              ["avx512-vnni", "avx512-vnni-ymm", "avx-vnni"]))
    assert all(p.is_file() for p in paths)


def test_kernel_variant_is_chosen_from_the_cpu_flags_and_checked(monkeypatch):
    monkeypatch.delenv("SPECULANT_KERNEL_ISA", raising=False)
    base = {"avx2", "fma", "f16c"}
    assert build.isa_candidates(base) == ["avx2"]
    assert build.isa_candidates(base | {"avx_vnni"}) == ["avx-vnni", "avx2"]
    assert build.isa_candidates(base | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni"}) == [
        "avx512-vnni", "avx2"]          # not avx-vnni nor avx512-vnni-ymm: avx512-vnni's groups below its pair threshold
    assert build.isa_candidates(base | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"}) == [
        "avx512-vnni", "amx-int8", "avx2"]
    assert build.isa_candidates(base | {"avx512f", "avx512_vnni"}) == ["avx2"]      # no AVX512VL: no 256-bit vpdpbusd
    monkeypatch.setenv("SPECULANT_KERNEL_ISA", "vnni-emulated")
    assert build.isa_candidates(base) == ["vnni-emulated"]
    monkeypatch.setenv("SPECULANT_KERNEL_ISA", "avx-vnni")
    with pytest.raises(SpeculantError, match="'avx-vnni' needs the CPU flags avx_vnni"):
        build.isa_candidates(base)
    monkeypatch.setenv("SPECULANT_KERNEL_ISA", " AVX2 ")                             # case and spaces aside
    assert build.isa_candidates(base) == ["avx2"]
    if "avx512_vnni" not in build._cpu_flags():                                   # a variant this CPU cannot run
        with pytest.raises(SpeculantError, match="kernel variant 'avx512-vnni' needs the CPU flags"):
            build.load_variant("avx512-vnni")
    with pytest.raises(SpeculantError, match="'neon' is not a kernel variant; allowed: avx512-vnni"):
        build.load_variant("neon")
    monkeypatch.setenv("SPECULANT_KERNEL_ISA", "sse2")
    with pytest.raises(SpeculantError, match="'sse2' is not a kernel variant; allowed: auto, avx512-vnni"):
        build.isa_candidates(base)


@needs_kernel
def test_a_variant_that_does_not_build_falls_back_to_the_next(monkeypatch, tmp_path):
    """A compiler without -mavxvnni (say) on a CPU with AVX-VNNI: the AVX2 variant is built and used."""
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECULANT_KERNEL_ISA", raising=False)
    for name, value in (("_LIB", None), ("_WHY_NOT", None), ("_ISA", None)):
        monkeypatch.setattr(build, name, value)
    monkeypatch.setattr(build, "_cpu_flags", lambda: {"avx2", "fma", "f16c", "avx_vnni"})
    monkeypatch.setitem(build.ISA_VARIANTS, "avx-vnni", (("--no-such-option-for-speculant",), frozenset({"avx_vnni"})))
    assert build.load() is not None and build.loaded_isa() == "avx2" and build.unavailable_reason() is None
    assert [p.name.split("-")[2] for p in (tmp_path / "kernels").glob("*.so")] == ["avx2"]
    monkeypatch.setattr(build, "_LIB", None)
    monkeypatch.setenv("SPECULANT_KERNEL_ISA", "avx512")
    with pytest.raises(SpeculantError, match="SPECULANT_KERNEL_ISA='avx512' is not a kernel variant"):
        build.load()                                      # a wrong setting is an error, not a silent fallback


@needs_kernel
def test_shapes_the_kernel_cannot_take_fall_back():
    lin = pack_linear("w4a8", torch.randn(8, 40))                  # 40 inputs: not blocks of 32
    assert lin.format == "int8"


def test_without_the_kernel_the_format_is_refused_and_not_tuned(monkeypatch):
    monkeypatch.setattr(build, "_LIB", None)
    monkeypatch.setattr(build, "_WHY_NOT", "needs an x86-64 CPU with AVX2 and FMA")
    assert not formats.format_available("w4a8") and formats.format_available("int4")
    with pytest.raises(SpeculantError, match="w4a8 weight format needs an x86-64 CPU with AVX2.*allowed here"):
        pack_linear("w4a8", torch.randn(8, 32))
    from helpers import tiny_model
    model = tiny_model(seed=3, vocab=96, hidden=64, heads=4, kv_heads=2, inter=128)
    result = tune.measure(model.decoder, threads=1, repeats=1)
    assert "w4a8" not in {row["format"] for row in result.table} and result.weights != "w4a8"


def test_build_failure_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_LIB", None)
    monkeypatch.setattr(build, "_WHY_NOT", None)
    monkeypatch.setattr(build, "_cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(build, "FLAGS", ("--no-such-option-for-speculant",) + build.FLAGS)
    assert not qgemm.available()
    assert "could not be built here" in qgemm.unavailable_reason()
    assert not list((tmp_path / "kernels").glob("*.so")) and not list((tmp_path / "kernels").glob("*.tmp*"))


def test_without_the_kernels_every_method_runs_on_float64_attention(monkeypatch, tmp_path):
    """No AVX2 / no compiler: new decoders keep a float64 cache, a float32 cache (a draft head's) attends through
    SDPA, and every drafter still decodes exactly what ``ar`` decodes."""
    from helpers import tiny_model

    from speculant import GenerationConfig, build_generator
    from speculant.drafters.draft_head import new_head, save_head
    monkeypatch.setattr(build, "_LIB", None)
    monkeypatch.setattr(build, "_WHY_NOT", "needs an x86-64 CPU with AVX2 and FMA")
    model = tiny_model(seed=3, vocab=96, hidden=64, heads=4, kv_heads=2, inter=128, scale=2.5)
    assert executor_of(model).kv_dtype == torch.float64
    torch.manual_seed(0)
    save_head(new_head(model, torch.arange(0, 96, 2)), tmp_path / "head")
    cfg = GenerationConfig(max_new_tokens=16)
    prompt = [3, 17, 42, 8, 25, 60, 1]
    ar = build_generator(model, method="ar").generate(prompt, cfg).token_ids
    for spec in (dict(method="eagle", num_speculations=3, draft_head=str(tmp_path / "head")),
                 dict(method="rsd-s", exit_layer=1, beam_width=2, draft_length=3),
                 dict(method="prompt-lookup", num_speculations=3)):
        assert build_generator(model, **spec).generate(prompt, cfg).token_ids == ar, spec
