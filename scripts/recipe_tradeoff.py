#!/usr/bin/env python
"""Issue 16's two fine-tune targets side by side, from ``finetune_recipe.py --long-mode eval`` results: for each run
(a JSON per method and learning rate), the dilated model's held-out perplexity over the dense one's after the same
training at the trained context ``T`` (x: target <= 1.02) and read at 4x ``T`` with RoPE scaling against dense +
RoPE (y: target < 1), and where both start before training (zero-shot).

    python scripts/recipe_tradeoff.py benchmarks/results/finetune_recipe-smollm2-H100-274steps-4T-*.json \\
        --out benchmarks/results/finetune_recipe-smollm2-H100-274steps-4T-tradeoff.png

Prints the table (markdown) and writes the plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import reporting  # noqa: E402

T_TARGET = 1.02  # within 2% of dense fine-tuned the same way at T
LONG_TARGET = 1.0  # better than dense + RoPE scaling at 4T


def label(result: dict[str, Any], method: str) -> str:
    s = result["settings"]
    if method == "lora":
        targets = s.get("lora_targets") or []
        extra = " all linear" if len(targets) > 4 else ""
        return f"LoRA r {s['lora_r']}{extra}, lr {s['lr_lora']:g}"
    return f"full, lr {s['lr_full']:g}"


def points(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """One row per (file, method) that has both comparisons: at ``T`` and read at the long context."""
    out = []
    for path in paths:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
        by = {}
        for c in result.get("comparison", []):
            if "trained_at" in c:
                by.setdefault(c["method"], {})["long"] = c
            elif c["context"] == result["trained_context"]:  # not a run trained at the long context (--long-mode both)
                by.setdefault(c["method"], {})["T"] = c
        for method, pair in by.items():
            if {"T", "long"} <= set(pair):
                t, long = pair["T"], pair["long"]
                steps = {r["attn"]: r["steps"] for r in result["runs"] if r["method"] == method}
                out.append({"file": Path(path).name, "label": label(result, method), "method": method,
                            "steps": steps.get("dilated"), "trained_context": t["context"],
                            "long_context": long["context"], "ratio_T": t["ratio_after"],
                            "ratio_long": long["ratio_after"], "zero_shot_T": t["dilated_before"] / t["dense_before"],
                            "zero_shot_long": long["ratio_before"],
                            "meets": t["ratio_after"] <= T_TARGET and long["ratio_after"] < LONG_TARGET})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = "| run | steps | at T (<= 1.02) | at 4T vs dense + RoPE (< 1) | both |\n| --- | --- | --- | --- | --- |"
    lines = [f"| {r['label']} | {r['steps']} | {r['ratio_T']:.4f} | {r['ratio_long']:.4f} | "
             f"{'yes' if r['meets'] else 'no'} |" for r in rows]
    if rows:
        z = rows[0]
        lines.append(f"| zero-shot (before training) | 0 | {z['zero_shot_T']:.4f} | {z['zero_shot_long']:.4f} | no |")
    return "\n".join([head, *lines])


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    xs = [r["ratio_T"] for r in rows] + [rows[0]["zero_shot_T"]]
    ys = [r["ratio_long"] for r in rows] + [rows[0]["zero_shot_long"]]
    lo_x, hi_x = min(xs + [T_TARGET]) - 0.002, max(xs + [T_TARGET]) + 0.002
    series = [{"label": f"4T target: < {LONG_TARGET:g}", "x": [lo_x, hi_x], "y": [LONG_TARGET, LONG_TARGET]}]
    for method, marker in (("full", "o"), ("lora", "s")):
        sel = [r for r in rows if r["method"] == method]
        if sel:
            series.append({"label": "full fine-tune" if method == "full" else "LoRA", "x": [r["ratio_T"] for r in sel],
                           "y": [r["ratio_long"] for r in sel], "points": True, "marker": marker,
                           "annotate": [r["label"] for r in sel]})
    series.append({"label": "zero-shot", "x": [rows[0]["zero_shot_T"]], "y": [rows[0]["zero_shot_long"]],
                   "points": True, "marker": "x"})
    panel = {"title": "dilated / dense perplexity after the same fine-tune (lower is better)",
             "xlabel": f"at T = {rows[0]['trained_context']} tokens", "ylabel":
             f"at 4T = {rows[0]['long_context']} tokens, both with RoPE scaling", "series": series,
             "vline": (T_TARGET, f"T target: <= {T_TARGET:g}")}
    return reporting.plot(path, [panel], title=title)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="finetune_recipe.json files written with --long-mode eval or both")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default="Fine-tune recipe: the two targets")
    args = ap.parse_args(argv)
    rows = points(args.results)
    if not rows:
        raise SystemExit("recipe_tradeoff: no file has both comparisons (run finetune_recipe.py with --long-mode eval)")
    print(table(rows))
    plot(rows, Path(args.out), args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
