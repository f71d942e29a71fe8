"""The device runbook at toy scale on a CPU (issue 28): sampling with transformers (self-instruct prompts), the four
training stages in parallel, the bundle; and what it brings back works in our engine."""

import json
import subprocess
import sys
import tarfile

import pytest
import torch
from safetensors import safe_open

from helpers import one_line_error, tiny_chat_dir
from speculant.engine.prompts import encode_prompt
from speculant.models.loading import load_tokenizer
from speculant.training import hf_sample
from speculant.training.runbook import main as runbook_main


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return tiny_chat_dir(tmp_path_factory.mktemp("tiny") / "hf")


def test_pre_query_ids_are_the_template_before_the_user_content(chat_dir):
    tok = load_tokenizer(chat_dir)
    ids = hf_sample.pre_query_ids(tok)
    assert ids == tok.encode("t2 ", add_special_tokens=False) == [2]


def test_self_instruct_keeps_distinct_finished_turns_only(chat_dir, monkeypatch):
    tok = load_tokenizer(chat_dir)
    # a repeat, an unfinished turn, an empty one, one under 8 characters
    rows = [[5, 6, 7, 1], [5, 6, 7, 1], [7, 8, 9], [1], [5, 6, 1], [9, 10, 11, 1]]
    monkeypatch.setattr(hf_sample, "generate_batch", lambda hf, r, eos, *a: rows[:len(r)])
    got = hf_sample.self_instruct_prompts(None, tok, [1], 10, batch=6, progress=False)
    assert [p.text for p in got] == ["t5 t6 t7", "t9 t10 t11"]
    assert [p.id for p in got] == ["selfinstruct-0", "selfinstruct-1"]


