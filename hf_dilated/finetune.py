"""Fine-tune a causal LM with dilated attention at long context, with Transformers' ``Trainer``.

``python scripts/finetune.py --help`` (or ``hf-dilated finetune --help``) lists every option. What a run does:

1. Loads a checkpoint: ``--model smollm2`` (SmolLM2-135M-Instruct from its GGUF asset), ``--model tiny`` (a small
   random Llama built from a config with a byte-level tokenizer, for smoke tests) or a local Hugging Face directory (possibly saved by an
   earlier run, already carrying its ``dilated_attention`` config).
2. Switches attention: ``--attn dilated`` patches the model (branches from ``--segment-lengths`` /
   ``--dilation-rates``, else the config stored in the checkpoint, else defaults from the trained context);
   ``--attn sdpa`` keeps dense attention, the baseline measured by the same script.
3. Builds a long-context dataset from real text: one document per file (Shakespeare's plays by default),
   tokenized, each followed by EOS, packed into rows of exactly ``--seq-len`` tokens. ``--packing documents``
   restarts ``position_ids`` at 0 at every document (and at every piece of a document split across rows), so
   attention never crosses documents and the first token of a document is never a target; ``--packing stream``
   numbers a row 0..N-1 (the dense model's fastest path: no mask at all). Whole plays are held out for evaluation.
4. Trains with ``Trainer``: bf16 autocast on GPU (``--precision``), activation checkpointing, optional LoRA (merged before saving),
   perplexity before and after, checkpoints every ``--save-steps`` and ``--resume``.
5. Writes ``results.json`` (loss curve, eval loss / perplexity before and after, tokens/s, peak memory, versions)
   and ``loss.png`` into ``--output-dir``, and the final model (full, or LoRA merged) into ``OUTPUT/model``, which
   reloads dilated with ``AutoModelForCausalLM.from_pretrained(path, attn_implementation="dilated")`` and gives the
   same eval loss (checked unless ``--no-verify-reload``).

Collator. ``--collator rows`` (default) is our own :class:`PackedRowsCollator`: rows stay ``[B, seq_len]`` so the
context a model sees is exactly ``--seq-len`` whatever the batch size, and labels use the convention of
Transformers' ``DataCollatorWithFlattening`` (``-100`` at the first token of every document). ``--collator flatten``
hands the document pieces of a batch to ``DataCollatorWithFlattening`` itself (``[1, B * seq_len]`` plus the
flash-style ``cu_seq_lens_q/k``), the padding-free format flash-attention users know. Both give the same loss.

Loss. With ``--loss-chunk-size C`` (default 4096) the LM head and cross-entropy run over ``C`` tokens at a time under
activation checkpointing, so the ``[N, vocab]`` float32 logits (12.9 GB for SmolLM2 at 64K tokens) never exist at
once; the result equals the model's own loss (``sum / num_items_in_batch``, as Transformers computes it).

Dropout and determinism. Dilated attention has no attention dropout: a model whose config sets
``attention_dropout > 0`` is refused here before training (and by the attention function itself).
``--deterministic`` sets ``TrainingArguments(full_determinism=True)``, i.e. ``torch.use_deterministic_algorithms``,
``CUBLAS_WORKSPACE_CONFIG`` and seeded workers. The Triton kernels are deterministic by construction (each gradient
row is summed by one program, no atomics); the PyTorch reference backend scatters gradients with ``index_put``, whose
CUDA accumulation uses atomics unless ``--deterministic`` is on. Data order follows ``--seed``. On CPU runs are
bitwise reproducible without the flag: a resumed run repeats the losses of an uninterrupted one (see the tests).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from . import assets
from .environment import run_environment
from .config import CONFIG_KEY, DilatedAttentionConfig, trained_context

ATTN_CHOICES = ("dilated", "sdpa")
PACKING_CHOICES = ("documents", "stream")
COLLATOR_CHOICES = ("rows", "flatten")
EDITION_CHOICES = assets.SHAKESPEARE_EDITIONS
PRECISION_CHOICES = ("auto", "autocast-bf16", "bf16", "fp32")
IGNORE_INDEX = -100
RESULTS_FILE = "results.json"
PLOT_FILE = "loss.png"
MODEL_SUBDIR = "model"


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hf-dilated finetune",
        description="Fine-tune a causal LM with dilated (or dense) attention at long context with Trainer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--model", default="smollm2", help="'smollm2' (GGUF asset), 'tiny' (random Llama) or a local HF directory")
    g.add_argument("--attn", default="dilated", choices=ATTN_CHOICES, help="attention implementation to train with")
    g.add_argument("--segment-lengths", type=_int_list, default=None, help="dilated branches w_i, e.g. 2048,4096,8192 (default: stored config, else from the trained context)")
    g.add_argument("--dilation-rates", type=_int_list, default=None, help="dilated branches r_i, e.g. 1,2,4")
    g.add_argument("--dilated-layers", type=_int_list, default=None, help="decoder layers that use dilated attention (default: all)")
    g.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"), help="dilated-attention backend")
    g.add_argument("--extend-branches", action=argparse.BooleanOptionalAction, default=True, help="when patching without explicit branches: extend the recipe's branches (doubling w and r) until a segment covers --seq-len, instead of stopping at the trained context")
    g.add_argument("--rope-scaling", default="none", choices=("none", "recipe", "linear", "dynamic", "yarn"), help="RoPE scaling to --seq-len applied by the patch (dilated only; 'recipe': the architecture's choice)")
    g.add_argument("--tiny-layers", type=int, default=2, help="layers of --model tiny")
    g.add_argument("--tiny-hidden", type=int, default=64, help="hidden size of --model tiny (4 query heads, 2 kv heads)")

    g = p.add_argument_group("data")
    g.add_argument("--data", default="shakespeare", help="'shakespeare' (the plays asset) or a directory of .txt files, one document per file")
    g.add_argument("--editions", default="modern", choices=EDITION_CHOICES, help="Shakespeare texts: modern spelling, First Folio, or both")
    g.add_argument("--seq-len", type=int, default=16384, help="tokens per training sequence (row)")
    g.add_argument("--packing", default="documents", choices=PACKING_CHOICES, help="per-document position_ids, or one stream per row")
    g.add_argument("--collator", default="rows", choices=COLLATOR_CHOICES, help="[B, seq_len] rows, or Transformers' DataCollatorWithFlattening")
    g.add_argument("--eval-docs", type=int, default=4, help="documents (the last ones by file name) held out for evaluation")
    g.add_argument("--max-train-tokens", type=int, default=None, help="stop tokenizing training documents after this many tokens")
    g.add_argument("--max-eval-tokens", type=int, default=None, help="stop tokenizing eval documents after this many tokens")
    g.add_argument("--max-eval-samples", type=int, default=None, help="evaluate on at most this many rows")

    g = p.add_argument_group("training")
    g.add_argument("--output-dir", required=True, help="checkpoints, results.json, loss.png and the final model go here")
    g.add_argument("--max-steps", type=int, default=200, help="optimizer steps")
    g.add_argument("--max-train-seconds", type=float, default=None, help="stop training (cleanly, then evaluate) after this many seconds")
    g.add_argument("--batch-size", type=int, default=1, help="rows per device per step")
    g.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    g.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    g.add_argument("--lr-scheduler", default="constant_with_warmup", help="Transformers scheduler name")
    g.add_argument("--warmup-steps", type=int, default=10)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--max-grad-norm", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--precision", default="auto", choices=PRECISION_CHOICES, help="'autocast-bf16': float32 weights, bf16 compute (Trainer's bf16=True); 'bf16': weights and compute in bf16, no autocast; 'fp32'; 'auto': autocast-bf16 on a CUDA device with bf16, else fp32")
    g.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True, help="activation checkpointing of every decoder layer")
    g.add_argument("--loss-chunk-size", type=int, default=4096, help="tokens per LM-head/cross-entropy chunk (0: the model's own loss)")
    g.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 * r)")
    g.add_argument("--lora-dropout", type=float, default=0.0)
    g.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj", help="comma-separated module names LoRA adapts")
    g.add_argument("--deterministic", action="store_true", help="TrainingArguments(full_determinism=True)")
    g.add_argument("--logging-steps", type=int, default=1)
    g.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps during training too (0: only before and after)")
    g.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: no intermediate checkpoints)")
    g.add_argument("--save-total-limit", type=int, default=2)
    g.add_argument("--resume", nargs="?", const="latest", default=None, help="resume from the latest checkpoint in --output-dir, or from the given checkpoint directory")
    g.add_argument("--save", action=argparse.BooleanOptionalAction, default=True, help="save the final model (LoRA merged) to OUTPUT/model")
    g.add_argument("--verify-reload", action=argparse.BooleanOptionalAction, default=True, help="reload the saved model with from_pretrained and check its eval loss")
    g.add_argument("--timing-warmup-steps", type=int, default=2, help="steps excluded from tokens/s (compilation, autotuning)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bars (logs still print)")
    return p


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Raise ``ValueError`` naming the first bad option."""
    positive = {
        "--seq-len": args.seq_len,
        "--max-steps": args.max_steps,
        "--batch-size": args.batch_size,
        "--grad-accum": args.grad_accum,
        "--logging-steps": args.logging_steps,
        "--tiny-layers": args.tiny_layers,
        "--tiny-hidden": args.tiny_hidden,
    }
    for name, value in positive.items():
        if value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2 tokens, got {args.seq_len}")
    non_negative = {
        "--eval-docs": args.eval_docs,
        "--warmup-steps": args.warmup_steps,
        "--eval-steps": args.eval_steps,
        "--save-steps": args.save_steps,
        "--loss-chunk-size": args.loss_chunk_size,
        "--lora-r": args.lora_r,
        "--timing-warmup-steps": args.timing_warmup_steps,
        "--save-total-limit": args.save_total_limit,
    }
    for name, value in non_negative.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    for name, value in (("--max-train-tokens", args.max_train_tokens), ("--max-eval-tokens", args.max_eval_tokens),
                        ("--max-eval-samples", args.max_eval_samples)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive when given, got {value}")
    if args.tiny_hidden % 4:
        raise ValueError(f"--tiny-hidden must be a multiple of 4 (4 attention heads), got {args.tiny_hidden}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    if args.max_train_seconds is not None and not args.max_train_seconds > 0:
        raise ValueError(f"--max-train-seconds must be positive, got {args.max_train_seconds}")
    if not 0.0 <= args.lora_dropout < 1.0:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if args.lora_r == 0 and (args.lora_alpha is not None or args.lora_dropout):
        raise ValueError("--lora-alpha / --lora-dropout need --lora-r > 0")
    if not [t for t in args.lora_targets.split(",") if t.strip()]:
        raise ValueError("--lora-targets must name at least one module")
    if (args.segment_lengths is None) != (args.dilation_rates is None):
        raise ValueError("--segment-lengths and --dilation-rates go together: give both or neither")
    dilated_opts = (
        args.segment_lengths is not None or args.dilated_layers is not None or args.backend != "auto"
        or args.rope_scaling != "none"
    )
    if args.attn != "dilated" and dilated_opts:
        raise ValueError(
            "--segment-lengths / --dilation-rates / --dilated-layers / --backend / --rope-scaling need --attn dilated, "
            f"got --attn {args.attn}"
        )
    if args.segment_lengths is not None:  # validates the branch list itself, with its own message
        DilatedAttentionConfig(segment_lengths=args.segment_lengths, dilation_rates=args.dilation_rates)
    if args.data != "shakespeare" and not Path(args.data).is_dir():
        raise ValueError(f"--data must be 'shakespeare' or a directory of .txt files, got {args.data!r}")
    if args.model not in ("smollm2", "tiny") and not Path(args.model).is_dir():
        raise ValueError(f"--model must be 'smollm2', 'tiny' or a local Hugging Face model directory, got {args.model!r}")
    if args.verify_reload and not args.save:
        args.verify_reload = False
    return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return validate_args(build_parser().parse_args(argv))


# ---------------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------------
class ByteTokenizer:
    """UTF-8 bytes as tokens (+ EOS = 256): the tokenizer of ``--model tiny`` (no asset needed, a 257-token head)."""

    vocab_size = 257
    eos_token_id = 256
    marker = "byte_tokenizer.json"

    def __call__(self, text: str | list[str], add_special_tokens: bool = False) -> dict[str, list]:
        if isinstance(text, str):
            return {"input_ids": list(text.encode("utf-8"))}
        return {"input_ids": [list(t.encode("utf-8")) for t in text]}

    def __len__(self) -> int:
        return self.vocab_size

    def save_pretrained(self, path: str | os.PathLike) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / self.marker).write_text(json.dumps({"vocab_size": self.vocab_size, "eos_token_id": 256}))


def load_tokenizer(model: str):
    """The tokenizer of a ``--model`` value."""
    if model == "tiny":
        return ByteTokenizer()
    if model == "smollm2":
        tok = assets.load_smollm2_tokenizer()
        if tok is None:
            raise RuntimeError(assets.SMOLLM2_MISSING)
        return tok
    if (Path(model) / ByteTokenizer.marker).exists():
        return ByteTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def tiny_llama(vocab_size: int, layers: int = 2, hidden: int = 64, seed: int = 0, context: int = 8192):
    """A small random Llama (4 query heads, 2 kv heads: GQA) for smoke tests: ``assets.tiny_llama``, resized."""
    return assets.tiny_llama(
        seed,
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=context,
    )


def strip_gguf_quantization(model):
    """Mark a model loaded from GGUF as the plain float model it is.

    Transformers dequantizes GGUF weights on load but keeps the model flagged as quantized, so ``Trainer`` refuses
    full fine-tuning and ``save_pretrained`` would write a ``quantization_config``. Other quantizations are kept
    (and refused by Trainer with its own message unless LoRA is used).
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or type(quantizer).__name__ != "GgufHfQuantizer":
        return model
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model, "quantization_method"):
        model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def bf16_parameters(model):
    """Cast the parameters (not the buffers) to bf16, as ``from_pretrained(dtype=torch.bfloat16)`` leaves a model:
    RoPE's ``inv_freq`` stays float32, so a saved bf16 model reloads as exactly the same function."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    return model


def load_model(args: argparse.Namespace, tokenizer):
    """Load the ``--model`` checkpoint in float32 (master weights under ``--precision autocast-bf16``)."""
    if args.model == "tiny":
        return tiny_llama(len(tokenizer), args.tiny_layers, args.tiny_hidden, args.seed)
    if args.model == "smollm2":
        loaded = assets.load_smollm2(dtype=torch.float32)
        if loaded is None:
            raise RuntimeError(assets.SMOLLM2_MISSING)
        return strip_gguf_quantization(loaded[0])
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)


