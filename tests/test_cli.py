"""The hf-dilated command end to end on tiny checkpoints: patch (weights bitwise, model card), eval, bad options."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import transformers
from safetensors.torch import load_file

from hf_dilated import assets
from hf_dilated.cli import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint in bfloat16 (so dtype="auto" must keep it) with untied head."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("src")
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _tensors(path):
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_patch_end_to_end(checkpoint, tmp_path, capsys):
    dst = tmp_path / "patched"
    assert main(["patch", str(checkpoint), str(dst), "--layers", "0,2", "--context-length", "1024"]) == 0
    printed = capsys.readouterr().out
    assert "converted layers (2/3): [0, 2]" in printed and "dense layers: [1]" in printed
    assert "'rope_type': 'yarn', 'factor': 4.0" in printed and "bitwise identical" in printed

    src_w, dst_w = _tensors(checkpoint), _tensors(dst)
    assert src_w.keys() == dst_w.keys()
    assert all(dst_w[k].dtype == torch.bfloat16 and torch.equal(src_w[k], dst_w[k]) for k in src_w)

    config = json.loads((dst / "config.json").read_text())
    assert config["attn_implementation"] == "dilated"
    assert config["dilated_attention"]["layers"] == [0, 2]
    assert config["dilated_attention"]["segment_lengths"] == [64, 128, 256, 512, 1024]
    card = (dst / "README.md").read_text()
    assert "library_name: transformers" in card and "| Converted layers | 2 of 3: 0, 2 |" in card

    model = transformers.AutoModelForCausalLM.from_pretrained(dst)
    assert model.config._attn_implementation == "dilated"
    assert not list(tmp_path.glob(".patched.*")), "the temporary directory must be gone"


@pytest.mark.parametrize(
    "options, message",
    [
        (["--layers", "0,9"], "layers must be 'all' or a list of layer indices in [0, 3)"),
        (["--segment-lengths", "100", "--dilation-rates", "3"], "multiple of its dilation rate"),
        (["--segment-lengths", "64"], "--segment-lengths and --dilation-rates must be given together"),
        (["--recipe", "gpt2"], "recipe must be 'auto' or one of"),
        (["--recipe", "bert"], "recipe 'bert' covers model types"),
        (["--rope", "ntk"], "invalid choice: 'ntk'"),
        (["--layers", "a,b"], "--layers must be 'all' or comma-separated layer indices"),
        (["--context-length", "-5"], "expected a positive integer"),
    ],
)
def test_patch_bad_options_write_nothing(checkpoint, tmp_path, capsys, options, message):
    dst = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["patch", str(checkpoint), str(dst), *options])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_patch_refuses_existing_dst_and_missing_src(checkpoint, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit):
        main(["patch", str(checkpoint), str(dst)])
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    with pytest.raises(SystemExit):
        main(["patch", str(tmp_path / "nope"), str(tmp_path / "out2")])
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()


@pytest.fixture(scope="module")
def lm_with_tokenizer(tmp_path_factory):
    """A tiny Llama over SmolLM2's tokenizer (so it reads real text), saved with that tokenizer."""
    tok = assets.load_smollm2_tokenizer()
    if tok is None:
        pytest.skip(assets.SMOLLM2_MISSING)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=128)
    path = tmp_path_factory.mktemp("lm")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_eval_end_to_end(lm_with_tokenizer, shakespeare, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(shakespeare[:20000], encoding="utf-8")
    out = tmp_path / "results"
    argv = ["eval", "--model", str(lm_with_tokenizer), "--text", str(text), "--contexts", "64", "256",
            "--windows", "2", "--device", "cpu", "--segment-lengths", "16", "32", "--dilation-rates", "1", "2",
            "--output-dir", str(out), "--name", "tiny"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "context |        dense |   dense+rope |      dilated | dilated+rope" in printed
    result = json.loads((out / "tiny.json").read_text())
    assert (out / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {(r["variant"], r["context"]): r for r in result["results"]}
    assert len(rows) == 8 and all(r["tokens"] == 2 * (r["context"] - 1) for r in rows.values())
    assert result["target_context"] == 256 and result["trained_context"] == 128 and result["windows"] == 2
    assert result["patches"]["dilated+rope"]["rope_parameters_after"]["rope_type"] == "yarn"
    assert result["patches"]["dense+rope"]["converted_layers"] == []
    # at 64 tokens only RoPE matters (the dense+rope variant), dilation changes the numbers
    assert rows[("dense", 64)]["perplexity"] != rows[("dilated", 64)]["perplexity"]
    assert rows[("dense+rope", 64)]["perplexity"] != rows[("dense", 64)]["perplexity"]
    assert all(torch.isfinite(torch.tensor(r["perplexity"])) for r in rows.values())


def test_eval_bad_options(tmp_path, capsys):
    for argv, message in [
        (["eval", "--device", "tpu"], "--device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        (["eval", "--text", str(tmp_path / "missing.txt")], "--text must be 'shakespeare' or a .txt file"),
        (["eval", "--contexts", "0"], "expected a positive integer"),
        (["eval", "--variants", "sparse"], "invalid choice: 'sparse'"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv + ["--output-dir", str(tmp_path / "out")])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_finetune_delegates(monkeypatch):
    calls = []
    fake = types.ModuleType("hf_dilated.finetune")
    fake.main = lambda argv: calls.append(list(argv)) or 0
    monkeypatch.setitem(sys.modules, "hf_dilated.finetune", fake)
    assert main(["finetune", "--model", "smollm2", "--steps", "3"]) == 0
    assert calls == [["--model", "smollm2", "--steps", "3"]]


def test_recipes_command(capsys):
    assert main(["recipes"]) == 0
    printed = capsys.readouterr().out
    for name in ("llama", "qwen2", "qwen3", "mistral", "gemma3", "gpt_neox", "bert"):
        assert f"\n{name} " in "\n" + printed
