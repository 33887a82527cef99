#!/usr/bin/env python
"""Long-context fidelity: perplexity of a causal LM on real text at several context lengths, dense against patched.

    python scripts/eval_long_context.py --contexts 2048 8192 16384 32768 65536 --device cuda --dtype bfloat16 \
        --windows 2 --output-dir benchmarks/results --name smollm2_long_context
    hf-dilated eval ...                                   (the same program)

For each context length ``N`` the text's tokens are cut into ``--windows`` consecutive windows of ``N`` tokens (the
same leading windows for every variant); the reported perplexity pools the next-token NLL of all their tokens,
computed by :func:`hf_dilated.evaluation.sequence_nll` (the LM head in chunks: no ``N x vocab`` tensor). Variants
(one model, patched and unpatched in turn, weights shared): ``dense`` (the checkpoint as it is), ``dense+rope``
(the recipe's RoPE setting for the target context alone, every layer exact), ``dilated`` (dilated attention, the
model's own RoPE) and ``dilated+rope`` (the full recipe). Writes ``NAME.json`` and ``NAME.png`` into
``--output-dir`` and prints the table. The command line (options, checks before any work, the ``--overwrite`` rule)
is ``hf-dilated eval``'s, shared with the other commands; this module is the program it runs.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

try:
    from . import reporting
except ImportError:  # run as a file: python scripts/eval_long_context.py
    import reporting

VARIANTS = ("dense", "dense+rope", "dilated", "dilated+rope")
VARIANTS_HELP = {
    "dense": "the checkpoint as it is (exact attention, its own RoPE)",
    "dense+rope": "exact attention with the recipe's RoPE setting for the target context",
    "dilated": "dilated attention, the model's own RoPE",
    "dilated+rope": "the full recipe: dilated attention and its RoPE setting",
}


def text_tokens(tokenizer: Any, text: str, n_tokens: int | None = None):
    """The text's token ids as a 1-D ``long`` tensor (no special tokens), cut to ``n_tokens`` when given."""
    import torch

    chars = None if n_tokens is None else max(n_tokens * 8, 1)
    ids = tokenizer(text[:chars] if chars else text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.long)
    return ids[:n_tokens] if n_tokens is not None else ids


def _apply_variant(model, variant: str, target: int, config, recipe: str, backend: str | None, rope: str) -> None:
    from hf_dilated.patching import patch

    if variant == "dense+rope":
        patch(model, recipe=recipe, layers=[], context_length=target, rope=rope)
    elif variant == "dilated":
        patch(model, config, recipe=recipe, context_length=target, rope="none", backend=backend)
    elif variant == "dilated+rope":
        patch(model, config, recipe=recipe, context_length=target, rope=rope, backend=backend)


def evaluate(model, tokens, contexts: Sequence[int], *, variants: Sequence[str] = VARIANTS, windows: int = 1,
             config=None, recipe: str = "auto", target_context: int | None = None, backend: str | None = None,
             rope: str = "recipe", logits_chunk: int = 4096, progress: Callable[[str], None] | None = None) -> dict:
    """Perplexity of each variant at each context length; returns the JSON-ready result dict.

    ``model`` is a dense causal LM (a patched one is unpatched first and its dilated config reused); ``tokens`` the
    text's 1-D token ids, at least ``windows * max(contexts)`` long. One patched model, made for ``target_context``
    (default ``max(contexts)``), is measured at every length, as deployed.
    """
    import torch

    from hf_dilated.config import DilatedAttentionConfig
    from hf_dilated.environment import run_environment
    from hf_dilated.evaluation import sequence_nll
    from hf_dilated.patching import is_patched, patch_summary, unpatch

    contexts = sorted(set(contexts))
    if not contexts or min(contexts) < 2:
        raise ValueError(f"contexts must be integers >= 2, got {list(contexts)!r}")
    if not variants or any(v not in VARIANTS for v in variants):
        raise ValueError(f"variants must be a non-empty subset of {VARIANTS}, got {list(variants)!r}")
    needed = windows * contexts[-1]
    if tokens.ndim != 1 or tokens.numel() < needed:
        raise ValueError(f"the text has {tokens.numel()} tokens; {windows} window(s) of {contexts[-1]} need {needed}: "
                         "use fewer windows or shorter contexts")
    if is_patched(model):
        stored = DilatedAttentionConfig.from_model_config(model.config)
        unpatch(model)
        config = config if config is not None else stored
    target = target_context or contexts[-1]
    device = next(model.parameters()).device
    model.eval()
    rows, summaries = [], {}
    for variant in variants:
        _apply_variant(model, variant, target, config, recipe, backend, rope)
        try:
            summaries[variant] = patch_summary(model)
            for n in contexts:
                total, count, start = 0.0, 0, time.perf_counter()
                for w in range(windows):
                    nll, k = sequence_nll(model, tokens[w * n : (w + 1) * n].unsqueeze(0).to(device), logits_chunk)
                    total, count = total + nll, count + k
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds = time.perf_counter() - start
                row = {"variant": variant, "context": n, "perplexity": math.exp(total / count), "nll": total / count,
                       "tokens": count, "seconds": round(seconds, 3)}
                if device.type == "cuda":
                    row["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
                    torch.cuda.reset_peak_memory_stats(device)
                rows.append(row)
                if progress is not None:
                    progress(f"{variant:>13} @ {n:>6}: ppl {row['perplexity']:.3f} ({seconds:.1f}s)")
        finally:
            if variant != "dense":
                unpatch(model)
    return {
        "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "model_class": type(model).__name__,
        "contexts": contexts,
        "windows": windows,
        "target_context": target,
        "rope": rope,
        "trained_context": getattr(model.config, "max_position_embeddings", None),
        "variants_help": {v: VARIANTS_HELP[v] for v in variants},
        "patches": summaries,
        "results": rows,
        "environment": run_environment(device, next(model.parameters()).dtype),
    }


def table(result: dict) -> str:
    """The perplexity table: one row per context length, one column per variant."""
    variants = list(dict.fromkeys(r["variant"] for r in result["results"]))
    ppl = {(r["context"], r["variant"]): r["perplexity"] for r in result["results"]}
    return reporting.format_table(["context", *variants], [[n, *(ppl.get((n, v)) for v in variants)] for n in result["contexts"]])


def plot(result: dict, path: Path) -> Path:
    """Perplexity against context length (log-log), one line per variant."""
    series = []
    for variant in dict.fromkeys(r["variant"] for r in result["results"]):
        rows = sorted((r for r in result["results"] if r["variant"] == variant), key=lambda r: r["context"])
        series.append({"label": variant, "x": [r["context"] for r in rows], "y": [r["perplexity"] for r in rows], "marker": "o"})
    trained = result.get("trained_context")
    env = result.get("environment", {})
    panel = {"title": f"{Path(str(result['model'])).name}: dense vs dilated ({env.get('device', '')}, {env.get('dtype', '')})",
             "xlabel": "context length (tokens)", "ylabel": "perplexity", "series": series, "logx": True, "logy": True,
             "vline": (trained, f"trained context ({trained})") if trained else None}
    return reporting.plot(path, [panel])


def save_json(result: dict, path: Path) -> Path:
    return reporting.write_json(path, result)


def main(argv: Sequence[str] | None = None) -> int:
    from hf_dilated.cli import main as cli_main

    return cli_main(["eval", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