def use_attention(model, args: argparse.Namespace) -> DilatedAttentionConfig | None:
    """Switch ``model`` to ``--attn``: ``"dilated"`` through :func:`hf_dilated.patching.patch`, or dense ``"sdpa"``.

    Without ``--segment-lengths`` the recipe's branches are used, extended to ``--seq-len`` (``--extend-branches``,
    default) with RoPE left as trained unless ``--rope-scaling`` says otherwise. A checkpoint saved patched loads
    dilated already; it keeps its stored branches unless the command line gives new ones (then it is unpatched and
    patched again). Returns the dilated config in effect (``None`` for sdpa).
    """
    from .patching import is_patched, patch, unpatch

    if args.attn not in ATTN_CHOICES:
        raise ValueError(f"attn must be one of {ATTN_CHOICES}, got {args.attn!r}")
    if args.attn == "sdpa":
        if is_patched(model):
            unpatch(model)
        model.set_attn_implementation("sdpa")
        return None
    dropout = getattr(model.config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ValueError(
            f"dilated attention has no attention dropout, but the model config sets attention_dropout={dropout}; "
            "set model.config.attention_dropout = 0 (or train with --attn sdpa)"
        )
    overrides = (
        args.segment_lengths is not None or args.dilated_layers is not None or args.backend != "auto"
        or args.rope_scaling != "none"
    )
    if is_patched(model) and not overrides:
        return DilatedAttentionConfig.from_model_config(model.config)
    if is_patched(model):
        unpatch(model)
    branches = None
    if args.segment_lengths is not None:
        branches = DilatedAttentionConfig(segment_lengths=args.segment_lengths, dilation_rates=args.dilation_rates)
    trained = trained_context(model.config) or args.seq_len
    reach = args.extend_branches or args.rope_scaling != "none"
    patch(
        model,
        branches,
        layers=args.dilated_layers if args.dilated_layers is not None else "all",
        backend=None if args.backend == "auto" else args.backend,
        context_length=args.seq_len if reach and args.seq_len > trained else None,
        rope=args.rope_scaling,
    )
    return DilatedAttentionConfig.from_model_config(model.config)


def attach_lora(model, args: argparse.Namespace):
    from peft import LoraConfig, get_peft_model

    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        raise ValueError(f"--lora-targets {missing} match no module of this model")
    cfg = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r,
        lora_dropout=args.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)


