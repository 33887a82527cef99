#!/usr/bin/env python
"""Issue 16's two fine-tune targets side by side, from ``finetune_recipe.py --long-mode eval`` results: for each run
(a JSON per method and learning rate), the patched (dilated or block-sparse) model's held-out perplexity over the
dense one's after the same training at the trained context ``T`` (x: target <= 1.02) and read at 4x ``T`` with RoPE
scaling against dense + RoPE (y: target < 1), and where both start before training (zero-shot).

    python scripts/recipe_tradeoff.py benchmarks/results/finetune_recipe-smollm2-H100-274steps-4T-*.json \\
        --out benchmarks/results/finetune_recipe-smollm2-H100-274steps-4T-tradeoff.png

Prints the table (markdown) and writes the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import reporting  # noqa: E402

T_TARGET = 1.02  # within 2% of dense fine-tuned the same way at T
LONG_TARGET = 1.0  # better than dense + RoPE scaling at 4T


MLP = ("gate_proj", "up_proj", "down_proj", "fc1", "fc2", "dense_h_to_4h", "dense_4h_to_h")


def kind(result: dict[str, Any]) -> str:
    """The sparse arm of a result: ``"dilated"``, or ``"block-sparse adaptive"`` (``--sparse-attention``)."""
    return "block-sparse adaptive" if result["settings"].get("sparse_attention") == "block_sparse" else "dilated"


def label(result: dict[str, Any], method: str) -> str:
    s = result["settings"]
    prefix = "block-sparse adaptive, " if kind(result) != "dilated" else ""
    if method == "lora":
        extra = " + MLP" if any(t in MLP for t in s.get("lora_targets") or []) else ""
        return f"{prefix}LoRA r {s['lora_r']}{extra}, lr {s['lr_lora']:g}"
    return f"{prefix}full, lr {s['lr_full']:g}"


def points(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """One row per (file, method) that has both comparisons: at ``T`` and read at the long context (the others are
    named on stderr). Runs with the same settings get their file's name in the label."""
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
            if not {"T", "long"} <= set(pair):
                print(f"recipe_tradeoff: {Path(path).name} ({method}) has no reading at the long context; left out",
                      file=sys.stderr)
            else:
                t, long = pair["T"], pair["long"]
                steps = {r["attn"]: r["steps"] for r in result["runs"] if r["method"] == method}
                out.append({"file": Path(path).name, "label": label(result, method), "method": method,
                            "kind": kind(result),
                            "steps": steps.get("dilated"), "trained_context": t["context"],
                            "long_context": long["context"], "ratio_T": t["ratio_after"],
                            "ratio_long": long["ratio_after"], "zero_shot_T": t["dilated_before"] / t["dense_before"],
                            "zero_shot_long": long["ratio_before"],
                            "meets": meets(t["ratio_after"], long["ratio_after"])})
    seen: dict[str, int] = {}
    for r in out:
        seen[r["label"]] = seen.get(r["label"], 0) + 1
    stems = [Path(r["file"]).stem for r in out]
    common = os.path.commonprefix(stems) if len(set(stems)) > 1 else ""
    for r, stem in zip(out, stems):
        if seen[r["label"]] > 1:
            r["label"] += f" ({stem[len(common):] or stem})"
    return out


def zero_shot(rows: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """The distinct (sparse arm, at ``T``, at the long context) readings before training (one per model, text and
    attention)."""
    return list(dict.fromkeys((r["kind"], round(r["zero_shot_T"], 6), round(r["zero_shot_long"], 6)) for r in rows))


def factor(rows: list[dict[str, Any]]) -> str:
    ratios = {r["long_context"] / r["trained_context"] for r in rows}
    return f"{ratios.pop():g}T" if len(ratios) == 1 else "the long context"


def meets(ratio_t: float, ratio_long: float) -> bool:
    return ratio_t <= T_TARGET and ratio_long < LONG_TARGET


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"| run | steps | at T (<= {T_TARGET:g}) | at {factor(rows)} vs dense + RoPE (< {LONG_TARGET:g}) | both |\n"
            "| --- | --- | --- | --- | --- |")
    lines = [f"| {r['label']} | {r['steps']} | {r['ratio_T']:.4f} | {r['ratio_long']:.4f} | "
             f"{'yes' if r['meets'] else 'no'} |" for r in rows]
    kinds = {r["kind"] for r in rows}
    for k, t, long in zero_shot(rows):
        name = "zero-shot (before training)" + (f", {k}" if len(kinds) > 1 else "")
        lines.append(f"| {name} | 0 | {t:.4f} | {long:.4f} | {'yes' if meets(t, long) else 'no'} |")
    return "\n".join([head, *lines])


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    zero = zero_shot(rows)
    xs = [r["ratio_T"] for r in rows] + [t for _, t, _ in zero]
    lo_x, hi_x = min(xs + [T_TARGET]) - 0.002, max(xs + [T_TARGET]) + 0.002
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    series = []  # points first: each takes its own colour (reporting.plot colours points after a line like the line)
    for k in kinds:
        for method, marker in (("full", "o"), ("lora", "s")):
            sel = [r for r in rows if r["method"] == method and r["kind"] == k]
            if sel:
                name = "full fine-tune" if method == "full" else "LoRA"
                series.append({"label": f"{k}, {name}" if len(kinds) > 1 else name, "x": [r["ratio_T"] for r in sel],
                               "y": [r["ratio_long"] for r in sel], "points": True, "marker": marker,
                               "annotate": [r["label"] for r in sel]})
        sel = [(t, long) for kz, t, long in zero if kz == k]
        series.append({"label": f"zero-shot, {k}" if len(kinds) > 1 else "zero-shot", "x": [t for t, _ in sel],
                       "y": [long for _, long in sel], "points": True, "marker": "x"})
    series.append({"label": f"{factor(rows)} target: < {LONG_TARGET:g}", "x": [lo_x, hi_x],
                   "y": [LONG_TARGET, LONG_TARGET]})
    panel = {"title": "patched / dense perplexity after the same fine-tune (lower is better)",
             "xlabel": f"at T = {rows[0]['trained_context']} tokens", "ylabel":
             f"at {factor(rows)} = {rows[0]['long_context']} tokens, both with RoPE scaling", "series": series,
             "vline": (T_TARGET, f"T target: <= {T_TARGET:g}")}
    return reporting.plot(path, [panel], title=title)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="finetune_recipe.json files written with --long-mode eval or both")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default="Fine-tune recipe: the two targets")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("recipe_tradeoff: the plot needs matplotlib (pip install 'hf_dilated[bench]')") from None
    rows = points(args.results)
    if not rows:
        raise SystemExit("recipe_tradeoff: no file has both comparisons (run finetune_recipe.py with --long-mode eval)")
    print(table(rows))
    plot(rows, Path(args.out), args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
