#!/usr/bin/env python
"""Fine-tune a causal LM with dilated (or dense) attention at long context, with Transformers' ``Trainer``.

    python scripts/finetune.py --model smollm2 --seq-len 16384 --bf16 --gradient-checkpointing --output-dir runs/16k
    hf-dilated finetune ...                                  (the same program)

Options: those of :class:`ScriptArguments` below, and every ``TrainingArguments`` option (``--learning-rate``,
``--max-steps``, ``--per-device-train-batch-size``, ``--bf16``, ``--gradient-checkpointing``, ``--save-strategy``,
``--resume-from-checkpoint PATH|latest``, ``--use-liger-kernel``, ...). A run:

1. loads ``--model``: ``smollm2`` (SmolLM2-135M-Instruct from its GGUF), ``tiny`` (a random SmolLM2-shaped Llama with
   SmolLM2's tokenizer, for smoke tests), a checkpoint directory (one saved by this program reloads dilated) or a
   ``.gguf`` file, through :func:`hf_dilated.assets.load_checkpoint`;
2. switches attention with :func:`hf_dilated.training.prepare_attention` (``--attn dilated``, ``--attn block_sparse``:
   the recipe's adaptive block-sparse attention with as many keys per query as the dilated default at ``--seq-len``,
   or the ``sdpa`` baseline);
3. reads documents with ``datasets`` (Shakespeare's plays, or the ``.txt`` files of ``--data``, one document per file;
   the last ``--eval-docs`` are held out whole), tokenizes them with the model's tokenizer (each followed by EOS) and
   packs them into rows of exactly ``--seq-len`` tokens. ``DataCollatorWithFlattening`` makes the batches: under
   ``--packing documents`` positions restart at every document (and every piece of one split across rows), so
   attention never crosses documents and no document's first token is a target; ``--packing stream`` numbers a row
   ``0..N-1`` (dense attention's fastest path, no mask);
4. trains with ``Trainer``; the loss is :func:`hf_dilated.evaluation.causal_lm_nll` over ``--loss-chunk-size``
   tokens at a time (``0``: the model's own loss; ``--use-liger-kernel``: Liger's fused linear cross-entropy);
   ``--lora-r`` trains a PEFT LoRA adapter, merged before saving;
5. writes ``results.json`` (loss curve, eval loss before and after, tokens/s, peak memory, versions), prints the
   results table, draws ``loss.png``, and saves the model into ``OUTPUT/model``, checked to reload to the same eval loss.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from hf_dilated.cli import BACKENDS, ROPE_CHOICES  # the command line's vocabulary (stdlib-only module)

try:
    from . import reporting
except ImportError:  # run as a file: python scripts/finetune.py
    import reporting

RESULTS_FILE = "results.json"
PLOT_FILE = "loss.png"
MODEL_SUBDIR = "model"
ATTENTIONS = ("dilated", "block_sparse", "sdpa")
PATCHED = ("dilated", "block_sparse")  # the attentions hf_dilated.patch puts in (saved with save_patched)
PACKINGS = ("documents", "stream")
EDITIONS = ("modern", "folio", "all")
DTYPES = ("float32", "bfloat16")


@dataclass
class ScriptArguments:
    """This program's options; ``TrainingArguments`` gives the rest."""

    model: str = field(default="smollm2", metadata={"help": "'smollm2' (the bundled GGUF), 'tiny' (a random SmolLM2-shaped Llama), a checkpoint directory or a .gguf file"})
    attn: Optional[str] = field(default=None, metadata={
        "choices": ATTENTIONS, "aliases": ["--attention"],
        "help": "attention to train with (block_sparse: the recipe's adaptive pattern); default: the attention a patched "
                "checkpoint carries, dilated for an unpatched one or with --segment-lengths"})
    segment_lengths: Optional[list[int]] = field(default=None, metadata={"help": "branch segment lengths w_i, e.g. 2048 4096 (default: the recipe's, extended to --seq-len)"})
    dilation_rates: Optional[list[int]] = field(default=None, metadata={"help": "branch dilation rates r_i, e.g. 1 2"})
    layers: list[str] = field(default_factory=lambda: ["all"], metadata={"help": "layers to convert: 'all' (the recipe's choice) or indices, e.g. 0 2 4"})
    backend: Optional[str] = field(default=None, metadata={"choices": BACKENDS, "help": "dilated-attention backend (default: auto)"})
    rope: Optional[str] = field(default=None, metadata={"choices": ROPE_CHOICES, "help": "RoPE scaling to --seq-len past the trained context (default: recipe, the recipe's type)"})
    data: str = field(default="shakespeare", metadata={"help": "'shakespeare' or a directory of .txt files, one document per file"})
    editions: str = field(default="modern", metadata={"choices": EDITIONS, "help": "Shakespeare: modern spelling, First Folio, or both"})
    seq_len: int = field(default=16384, metadata={"help": "tokens per training row"})
    packing: str = field(default="documents", metadata={"choices": PACKINGS, "help": "positions restart per document, or one stream per row"})
    eval_docs: int = field(default=4, metadata={"help": "documents (the last by name) held out for evaluation"})
    max_train_tokens: Optional[int] = field(default=None, metadata={"help": "use only the first N training tokens"})
    max_eval_tokens: Optional[int] = field(default=None, metadata={"help": "use only the first N held-out tokens"})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "evaluate on at most N rows"})
    dtype: str = field(default="float32", metadata={"choices": DTYPES, "help": "weights: float32 (master weights under --bf16 autocast) or bfloat16"})
    loss_chunk_size: int = field(default=4096, metadata={"help": "tokens per LM-head/cross-entropy chunk (0: the model's own loss)"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank (0: full fine-tuning)"})
    lora_alpha: Optional[float] = field(default=None, metadata={"help": "LoRA alpha (default 2 * r)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout"})
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], metadata={"help": "modules LoRA adapts"})
    max_train_seconds: Optional[float] = field(default=None, metadata={"help": "stop training cleanly after N seconds"})
    timing_warmup_steps: int = field(default=2, metadata={"help": "steps left out of tokens/s (compilation, autotuning)"})
    sequence_parallel: int = field(default=1, metadata={"help": "shard each sequence over N ranks ('dilated_ring' attention; launch W ranks, W divisible by N, with torchrun or accelerate launch)"})
    overwrite: bool = field(default=False, metadata={"help": "write into an existing non-empty --output-dir"})
    save_model: bool = field(default=True, metadata={"help": "save the final model (LoRA merged) to OUTPUT/model"})
    verify_reload: bool = field(default=True, metadata={"help": "reload the saved model and check its eval loss"})