def unwrap_causal_lm(model):
    """The ``*ForCausalLM`` under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------
def shakespeare_documents(editions: str = "modern") -> list[tuple[str, str]]:
    """``[(file name, text)]`` of the plays and poems (see :func:`hf_dilated.assets.shakespeare_documents`)."""
    docs = assets.shakespeare_documents(editions)
    if docs is None:
        raise RuntimeError(assets.SHAKESPEARE_MISSING)
    return docs


def directory_documents(path: str | os.PathLike) -> list[tuple[str, str]]:
    files = sorted(Path(path).rglob("*.txt"))
    if not files:
        raise ValueError(f"--data {path}: no .txt files found")
    return [(str(f.relative_to(path)), f.read_text(encoding="utf-8", errors="replace")) for f in files]


def load_documents(args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.data == "shakespeare":
        return shakespeare_documents(args.editions)
    return directory_documents(args.data)


def split_documents(docs: list[tuple[str, str]], eval_docs: int) -> tuple[list, list]:
    """Hold out the last ``eval_docs`` documents (by name) whole: no eval text is ever trained on."""
    if eval_docs >= len(docs):
        raise ValueError(f"--eval-docs {eval_docs} leaves no training document (there are {len(docs)})")
    cut = len(docs) - eval_docs
    return docs[:cut], docs[cut:]


def tokenize_documents(tokenizer, docs: list[tuple[str, str]], max_tokens: int | None = None) -> list[list[int]]:
    """Token ids of each document followed by EOS; with ``max_tokens``, the first ``max_tokens`` tokens of them."""
    eos = tokenizer.eos_token_id
    if max_tokens is None:  # one batched call: fast tokenizers spread it over all cores
        encoded = tokenizer([text for _, text in docs], add_special_tokens=False)["input_ids"]
        return [list(ids) + ([int(eos)] if eos is not None else []) for ids in encoded]
    out, total = [], 0
    for _, text in docs:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(int(eos))
        if max_tokens is not None and total + len(ids) >= max_tokens:
            out.append(ids[: max_tokens - total])
            break
        out.append(ids)
        total += len(ids)
    return out


def pack_documents(docs: list[list[int]], seq_len: int, packing: str = "documents") -> list[dict[str, list[int]]]:
    """Pack documents into rows of exactly ``seq_len`` tokens (the last, partial row is dropped).

    Each row is ``{"input_ids", "position_ids"}``. With ``packing="documents"`` positions restart at 0 at every
    document and at every piece of a document split across rows; with ``"stream"`` a row is numbered ``0..N-1``.
    """
    if packing not in PACKING_CHOICES:
        raise ValueError(f"packing must be one of {PACKING_CHOICES}, got {packing!r}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    rows, ids, pos = [], [], []
    for doc in docs:
        start = 0
        while start < len(doc):
            take = min(seq_len - len(ids), len(doc) - start)
            ids.extend(doc[start : start + take])
            pos.extend(range(take) if packing == "documents" else range(len(pos), len(pos) + take))
            start += take
            if len(ids) == seq_len:
                rows.append({"input_ids": ids, "position_ids": pos})
                ids, pos = [], []
    return rows


def row_pieces(position_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the documents in a row: a new one starts wherever the position is 0."""
    starts = [i for i, p in enumerate(position_ids) if p == 0] or [0]
    if starts[0] != 0:
        starts.insert(0, 0)
    return list(zip(starts, starts[1:] + [len(position_ids)]))


class PackedDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, list[int]]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.rows[i]


class PackedRowsCollator:
    """Stack packed rows into ``[B, N]`` ``input_ids``, ``position_ids`` and ``labels``.

    Labels follow ``DataCollatorWithFlattening``: the ids themselves, with ``-100`` at the first token of every
    document (position 0), so no document is asked to predict its first token from the previous document.
    """

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        input_ids = torch.tensor([f["input_ids"] for f in features], dtype=torch.long)
        position_ids = torch.tensor([f["position_ids"] for f in features], dtype=torch.long)
        labels = input_ids.masked_fill(position_ids == 0, IGNORE_INDEX)
        return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


class FlatteningCollator:
    """Split rows into their documents and hand them to Transformers' ``DataCollatorWithFlattening``.

    The batch becomes one ``[1, B * N]`` row with ``position_ids`` restarting per document and the flash-style
    ``cu_seq_lens_q/k`` / ``max_length_q/k``, which the ``"dilated"`` attention reads directly.
    """

    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.inner = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        pieces = []
        for f in features:
            for s, e in row_pieces(f["position_ids"]):
                pieces.append({"input_ids": list(f["input_ids"][s:e])})
        return self.inner(pieces, return_tensors="pt")


def make_collator(kind: str):
    if kind == "rows":
        return PackedRowsCollator()
    if kind == "flatten":
        return FlatteningCollator()
    raise ValueError(f"collator must be one of {COLLATOR_CHOICES}, got {kind!r}")


