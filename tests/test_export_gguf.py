"""``speculant export --gguf``: an EAGLE-3 head converted by llama.cpp's own converter (a stand-in source tree here,
whose ``convert_hf_to_gguf.py`` checks what the real one reads; the real one ran in benchmarks/llamacpp_eagle3.py,
BENCHMARKS AM)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import one_line_error, tiny_model
from test_eagle3 import random_eagle3

from speculant.cli import main
from speculant.drafters.eagle3_head import AUX_IDS_KEY, save_eagle3
from speculant.drafters.export import export_head
from speculant.drafters.export_gguf import GGUF_NAME, check_llama_cpp_source, export_gguf
from speculant.errors import SpeculantError
from speculant.models.loading import save_hf_dir

STAND_IN = '''
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
head, target = Path(args[0]), Path(args[args.index("--target-model-dir") + 1])
out = Path(args[args.index("--outfile") + 1])
conf = json.loads((head / "config.json").read_text())
if os.environ.get("FAIL"):
    sys.exit("ValueError: the stand-in converter was told to fail")
import gguf_marker                                      # from gguf-py/ on PYTHONPATH, as the real converter's gguf
out.write_text(json.dumps({"architectures": conf["architectures"], "aux": conf["eagle_aux_hidden_state_layer_ids"],
                           "target_layers": json.loads((target / "config.json").read_text())["num_hidden_layers"],
                           "outtype": args[args.index("--outtype") + 1], "gguf_py": gguf_marker.WHERE}))
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    model = tiny_model(seed=11, scale=2.5, vocab=64, layers=5)
    target = save_hf_dir(model, root / "target")
    save_eagle3(random_eagle3(model, torch.arange(0, 64, 2), aux=[1, 3, 5]), root / "head")
    src = root / "llama.cpp"
    (src / "gguf-py").mkdir(parents=True)
    (src / "gguf-py" / "gguf_marker.py").write_text("WHERE = 'gguf-py'\n")
    (src / "convert_hf_to_gguf.py").write_text(STAND_IN)
    return model, target, root / "head", src


def test_the_converter_gets_the_export_and_the_target(setup, tmp_path):
    model, target, head, src = setup
    export = tmp_path / "export"
    export_head(head, export)
    out = export_gguf(export, target, src)
    assert out == export / GGUF_NAME and not list(export.glob("*.partial"))
    got = json.loads(out.read_text())
    assert got == {"architectures": ["LlamaForCausalLMEagle3"], "aux": [1, 3, 5], "target_layers": 5,
                   "outtype": "f16", "gguf_py": "gguf-py"}
    assert json.loads((export / "config.json").read_text())[AUX_IDS_KEY] == [1, 3, 5]


def test_failures_are_one_line_and_leave_no_file(setup, tmp_path, monkeypatch):
    model, target, head, src = setup
    export = tmp_path / "export"
    export_head(head, export)
    monkeypatch.setenv("FAIL", "1")
    with pytest.raises(SpeculantError, match="converter failed .*told to fail"):
        export_gguf(export, target, src)
    assert not (export / GGUF_NAME).exists() and not list(export.glob("*.partial"))
    monkeypatch.delenv("FAIL")
    with pytest.raises(SpeculantError, match="has no convert_hf_to_gguf.py and no gguf-py"):
        check_llama_cpp_source(tmp_path)
    with pytest.raises(SpeculantError, match="--gguf needs --llama-cpp"):
        check_llama_cpp_source(None)
    with pytest.raises(SpeculantError, match="has no config.json"):
        export_gguf(export, tmp_path, src)
    with pytest.raises(SpeculantError, match="EAGLE-3 heads only"):
        export_gguf(target, target, src)


def test_cli(setup, tmp_path, capsys, monkeypatch):
    """``--gguf`` through the CLI, the target from ``--model`` (an HF directory here); without a source tree: one
    line, exit code 2, no output directory."""
    model, target, head, src = setup
    monkeypatch.delenv("SPECULANT_LLAMA_CPP_SRC", raising=False)
    assert main(["export", "--draft-head", str(head), "--model", str(target), "--out", str(tmp_path / "a"),
                 "--gguf", "--llama-cpp", str(src)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["gguf"] == str(tmp_path / "a" / GGUF_NAME)
    assert json.loads((tmp_path / "a" / GGUF_NAME).read_text())["target_layers"] == 5
    assert main(["export", "--draft-head", str(head), "--model", str(target), "--out", str(tmp_path / "b"),
                 "--gguf"]) == 2
    assert one_line_error(capsys.readouterr().err) and not (tmp_path / "b").exists()
    monkeypatch.setenv("FAIL", "1")
    assert main(["export", "--draft-head", str(head), "--model", str(target), "--out", str(tmp_path / "c"),
                 "--gguf", "--llama-cpp", str(src)]) == 2
    assert one_line_error(capsys.readouterr().err) and not (tmp_path / "c").exists()
