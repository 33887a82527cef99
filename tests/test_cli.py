"""The hf-dilated command end to end on tiny checkpoints: patch (weights bitwise, model card), eval, bad options."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import types
from pathlib import Path

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
    assert main(["patch", str(checkpoint), str(dst), "--layers", "0", "2", "--context-length", "1024"]) == 0
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

    assert f'from_pretrained("{dst}")' in card, "the card names the final directory, not the staging one"
    assert "not on PyPI" in card and "pip install hf_dilated" not in card
    assert (dst.stat().st_mode & 0o777) == (0o777 & ~_umask())

    model = transformers.AutoModelForCausalLM.from_pretrained(dst)
    assert model.config._attn_implementation == "dilated"
    assert [p.name for p in tmp_path.iterdir()] == ["patched"], "the staging directory must be gone"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.parametrize(
    "options, message",
    [
        (["--layers", "0", "9"], "--layers must be 'all' or a list of layer indices in [0, 3)"),
        (["--segment-lengths", "100", "--dilation-rates", "3"], "multiple of its dilation rate"),
        (["--segment-lengths", "64"], "--segment-lengths and --dilation-rates must be given together"),
        (["--recipe", "gpt2"], "recipe must be 'auto' or one of"),
        (["--recipe", "bert"], "recipe 'bert' covers model types"),
        (["--rope", "ntk"], "invalid choice: 'ntk'"),
        (["--layers", "a"], "--layers takes 'all' or layer indices"),
        (["--layers", "all", "1"], "--layers takes 'all' alone"),
        (["--context-length", "100"], "--context-length 100 is below the 256 tokens"),
        (["--context-length", "-5"], "expected a positive integer"),
        (["--attention", "sparse"], "argument --attention: invalid choice: 'sparse' (choose from 'dilated', 'block_sparse')"),
        (["--top-k", "3"], "--top-k needs --attention block_sparse (--attention is one of dilated, block_sparse"),
        (["--pattern", "local", "--block-size", "32"], "--pattern / --block-size need --attention block_sparse"),
        (["--attention", "block_sparse", "--segment-lengths", "64", "--dilation-rates", "1"],
         "--segment-lengths / --dilation-rates are dilated-attention options; with --attention block_sparse give --pattern"),
        (["--attention", "block_sparse", "--pattern", "stripes"], "invalid choice: 'stripes' (choose from 'local', 'dilated'"),
        (["--attention", "block_sparse", "--block-size", "48"], "--block-size must be a power of two >= 16"),
        (["--attention", "block_sparse", "--top-k", "0"], "argument --top-k: expected a positive integer, got '0'"),
        (["--attention", "block_sparse", "--pattern", "local", "--local-blocks", "0"],
         "--local-blocks must be >= 1 for --pattern='local'"),
    ],
)
def test_patch_bad_options_write_nothing(checkpoint, tmp_path, capsys, options, message):
    dst = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["patch", str(checkpoint), str(dst), *options])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_patch_block_sparse_end_to_end(checkpoint, tmp_path, capsys):
    """`hf-dilated patch SRC DST --attention block_sparse ...`: config.json, model card, and a reload that gives the
    logits of the same patch made in memory."""
    from hf_dilated import BlockSparseConfig, patch

    dst = tmp_path / "bs"
    assert main(["patch", str(checkpoint), str(dst), "--attention", "block_sparse", "--block-size", "16", "--top-k", "2",
                 "--layers", "0", "2"]) == 0
    printed = capsys.readouterr().out
    assert "attention: sdpa -> block_sparse" in printed and "converted layers (2/3): [0, 2]" in printed
    assert "block-sparse: pattern=adaptive block_size=16 local_blocks=2 global_blocks=1 top_k=2" in printed
    assert "keys per query at 256 tokens" in printed and "bitwise identical" in printed
    config = json.loads((dst / "config.json").read_text())
    assert config["attn_implementation"] == "block_sparse" and "dilated_attention" not in config
    assert config["block_sparse_attention"]["layers"] == [0, 2] and config["block_sparse_attention"]["top_k"] == 2
    assert config["dilated_attention_patch"]["attention"] == "block_sparse"
    card = (dst / "README.md").read_text()
    assert "with block-sparse attention" in card and "| Block size | 16 |" in card and "| `top_k` | 2 |" in card

    ids = torch.randint(0, 128, (1, 200))
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    patch(base, {"block_size": 16, "top_k": 2}, attention="block_sparse", layers=[0, 2])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    assert reloaded.config._attn_implementation == "block_sparse"
    assert BlockSparseConfig.from_model_config(reloaded.config) == BlockSparseConfig.from_model_config(base.config)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, base(ids).logits)


def test_patch_refuses_existing_dst_and_missing_src(checkpoint, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit):
        main(["patch", str(checkpoint), str(dst)])
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --overwrite replaces only an earlier patch output, never other files
        main(["patch", str(checkpoint), str(dst), "--overwrite"])
    assert "did not write" in capsys.readouterr().err
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
    assert "dilated: branches w=[16, 32] r=[1, 2] (given by --segment-lengths / --dilation-rates) on 2/2 layers" in printed
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
        (["eval", "--top-k", "2"], "--top-k sets the block_sparse variants; add block_sparse or block_sparse+rope"),
        (["eval", "--variants", "block_sparse", "--block-size", "24"], "--block-size must be a power of two >= 16"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv + ["--output-dir", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_eval_block_sparse_variants(lm_with_tokenizer, shakespeare, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(shakespeare[:8000], encoding="utf-8")
    out = tmp_path / "results"
    argv = ["eval", "--model", str(lm_with_tokenizer), "--text", str(text), "--contexts", "64", "128", "--device", "cpu",
            "--variants", "dense", "block_sparse", "block_sparse+rope", "--block-size", "16", "--target-context", "256",
            "--segment-lengths", "16", "32", "--dilation-rates", "1", "2", "--output-dir", str(out), "--name", "bs"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "context |        dense | block_sparse | block_sparse+rope" in printed
    result = json.loads((out / "bs.json").read_text())
    rows = {(r["variant"], r["context"]): r["perplexity"] for r in result["results"]}
    assert len(rows) == 6 and all(torch.isfinite(torch.tensor(v)) for v in rows.values())
    summary = result["patches"]["block_sparse"]
    assert summary["attention"] == "block_sparse" and summary["block_sparse"]["block_size"] == 16
    assert summary["rope_parameters_after"] == summary["base"]["rope_parameters"]  # the model's own RoPE
    assert result["patches"]["block_sparse+rope"]["rope_parameters_after"]["rope_type"] == "yarn"
    # adaptive with the budget of the dilated branches given (w = 16, 32): local 16 / 2 tokens -> 1 block
    from hf_dilated import BlockSparseConfig, DilatedAttentionConfig

    want = BlockSparseConfig.matching_budget(DilatedAttentionConfig(segment_lengths=[16, 32], dilation_rates=[1, 2]),
                                             256, block_size=16, global_blocks=1)
    assert summary["block_sparse"]["top_k"] == want.top_k and summary["block_sparse"]["local_blocks"] == 1
    assert f"block_sparse: pattern=adaptive block_size=16 local_blocks=1 global_blocks=1 top_k={want.top_k}" in printed
    assert rows[("dense", 128)] != rows[("block_sparse", 128)]  # 8 blocks, a few attended: not dense


def test_finetune_delegates(monkeypatch):
    calls = []
    fake = types.ModuleType("hf_dilated.scripts.finetune")
    fake.main = lambda argv: calls.append(list(argv)) or 0
    monkeypatch.setitem(sys.modules, "hf_dilated.scripts.finetune", fake)
    assert main(["finetune", "--model", "smollm2", "--steps", "3"]) == 0
    assert calls == [["--model", "smollm2", "--steps", "3"]]


def test_recipes_command(capsys):
    assert main(["recipes"]) == 0
    printed = capsys.readouterr().out
    for name in ("llama", "qwen2", "qwen3", "mistral", "gemma3", "gpt_neox", "bert"):
        assert f"\n{name} " in "\n" + printed
    assert printed.count("block_sparse=pattern=adaptive,block_size=64,global_blocks=1") == len(printed.splitlines())


# ---- output paths: atomic, never deleting what the command did not write ----------------------------------------
def _tree(root: Path) -> dict:
    """Every path under ``root`` with its size and mtime: the file system as a test sees it."""
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_size if p.is_file() else 0, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def test_patch_refuses_destinations_that_would_lose_files(checkpoint, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    (tmp_path / "afile").write_text("x")
    before = _tree(tmp_path)
    for dst, message in [
        (".", "is or contains the working directory"),
        (str(tmp_path), "is or contains the working directory"),
        (str(checkpoint), "is or contains"),
        (str(checkpoint.parent), "is or contains"),
        (str(tmp_path / "afile"), "is a file"),
        (str(tmp_path / "afile" / "sub"), "which is a file"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["patch", str(checkpoint), dst, "--overwrite"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, (dst, err)
    assert _tree(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: file permissions cannot refuse it")
def test_patch_unwritable_destination(checkpoint, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(SystemExit) as exit_info:
        main(["patch", str(checkpoint), str(locked / "out")])
    assert exit_info.value.code == 2 and "no permission to write" in capsys.readouterr().err


def test_patch_overwrite_replaces_an_earlier_output_atomically(checkpoint, tmp_path, monkeypatch, capsys):
    dst = tmp_path / "out"
    (tmp_path / "neighbour.txt").write_text("keep")
    assert main(["patch", str(checkpoint), str(dst), "--layers", "0"]) == 0
    assert json.loads((dst / "config.json").read_text())["dilated_attention"]["layers"] == [0]
    # A failure while writing leaves the earlier output as it was and no staging directory behind.
    before = _tree(tmp_path)
    from hf_dilated import cli

    def broken(model, path):
        raise RuntimeError("disk full")

    monkeypatch.setattr(cli, "verify_weights", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        main(["patch", str(checkpoint), str(dst), "--layers", "1", "--overwrite"])
    assert _tree(tmp_path) == before
    monkeypatch.undo()
    assert main(["patch", str(checkpoint), str(dst), "--layers", "1", "--overwrite"]) == 0
    assert json.loads((dst / "config.json").read_text())["dilated_attention"]["layers"] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["neighbour.txt", "out"]


def test_prepare_output_dir_rule(tmp_path):
    from hf_dilated.cli import CLIError, prepare_output_dir

    out = tmp_path / "results"
    assert prepare_output_dir(out, False, files=["a.json"]) == out and out.is_dir()
    (out / "a.json").write_text("{}")
    (out / "other.txt").write_text("x")
    with pytest.raises(CLIError, match="already holds a.json; pass --overwrite"):
        prepare_output_dir(out, False, files=["a.json", "a.png"])
    assert prepare_output_dir(out, True, files=["a.json"]) == out
    assert prepare_output_dir(out, False, files=["b.json"]) == out  # other names: nothing to replace
    with pytest.raises(CLIError, match="already holds a.json, other.txt"):
        prepare_output_dir(out, False)  # a run directory the command owns must be empty
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "other.txt"]


def test_eval_refuses_to_replace_results_and_checks_matplotlib_first(tmp_path, monkeypatch, capsys):
    out = tmp_path / "res"
    out.mkdir()
    (out / "run.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--output-dir", str(out), "--name", "run"])
    assert exit_info.value.code == 2 and "pass --overwrite" in capsys.readouterr().err
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--output-dir", str(tmp_path / "new")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "needs matplotlib" in err and "hf_dilated[eval]" in err
    assert not (tmp_path / "new").exists()


# ---- the real checkpoint: the README's command --------------------------------------------------------------------
@pytest.mark.slow
def test_patch_smollm2_gguf_end_to_end(tmp_path, capsys):
    """`hf-dilated patch smollm2 out --context-length 16384`, as the README gives it, on the bundled GGUF."""
    if not assets.smollm2_available():
        pytest.skip(assets.SMOLLM2_MISSING)
    dst = tmp_path / "out"
    assert main(["patch", "smollm2", str(dst), "--context-length", "16384"]) == 0
    printed = capsys.readouterr().out
    assert "bitwise identical" in printed
    config = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in config and config["attn_implementation"] == "dilated"
    assert config["dilated_attention"]["segment_lengths"] == [2048, 4096, 8192, 16384]
    assert config["dilated_attention"]["dilation_rates"] == [1, 1, 2, 4]
    assert config["dilated_attention"]["global_tokens"] == 4
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == 2.0
    assert (dst / "tokenizer.json").exists() and (dst / "README.md").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(dst)
    assert model.config._attn_implementation == "dilated" and not getattr(model, "is_quantized", False)
    ids = torch.arange(3, 67)[None]
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


# ---- the command line's surface ---------------------------------------------------------------------------------
def test_help_version_and_no_doubled_defaults(capsys):
    from hf_dilated import __version__
    from hf_dilated.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"hf-dilated {__version__}"
    parser = build_parser()
    for command in ("patch", "eval"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: auto)" in text and "default: auto) (default" not in text
        assert not re.search(r"\(default: [^)]*\) \(default:", text)
        assert "(default: None)" not in text and "(default: False)" not in text


def test_cli_constants_match_the_library():
    from hf_dilated import cli, config, patching
    from hf_dilated.scripts.eval_long_context import VARIANTS

    from hf_dilated.ops.block_sparse import PATTERNS
    from hf_dilated.scripts.eval_long_context import DEFAULT_VARIANTS

    assert cli.BACKENDS == config.BACKENDS and cli.ROPE_CHOICES == patching.ROPE_CHOICES
    assert cli.EVAL_VARIANTS == VARIANTS and cli.PATCH_MARKER == patching.PATCH_KEY
    assert cli.DEFAULT_EVAL_VARIANTS == DEFAULT_VARIANTS and cli.ATTENTIONS == patching.ATTENTIONS
    assert cli.PATTERNS == PATTERNS


def test_help_is_quick_and_imports_no_model_code():
    """`hf-dilated --help` builds the parser without the package's model code (torch comes with `import hf_dilated`)."""
    code = ("import sys, time; t = time.perf_counter(); from hf_dilated import cli; t0 = time.perf_counter();"
            "p = cli.build_parser(); print(time.perf_counter() - t0);"
            "print(any(m in sys.modules for m in ('hf_dilated.evaluation', 'hf_dilated.finetune', 'hf_dilated.assets')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout.split()
    assert float(out[0]) < 1.0 and out[1] == "False"


def test_library_errors_read_as_options():
    from hf_dilated.cli import cli_message

    assert cli_message(ValueError("context_length must be positive;\n layers [9] bad")) == (
        "--context-length must be positive; --layers [9] bad")
    assert cli_message(ValueError("config.layers=[1]")) == "config.layers=[1]"
    assert cli_message(ValueError("recipe 'bert' covers; rope.type x")) == "recipe 'bert' covers; rope.type x"


# ---- property: malformed, missing or conflicting options fail fast and write nothing --------------------------------
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

BAD = {
    "patch": [
        ["--segment-lengths", "64"], ["--dilation-rates", "1"], ["--segment-lengths", "0", "--dilation-rates", "1"],
        ["--segment-lengths", "100", "--dilation-rates", "3"], ["--segment-lengths", "64", "32", "--dilation-rates", "1", "2"],
        ["--layers", "x"], ["--layers", "all", "2"], ["--layers", "-1"], ["--rope", "ntk"], ["--backend", "cuda"],
        ["--recipe", "nope"], ["--context-length", "-1"], ["--context-length", "1e3"], ["--dtype", "int8"],
        ["--eval-results", "missing.json"], ["--frobnicate"], ["--overwrite=yes"], ["--attention", "sparse"],
        ["--pattern", "stripes"], ["--top-k", "0"], ["--block-size", "48"], ["--local-blocks", "-1"],
    ],
    "eval": [
        ["--device", "tpu"], ["--contexts", "0"], ["--contexts"], ["--variants", "x"], ["--text", "missing.txt"],
        ["--model", "missing-dir"], ["--windows", "0"], ["--layers", "0"], ["--name", "a/b"], ["--logits-chunk", "-1"],
        ["--dtype", "int8"], ["--segment-lengths", "64"], ["--recipe", "nope"], ["--frobnicate"], ["--top-k", "0"],
        ["--pattern", "stripes"], ["--block-size", "24"],
    ],
    "recipes": [["--frobnicate"], ["extra"]],
    "finetune": [
        ["--seq-len", "0"], ["--attn", "flash"], ["--frobnicate"], ["--layers", "x"], ["--rope", "ntk"],
        ["--segment-lengths", "64"], ["--data", "missing-dir"], ["--model", "missing-dir"], ["--max-steps", "x"],
        ["--attn", "block_sparse", "--segment-lengths", "64", "--dilation-rates", "1"], ["--attention", "flash"],
    ],
}
GOOD = {
    "patch": [["--backend", "torch"], ["--rope", "none"], ["--dtype", "float32"], ["--overwrite"], ["--layers", "0"]],
    "eval": [["--windows", "2"], ["--device", "cpu"], ["--overwrite"], ["--contexts", "64", "128"]],
    "recipes": [[]],
    "finetune": [["--attn", "sdpa"], ["--attn", "block_sparse"], ["--overwrite"], ["--max-steps", "2"]],
}


@st.composite
def bad_command_lines(draw):
    command = draw(st.sampled_from(sorted(BAD)))
    options = draw(st.lists(st.sampled_from(BAD[command]), min_size=1, max_size=3))
    bad_flags = {option[0] for option in options if option}
    good = [option for option in GOOD[command] if not option or option[0] not in bad_flags]  # no override of a bad one
    options += draw(st.lists(st.sampled_from(good), max_size=2)) if good else []
    options = draw(st.permutations(options))
    argv = [command]
    if command == "patch":
        argv += draw(st.sampled_from([["SRC", "out"], ["SRC"], [], ["missing-src", "out"]]))
    return argv + [part for option in options for part in option]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=bad_command_lines())