@dataclass
class Datasets:
    train: PackedDataset
    eval: PackedDataset
    train_docs: list[str]
    eval_docs: list[str]
    train_tokens: int
    eval_tokens: int


def build_datasets(args: argparse.Namespace, tokenizer) -> Datasets:
    docs = load_documents(args)
    train_docs, eval_docs = split_documents(docs, args.eval_docs)
    train_tok = tokenize_documents(tokenizer, train_docs, args.max_train_tokens)
    train_rows = pack_documents(train_tok, args.seq_len, args.packing)
    if not train_rows:
        raise ValueError(
            f"the training documents hold {sum(map(len, train_tok))} tokens, fewer than one row of --seq-len "
            f"{args.seq_len}; lower --seq-len or raise --max-train-tokens"
        )
    eval_rows = []
    if args.eval_docs:
        eval_tok = tokenize_documents(tokenizer, eval_docs, args.max_eval_tokens)
        eval_rows = pack_documents(eval_tok, args.seq_len, args.packing)
        if not eval_rows:  # short held-out text: evaluate on its first tokens, wrapped around
            flat = [t for d in eval_tok for t in d]
            reps = -(-args.seq_len // max(len(flat), 1))
            eval_rows = pack_documents(eval_tok * reps, args.seq_len, args.packing)[:1]
        if args.max_eval_samples is not None:
            eval_rows = eval_rows[: args.max_eval_samples]
    return Datasets(
        train=PackedDataset(train_rows),
        eval=PackedDataset(eval_rows),
        train_docs=[n for n, _ in train_docs[: len(train_tok)]],
        eval_docs=[n for n, _ in eval_docs] if args.eval_docs else [],
        train_tokens=len(train_rows) * args.seq_len,
        eval_tokens=len(eval_rows) * args.seq_len,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------------------------------
def check_chunked_loss_supported(model) -> None:
    causal = unwrap_causal_lm(model)
    cfg = causal.config
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(cfg, attr, None) not in (None, 0, 1, 1.0):
            raise ValueError(f"--loss-chunk-size does not implement {attr} of {type(causal).__name__}; pass --loss-chunk-size 0")
    body = getattr(causal, getattr(causal, "base_model_prefix", "model"), None)
    if body is None or causal.get_output_embeddings() is None:
        raise ValueError(f"--loss-chunk-size needs a *ForCausalLM with a decoder body and an LM head, got {type(causal).__name__}; pass --loss-chunk-size 0")


def chunked_causal_lm_loss(
    model, inputs: dict[str, Any], chunk_size: int, num_items_in_batch: torch.Tensor | int | None = None
) -> torch.Tensor:
    """The causal-LM loss of ``model(**inputs)`` without materializing all logits.

    The decoder body runs once; the LM head and cross-entropy run over ``chunk_size`` tokens at a time, each chunk
    under activation checkpointing. Reduction as Transformers' ``ForCausalLMLoss``: sum over targets divided by
    ``num_items_in_batch`` when given, else the mean over targets.
    """
    causal = unwrap_causal_lm(model)
    body = getattr(causal, getattr(causal, "base_model_prefix", "model"))
    head = causal.get_output_embeddings()
    labels = inputs["labels"]
    body_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "num_items_in_batch")}
    hidden = body(**body_inputs, use_cache=False).last_hidden_state
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].to(hidden.device)

    def nll(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(h).float()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    n = hidden.shape[1]
    for s in range(0, n, chunk_size):
        h, y = hidden[:, s : s + chunk_size], targets[:, s : s + chunk_size]
        if torch.is_grad_enabled():
            total = total + torch.utils.checkpoint.checkpoint(nll, h, y, use_reentrant=False)
        else:
            total = total + nll(h, y)
    if num_items_in_batch is None:
        count = (targets != IGNORE_INDEX).sum()
        return total / count.clamp_min(1)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


# ---------------------------------------------------------------------------------------------------------------------
# Trainer pieces
# ---------------------------------------------------------------------------------------------------------------------
def _trainer_classes():
    from transformers import Trainer, TrainerCallback

    class LongContextTrainer(Trainer):
        """``Trainer`` whose loss runs the LM head in chunks (see :func:`chunked_causal_lm_loss`)."""

        def __init__(self, *a, loss_chunk_size: int = 0, **kw):
            super().__init__(*a, **kw)
            self.loss_chunk_size = loss_chunk_size

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not self.loss_chunk_size or "labels" not in inputs:
                return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            # accelerate applies mixed precision by wrapping the top-level forward; we call the decoder body directly.
            with self.accelerator.autocast():
                loss = chunked_causal_lm_loss(model, inputs, self.loss_chunk_size, num_items_in_batch)
            return (loss, {"loss": loss}) if return_outputs else loss

    class MeasureCallback(TrainerCallback):
        """Step times (synchronized), tokens/s after warm-up, and an optional wall-clock budget."""

        def __init__(self, tokens_per_step: int, warmup_steps: int, max_seconds: float | None):
            self.tokens_per_step = tokens_per_step
            self.warmup_steps = warmup_steps
            self.max_seconds = max_seconds
            self.step_times: list[float] = []
            self.stopped_by_time = False
            self._t0 = self._start = None

        @staticmethod
        def _sync():
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def on_train_begin(self, args, state, control, **kw):
            self._sync()
            self._start = time.perf_counter()

        def on_step_begin(self, args, state, control, **kw):
            self._sync()
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self._sync()
            now = time.perf_counter()
            self.step_times.append(now - self._t0)
            if self.max_seconds is not None and now - self._start > self.max_seconds and not control.should_training_stop:
                self.stopped_by_time = True
                control.should_training_stop = True
                control.should_save = args.save_strategy != "no"

        def summary(self) -> dict[str, Any]:
            timed = self.step_times[self.warmup_steps :] or self.step_times
            mean = sum(timed) / len(timed) if timed else float("nan")
            return {
                "steps_run": len(self.step_times),
                "steps_timed": len(timed),
                "step_time_mean_s": mean,
                "tokens_per_step": self.tokens_per_step,
                "tokens_per_second": self.tokens_per_step / mean if timed and mean > 0 else None,
                "stopped_by_time": self.stopped_by_time,
            }

    return LongContextTrainer, MeasureCallback


def resolve_precision(flag: str) -> str:
    """``"autocast-bf16"``, ``"bf16"`` or ``"fp32"`` for a ``--precision`` value."""
    if flag not in PRECISION_CHOICES:
        raise ValueError(f"--precision must be one of {PRECISION_CHOICES}, got {flag!r}")
    if flag != "auto":
        return flag
    return "autocast-bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


def use_bf16(flag: str) -> bool:
    """Whether Trainer runs bf16 autocast (``TrainingArguments(bf16=True)``) for a ``--precision`` value."""
    return resolve_precision(flag) == "autocast-bf16"


def training_arguments(args: argparse.Namespace, bf16: bool, has_eval: bool):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type=args.lr_scheduler,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        bf16=bf16,
        gradient_checkpointing=args.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if args.gradient_checkpointing else None,
        logging_steps=args.logging_steps,
        logging_first_step=True,
        eval_strategy="steps" if (args.eval_steps and has_eval) else "no",
        eval_steps=args.eval_steps or None,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit or None,
        prediction_loss_only=True,
        remove_unused_columns=False,
        report_to="none",
        seed=args.seed,
        data_seed=args.seed,
        full_determinism=args.deterministic,
        dataloader_num_workers=0,
        disable_tqdm=args.disable_tqdm,
        use_cpu=not torch.cuda.is_available(),
    )


