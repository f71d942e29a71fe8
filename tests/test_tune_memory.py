"""The tuner packs a sample of the LM head, not the whole head, in every format (speculant.runtime.tune.head_sample):
a large vocabulary's head in every format at once was most of a first load's peak memory."""

import torch

from helpers import tiny_model
from speculant.models.linear import DecodeLinear
from speculant.runtime import tune


def test_head_sample_is_a_view_of_the_first_rows_with_its_scale():
    head = DecodeLinear(64, 1000, bias=False)
    sample, scale = tune.head_sample(head, max_bytes=64 * 4 * 250)
    assert sample.out_features == 250 and sample.in_features == 64 and scale == 1000 / 250
    assert sample.weight.data_ptr() == head.weight.data_ptr()            # a view: no copy
    x = torch.randn(3, 64)
    # the same rows (a float32 GEMM may sum in another order for 250 than for 1000 outputs: on a Zen 5 EPYC it
    # does, so equality within rounding, not bitwise; a view of other rows would differ by O(1))
    torch.testing.assert_close(sample(x), head(x)[:, :250], rtol=1e-6, atol=1e-6)
    whole, one = tune.head_sample(head, max_bytes=64 * 4 * 1000)
    assert whole is head and one == 1.0


def test_measure_times_the_head_sample_and_scales_it(monkeypatch):
    model = tiny_model(seed=1)
    decoder = model.decoder
    head = decoder.lm_head_proj
    seen = []
    real = tune.head_sample
    monkeypatch.setattr(tune, "head_sample", lambda h: seen.append(real(h, max_bytes=4 * h.in_features * 16)) or seen[-1])
    calls = []
    time_pass = tune._time_pass
    monkeypatch.setattr(tune, "_time_pass", lambda *a, **k: calls.append(a[4:] + tuple(k.values())) or time_pass(*a, **k))
    result = tune.measure(decoder, 1, repeats=1, log=open("/dev/null", "w"))
    sample, scale = seen[0]
    assert sample.out_features == 16 and scale == head.out_features / 16
    assert calls and all(c[-1] == scale for c in calls)                  # every timed pass scales the head's part
    assert decoder.lm_head_proj is head and result.weights in tune.FORMATS


def test_sampled_layers_are_bounded_by_their_float32_bytes(monkeypatch):
    small = [(64, 64)] * 7 + [(1000, 64)]                          # 7 projections of a tiny layer, then the LM head
    assert tune.sample_layers(30, small) == tune.sample_layers(30) == [0, 6, 12, 17, 23, 29]
    big = [(5 << 10, 1 << 10)] + [(1000, 64)]                       # 20 MiB a layer in float32: 3 fit in 64 MiB
    monkeypatch.setattr(tune, "SAMPLE_BYTES", 64 << 20)
    assert tune.sample_layers(30, big) == [0, 14, 29]
    huge = [(1 << 20, 1 << 10)] + [(1000, 64)]                      # one projection of 4 GiB: one layer, the middle one
    assert tune.sample_layers(30, huge) == [15] and tune.sample_layers(1, huge) == [0]
    assert tune.sample_layers(4, small) == [0, 1, 2, 3]


def test_fill_cache_runs_chunks_and_fills_what_one_forward_would(monkeypatch):
    decoder = tiny_model(seed=2).decoder
    ctx = 2 * tune.FILL_CHUNK + 5
    whole, chunked = decoder.new_cache(ctx + 1), decoder.new_cache(ctx + 1)
    ids = tune.timing_tokens(decoder, (1, ctx), torch.Generator().manual_seed(0))
    with torch.inference_mode():
        decoder.run_layers(decoder.embed(ids), 0, decoder.num_layers, torch.arange(ctx), None, whole, 0)
        seen = []
        run_layers = decoder.run_layers
        monkeypatch.setattr(decoder, "run_layers", lambda h, *a: seen.append(h.shape[1]) or run_layers(h, *a))
        tune.fill_cache(decoder, chunked, ctx, torch.Generator().manual_seed(0))
    assert seen == [tune.FILL_CHUNK, tune.FILL_CHUNK, 5]
    torch.testing.assert_close(chunked.keys, whole.keys)
    torch.testing.assert_close(chunked.values, whole.values)
