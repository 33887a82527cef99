#!/usr/bin/env python
"""The fine-tune recipe comparison of issue 16: a patched checkpoint fine-tuned briefly against the dense model
fine-tuned the same way, at the trained context and at 4x it, LoRA and full, from plain files (no ``datasets``).

    python scripts/finetune_recipe.py --gguf .gpu/smol.gguf --text .gpu/text.txt --out "$OUT"

Runs, in this order (each on fresh weights, the same rows in the same order, bf16 autocast over float32 weights,
activation checkpointing, batch 1, AdamW at a constant learning rate after 10 warm-up steps, the chunked LM-head loss
of :func:`hf_dilated.evaluation.causal_lm_nll`), each stopped at ``--steps`` or its share of ``--budget-s``:

1. at the trained context ``T`` (SmolLM2: 8K): ``dense`` (sdpa) then ``dilated`` (``--segment-lengths``,
   ``--dilation-rates``, ``--global-tokens``, ``--layers``; default: the recipe's branches from first segment
   ``--first-segment`` with ``--global-tokens`` sinks), with LoRA and with full fine-tuning;
2. at ``--long-factor`` x ``T`` (32K): ``dense+rope`` (sdpa with the recipe's RoPE scaling) and ``dilated+rope``
   (dilated branches extended to the length, the same RoPE scaling), LoRA then full, as time allows
   (``--long-mode train``, the default, or ``both``).

With ``--long-mode eval`` (or ``both``) every run at ``T`` is also evaluated at the long context, before and after its
training: the dense model as ``dense+rope``, the dilated one as ``dilated+rope``. That is issue 16's comparison at 4x
the trained context, zero-shot and fine-tuned the same way (at ``T``, with the recipe), without training at 4x.

A dilated run makes exactly the steps its dense partner made (a dense run cut short by the budget shortens it).
With ``--sparse-attention block_sparse`` the sparse arm (still labelled ``dilated`` in the runs, its config under
``dilated_attention``, ``sparse_attention`` saying which) is block-sparse with the adaptive pattern sized to the
dilated branches' keys per query at each length (``BlockSparseConfig.matching_budget``): the same number of keys, the
blocks chosen by content.

The text is split once: the last ``--eval-fraction`` of its characters is held out. Training rows are consecutive
``N``-token pieces of the rest (one stream, positions ``0..N-1``: sdpa's fastest path). Every run evaluates the same
held-out tokens (``--eval-tokens``, cut into ``N``-token rows) before and after training: perplexity over all tokens
and over each row's second half. Writes ``OUT/finetune_recipe.json`` (every run, its loss curve, the GPU, versions
and command; rewritten after each run) and ``OUT/finetune_recipe.png`` (loss curves, one panel per context and
method), and prints the comparison: dilated after fine-tuning against dense after fine-tuning, per context and method.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
if not __package__ and str(ROOT) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(ROOT))
SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import finetune  # noqa: E402  (scripts/finetune.py: make_trainer, attach_lora, PackedRowsCollator)
import reporting  # noqa: E402

ATTENTIONS = ("dense", "dilated", "dense+rope", "dilated+rope")
METHODS = ("lora", "full")


def read_text_arg(path: str | None) -> str:
    """``--text`` or the bundled Shakespeare; a missing asset ends the program with the reason."""
    from hf_dilated import assets

    try:
        return assets.text_file_or_shakespeare(path)
    except ValueError as err:
        raise SystemExit(f"finetune_recipe: {err}") from None


def log(msg: str) -> None:
    print(f"[finetune_recipe {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Data: rows from a plain text file
# ---------------------------------------------------------------------------------------------------------------------
def token_stream(tokenizer, text: str, n_tokens: int | None, chunk_chars: int = 1 << 20) -> list[int]:
    """Token ids of ``text`` (no special tokens), tokenized in ~1 MB pieces cut at line breaks, stopping once
    ``n_tokens`` are read (``None``: all)."""
    ids: list[int] = []
    start = 0
    while start < len(text) and (n_tokens is None or len(ids) < n_tokens):
        end = min(len(text), start + chunk_chars)
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        ids += tokenizer(text[start:end], add_special_tokens=False, return_attention_mask=False)["input_ids"]
        start = end
    return ids if n_tokens is None else ids[:n_tokens]


def rows(ids: list[int], seq_len: int, count: int | None = None) -> list[dict[str, Any]]:
    """Consecutive ``seq_len``-token rows (the collator's ``input_ids`` / ``piece_lengths``: one piece a row)."""
    n = len(ids) // seq_len if count is None else min(count, len(ids) // seq_len)
    return [{"input_ids": ids[i * seq_len : (i + 1) * seq_len], "piece_lengths": [seq_len]} for i in range(n)]


def split_text(text: str, eval_fraction: float) -> tuple[str, str]:
    """``(train, held out)``: the held-out part is the text's last ``eval_fraction``, from a line break on."""
    cut = int(len(text) * (1 - eval_fraction))
    nl = text.find("\n", cut)
    cut = nl + 1 if nl >= 0 else cut
    return text[:cut], text[cut:]


# ---------------------------------------------------------------------------------------------------------------------
# Model set-up per run
# ---------------------------------------------------------------------------------------------------------------------
def dilated_config(args, seq_len: int, trained: int, num_layers: int):
    from hf_dilated import DilatedAttentionConfig

    if args.segment_lengths:
        ws, rs = list(args.segment_lengths), list(args.dilation_rates)
        while ws[-1] < seq_len:  # extended geometrically to cover a longer context
            ws.append(ws[-1] * 2)
            rs.append(rs[-1] * 2)
    else:
        ws, rs = [args.first_segment], [1]
        while ws[-1] < max(seq_len, trained):
            ws.append(ws[-1] * 2)
            rs.append(rs[-1] * 2)
    layers = None if args.layers == ["all"] else sorted({int(i) for i in args.layers if int(i) < num_layers})
    return DilatedAttentionConfig(segment_lengths=ws, dilation_rates=rs, global_tokens=args.global_tokens, layers=layers)


def prepare(model, attn: str, seq_len: int, trained: int, args):
    """Switch a freshly loaded model to ``attn`` for ``seq_len``; returns the dilated config (or ``None``)."""
    from hf_dilated.patching import patch
    from hf_dilated.training import prepare_attention

    model.config.use_cache = False
    if attn == "dense":
        prepare_attention(model, "sdpa")
        return None
    if attn == "dense+rope":  # the recipe's RoPE for seq_len through a patch with no layer converted, run by sdpa
        patch(model, layers=[], context_length=seq_len if seq_len > trained else None)
        model.set_attn_implementation("sdpa")
        return None
    cfg = dilated_config(args, seq_len, trained, model.config.num_hidden_layers)
    rope = "recipe" if attn == "dilated+rope" else "none"
    if args.sparse_attention == "block_sparse":
        from hf_dilated import BlockSparseConfig

        cfg = BlockSparseConfig.matching_budget(cfg, seq_len)
    return prepare_attention(model, args.sparse_attention, cfg, seq_len=seq_len, rope=rope)


def evaluate(model, eval_rows: list[dict], device, bf16: bool) -> dict[str, float]:
    """Perplexity over every held-out token and over each row's second half (the model's own attention)."""
    import contextlib

    import torch

    from hf_dilated.evaluation import IGNORE_INDEX, causal_lm_nll

    model.eval()
    total = count = half_total = half_count = 0.0
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        for row in eval_rows:
            ids = torch.tensor([row["input_ids"]], device=device)
            n = ids.shape[1]
            s, c = causal_lm_nll(model, {"input_ids": ids, "labels": ids})
            labels = ids.clone()
            labels[:, : n // 2] = IGNORE_INDEX
            hs, hc = causal_lm_nll(model, {"input_ids": ids, "labels": labels})
            total, count, half_total, half_count = total + float(s), count + int(c), half_total + float(hs), half_count + int(hc)
    model.train()
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "second_half_perplexity": math.exp(half_total / half_count),
            "tokens": int(count)}


def failure(err: Exception) -> str:
    """``"kind: message"`` of a run or reading that failed (an out-of-memory named as such), after freeing what it
    held so that the next one starts clean."""
    import torch

    kind = "out of memory" if isinstance(err, torch.cuda.OutOfMemoryError) else type(err).__name__
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return f"{kind}: {str(err)[:300]}"


def evaluate_long(model, attn: str, long: int, trained: int, long_rows: list[dict], device, bf16: bool, args,
                  back: bool) -> dict[str, Any]:
    """Evaluate a model trained (or about to be trained) at ``T`` at the long context: ``dense`` as ``dense+rope``,
    ``dilated`` as ``dilated+rope`` (branches extended, the recipe's RoPE); the result also records the RoPE and the
    branches it was read with, or the error that stopped it (an out-of-memory at the long context must not discard the
    run at ``T``). With ``back`` the model returns to its attention at ``T`` afterwards (for training)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA: the wrapped model
    try:
        cfg = prepare(base, f"{attn}+rope", long, trained, args)
        result = evaluate(model, long_rows, device, bf16)
        result["rope_parameters"] = getattr(base.config, "rope_parameters", None)
        result["dilated_attention"] = cfg.to_dict() if cfg is not None else None
    except Exception as err:  # noqa: BLE001
        result = {"error": failure(err)}
        log(f"  -> the reading at {long} tokens failed: {result['error'][:200]}")
    if back:
        prepare(base, attn, trained, trained, args)
    return result


def one_run(model_dir: str, attn: str, method: str, seq_len: int, trained: int, train_rows: list[dict],
            eval_rows: list[dict], steps: int, seconds: float, args, out: Path,
            long_rows: list[dict] | None = None) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, TrainingArguments, set_seed

    set_seed(args.seed)
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    cfg = prepare(model, attn, seq_len, trained, args)
    lr = args.lr_lora if method == "lora" else args.lr_full
    if method == "lora":
        script = finetune.ScriptArguments(lora_r=args.lora_r, lora_alpha=2.0 * args.lora_r, lora_targets=args.lora_targets)
        model = finetune.attach_lora(model, script)
    bf16 = device.type == "cuda"
    run_dir = out / f"{seq_len // 1024}k_{attn}_{method}"
    training = TrainingArguments(
        output_dir=str(run_dir), max_steps=steps, learning_rate=lr, warmup_steps=min(10, max(steps // 10, 1)),
        lr_scheduler_type="constant_with_warmup", per_device_train_batch_size=1, gradient_accumulation_steps=1,
        bf16=bf16, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=1, save_strategy="no", report_to="none", seed=args.seed, disable_tqdm=args.no_progress,
        use_cpu=device.type == "cpu", dataloader_pin_memory=False, weight_decay=0.0,
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = evaluate(model, eval_rows, device, bf16)
    long = trained * args.long_factor
    if long_rows:
        before_long = evaluate_long(model, attn, long, trained, long_rows, device, bf16, args, back=True)
    trainer, measure = finetune.make_trainer(model, training, train_rows[:steps], loss_chunk_size=4096,
                                             tokens_per_step=seq_len, warmup_steps=3, max_seconds=seconds)
    if args.no_progress:  # no per-step log lines either (the loss curve is in the JSON)
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0
    after = evaluate(trainer.model, eval_rows, device, bf16)
    if long_rows:
        after_long = evaluate_long(trainer.model, attn, long, trained, long_rows, device, bf16, args, back=False)
    result = {
        "context": seq_len, "attn": attn, "method": method, "learning_rate": lr, "steps": trainer.state.global_step,
        "max_steps": steps, "train_seconds": round(train_s, 1), **measure.summary(),
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "dilated_attention": cfg.to_dict() if cfg is not None else None,
        "sparse_attention": args.sparse_attention if attn.startswith("dilated") else None,
        "rope_parameters": getattr(model.config, "rope_parameters", None) if "rope" in attn else None,
        "eval_before": before, "eval_after": after,
        **({"long_context": long, "eval_long_before": before_long, "eval_long_after": after_long} if long_rows else {}),
        "loss_curve": [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h and "step" in h],
    }
    if device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del trainer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    shutil.rmtree(run_dir, ignore_errors=True)  # Trainer's empty output directory
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Plan, report
# ---------------------------------------------------------------------------------------------------------------------
def plan(args, trained: int) -> list[tuple[int, str, str, int]]:
    """``(context, attn, method, steps)`` in priority order."""
    long = trained * args.long_factor
    out = []
    for method in args.methods:
        out += [(trained, "dense", method, args.steps), (trained, "dilated", method, args.steps)]
    if args.long_factor > 1 and args.long_mode in ("train", "both"):
        for method in args.methods:
            out += [(long, "dense+rope", method, args.long_steps), (long, "dilated+rope", method, args.long_steps)]
    return out


def _versus(r: dict, base: dict, before: str, after: str) -> dict:
    """The sparse run ``r`` against its dense partner ``base`` on the readings ``before`` / ``after`` training
    (``eval_before`` / ``eval_after``, or the long context's ``eval_long_before`` / ``eval_long_after``)."""
    return {"dilated_before": r[before]["perplexity"], "dense_before": base[before]["perplexity"],
            "dilated_after": r[after]["perplexity"], "dense_after": base[after]["perplexity"],
            "ratio_after": r[after]["perplexity"] / base[after]["perplexity"],
            "ratio_after_second_half": r[after]["second_half_perplexity"] / base[after]["second_half_perplexity"]}


def comparison(runs: list[dict]) -> list[dict]:
    """Per (context, method): the dilated run's eval perplexity after fine-tuning against the dense one's."""
    by = {(r["context"], r["attn"], r["method"]): r for r in runs if r.get("eval_after")}
    out = []
    for (ctx, attn, method), r in by.items():
        base = by.get((ctx, attn.replace("dilated", "dense"), method))
        if attn.startswith("dilated") and base:
            out.append({"context": ctx, "method": method, "attn": attn, "dense": base["attn"],
                        **_versus(r, base, "eval_before", "eval_after")})
            read = [x.get(k) or {} for x in (r, base) for k in ("eval_long_before", "eval_long_after")]
            if all("perplexity" in x for x in read):  # trained at T, read at the long context
                long = _versus(r, base, "eval_long_before", "eval_long_after")
                out.append({"context": r["long_context"], "method": method, "trained_at": ctx,
                            "attn": "dilated+rope (tuned at T)", "dense": "dense+rope (tuned at T)",
                            **long, "ratio_before": long["dilated_before"] / long["dense_before"]})
    return out


def table(result: dict) -> str:
    cols = ("context", "attn", "method", "steps", "tokens/s", "peak GiB", "ppl before", "ppl after", "2nd half after")
    lines = [reporting.format_table(cols, [
        [r["context"], r["attn"], r["method"], r.get("steps"), round(r["tokens_per_second"]) if r.get("tokens_per_second") else None,
         r.get("peak_memory_gib"), (r.get("eval_before") or {}).get("perplexity"), (r.get("eval_after") or {}).get("perplexity"),
         (r.get("eval_after") or {}).get("second_half_perplexity")] for r in result["runs"]])]
    if result["comparison"]:
        lines.append(reporting.format_table(("context", "method", "dilated", "vs", "before / dense before",
                                             "after / dense after"), [
            [c["context"], c["method"], c["attn"], c["dense"], f"{c['dilated_before'] / c['dense_before']:.4f}",
             f"{c['ratio_after']:.4f}"] for c in result["comparison"]]))
    return "\n\n".join(lines)


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps: one row's loss varies far more between rows than between attentions."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def plot(result: dict, path: Path) -> None:
    """Per context and method: the training loss of each run (trailing mean), its held-out loss before and after;
    then the dilated runs' training loss minus the dense run's on the same rows (the gap the fine-tune closes)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    panels = []
    for ctx in sorted({r["context"] for r in result["runs"]}):
        for method in dict.fromkeys(r["method"] for r in result["runs"]):
            runs = [r for r in result["runs"] if r["context"] == ctx and r["method"] == method and r.get("loss_curve")]
            if not runs:
                continue
            window = max(1, max(len(r["loss_curve"]) for r in runs) // 20)
            series, gaps = [], []
            dense = next((r for r in runs if r["attn"].startswith("dense")), None)
            for r in runs:
                steps, losses = zip(*r["loss_curve"])
                series.append({"label": f"{r['attn']} train (mean of {window})", "x": list(steps),
                               "y": smooth(losses, window)})
                for key, x, marker in (("eval_before", 0, "o"), ("eval_after", r["steps"], "s")):
                    series.append({"label": f"{r['attn']} {key.replace('_', ' ')} (ppl {r[key]['perplexity']:.2f})",
                                   "x": [x], "y": [r[key]["loss"]], "points": True, "marker": marker})
                if dense is not None and r is not dense:
                    base = dict(dense["loss_curve"])
                    pairs = [(s, l - base[s]) for s, l in r["loss_curve"] if s in base]
                    if pairs:
                        xs, ds = zip(*pairs)
                        gaps.append({"label": f"{r['attn']} - {dense['attn']} (mean of {window})", "x": list(xs),
                                     "y": smooth(ds, window)})
            panels.append({"title": f"{ctx} tokens, {method}", "xlabel": "optimizer step",
                           "ylabel": "loss (nats/token)", "series": series})
            if gaps:
                panels.append({"title": f"{ctx} tokens, {method}: training-loss gap to dense", "xlabel": "optimizer step",
                               "ylabel": "loss difference (nats/token)", "series": gaps})
    if panels:
        env = result["environment"]
        reporting.plot(path, panels, title=f"{result['model']}: fine-tuning recipe ({env.get('device')})")


def prepare_model_dir(args, scratch: Path) -> tuple[str, Any]:
    """A Transformers directory of the model (a GGUF converted once, float32) and its tokenizer."""
    import torch

    from hf_dilated import assets

    if args.checkpoint:
        model, tokenizer = assets.load_checkpoint(args.checkpoint, dtype=torch.float32)
        if tokenizer is None:
            raise SystemExit("finetune_recipe: the checkpoint has no tokenizer beside it")
        return args.checkpoint, tokenizer
    path = args.gguf or assets.smollm2_path()
    model, tokenizer = assets.load_gguf(path, dtype=torch.float32)
    model.save_pretrained(str(scratch))
    tokenizer.save_pretrained(str(scratch))
    return str(scratch), tokenizer


def run(args) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig

    from hf_dilated.config import trained_context
    from hf_dilated.environment import run_environment

    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="finetune_recipe."))
    try:
        model_dir, tokenizer = prepare_model_dir(args, scratch)
        trained = args.trained_context or trained_context(AutoConfig.from_pretrained(model_dir))
        jobs = plan(args, trained)
        long_eval = args.long_mode in ("eval", "both") and args.long_factor > 1
        longest = max([c for c, *_ in jobs] + ([trained * args.long_factor] if long_eval else []))
        need = max(c * s for c, _, _, s in jobs)
        train_text, eval_text = split_text(read_text_arg(args.text), args.eval_fraction)
        train_ids = token_stream(tokenizer, train_text, need)
        eval_ids = token_stream(tokenizer, eval_text, max(args.eval_tokens, longest))
        if len(eval_ids) < longest:
            raise SystemExit(f"finetune_recipe: the held-out text has {len(eval_ids)} tokens, fewer than one row of "
                             f"{longest}; raise --eval-fraction")
        log(f"model {model_dir} (trained context {trained}); {len(train_ids)} training and {len(eval_ids)} held-out tokens; "
            f"{len(jobs)} runs")
        result: dict[str, Any] = {
            "model": Path(args.gguf or args.checkpoint or "smollm2").name, "trained_context": trained,
            "text": Path(args.text).name if args.text else "shakespeare (bundled)", "eval_fraction": args.eval_fraction,
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "environment": run_environment(torch.device(args.device)), "runs": [], "skipped": [], "comparison": [],
        }
        deadline = start + args.budget_s
        weights = {c: (c / trained) ** 0.5 for c, *_ in jobs}  # a longer row takes longer per step
        achieved: dict[tuple[int, str], int] = {}  # (context, method) -> steps the dense run made
        for i, (ctx, attn, method, steps) in enumerate(jobs):
            if attn.startswith("dilated") and (ctx, method) in achieved:
                steps = min(steps, achieved[(ctx, method)])  # the same steps as the dense run it is compared with
            left = jobs[i:]
            # the four readings at the long context of a run at T take about twice the rest of its evaluation
            overhead = args.overhead_s * (3 if long_eval else 1)
            remaining = deadline - time.time() - overhead * len(left)
            share = remaining * weights[ctx] / sum(weights[c] for c, *_ in left)
            if attn.startswith("dense") and any(a.startswith("dilated") and c == ctx and m == method
                                                for c, a, m, _ in left):
                share *= DENSE_SHARE  # its dilated partner, slower per step, must make the same steps in the rest
            train_rows = rows(train_ids, ctx, steps)
            if share < 10 or not train_rows:
                result["skipped"].append({"context": ctx, "attn": attn, "method": method,
                                          "reason": "time budget" if share < 10 else "not enough text"})
                continue
            log(f"run {i + 1}/{len(jobs)}: {ctx} {attn} {method}, <= {steps} steps, <= {share:.0f}s")
            try:
                r = one_run(model_dir, attn, method, ctx, trained, train_rows, rows(eval_ids, ctx), min(steps, len(train_rows)),
                            share, args, out,
                            rows(eval_ids, trained * args.long_factor) if long_eval and ctx == trained else None)
            except Exception as err:  # noqa: BLE001  (one run failing, e.g. out of memory, must not end the comparison)
                reason = failure(err)
                result["skipped"].append({"context": ctx, "attn": attn, "method": method, "reason": reason})
                log(f"  -> failed: {reason[:200]}")
                continue
            if attn.startswith("dense"):
                achieved[(ctx, method)] = r["steps"]
            log(f"  -> {r['steps']} steps, ppl {r['eval_before']['perplexity']:.3f} -> {r['eval_after']['perplexity']:.3f}")
            result["runs"].append(r)
            result["comparison"] = comparison(result["runs"])
            result["seconds"] = round(time.time() - start, 1)
            reporting.write_json(out / "finetune_recipe.json", result)
            plot(result, out / "finetune_recipe.png")
        result["seconds"] = round(time.time() - start, 1)
        reporting.write_json(out / "finetune_recipe.json", result)
        plot(result, out / "finetune_recipe.png")
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="a GGUF file (default: the bundled SmolLM2)")
    src.add_argument("--checkpoint", help="a Transformers checkpoint directory")
    p.add_argument("--text", help="a plain-text file (default: the bundled Shakespeare)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps at the trained context")
    p.add_argument("--long-factor", type=int, default=4, help="the long context is this many times the trained (1: none)")
    p.add_argument("--long-steps", type=int, default=50, help="optimizer steps at the long context")
    p.add_argument("--long-mode", default="train", choices=("train", "eval", "both"),
                   help="at the long context: train there (dense+rope, dilated+rope), evaluate the runs trained at T "
                        "there (zero-shot and fine-tuned), or both")
    p.add_argument("--trained-context", type=int, help="override the model's trained context (tests)")
    p.add_argument("--first-segment", type=int, default=4096, help="w0 of the dilated branches (r doubles with w)")
    p.add_argument("--segment-lengths", type=int, nargs="+", help="explicit branches instead of --first-segment")
    p.add_argument("--dilation-rates", type=int, nargs="+")
    p.add_argument("--global-tokens", type=int, default=4)
    p.add_argument("--layers", nargs="+", default=["all"], help="'all' or layer indices to make dilated")
    p.add_argument("--sparse-attention", default="dilated", choices=("dilated", "block_sparse"),
                   help="the sparse arm: dilated, or block-sparse adaptive with the dilated branches' keys per query")
    p.add_argument("--lr-lora", type=float, default=1e-3)
    p.add_argument("--lr-full", type=float, default=1e-4)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"])
    p.add_argument("--eval-tokens", type=int, default=65536, help="held-out tokens evaluated at every context")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="share of the text held out (its end)")
    p.add_argument("--budget-s", type=float, default=400.0, help="wall-clock budget of the whole command")
    p.add_argument("--overhead-s", type=float, default=12.0, help="time reserved per run for loading and evaluation "
                   "(three times that with --long-mode eval or both)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if (args.segment_lengths is None) != (args.dilation_rates is None):
        p.error("--segment-lengths and --dilation-rates go together")
    if not 0 < args.eval_fraction < 0.5:
        p.error(f"--eval-fraction must be in (0, 0.5), got {args.eval_fraction}")
    if args.steps < 1 or args.long_steps < 1 or args.long_factor < 1:
        p.error("--steps, --long-steps and --long-factor must be >= 1")
    if args.long_mode != "train" and args.long_factor == 1:
        p.error(f"--long-mode {args.long_mode} reads the runs at --long-factor x the trained context: give a factor > 1")
    return args


# A dense run takes this fraction of its equal share of the budget: the sparse run compared with it makes exactly its
# steps, at up to about 2x the time per step (measured at the trained context on the H100: dilated 1.4-1.8x,
# block-sparse 1.6-2.0x, two processes sharing the GPU), in what is left.
DENSE_SHARE = 0.6


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(table(result), flush=True)
    if result["skipped"]:
        print(f"skipped: {json.dumps(result['skipped'])}")
    print(f"results: {Path(args.out) / 'finetune_recipe.json'} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