def test_bad_command_lines_exit_2_with_one_line_and_touch_nothing(argv, checkpoint, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    monkeypatch.chdir(work)
    argv = [str(checkpoint) if a == "SRC" else a for a in argv]
    from hf_dilated import assets as assets_module

    def no_loading(*args, **kwargs):
        raise AssertionError(f"{argv} loaded a model before refusing its options")

    monkeypatch.setattr(assets_module, "load_checkpoint", no_loading)
    before = _tree(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, (argv, captured)
    assert captured.err.count("\n") == 1 and "error:" in captured.err, (argv, captured.err)
    assert _tree(tmp_path) == before, argv


def test_eval_says_when_branches_are_dense_at_a_length():
    from hf_dilated.cli import _branch_notes

    result = {"contexts": [512, 4096], "patches": {
        "dense": None,
        "dilated": {"converted_layers": [0], "segment_lengths": [2048], "dilation_rates": [1]},
        "dilated+rope": {"converted_layers": [0], "segment_lengths": [2048, 4096], "dilation_rates": [1, 2]},
    }}
    assert _branch_notes(result) == ["dilated: branches w=[2048] r=[1] are exact dense attention at [512] tokens "
                                     "(every branch has r = 1 and a segment at least as long as the window)"]


def test_patch_of_a_patched_checkpoint_is_refused_in_cli_words(checkpoint, tmp_path, capsys):
    first = tmp_path / "first"
    assert main(["patch", str(checkpoint), str(first)]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["patch", str(first), str(tmp_path / "second")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "already patched" in err and "hf_dilated.unpatch" not in err
    assert err.count("\n") == 1 and not (tmp_path / "second").exists()


def test_finetune_accepts_block_sparse(tmp_path, capsys):
    """`hf-dilated finetune --attention block_sparse` (alias of --attn) parses and validates; the library switch it
    runs (training.prepare_attention) patches the recipe's block-sparse attention at --seq-len."""
    import hf_dilated
    from hf_dilated import BlockSparseConfig
    from hf_dilated.scripts import finetune as ft
    from hf_dilated.training import prepare_attention

    script, _ = ft.parse_args(["--model", "tiny", "--attention", "block_sparse", "--layers", "0", "--backend", "torch",
                               "--output-dir", str(tmp_path / "run")])
    assert script.attn == "block_sparse" and ft._layers(script.layers) == [0]
    for argv, message in [
        (["--attn", "block_sparse", "--segment-lengths", "64", "--dilation-rates", "1"],
         "--segment-lengths / --dilation-rates are dilated-attention options; --attn block_sparse"),
        (["--attn", "sdpa", "--backend", "torch"], "need --attn dilated or block_sparse, got --attn sdpa"),
        (["--attention", "sparse"], "invalid choice: 'sparse' (choose from 'dilated', 'block_sparse', 'sdpa')"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            ft.main([*argv, "--output-dir", str(tmp_path / "bad")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "bad").exists()

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=4096))
    cfg = prepare_attention(model, "block_sparse", seq_len=8192, layers=[1], backend="torch", rope="none")
    assert isinstance(cfg, BlockSparseConfig) and cfg.pattern == "adaptive" and cfg.layers == [1]
    assert model.config._attn_implementation == "block_sparse" and model.config.use_cache is False
    assert prepare_attention(model, "block_sparse", seq_len=8192) == cfg  # already patched so: kept
    assert isinstance(prepare_attention(model, "dilated", seq_len=8192), hf_dilated.DilatedAttentionConfig)
    assert model.config._attn_implementation == "dilated"  # switched, not stacked
    with pytest.raises(ValueError, match="attn must be one of \\('dilated', 'block_sparse', 'sdpa'\\)"):
        prepare_attention(model, "flash")
