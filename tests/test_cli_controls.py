"""Issue 27 on the command line: ``speculant generate``'s control flags give what the Python API gives with the
same config (penalties, min-p, logit bias, logprobs, ``--n``, a grammar, min tokens, ignore EOS, stop token ids),
and bad values are one-line errors with exit code 2."""

from __future__ import annotations

import json
import re

import pytest
from helpers import byte_tokenizer, one_line_error, tiny_model

from speculant import GenerationConfig, SamplingConfig, build_generator
from speculant.cli import main
from speculant.models.loading import LoadedModel, save_hf_dir
from speculant.runtime.loader import load_model
from speculant.sampling.grammar import compile_grammar

PROMPT = "the cat, the cat, the cat, the"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = byte_tokenizer()
    tiny = tiny_model(seed=7, scale=2.0, vocab=len(tok), layers=2, ctx=512, eos=tok.eos_token_id)
    return save_hf_dir(LoadedModel("tiny", tiny.decoder, tok, None), tmp_path_factory.mktemp("cli_controls"))


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(str(model_dir), weights="int8", compile=False)     # batch-invariant kernels everywhere


DRAFT = ("--method", "draft-model", "--draft-model", "truncated:1", "--num-speculations", "3",
         "--speculation", "always")          # every round drafts (the tests read drafted tokens)
AR = ("--method", "ar")


@pytest.fixture
def cli(capsys, model_dir):
    """``speculant generate PROMPT --raw --json ...`` on the tiny model: (exit code, stdout, stderr)."""
    def go(*args, method=DRAFT):
        code = main(["generate", PROMPT, "--model", str(model_dir), "--raw", "--json", "--no-compile", "--weights", "int8",
                     "--max-new-tokens", "16", *method, *args])
        out = capsys.readouterr()
        return code, out.out, out.err
    return go


@pytest.fixture
def run(cli):
    """The JSON output of a successful call."""
    def go(*args, **kw):
        code, out, err = cli(*args, **kw)
        assert code == 0, err
        return json.loads(out)
    return go


def api(model, max_new_tokens=16, n=1, **kw):
    gen_keys = {"logprobs", "grammar", "min_tokens", "ignore_eos", "stop_token_ids"}
    cfg = GenerationConfig(max_new_tokens, SamplingConfig(**{k: v for k, v in kw.items() if k not in gen_keys}),
                           chat=False, **{k: v for k, v in kw.items() if k in gen_keys})
    gen = build_generator(model, method="ar")
    return gen.generate_n(PROMPT, cfg, n) if n > 1 else gen.generate(PROMPT, cfg)


def test_penalties_min_p_and_bias_equal_the_api(run, model):
    plain = run()["token_ids"]
    flags = ("--frequency-penalty", "1.5", "--presence-penalty", "0.5", "--repetition-penalty", "1.3")
    d = run(*flags)
    assert d["token_ids"] != plain
    assert d["token_ids"] == api(model, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3).token_ids
    # sampled: a drafting method draws other random numbers than ar (same law, other samples), so compare ar's
    d = run("--temperature", "1", "--seed", "9", "--min-p", "0.2", "--frequency-penalty", "1", method=AR)
    assert d["token_ids"] == api(model, temperature=1.0, seed=9, min_p=0.2, frequency_penalty=1.0).token_ids
    cat = model.tokenizer.convert_tokens_to_ids("cat")
    d = run("--logit-bias", f"{cat}=100", "--logit-bias", "5=-3")
    assert d["token_ids"] == [cat] * 16 and d["text"] == "cat" * 16


def test_logprobs_in_json_equal_ar_bit_for_bit(run, model):
    spec, ar = run("--logprobs", "2"), run("--logprobs", "2", method=AR)
    assert spec["stats"]["drafted_tokens"] > 0
    assert spec["logprobs"] == ar["logprobs"]
    want = api(model, logprobs=2).logprobs
    assert [lp["logprob"] for lp in spec["logprobs"]] == [lp.logprob for lp in want]
    assert [lp["token_id"] for lp in spec["logprobs"]] == spec["token_ids"]
    assert all(len(lp["top"]) == 2 for lp in spec["logprobs"])