# The fine-tune recipe (SmolLM2 at 8K with the Llama recipe's branches, 274 steps: dilated 1.019-1.022x of dense
# fine-tuned the same way with full fine-tuning over five seeds (mean 1.020), 1.021-1.023x with LoRA; read at 32K,
# 0.994-1.010x dense + YaRN; benchmarks/FIDELITY.md). The rate applies unless --learning-rate is given, the steps
# unless --max-steps is.
RECIPE_LEARNING_RATE = {"lora": 1e-3, "full": 1e-4}
RECIPE_STEPS = 274


def build_parser():
    import torch
    from transformers import HfArgumentParser, TrainingArguments

    class OneLineErrors(HfArgumentParser):
        def error(self, message: str):  # one line, like every hf-dilated command (the usage is in --help)
            self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    parser = OneLineErrors((ScriptArguments, TrainingArguments), prog="hf-dilated finetune",
                           description="Fine-tune a causal LM with dilated (or dense) attention at long context.")
    # Trainer's defaults, where a long-context run wants others: one row a step, a loss point per step, no checkpoint
    # unless asked; without CUDA, the CPU (where --bf16 autocast works too).
    # The measured fine-tune recipe (scripts/finetune_recipe.py, benchmarks/FIDELITY.md): 274 steps (at SmolLM2's
    # trained 8K: 1.020x dense fine-tuned alike, the mean of five seeds), a constant rate after 10 warm-up steps, 1e-4
    # (with --lora-r: 1e-3, set in parse_args unless --learning-rate is given).
    parser.set_defaults(logging_steps=1, save_strategy="no", max_steps=RECIPE_STEPS, report_to="none",
                        lr_scheduler_type="constant_with_warmup", warmup_steps=10, weight_decay=0.0,
                        learning_rate=RECIPE_LEARNING_RATE["full"],
                        per_device_train_batch_size=1, per_device_eval_batch_size=1,
                        use_cpu=not torch.cuda.is_available(), dataloader_pin_memory=torch.cuda.is_available())
    return parser