def peak_memory() -> dict[str, Any]:
    if torch.cuda.is_available():
        return {
            "kind": "cuda_max_memory_allocated",
            "peak_memory_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_memory_reserved_bytes": int(torch.cuda.max_memory_reserved()),
        }
    return {"kind": "cpu_max_rss", "peak_memory_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}


def _eval_metrics(metrics: dict[str, float]) -> dict[str, float]:
    loss = float(metrics["eval_loss"])
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 50 else float("inf")}


def loss_curve(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: h[k] for k in ("step", "loss", "learning_rate", "grad_norm") if k in h}
        for h in log_history
        if "loss" in h and "step" in h
    ]


def plot_loss(results: dict[str, Any], path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    curve = results["loss_curve"]
    label = f"{results['attn']} train"
    ax.plot([c["step"] for c in curve], [c["loss"] for c in curve], label=label, lw=1.2)
    for key, marker in (("eval_before", "o"), ("eval_after", "s")):
        if results.get(key):
            step = 0 if key == "eval_before" else results["global_step"]
            ax.scatter([step], [results[key]["loss"]], marker=marker, zorder=3, label=f"eval {key.split('_')[1]}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(f"{results['model_name']}  {results['attn']}  {results['seq_len']} tokens/sequence")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(output_dir: str | os.PathLike, results: dict[str, Any]) -> None:
    path = Path(output_dir) / RESULTS_FILE
    path.write_text(json.dumps(results, indent=2, default=str))


def _latest_checkpoint(output_dir: str) -> str:
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
    if last is None:
        raise ValueError(f"--resume: no checkpoint-* directory in {output_dir}; run with --save-steps first")
    return last


# ---------------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------------
def make_trainer(model, args: argparse.Namespace, train_dataset, eval_dataset=None, *, bf16: bool | None = None, callbacks=()):
    """``(trainer, measure)``: our ``Trainer`` (chunked loss) over packed rows, with the measuring callback."""
    if bf16 is None:
        bf16 = use_bf16(args.precision)
    # No KV cache in training or evaluation: besides wasting memory, a cache makes Transformers' dense masks ignore
    # the packing in position_ids (documents would attend to each other under sdpa).
    unwrap_causal_lm(model).config.use_cache = False
    has_eval = eval_dataset is not None and len(eval_dataset) > 0
    targs = training_arguments(args, bf16, has_eval=has_eval)
    LongContextTrainer, MeasureCallback = _trainer_classes()
    measure = MeasureCallback(args.batch_size * args.grad_accum * args.seq_len, args.timing_warmup_steps, args.max_train_seconds)
    trainer = LongContextTrainer(
        model=model,
        args=targs,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset if has_eval else None,
        data_collator=make_collator(args.collator),
        callbacks=[measure, *callbacks],
        loss_chunk_size=args.loss_chunk_size,
    )
    return trainer, measure


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load, patch, build data, train, evaluate, save; returns (and writes) the results dict."""
    from transformers import set_seed

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    resume_from = None
    if args.resume is not None:
        resume_from = _latest_checkpoint(args.output_dir) if args.resume == "latest" else args.resume
        if not Path(resume_from).is_dir():
            raise ValueError(f"--resume {resume_from}: not a checkpoint directory")
    set_seed(args.seed)
    precision = resolve_precision(args.precision)
    bf16 = precision == "autocast-bf16"

    tokenizer = load_tokenizer(args.model)
    model = load_model(args, tokenizer)
    if precision == "bf16":
        bf16_parameters(model)
    dcfg = use_attention(model, args)
    if args.lora_r:
        model = attach_lora(model, args)
    if args.loss_chunk_size:
        check_chunked_loss_supported(model)

    data = build_datasets(args, tokenizer)
    trainer, measure = make_trainer(model, args, data.train, data.eval, bf16=bf16)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    results: dict[str, Any] = {
        "status": "running",
        "model_name": args.model if args.model in ("smollm2", "tiny") else Path(args.model).name,
        "attn": args.attn,
        "dilated_attention": dcfg.to_dict() if dcfg else None,
        "seq_len": args.seq_len,
        "packing": args.packing,
        "collator": args.collator,
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "precision": precision,
        "gradient_checkpointing": args.gradient_checkpointing,
        "lora_r": args.lora_r,
        "loss_chunk_size": args.loss_chunk_size,
        "parameters": n_params,
        "trainable_parameters": n_trainable,
        "train_rows": len(data.train),
        "eval_rows": len(data.eval),
        "train_documents": data.train_docs,
        "eval_documents": data.eval_docs,
        "args": {k: v for k, v in vars(args).items()},
        "environment": run_environment(),
    }

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if len(data.eval) and resume_from is None:
        results["eval_before"] = _eval_metrics(trainer.evaluate(metric_key_prefix="eval"))
    try:
        train_out = trainer.train(resume_from_checkpoint=resume_from)
    except torch.cuda.OutOfMemoryError as exc:
        results.update(status="oom", error=str(exc).splitlines()[0], **peak_memory())
        write_results(out, results)
        raise
    results.update(peak_memory())
    results.update(measure.summary())
    results["train_runtime_s"] = train_out.metrics.get("train_runtime")
    results["global_step"] = trainer.state.global_step
    results["loss_curve"] = loss_curve(trainer.state.log_history)
    results["eval_history"] = [
        {"step": h["step"], "loss": h["eval_loss"]} for h in trainer.state.log_history if "eval_loss" in h
    ]
    if len(data.eval):
        results["eval_after"] = _eval_metrics(trainer.evaluate(metric_key_prefix="eval"))

    if args.save:
        model_dir = out / MODEL_SUBDIR
        final = trainer.model
        if args.lora_r:
            final = final.merge_and_unload()
        final.config.use_cache = True  # gradient checkpointing turned it off for training only
        if args.attn == "dilated":
            from .patching import save_patched

            save_patched(final, str(model_dir), tokenizer=tokenizer)
        else:
            final.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
        results["model_dir"] = str(model_dir)
        if args.verify_reload and len(data.eval):
            results["reload"] = verify_reload(model_dir, args, trainer, data)
    results["status"] = "ok"
    write_results(out, results)
    plot_loss(results, out / PLOT_FILE)
    return results


def verify_reload(model_dir: Path, args: argparse.Namespace, trainer, data: Datasets) -> dict[str, Any]:
    """Reload the saved model as a user would (``import hf_dilated; from_pretrained(path)``: a patched checkpoint
    comes back dilated by itself) and evaluate it the same way."""
    from transformers import AutoModelForCausalLM

    import hf_dilated

    dtype = torch.bfloat16 if resolve_precision(args.precision) == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    expected = hf_dilated.ATTENTION_NAME if args.attn == "dilated" else "sdpa"
    if model.config._attn_implementation != expected:
        raise RuntimeError(
            f"the saved model reloaded with attn_implementation={model.config._attn_implementation!r}, expected {expected!r}"
        )
    model.to(trainer.args.device)
    reloaded_attn = model.config._attn_implementation
    LongContextTrainer, _ = _trainer_classes()
    targs = training_arguments(args, trainer.args.bf16, has_eval=True)
    targs.output_dir = str(Path(args.output_dir) / "reload_eval")
    check = LongContextTrainer(
        model=model, args=targs, eval_dataset=data.eval, data_collator=trainer.data_collator,
        loss_chunk_size=args.loss_chunk_size,
    )
    metrics = _eval_metrics(check.evaluate(metric_key_prefix="eval"))
    metrics["attn_implementation"] = reloaded_attn
    metrics["dilated_attention"] = getattr(model.config, CONFIG_KEY, None)
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_args(args)
    except ValueError as exc:  # a bad option: usage and the message, exit status 2, as argparse does
        parser.error(str(exc))
    results = run(args)
    summary = {k: results.get(k) for k in ("attn", "seq_len", "global_step", "tokens_per_second", "peak_memory_bytes")}
    for key in ("eval_before", "eval_after", "reload"):
        if results.get(key):
            summary[key] = {k: results[key][k] for k in ("loss", "perplexity")}
    print(json.dumps(summary, indent=2))
    print(f"results: {Path(args.output_dir) / RESULTS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