def test_n_samples(run, model):
    d = run("--n", "3", "--temperature", "1", "--seed", "4", method=AR)
    texts = [c["text"] for c in d["choices"]]
    assert texts == [r.text for r in api(model, n=3, temperature=1.0, seed=4)] and len(set(texts)) > 1
    d = run("--n", "2", "--temperature", "1", "--seed", "4")            # a drafting method: sample i has seed 4 + i
    assert [c["token_ids"] for c in d["choices"]] == [run("--temperature", "1", "--seed", str(4 + i))["token_ids"]
                                                      for i in range(2)]


def test_grammar_flags(run, model, tmp_path):
    d = run("--json-schema", json.dumps(SCHEMA), "--max-new-tokens", "24")
    assert d["stop_reason"] == "eos" and set(json.loads(d["text"])) == {"ok"}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SCHEMA))
    assert run("--json-schema", str(path), "--max-new-tokens", "24")["text"] == d["text"]
    grammar = compile_grammar("json_schema", SCHEMA, model.tokenizer, vocab_size=model.config.vocab_size,
                              eos_token_ids=model.eos_token_ids)
    assert d["token_ids"] == api(model, 24, grammar=grammar).token_ids
    assert re.fullmatch("(cat|mat)[0-9]{3}", run("--regex", "(cat|mat)[0-9]{3}")["text"])
    assert run("--grammar", 'start: "yes" | "no"', "--temperature", "1")["text"] in ("yes", "no")
    assert run("--json-object", "--max-new-tokens", "8")["text"].startswith("{")


def test_min_tokens_ignore_eos_stop_token_id(run, model):
    eos = model.tokenizer.eos_token_id
    d = run("--logit-bias", f"{eos}=100", "--min-tokens", "5")
    assert len(d["token_ids"]) == 6 and d["token_ids"][-1] == eos and d["stop_reason"] == "eos"
    d = run("--logit-bias", f"{eos}=100", "--ignore-eos")
    assert len(d["token_ids"]) == 16 and d["stop_reason"] == "length"
    plain = run()["token_ids"]
    d = run("--stop-token-id", str(plain[4]))
    assert d["token_ids"] == plain[:plain.index(plain[4]) + 1] and d["stop_reason"] == "stop"


@pytest.mark.parametrize("args,needle", [
    (["--logit-bias", "abc"], "--logit-bias='abc'"), (["--logit-bias", "5"], "--logit-bias='5'"),
    (["--logit-bias", "5=200"], "logit_bias[5]"), (["--logit-bias", "999999=1"], "logit_bias token id 999999"),
    (["--frequency-penalty", "3"], "frequency_penalty"), (["--presence-penalty", "-2.5"], "presence_penalty"),
    (["--repetition-penalty", "0"], "repetition_penalty"), (["--min-p", "1.5"], "min_p"),
    (["--n", "0"], "--n=0"), (["--n", "129"], "--n=129"), (["--logprobs", "21"], "logprobs=21"),
    (["--json-schema", "{bad"], "--json-schema is not valid JSON"), (["--regex", "(x"], "regex is invalid"),
    (["--regex", "a", "--json-object"], "--regex and --json-object both constrain"),
    (["--grammar", "start: nothing_defined"], "ebnf is invalid"), (["--min-tokens", "99"], "min_tokens=99"),
    (["--stop-token-id", "-1"], "stop_token_ids"),
])
def test_bad_control_values_are_one_line_exit_2(cli, args, needle):
    code, _, err = cli(*args)
    assert code == 2 and needle in err and one_line_error(err), err


def test_logprobs_need_json(capsys, model_dir):
    code = main(["generate", PROMPT, "--model", str(model_dir), "--raw", "--logprobs", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--logprobs needs --json" in err and one_line_error(err)