def parse_args(argv: Sequence[str] | None = None):
    """``(script, training)`` arguments; ``ValueError`` naming the first bad option."""
    parser = build_parser()
    script, training = parser.parse_args_into_dataclasses(args=argv)
    given = sys.argv[1:] if argv is None else list(argv)
    if script.lora_r and not any(a.split("=")[0] in ("--learning_rate", "--learning-rate") for a in given):
        training.learning_rate = RECIPE_LEARNING_RATE["lora"]
    validate(script, training)
    return script, training


def _layers(values: list[str]) -> str | list[int]:
    if values == ["all"]:
        return "all"
    try:
        layers = sorted({int(v) for v in values})
    except ValueError:
        layers = [-1]
    if not layers or min(layers) < 0:
        raise ValueError(f"--layers takes 'all' alone or layer indices such as 0 2 4, got {' '.join(values)}")
    return layers


def validate(script: ScriptArguments, training) -> None:
    """Every check that needs no model or data: ``ValueError`` naming the option. Creates ``--output-dir`` last."""
    from hf_dilated import DilatedAttentionConfig
    from hf_dilated.cli import prepare_output_dir, require_modules

    if script.seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2, got {script.seq_len}")
    for name in ("eval_docs", "loss_chunk_size", "lora_r", "timing_warmup_steps"):
        if getattr(script, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(script, name)}")
    for name in ("max_train_tokens", "max_eval_tokens", "max_eval_samples", "max_train_seconds"):
        value = getattr(script, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive when given, got {value}")
    if (script.segment_lengths is None) != (script.dilation_rates is None):
        raise ValueError("--segment-lengths and --dilation-rates go together: give both or neither")
    if script.segment_lengths is not None:  # checks the branches, with its own message
        DilatedAttentionConfig(segment_lengths=script.segment_lengths, dilation_rates=script.dilation_rates)
    _layers(script.layers)
    check_attention(script)
    if not 0.0 <= script.lora_dropout < 1.0:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {script.lora_dropout}")
    if script.lora_r == 0 and (script.lora_alpha is not None or script.lora_dropout):
        raise ValueError("--lora-alpha / --lora-dropout need --lora-r > 0")
    if script.sequence_parallel < 1:
        raise ValueError(f"--sequence-parallel must be a positive integer, got {script.sequence_parallel}")
    if script.data != "shakespeare" and not Path(script.data).is_dir():
        raise ValueError(f"--data must be 'shakespeare' or a directory of .txt files, got {script.data!r}")
    if script.model not in ("smollm2", "tiny") and not (Path(script.model).is_dir() or script.model.endswith(".gguf")):
        raise ValueError(f"--model must be 'smollm2', 'tiny', a checkpoint directory or a .gguf file, got {script.model!r}")
    if script.verify_reload and not script.save_model:
        script.verify_reload = False
    require_modules("finetune", "datasets", "matplotlib", *(["peft"] if script.lora_r else []),
                    *(["gguf"] if script.model in ("smollm2", "tiny") or script.model.endswith(".gguf") else []),
                    *(["liger_kernel"] if training.use_liger_kernel else []))
    resume = training.resume_from_checkpoint is not None  # continues in the directory it left
    protect = [] if script.model in ("smollm2", "tiny") else [Path(script.model)]
    prepare_output_dir(training.output_dir, script.overwrite or resume, protect=protect)


# ---------------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------------
def check_attention(script: ScriptArguments) -> None:
    """The options that depend on ``--attn`` (checked again once a default ``--attn`` is resolved from the model)."""
    if script.attn is None:  # resolved from the checkpoint after loading (resolve_attention)
        return
    if script.attn == "block_sparse" and script.segment_lengths is not None:
        raise ValueError("--segment-lengths / --dilation-rates are dilated-attention options; --attn block_sparse takes "
                         "the recipe's block-sparse settings (hf-dilated patch --attention block_sparse sets others)")
    patched_only = script.segment_lengths is not None or script.layers != ["all"] or script.backend or script.rope
    if script.attn not in PATCHED and patched_only:
        raise ValueError(f"--segment-lengths / --dilation-rates / --layers / --backend / --rope need --attn dilated or "
                         f"block_sparse, got --attn {script.attn}")
    if script.sequence_parallel > 1 and script.attn != "dilated":
        raise ValueError(f"--sequence-parallel {script.sequence_parallel} needs --attn dilated, got --attn {script.attn}")


def resolve_attention(script: ScriptArguments, model) -> str:
    """``--attn``, or by default the attention the checkpoint was patched with (so that fine-tuning a block-sparse
    checkpoint keeps it block-sparse), dilated for an unpatched one or when dilated-only options are given."""
    from hf_dilated.patching import patched_attention

    if script.attn is not None:
        return script.attn
    if script.segment_lengths is not None or script.sequence_parallel > 1:
        return "dilated"
    return patched_attention(model) or "dilated"


def load_model(script: ScriptArguments, seed: int = 0):
    """``(model, tokenizer)`` of ``--model`` in ``--dtype`` (``seed`` initializes ``tiny``)."""
    import torch

    from hf_dilated import assets

    dtype = getattr(torch, script.dtype)
    if script.model == "tiny":
        tokenizer = assets.load_smollm2_tokenizer()
        if tokenizer is None:
            raise ValueError(assets.SMOLLM2_MISSING)
        return assets.tiny_llama(seed, vocab_size=len(tokenizer)).to(dtype), tokenizer
    model, tokenizer = assets.load_checkpoint(script.model, dtype=dtype)
    if tokenizer is None:
        raise ValueError(f"--model {script.model} has no tokenizer beside it; fine-tuning needs one")
    return model, tokenizer


def attach_lora(model, script: ScriptArguments):
    from peft import LoraConfig, get_peft_model

    targets = list(script.lora_targets)
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        raise ValueError(f"--lora-targets {missing} match no module of this model")
    alpha = script.lora_alpha if script.lora_alpha is not None else 2 * script.lora_r
    config = LoraConfig(r=script.lora_r, lora_alpha=alpha, lora_dropout=script.lora_dropout, target_modules=targets,
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------
def load_documents(script: ScriptArguments):
    """A ``datasets.Dataset`` of ``name``, ``text``: one document per play (or per ``.txt`` file), sorted by name."""
    from datasets import Dataset, load_dataset

    from hf_dilated import assets

    if script.data == "shakespeare":
        docs = assets.shakespeare_documents(script.editions)
        if docs is None:
            raise ValueError(assets.SHAKESPEARE_MISSING)
        return Dataset.from_dict({"name": [n for n, _ in docs], "text": [t for _, t in docs]})
    files = sorted(Path(script.data).rglob("*.txt"))
    if not files:
        raise ValueError(f"--data {script.data}: no .txt files found")
    docs = load_dataset("text", data_files=[str(f) for f in files], sample_by="document", split="train")
    return docs.add_column("name", [str(f.relative_to(script.data)) for f in files])


def pack(docs, tokenizer, seq_len: int, packing: str, max_tokens: int | None = None):
    """Rows of exactly ``seq_len`` tokens (the last partial row dropped): ``input_ids`` and the lengths of the
    document pieces in the row (``piece_lengths``; one piece per row under ``packing="stream"``)."""
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    if max_tokens is not None:  # tokenize only what is used: ~4 characters a token, 8 to be safe
        budget, texts = max_tokens * 8, []
        for text in docs["text"]:
            texts.append(text[:budget])
            budget -= len(texts[-1])
            if budget <= 0:
                break
        docs = docs.select(range(len(texts))).map(lambda _, i: {"text": texts[i]}, with_indices=True)
    tokens = docs.map(lambda b: {"input_ids": [ids + eos for ids in tokenizer(b["text"], add_special_tokens=False)["input_ids"]]},
                      batched=True, remove_columns=docs.column_names)

    def rows(batch):
        out = {"input_ids": [], "piece_lengths": []}
        row, pieces, left = [], [], max_tokens
        for doc in batch["input_ids"]:
            doc = doc if left is None else doc[:left]
            left = None if left is None else left - len(doc)
            while doc:
                take = doc[: seq_len - len(row)]
                row, doc = row + take, doc[len(take):]
                pieces.append(len(take))
                if len(row) == seq_len:
                    out["input_ids"].append(row)
                    out["piece_lengths"].append(pieces if packing == "documents" else [seq_len])
                    row, pieces = [], []
        return out

    return tokens.map(rows, batched=True, batch_size=None, remove_columns=tokens.column_names)


class PackedRowsCollator:
    """Packed rows to a batch by Transformers' ``DataCollatorWithFlattening``: every document piece of the rows
    becomes one sequence of a ``[1, B * seq_len]`` batch, ``position_ids`` restarting at 0 and label ``-100`` at each
    piece's first token."""

    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_position_ids=True, return_flash_attn_kwargs=False)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        pieces = []
        for row in rows:
            start = 0
            for n in row["piece_lengths"]:
                pieces.append({"input_ids": list(row["input_ids"][start : start + n])})
                start += n
        return self.flatten(pieces, return_tensors="pt")


def build_datasets(script: ScriptArguments, tokenizer):
    """``(train, eval, names)``: packed training and held-out rows, and the documents of each."""
    import datasets

    datasets.disable_progress_bars()  # a few seconds of tokenizing; Trainer's bar is the one to watch
    docs = load_documents(script)
    if script.eval_docs >= len(docs):
        raise ValueError(f"--eval-docs {script.eval_docs} leaves no training document (there are {len(docs)})")
    cut = len(docs) - script.eval_docs
    train = pack(docs.select(range(cut)), tokenizer, script.seq_len, script.packing, script.max_train_tokens)
    if not len(train):
        raise ValueError(f"the training documents hold fewer tokens than one row of --seq-len {script.seq_len}; "
                         "lower --seq-len or raise --max-train-tokens")
    evaluation = None
    if script.eval_docs:
        evaluation = pack(docs.select(range(cut, len(docs))), tokenizer, script.seq_len, script.packing, script.max_eval_tokens)
        if not len(evaluation):
            raise ValueError(f"the held-out documents hold fewer tokens than one row of --seq-len {script.seq_len}; "
                             "raise --eval-docs or --max-eval-tokens, or pass --eval-docs 0")
        if script.max_eval_samples is not None:
            evaluation = evaluation.select(range(min(script.max_eval_samples, len(evaluation))))
    return train, evaluation, {"train": docs["name"][:cut], "eval": docs["name"][cut:]}


# ---------------------------------------------------------------------------------------------------------------------
# Trainer: the chunked loss, and a callback measuring tokens/s under a time budget
# ---------------------------------------------------------------------------------------------------------------------
def _wrapped(model, unwrapped) -> bool:
    """Whether Trainer handed ``compute_loss`` a DDP / FSDP wrapper of the model (data parallel over several processes).
    The chunked NLL calls the decoder body directly, which would skip the wrapper's forward and with it the gradient
    synchronization, so there the model's own loss runs (its full logits cost memory; said once)."""
    if model is unwrapped or not hasattr(model, "module"):
        return False
    if not _WARNED_WRAPPED:
        _WARNED_WRAPPED.append(True)
        import warnings

        warnings.warn(f"{type(model).__name__} wraps the model: the training loss is the model's own (full logits), not "
                      "the chunked NLL, so that the wrapper synchronizes gradients", stacklevel=2)
    return True


_WARNED_WRAPPED: list = []


def make_trainer(model, training, train_dataset=None, eval_dataset=None, *, loss_chunk_size: int = 4096,
                 tokens_per_step: int = 0, warmup_steps: int = 0, max_seconds: float | None = None, callbacks=(),
                 sequence_parallel: int = 1):
    """``(trainer, measure)``: a ``Trainer`` whose loss is :func:`hf_dilated.evaluation.causal_lm_nll`, and the
    callback that measures step times. ``sequence_parallel > 1``: the ``SequenceParallelTrainer`` of
    ``hf_dilated.distributed.trainer`` (the model already switched by ``enable_sequence_parallel``)."""
    import torch
    from transformers import Trainer, TrainerCallback

    from hf_dilated.evaluation import causal_lm_nll

    base = Trainer
    if sequence_parallel > 1:
        from hf_dilated.distributed.trainer import SequenceParallelTrainer as base

    class ChunkedLossTrainer(base):
        def shard_loss_sum(self, model, inputs):  # sequence parallel: one shard's summed loss, the same chunked NLL
            if not loss_chunk_size or self.args.use_liger_kernel:
                return super().shard_loss_sum(model, inputs)
            with self.accelerator.autocast():
                return causal_lm_nll(model, inputs, loss_chunk_size)[0]

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not loss_chunk_size or self.args.use_liger_kernel or _wrapped(model, self.model):
                return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            with self.accelerator.autocast():  # it wraps the top-level forward; the NLL calls the decoder body
                total, count = causal_lm_nll(model, inputs, loss_chunk_size)
            loss = total / (count.clamp_min(1) if num_items_in_batch is None else num_items_in_batch.to(total.device))
            if num_items_in_batch is not None and self.args.average_tokens_across_devices:
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())  # as Trainer: the count is global
            return (loss, {"loss": loss}) if return_outputs else loss

    class Measure(TrainerCallback):
        """Synchronized step times, tokens/s after the warm-up steps, and the wall-clock budget."""

        def __init__(self):
            self.step_times: list[float] = []
            self.stopped_by_time = False
            self._start = self._t0 = 0.0

        @staticmethod
        def _now() -> float:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kw):
            self._start = self._now()

        def on_step_begin(self, args, state, control, **kw):
            self._t0 = self._now()

        def on_step_end(self, args, state, control, **kw):
            now = self._now()
            self.step_times.append(now - self._t0)
            if max_seconds is not None and now - self._start > max_seconds and not control.should_training_stop:
                self.stopped_by_time = control.should_training_stop = True
                control.should_save = args.save_strategy != "no"

        def summary(self) -> dict[str, Any]:
            timed = self.step_times[warmup_steps:] or self.step_times
            mean = sum(timed) / len(timed) if timed else float("nan")
            return {"steps_run": len(self.step_times), "steps_timed": len(timed), "step_time_mean_s": mean,
                    "tokens_per_step": tokens_per_step,
                    "tokens_per_second": tokens_per_step / mean if timed and mean > 0 else None,
                    "stopped_by_time": self.stopped_by_time}

    training.remove_unused_columns = False  # the collator reads piece_lengths
    training.prediction_loss_only = True
    measure = Measure()
    trainer = ChunkedLossTrainer(model=model, args=training, train_dataset=train_dataset, eval_dataset=eval_dataset,
                                 data_collator=PackedRowsCollator(), callbacks=[measure, *callbacks])
    return trainer, measure


