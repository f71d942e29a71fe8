"""The prefix cache's bookkeeping (speculant/engine/prefix_cache.py): longest-prefix match, LRU within a token
budget, what it refuses.  That a cached prefix gives a prompt the bits of its full prefill is tested with the fused
step (tests/test_decode_step.py)."""

import pytest
import torch

from speculant.engine.prefix_cache import PrefixCache
from speculant.errors import SpeculantError
from speculant.models.kv_cache import KVCache


def _filled(tokens, layers=2, heads=1, dim=4, length=32):
    """A cache whose slot s holds the value tokens[s] + 0.5 * layer everywhere (a stand-in for a prefill)."""
    c = KVCache(layers, heads, dim, length)
    for s, t in enumerate(tokens):
        for layer in range(layers):
            c.keys[layer, :, :, s] = t + 0.5 * layer
            c.values[layer, :, :, s] = -(t + 0.5 * layer)
    c.crop(len(tokens))
    return c


def test_longest_prefix_is_matched_and_loaded():
    pc = PrefixCache(max_tokens=100)
    pc.store([1, 2, 3, 4], _filled([1, 2, 3, 4]))
    pc.store([1, 2, 9], _filled([1, 2, 9]))
    assert pc.match([1, 2, 3, 4, 5, 6]) == (4, (1, 2, 3, 4))
    assert pc.match([1, 2, 9, 9]) == (3, (1, 2, 9))
    assert pc.match([1, 2, 7])[0] == 2
    assert pc.match([1, 2, 3, 4]) == (3, (1, 2, 3, 4))        # the last position is always computed
    assert pc.match([5]) == (0, None)
    assert pc.queries == 6 + 4 + 3 + 4 + 1 and pc.hits == 4 + 3 + 2 + 3
    target = KVCache(2, 1, 4, 32)
    pc.load((1, 2, 3, 4), 3, target)
    assert torch.equal(target.keys[..., :3, :], _filled([1, 2, 3]).keys[..., :3, :])
    assert torch.equal(target.values[..., :3, :], _filled([1, 2, 3]).values[..., :3, :])
    assert torch.count_nonzero(target.keys[..., 3:, :]) == 0


def test_lru_within_the_budget_and_prefixes_not_duplicated():
    pc = PrefixCache(max_tokens=10)
    pc.store([1, 2, 3, 4], _filled([1, 2, 3, 4]))
    pc.store([5, 6, 7], _filled([5, 6, 7]))
    pc.match([1, 2, 3, 9])                                  # uses the first: the second is now least recent
    pc.store([8, 9, 10, 11], _filled([8, 9, 10, 11]))        # 11 tokens > 10: [5, 6, 7] goes
    assert set(pc._entries) == {(1, 2, 3, 4), (8, 9, 10, 11)} and pc.tokens == 8
    pc.store([1, 2], _filled([1, 2]))                        # a prefix of an entry: nothing new
    assert pc.tokens == 8 and len(pc) == 2
    pc.store([1, 2, 3, 4, 5], _filled([1, 2, 3, 4, 5]))      # extends an entry: replaces it
    assert (1, 2, 3, 4) not in pc._entries and pc.tokens == 9
    assert pc.nbytes == 9 * 2 * 2 * 1 * 4 * 4                 # tokens * (k, v) * layers * heads * dim * 4 bytes
    pc.store(list(range(20, 31)), _filled(list(range(20, 31))))   # over the budget alone: not stored
    assert pc.tokens == 9
    assert PrefixCache(0).match([1, 2]) == (0, None)


def test_bad_budget_and_a_cache_of_another_shape_are_refused():
    with pytest.raises(SpeculantError, match="max_tokens=-1"):
        PrefixCache(-1)
    pc = PrefixCache(max_tokens=10)
    pc.store([1, 2, 3], _filled([1, 2, 3]))
    with pytest.raises(SpeculantError, match="does not fit"):
        pc.load((1, 2, 3), 2, KVCache(3, 1, 4, 32))            # another layer count
    with pytest.raises(SpeculantError, match="does not fit"):
        pc.load((1, 2, 3), 4, KVCache(2, 1, 4, 32))            # longer than the entry
