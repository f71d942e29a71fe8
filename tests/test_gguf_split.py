"""Split GGUF sets (llama.cpp's ``gguf-split``: ``<stem>-00001-of-0000N.gguf`` ..., ``split.no`` / ``split.count`` /
``split.tensors.count`` in each shard, the model's metadata in the first): ``--model FIRST-SHARD.gguf`` loads the
tensors of every shard, equal to the same model written as one file; a later shard, a missing shard or shards whose
metadata disagree are one-line errors."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader
from gguf_helpers import write_tiny_gguf

from speculant.errors import SpeculantError
from speculant.models.gguf_codes import index_tensors
from speculant.models.gguf_files import inspect_gguf
from speculant.models.loading import ours_to_hf_state, read_checkpoint


@pytest.mark.parametrize("arch", ("llama", "gemma3"))
def test_a_split_set_loads_as_the_single_file(arch, tmp_path, in_process):
    kwargs = dict(arch=arch, layers=6 if arch == "gemma3" else 2, seed=5)
    for d in ("one", "split"):
        (tmp_path / d).mkdir()
    single = write_tiny_gguf(tmp_path / "one" / "m.gguf", "Q8_0", **kwargs)
    first = write_tiny_gguf(tmp_path / "split" / "m.gguf", "Q8_0", split_max_tensors=8, **kwargs)
    shards = sorted((tmp_path / "split").glob("m-*-of-*.gguf"))
    assert len(shards) >= 3 and first == shards[0]
    assert [GGUFReader(str(s)).fields["split.no"].contents() for s in shards] == list(range(len(shards)))
    info = inspect_gguf(first)
    assert info.shards == tuple(s.resolve() for s in shards) and info.architecture == arch
    assert len(index_tensors(first).tensors) == len(info.tensor_types) == len(GGUFReader(str(single)).tensors)
    a, b = read_checkpoint(str(single)), read_checkpoint(str(first))
    assert a.config == b.config
    sa, sb = ours_to_hf_state(a.decoder), ours_to_hf_state(b.decoder)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(SpeculantError, match="shard 2 of a split GGUF set; allowed: its first shard") as e:
        inspect_gguf(shards[1])
    assert "\n" not in str(e.value)
    shards[-1].unlink()
    with pytest.raises(SpeculantError, match=f"shard .*{shards[-1].name}.* is missing"):
        inspect_gguf(first)