def _eval(trainer) -> dict[str, float]:
    loss = float(trainer.evaluate()["eval_loss"])
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 50 else float("inf")}


def peak_memory() -> dict[str, Any]:
    import torch

    if torch.cuda.is_available():
        return {"kind": "cuda_max_memory_allocated", "peak_memory_bytes": int(torch.cuda.max_memory_allocated()),
                "peak_memory_reserved_bytes": int(torch.cuda.max_memory_reserved())}
    return {"kind": "cpu_max_rss", "peak_memory_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}


# ---------------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------------
TABLE_COLUMNS = ("attn", "tokens/seq", "steps", "tokens/s", "peak GiB", "eval ppl before", "eval ppl after", "reloaded ppl")


def table_row(results: dict[str, Any]) -> list[Any]:
    """One run's line of the results table (shared with ``bench_finetune.py``)."""
    ppl = lambda key: (results.get(key) or {}).get("perplexity")  # noqa: E731
    peak = results.get("peak_memory_bytes")
    tps = results.get("tokens_per_second")
    return [results.get("attn"), results.get("seq_len"), results.get("global_step"), round(tps) if tps else None,
            round(peak / 2**30, 2) if peak else None, ppl("eval_before"), ppl("eval_after"), ppl("reload")]


def loss_plot(results: dict[str, Any], path: Path) -> Path:
    curve = results["loss_curve"]
    series = [{"label": f"{results['attn']} train", "x": [c["step"] for c in curve], "y": [c["loss"] for c in curve]}]
    for key, step, marker in (("eval_before", 0, "o"), ("eval_after", results["global_step"], "s")):
        if results.get(key):
            series.append({"label": f"{results['attn']} {key.replace('_', ' ')}", "x": [step], "y": [results[key]["loss"]],
                           "points": True, "marker": marker})
    panel = {"title": f"{results['model_name']}, {results['attn']}, {results['seq_len']} tokens/sequence",
             "xlabel": "optimizer step", "ylabel": "loss (nats/token)", "series": series}
    return reporting.plot(path, [panel])


def run(script: ScriptArguments, training) -> dict[str, Any]:
    """Load, switch attention, build data, train, evaluate, save; returns (and writes) the results dict."""
    import torch
    from transformers import set_seed
    from transformers.trainer_utils import get_last_checkpoint

    from hf_dilated import training as hf_training
    from hf_dilated.environment import run_environment

    resume = training.resume_from_checkpoint
    out = Path(training.output_dir)  # checked and created by validate()
    if resume == "latest":
        resume = get_last_checkpoint(str(out))
        if resume is None:
            raise ValueError(f"--resume-from-checkpoint latest: no checkpoint-* directory in {out}; "
                             "train with --save-strategy steps --save-steps N first")
    elif resume is not None and not Path(resume).is_dir():
        raise ValueError(f"--resume-from-checkpoint {resume}: not a checkpoint directory")
    set_seed(training.seed)

    model, tokenizer = load_model(script, training.seed)
    script.attn = resolve_attention(script, model)
    check_attention(script)
    config = None
    if script.segment_lengths is not None:
        from hf_dilated import DilatedAttentionConfig

        config = DilatedAttentionConfig(segment_lengths=script.segment_lengths, dilation_rates=script.dilation_rates)
    dcfg = hf_training.prepare_attention(model, script.attn, config, seq_len=script.seq_len, layers=_layers(script.layers),
                                         backend=script.backend, rope=script.rope)
    if script.sequence_parallel > 1:
        _ = training.device  # Trainer's process group (torchrun / accelerate launch), before the groups are made
        hf_training.enable_sequence_parallel(model, script.sequence_parallel)
    if script.lora_r:
        model = attach_lora(model, script)
    train, evaluation, names = build_datasets(script, tokenizer)
    tokens_per_step = training.per_device_train_batch_size * training.gradient_accumulation_steps * script.seq_len
    trainer, measure = make_trainer(model, training, train, evaluation, loss_chunk_size=script.loss_chunk_size,
                                    tokens_per_step=tokens_per_step, warmup_steps=script.timing_warmup_steps,
                                    max_seconds=script.max_train_seconds, sequence_parallel=script.sequence_parallel)
    results: dict[str, Any] = {
        "status": "running",
        "model_name": script.model if script.model in ("smollm2", "tiny") else Path(script.model).name,
        "attn": script.attn,
        "dilated_attention": dcfg.to_dict() if script.attn == "dilated" else None,
        "block_sparse_attention": dcfg.to_dict() if script.attn == "block_sparse" else None,
        "seq_len": script.seq_len,
        "packing": script.packing,
        "batch_size": training.per_device_train_batch_size,
        "grad_accum": training.gradient_accumulation_steps,
        "dtype": script.dtype,
        "bf16_autocast": training.bf16,
        "gradient_checkpointing": training.gradient_checkpointing,
        "lora_r": script.lora_r,
        "sequence_parallel": script.sequence_parallel,
        "processes": training.world_size,
        "loss": "liger" if training.use_liger_kernel else (f"chunked ({script.loss_chunk_size})" if script.loss_chunk_size else "model"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "train_rows": len(train),
        "eval_rows": len(evaluation) if evaluation is not None else 0,
        "train_documents": names["train"],
        "eval_documents": names["eval"],
        "args": {"script": asdict(script), "training": training.to_dict()},
        "environment": run_environment(),
    }
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if evaluation is not None and resume is None:
        results["eval_before"] = _eval(trainer)
    try:
        train_out = trainer.train(resume_from_checkpoint=resume)
    except torch.cuda.OutOfMemoryError as exc:
        results.update(status="oom", error=str(exc).splitlines()[0], **peak_memory())
        if training.process_index == 0:
            reporting.write_json(out / RESULTS_FILE, results)
        raise
    results.update(peak_memory())
    results.update(measure.summary())
    history = trainer.state.log_history
    results["train_runtime_s"] = train_out.metrics.get("train_runtime")
    results["global_step"] = trainer.state.global_step
    results["loss_curve"] = [{k: h[k] for k in ("step", "loss", "learning_rate", "grad_norm") if k in h}
                             for h in history if "loss" in h and "step" in h]
    results["eval_history"] = [{"step": h["step"], "loss": h["eval_loss"]} for h in history if "eval_loss" in h]
    if evaluation is not None:
        results["eval_after"] = _eval(trainer)
    if script.save_model:
        if script.sequence_parallel > 1:
            trainer.model.set_attn_implementation("dilated")  # saved and reloaded single-device
        if training.process_index == 0:
            save_model(trainer.model, tokenizer, script, out / MODEL_SUBDIR)
        trainer.accelerator.wait_for_everyone()
        results["model_dir"] = str(out / MODEL_SUBDIR)
        if script.verify_reload and evaluation is not None:
            results["reload"] = verify_reload(out / MODEL_SUBDIR, script, training, evaluation)
    results["status"] = "ok"
    if training.process_index == 0:
        reporting.write_json(out / RESULTS_FILE, results)
    return results


def save_model(model, tokenizer, script: ScriptArguments, path: Path) -> Path:
    """The trained model (LoRA merged) with its tokenizer; a patched one (dilated, block-sparse) with its model card,
    reloading with its attention."""
    if script.lora_r:
        model = model.merge_and_unload()
    model.config.use_cache = True  # off for training only
    if script.attn in PATCHED:
        from hf_dilated.patching import save_patched

        save_patched(model, str(path), tokenizer=tokenizer)
    else:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def verify_reload(path: Path, script: ScriptArguments, training, evaluation) -> dict[str, Any]:
    """Reload the saved model as a user would (``import hf_dilated; from_pretrained(path)``) and evaluate it alike."""
    import copy
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    import hf_dilated
    from hf_dilated.config import CONFIG_KEY
    from hf_dilated.ops.block_sparse.config import CONFIG_KEY as BLOCK_SPARSE_KEY

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, script.dtype))
    expected = {"dilated": hf_dilated.ATTENTION_NAME, "block_sparse": "block_sparse"}.get(script.attn, "sdpa")
    if model.config._attn_implementation != expected:
        raise RuntimeError(f"the saved model reloaded with attn_implementation={model.config._attn_implementation!r}, expected {expected!r}")
    model.config.use_cache = False
    args = copy.deepcopy(training)
    with tempfile.TemporaryDirectory() as scratch:
        args.output_dir = scratch
        trainer, _ = make_trainer(model, args, eval_dataset=evaluation, loss_chunk_size=script.loss_chunk_size)
        metrics = _eval(trainer)
    metrics["attn_implementation"] = model.config._attn_implementation
    metrics["dilated_attention"] = getattr(model.config, CONFIG_KEY, None)
    metrics["block_sparse_attention"] = getattr(model.config, BLOCK_SPARSE_KEY, None)
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        script, training = parser.parse_args_into_dataclasses(args=argv)
        validate(script, training)
    except ValueError as err:  # a bad option: usage and the message, exit status 2, before anything is loaded
        parser.error(str(err))
    try:
        results = run(script, training)
    except ValueError as err:  # bad data or model for these options, found while loading
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if training.process_index != 0:  # one process reports (torchrun / accelerate launch)
        return 0
    print(reporting.format_table(TABLE_COLUMNS, [table_row(results)]))
    out = Path(training.output_dir)
    loss_plot(results, out / PLOT_FILE)
    print(f"results: {out / RESULTS_FILE}, plot: {out / PLOT_FILE}" + (f", model: {results['model_dir']}" if results.get("model_dir") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