def test_runbook_at_toy_scale_brings_back_drafters_that_work(chat_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = out_dir = tmp_path / "rb"
    rc = runbook_main(["--model", str(chat_dir), "--out", str(out), "--device", "cpu", "--preset", "toy",
                       "--minutes", "6", "--part-mib", "0.1"])
    summary = json.loads((out / "summary.json").read_text())
    assert rc == 0, {k: v["last_line"] for k, v in summary["stages"].items()}
    assert set(summary["stages"]) == {"data", "draft-head", "draft-head-unroll2", "eagle3", "layerskip"}
    parts = summary["bundle"]
    assert len(parts) > 1 and parts == sorted(parts)                     # cut, and `cat` order is the parts' order
    (tmp_path / "b.tar").write_bytes(b"".join((out / p).read_bytes() for p in parts))
    back = tmp_path / "back"
    with tarfile.open(tmp_path / "b.tar") as tar:
        names = tar.getnames()
        tar.extractall(back, filter="data")
    assert not [n for n in names if n.endswith((".pt", "corpus.jsonl")) or "/model/" in n or n.startswith("cache-")]

    # the corpus: make-data records, prompt ids by our one prompt rule, self-instruct prompts among them
    tok = load_tokenizer(chat_dir)
    corpus = [json.loads(line) for line in (out / "work" / "corpus.jsonl").read_text().splitlines()]
    assert {r["source"] for r in corpus} >= {"builtin"}
    for r in corpus:
        assert r["prompt_ids"] == encode_prompt(tok, r["prompt"], True)
        assert r["split"] in ("train", "heldout") and r["response_ids"]
    import gzip
    assert gzip.decompress((back / "corpus.jsonl.gz").read_bytes()) == (out / "work" / "corpus.jsonl").read_bytes()
    held = [json.loads(line) for line in (back / "heldout.jsonl").read_text().splitlines()]
    assert held and held == [r for r in corpus if r["split"] == "heldout"]

    # the heads load into our engine and decode exactly as the target alone (greedy)
    from helpers import load_hf_dir_in
    from speculant import GenerationConfig, build_generator
    model = load_hf_dir_in(chat_dir, "fp32")
    prompt, cfg = [2, 5, 9, 1, 3], GenerationConfig(max_new_tokens=12)
    ar = build_generator(model, method="ar").generate(prompt, cfg).token_ids
    for head in ("draft-head", "draft-head-unroll2", "eagle3"):
        gen = build_generator(model, method="eagle", draft_head=str(back / head), num_speculations=3,
                              speculation="always")
        out = gen.generate(prompt, cfg)
        assert out.token_ids == ar and out.stats.drafted_tokens > 0, head
    conf = json.loads((back / "eagle3" / "config.json").read_text())
    assert len(conf["eagle_aux_hidden_state_layer_ids"]) == 3

    # the LayerSkip run's LoRA weights travel alone
    with safe_open(str(back / "layerskip" / "lora.safetensors"), "pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    assert keys and all("lora_A" in k or "lora_B" in k for k in keys) and meta["rank"] == "8"
    ls_metrics = json.loads((back / "layerskip" / "metrics.json").read_text())
    assert ls_metrics["steps_done"] == 3
    card = (back / "layerskip" / "README.md").read_text()                 # and its model card travels with them
    assert str(chat_dir) in card and "`lora.safetensors`" in card and ls_metrics["trained_on"] in card
    import os
    umask = os.umask(0)
    os.umask(umask)
    for f in (out_dir / "work").rglob("*.safetensors"):                      # trained weights: an ordinary file's mode
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f


MISSING_CUDA = "cuda:99" if torch.cuda.is_available() else "cuda"
"""A CUDA device this machine lacks."""


@pytest.mark.parametrize("command", ["train", "make-data"])
@pytest.mark.parametrize("device", ["nosuch", "tpu", "meta", "cuda:x", MISSING_CUDA])
def test_a_device_this_machine_lacks_is_one_short_line(chat_dir, tmp_path, device, command):
    """train and make-data (--engine transformers) refuse a device in one short line naming the value and the allowed
    ones (not torch's list of every device type), before the model loads."""
    flags = (["train", "--recipe", "draft-head", "--corpus", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")]
             if command == "train" else
             ["make-data", "--engine", "transformers", "--builtin", "--out", str(tmp_path / "c.jsonl")])
    r = subprocess.run([sys.executable, "-m", "speculant.cli", *flags, "--model", str(chat_dir), "--device", device],
                       capture_output=True, text=True)
    assert r.returncode == 2 and one_line_error(r.stderr), r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert f"--device={device!r}" in line and len(line) < 160 and "Expected one of" not in line, line
    assert line.endswith("allowed: cpu" if device == "cuda" else "cuda:N" if device != MISSING_CUDA else "")
    assert not (tmp_path / "o").exists() and not (tmp_path / "c.jsonl").exists()


def test_batched_generation_equals_one_row_at_a_time_and_cuts_at_eos(chat_dir):
    """Left padding changes nothing (greedy rows of different lengths decoded together equal each decoded alone), and
    each row ends right after its first EOS (kept) or at the token budget."""
    hf, _ = hf_sample.load_hf(str(chat_dir), "cpu")
    rows = [[2, 5, 9, 1, 3], [2, 7, 3], [2, 11, 12, 13, 14, 15, 1, 3]]
    together = hf_sample.generate_batch(hf, rows, [1], 12, 0.0, 1.0)
    alone = [hf_sample.generate_batch(hf, [r], [1], 12, 0.0, 1.0)[0] for r in rows]
    assert together == alone
    for r in together:
        assert (r[-1] == 1 and 1 not in r[:-1]) or (len(r) == 12 and 1 not in r)


def test_sample_corpus_spreads_greedy_batches_and_refuses_an_empty_result(chat_dir, tmp_path):
    from speculant.errors import SpeculantError
    from speculant.training.data import Prompt
    hf, tok = hf_sample.load_hf(str(chat_dir), "cpu")
    prompts = [Prompt(f"p{i}", "test", " ".join(f"t{4 + (i * j) % 50}" for j in range(2 + i % 5))) for i in range(16)]
    summary = hf_sample.sample_corpus(hf, tok, prompts, tmp_path / "c.jsonl", [1], 6, batch=4,
                                      greedy_fraction=0.25, progress=False)
    recs = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert len(recs) == 16 and summary["prompts_skipped"] == 0
    assert sum(r["temperature"] == 0.0 for r in recs) == 4            # one batch of the four, exactly
    with pytest.raises(SpeculantError, match="no record was written"):
        hf_sample.sample_corpus(hf, tok, prompts, tmp_path / "d.jsonl", [1], 6, batch=4, max_minutes=-1.0,
                                progress=False)


@pytest.mark.parametrize("flags, says", [
    (["--engine", "transformers", "--resume"], "--resume is not supported by --engine transformers"),
    (["--engine", "transformers", "--text-file", "x.txt"], "--text-file is not supported"),
    (["--device", "cuda"], "--device needs --engine transformers"),
    (["--self-instruct", "5"], "--self-instruct needs --engine transformers"),
    (["--engine", "transformers", "--greedy-fraction", "1.5"], "--greedy-fraction=1.5 is out of range"),
    (["--engine", "transformers", "--self-instruct", "-1"], "--self-instruct=-1 is out of range"),
])
def test_make_data_refuses_flags_its_engine_would_ignore(chat_dir, tmp_path, capsys, flags, says):
    from speculant.cli import main
    assert main(["make-data", "--model", str(chat_dir), "--builtin", "--out", str(tmp_path / "c.jsonl"), *flags]) == 2
    err = capsys.readouterr().err
    assert one_line_error(err) and says in err, err
    assert not (tmp_path / "c.jsonl").exists()


def test_exit_adapter_training_refuses_a_device(chat_dir, tmp_path, capsys):
    from speculant.cli import main
    assert main(["train", "--recipe", "exit-adapter", "--model", str(chat_dir), "--corpus", "c.jsonl",
                 "--out", str(tmp_path / "o"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert one_line_error(err) and "not supported by --recipe exit-adapter; allowed: cpu" in err, err


@pytest.mark.parametrize("flags, says", [
    (["--stages", "draft-head,eagle4"], "--stages='draft-head,eagle4' is not a list of stages; allowed: some of"),
    (["--stages", ","], "--stages=',' is not a list of stages"),
    (["--part-mib", "0"], "--part-mib=0.0 is out of range; allowed: [0.01, "),
    (["--part-mib", "-3"], "--part-mib=-3.0 is out of range"),
    (["--part-mib", "nan"], "--part-mib=nan is out of range"),
    (["--part-mib", "inf"], "--part-mib=inf is out of range"),
    (["--minutes", "0"], "--minutes=0.0 is out of range; allowed: [1.0, inf)"),
    (["--minutes", "-1"], "--minutes=-1.0 is out of range"),
    (["--minutes", "nan"], "--minutes=nan is out of range"),
    (["--minutes", "ten"], "argument --minutes: invalid float value: 'ten'"),
    (["--preset", "big"], "argument --preset: invalid choice: 'big'"),
    (["--device", "tpu"], "--device='tpu' is not a device training runs on; allowed: cpu, cuda, cuda:N"),
    (["--device", MISSING_CUDA], f"--device={MISSING_CUDA!r} is not available here"),
])
def test_runbook_refuses_bad_flags_in_one_line_before_any_work(tmp_path, capsys, flags, says):
    out = tmp_path / "o"
    assert runbook_main(["--out", str(out), "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert one_line_error(err) and says in err and "usage:" not in err, err
    assert not out.exists()


def test_runbook_help_says_what_each_flag_is(capsys):
    assert runbook_main(["--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--out", "--device", "--minutes", "--preset", "--part-mib", "--stages"):
        help_text = text.split(flag, 2)[2].split("\n  --")[0]        # the flag's own entry under "options"
        assert len(help_text.split()) >= 6, (flag, help_text)
