#!/usr/bin/env python
"""Fine-tuning benchmark: SmolLM2-135M on Shakespeare, "dilated" against "sdpa", at 16K and 64K tokens per sequence.

One command, made to fit one 10-minute GPU call (``--budget-s``, default 560 s, bounds everything):

    python scripts/bench_finetune.py --out "$OUT"

1. Converts the SmolLM2 GGUF once to a float32 Hugging Face directory (``hf_dilated.assets.smollm2_checkpoint``), so
   that each run loads in a second or two instead of dequantizing the GGUF again.
2. Runs ``scripts/finetune.py`` once per (context, attention), each in its own process (clean peak-memory counters;
   an out-of-memory sdpa run cannot take the others down), with identical settings: bf16 autocast, activation
   checkpointing, batch 1, AdamW at a constant learning rate after warm-up, chunked LM-head loss, the same rows in the
   same order (one row a step, so the batches are the ``[1, N]`` rows themselves). Rows use ``--packing stream`` (positions 0..N-1, plays separated by EOS): dense sdpa then takes its
   fastest path (flash, ``is_causal``, no mask), the fair baseline. Dilated branches are the SmolLM2 recipe's extended
   to the sequence (``w = 2048 .. N``, ``r = 1 .. N/2048``); RoPE is left as trained for both.
   Each run trains for at most ``--steps`` optimizer steps and at most its share of the time budget, and evaluates
   perplexity on held-out plays (the same 128K tokens at every context) before and after.
3. Writes ``OUT/<context>_<attn>/results.json`` (+ ``loss.png``, ``log.txt``) per run, and ``OUT/summary.json`` and
   ``OUT/loss_curves.png`` for all of them, and prints the table; the summary is rewritten after every run, so a
   cut-off command still leaves what finished.

``--probe`` instead searches the longest context that trains (two optimizer steps without running out of memory or
past ``--probe-step-s`` seconds per step) for each implementation, doubling from 128K tokens:

    python scripts/bench_finetune.py --out "$OUT" --probe
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not __package__ and str(ROOT) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(ROOT))

from hf_dilated.environment import run_environment  # noqa: E402

try:
    from . import reporting
except ImportError:  # run as a file: python scripts/bench_finetune.py
    import reporting

FINETUNE = Path(__file__).resolve().with_name("finetune.py")
PRECISION_OPTIONS = {"autocast-bf16": ["--bf16", "true"], "bf16": ["--dtype", "bfloat16"], "fp32": []}


def log(msg: str) -> None:
    print(f"[bench_finetune {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (on the GPU machine: $OUT)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (converted from its GGUF once) or a local HF directory")
    p.add_argument("--contexts", default="16384,65536", help="tokens per sequence, comma-separated")
    p.add_argument("--attns", default="dilated,sdpa", help="attention implementations, comma-separated")
    p.add_argument("--steps", default="16384:300,65536:150", help="max optimizer steps per context (ctx:steps,...)")
    p.add_argument("--budget-s", type=float, default=560.0, help="wall-clock budget of the whole command")
    p.add_argument("--weights", default="16384:1,65536:1.7", help="share of the training time per context (ctx:weight)")
    p.add_argument("--overhead-s", type=float, default=40.0, help="time reserved per run for start-up and evaluation")
    p.add_argument("--eval-tokens", type=int, default=131072, help="held-out tokens evaluated at every context")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--packing", default="stream", choices=("stream", "documents"))
    p.add_argument("--precision", default="autocast-bf16", choices=tuple(PRECISION_OPTIONS),
                   help="'autocast-bf16': float32 weights under bf16 autocast (finetune.py --bf16); 'bf16': bf16 weights "
                        "(--dtype bfloat16); 'fp32'")
    p.add_argument("--probe", action="store_true", help="search the longest context that trains instead")
    p.add_argument("--probe-contexts", default="131072,262144,524288,1048576")
    p.add_argument("--probe-step-s", type=float, default=120.0, help="a probe step slower than this counts as not training")
    p.add_argument("--extra", default="", help="extra finetune.py options for every run, as one string")
    return p.parse_args(argv)


def _pairs(text: str, cast=float) -> dict[int, float]:
    out = {}
    for item in text.split(","):
        if item.strip():
            k, v = item.split(":")
            out[int(k)] = cast(v)
    return out


def ctx_name(ctx: int) -> str:
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def prepare_model(args: argparse.Namespace) -> str:
    """A local Hugging Face directory of the model: for 'smollm2', the one ``hf_dilated.assets`` writes once from the
    GGUF (float32), so that each run loads in a second or two instead of dequantizing the GGUF again."""
    if args.model != "smollm2":
        return args.model
    from hf_dilated import assets

    t0 = time.time()
    path = assets.smollm2_checkpoint()
    log(f"SmolLM2 checkpoint: {path} ({time.time() - t0:.0f}s)")
    return path


def run_one(model_dir: str, ctx: int, attn: str, out: Path, steps: int, train_s: float, timeout_s: float,
            args: argparse.Namespace, extra: list[str]) -> dict:
    run_dir = out / f"{ctx_name(ctx)}_{attn}"
    run_dir.mkdir(parents=True, exist_ok=True)
    eval_rows = max(args.eval_tokens // ctx, 1) if args.eval_tokens else 0
    cmd = [
        sys.executable, str(FINETUNE),
        "--model", model_dir, "--attn", attn, "--seq-len", str(ctx), "--packing", args.packing,
        "--max-steps", str(steps), "--max-train-seconds", f"{max(train_s, 1.0):.0f}",
        "--learning-rate", str(args.lr), "--warmup-steps", "10", "--lr-scheduler-type", "constant_with_warmup",
        "--per-device-train-batch-size", "1", "--gradient-accumulation-steps", "1", *PRECISION_OPTIONS[args.precision],
        "--gradient-checkpointing", "true", "--loss-chunk-size", "4096", "--editions", "modern", "--no-save-model",
        "--disable-tqdm", "true", "--timing-warmup-steps", "3", "--output-dir", str(run_dir), "--overwrite",
    ]
    if attn == "dilated":
        cmd += ["--rope", "none"]  # RoPE as trained, for both
    if eval_rows:
        cmd += ["--eval-docs", "6", "--max-eval-samples", str(eval_rows)]
    else:
        cmd += ["--eval-docs", "0"]
    cmd += extra
    log(f"run {ctx} {attn}: steps<={steps}, train<={train_s:.0f}s, timeout {timeout_s:.0f}s")
    t0 = time.time()
    with open(run_dir / "log.txt", "w") as fh:
        try:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=max(timeout_s, 5))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.time() - t0
    res_path = run_dir / "results.json"
    res = json.loads(res_path.read_text()) if res_path.exists() else {}
    if rc != 0 and res.get("status") in (None, "running", "ok"):
        res["status"] = "timeout" if rc == "timeout" else f"failed (exit {rc})"
    tail = (run_dir / "log.txt").read_text(errors="replace").splitlines()[-15:]
    row = {
        "context": ctx,
        "attn": attn,
        "status": res.get("status", "failed"),
        "wall_s": round(wall, 1),
        "steps": res.get("global_step"),
        "stopped_by_time": res.get("stopped_by_time"),
        "tokens_per_second": res.get("tokens_per_second"),
        "step_time_mean_s": res.get("step_time_mean_s"),
        "peak_memory_gib": round(res["peak_memory_bytes"] / 2**30, 2) if res.get("peak_memory_bytes") else None,
        "peak_memory_reserved_gib": round(res["peak_memory_reserved_bytes"] / 2**30, 2) if res.get("peak_memory_reserved_bytes") else None,
        "eval_before": res.get("eval_before"),
        "eval_after": res.get("eval_after"),
        "dilated_attention": res.get("dilated_attention"),
        "loss_curve": [(c["step"], c["loss"]) for c in res.get("loss_curve", [])],
        "results": str(res_path.relative_to(out)) if res_path.exists() else None,
    }
    if row["status"] != "ok":
        row["log_tail"] = tail
    log(f"  -> {row['status']} in {wall:.0f}s: steps {row['steps']}, tokens/s {row['tokens_per_second']}, "
        f"peak {row['peak_memory_gib']} GiB, eval {row['eval_before']} -> {row['eval_after']}")
    return row


AUTOCAST_CHECK = """
import torch, hf_dilated
from hf_dilated.assets import tiny_llama
m = tiny_llama(0, vocab_size=257).cuda()
hf_dilated.patch(m, hf_dilated.DilatedAttentionConfig(segment_lengths=[64, 128], dilation_rates=[1, 2]))
ids = torch.randint(0, 256, (1, 256), device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    loss = m(input_ids=ids, labels=ids, use_cache=False).loss
loss.backward()
assert torch.isfinite(loss)
"""


def autocast_problem() -> str | None:
    """``None`` when a dilated model trains under CUDA bf16 autocast, else the error (then runs use pure bf16)."""
    import torch

    if not torch.cuda.is_available():
        return None
    proc = subprocess.run([sys.executable, "-c", AUTOCAST_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=180)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["failed"])[-1]


def write_summary(out: Path, rows: list[dict], meta: dict, name: str = "summary.json") -> None:
    by = {(r["context"], r["attn"]): r for r in rows}
    for r in rows:
        base = by.get((r["context"], "sdpa"))
        if r["attn"] != "sdpa" and base and base.get("tokens_per_second") and r.get("tokens_per_second"):
            r["speedup_vs_sdpa"] = round(r["tokens_per_second"] / base["tokens_per_second"], 2)
    (out / name).write_text(json.dumps({**meta, "runs": rows}, indent=2, default=str))


def plot(out: Path, rows: list[dict], meta: dict) -> None:
    """Training loss against step, one panel per context, one line per attention (o / s: eval before / after)."""
    panels = []
    for ctx in sorted({r["context"] for r in rows}):
        series = []
        for r in rows:
            if r["context"] != ctx or not r["loss_curve"]:
                continue
            steps, losses = zip(*r["loss_curve"])
            tps = f"{r['tokens_per_second']:.0f} tok/s" if r.get("tokens_per_second") else r["status"]
            mem = f", {r['peak_memory_gib']} GiB" if r.get("peak_memory_gib") else ""
            series.append({"label": f"{r['attn']} ({tps}{mem})", "x": list(steps), "y": list(losses)})
            for key, x, marker in (("eval_before", 0, "o"), ("eval_after", r["steps"], "s")):
                if r.get(key):
                    series.append({"label": f"{r['attn']} {key.replace('_', ' ')}", "x": [x],
                                   "y": [r[key]["loss"]], "points": True, "marker": marker})
        panels.append({"title": f"SmolLM2-135M, {ctx_name(ctx)} tokens/sequence", "xlabel": "optimizer step",
                       "ylabel": "loss (nats/token)", "series": series})
    if panels:
        reporting.plot(out / "loss_curves.png", panels,
                       title=f"{meta['environment']['device']}: fine-tuning on Shakespeare, dilated vs sdpa")


TABLE_COLUMNS = ("context", "attn", "status", "steps", "tokens/s", "vs sdpa", "peak GiB", "eval ppl before", "eval ppl after")


def table(rows: list[dict]) -> str:
    ppl = lambda r, key: (r.get(key) or {}).get("perplexity")  # noqa: E731
    return reporting.format_table(TABLE_COLUMNS, [
        [r["context"], r["attn"], r["status"], r.get("steps"),
         round(r["tokens_per_second"]) if r.get("tokens_per_second") else None, r.get("speedup_vs_sdpa"),
         r.get("peak_memory_gib"), ppl(r, "eval_before"), ppl(r, "eval_after")] for r in rows])


def bench(args: argparse.Namespace, out: Path, model_dir: str, deadline: float, meta: dict) -> list[dict]:
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    attns = [a.strip() for a in args.attns.split(",") if a.strip()]
    steps = _pairs(args.steps, int)
    weights = _pairs(args.weights)
    extra = args.extra.split() if args.extra else []
    plan = [(c, a) for c in contexts for a in attns]  # sdpa after dilated at each context: an sdpa OOM ends last
    rows: list[dict] = []
    for i, (ctx, attn) in enumerate(plan):
        remaining = deadline - time.time()
        left = plan[i:]
        total_w = sum(weights.get(c, 1.0) for c, _ in left)
        train_s = (remaining - args.overhead_s * len(left)) * weights.get(ctx, 1.0) / total_w
        if remaining < args.overhead_s or train_s < 10:
            rows.append({"context": ctx, "attn": attn, "status": "skipped (time budget)", "loss_curve": []})
            continue
        timeout = remaining - args.overhead_s * (len(left) - 1) * 0.5
        rows.append(run_one(model_dir, ctx, attn, out, steps.get(ctx, 100), train_s, timeout, args, extra))
        write_summary(out, rows, meta)
        plot(out, rows, meta)
    return rows


def probe(args: argparse.Namespace, out: Path, model_dir: str, deadline: float, meta: dict) -> None:
    attns = [a.strip() for a in args.attns.split(",") if a.strip()]
    contexts = [int(c) for c in args.probe_contexts.split(",") if c.strip()]
    extra = ["--editions", "all", "--timing-warmup-steps", "1"] + (args.extra.split() if args.extra else [])
    rows, longest = [], {}
    for attn in attns:
        for ctx in contexts:
            remaining = deadline - time.time()
            if remaining < 60:
                rows.append({"context": ctx, "attn": attn, "status": "skipped (time budget)", "loss_curve": []})
                break
            timeout = min(remaining - 5, 90 + 2.5 * args.probe_step_s)
            saved_eval, args.eval_tokens = args.eval_tokens, 0
            row = run_one(model_dir, ctx, attn, out / "probe", 2, 2 * args.probe_step_s, timeout, args, extra)
            args.eval_tokens = saved_eval
            ok = row["status"] == "ok" and row["steps"] == 2 and (row.get("step_time_mean_s") or 1e9) <= args.probe_step_s
            row["trains"] = ok
            rows.append(row)
            write_summary(out, rows, {**meta, "longest_training_context": longest}, "probe_summary.json")
            if not ok:
                break
            longest[attn] = ctx
    write_summary(out, rows, {**meta, "longest_training_context": longest}, "probe_summary.json")
    log(f"longest context that trains: {longest}")


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    deadline = start + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(args)
    meta = {"environment": run_environment(), "settings": {k: v for k, v in vars(args).items() if k not in ("out",)}}
    if args.precision == "autocast-bf16" and "dilated" in args.attns:
        problem = autocast_problem()
        if problem:
            log(f"dilated attention fails under bf16 autocast ({problem}); every run uses --precision bf16 instead")
            args.precision = "bf16"
            meta["precision_fallback"] = {"to": "bf16", "reason": problem}
    if args.probe:
        probe(args, out, model_dir, deadline, meta)
    else:
        rows = bench(args, out, model_dir, deadline, meta)
        print(table(rows), flush=True)
    log(f"done in {time.time() - start:.0f}s; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
