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
model's own RoPE), ``dilated+rope`` (the full recipe), and ``block_sparse`` / ``block_sparse+rope`` (block-sparse
attention: by default the recipe's adaptive pattern, attending to as many keys per query as the dilated variant at
the target context). Writes ``NAME.json`` and ``NAME.png`` into
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

VARIANTS = ("dense", "dense+rope", "dilated", "dilated+rope", "block_sparse", "block_sparse+rope")
DEFAULT_VARIANTS = VARIANTS[:4]
VARIANTS_HELP = {
    "dense": "the checkpoint as it is (exact attention, its own RoPE)",
    "dense+rope": "exact attention with the recipe's RoPE setting for the target context",
    "dilated": "dilated attention, the model's own RoPE",
    "dilated+rope": "the full recipe: dilated attention and its RoPE setting",
    "block_sparse": "block-sparse attention (as many keys per query as dilated), the model's own RoPE",
    "block_sparse+rope": "block-sparse attention and the recipe's RoPE setting",
}


def text_tokens(tokenizer: Any, text: str, n_tokens: int | None = None):
    """The text's token ids as a 1-D ``long`` tensor (no special tokens), cut to ``n_tokens`` when given."""
    import torch

    chars = None if n_tokens is None else max(n_tokens * 8, 1)
    ids = tokenizer(text[:chars] if chars else text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.long)
    return ids[:n_tokens] if n_tokens is not None else ids


def block_sparse_config(model, settings: dict | None, dilated, target: int, recipe: str = "auto"):
    """The block-sparse config of the ``block_sparse`` variants: ``settings`` (``BlockSparseConfig`` fields) over the
    recipe's defaults; an adaptive pattern without ``top_k`` attends to as many keys per query at ``target`` tokens
    as ``dilated`` (the dilated variant's config; ``None``: the recipe's default branches)."""
    from hf_dilated import BlockSparseConfig
    from hf_dilated.patching import load_recipe, recipe_for

    if isinstance(settings, BlockSparseConfig):
        return settings
    chosen = recipe_for(model) if recipe == "auto" else load_recipe(recipe)
    trained = chosen.trained_context(model.config)
    if trained is None:
        raise ValueError(f"{type(model.config).__name__} does not state its trained context (max_position_embeddings)")
    return chosen.block_sparse_config(trained, target, dilated=dilated, **(settings or {}))


def _apply_variant(model, variant: str, target: int, config, block_sparse, recipe: str, backend: str | None,
                   rope: str) -> None:
    from hf_dilated.patching import patch

    if variant == "dense+rope":
        patch(model, recipe=recipe, layers=[], context_length=target, rope=rope)
    elif variant in ("dilated", "dilated+rope"):
        patch(model, config, recipe=recipe, context_length=target, rope=rope if variant.endswith("+rope") else "none",
              backend=backend)
    elif variant in ("block_sparse", "block_sparse+rope"):
        patch(model, block_sparse, attention="block_sparse", recipe=recipe, context_length=target,
              rope=rope if variant.endswith("+rope") else "none", backend=backend)


def evaluate(model, tokens, contexts: Sequence[int], *, variants: Sequence[str] = DEFAULT_VARIANTS, windows: int = 1,
             config=None, block_sparse=None, recipe: str = "auto", target_context: int | None = None,
             backend: str | None = None, rope: str = "recipe", logits_chunk: int = 4096,
             progress: Callable[[str], None] | None = None) -> dict:
    """Perplexity of each variant at each context length; returns the JSON-ready result dict.

    ``model`` is a dense causal LM (a patched one is unpatched first and its attention config reused); ``tokens`` the
    text's 1-D token ids, at least ``windows * max(contexts)`` long. One patched model, made for ``target_context``
    (default ``max(contexts)``), is measured at every length, as deployed. ``config``: the dilated config (``None``:
    the recipe's); ``block_sparse``: a ``BlockSparseConfig`` or a dict of its fields over the recipe's defaults
    (:func:`block_sparse_config`).
    """
    import torch

    from hf_dilated.config import DilatedAttentionConfig
    from hf_dilated.environment import run_environment
    from hf_dilated.evaluation import sequence_nll
    from hf_dilated import BlockSparseConfig
    from hf_dilated.patching import is_patched, patch_summary, patched_attention, unpatch

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
        if patched_attention(model) == "block_sparse":
            stored = BlockSparseConfig.from_model_config(model.config)
            block_sparse = block_sparse if block_sparse is not None else stored
        else:
            stored = DilatedAttentionConfig.from_model_config(model.config)
            config = config if config is not None else stored
        unpatch(model)
    target = target_context or contexts[-1]
    if any(v.startswith("block_sparse") for v in variants):
        block_sparse = block_sparse_config(model, block_sparse, config, target, recipe)
    device = next(model.parameters()).device
    model.eval()
    rows, summaries = [], {}
    for variant in variants:
        _apply_variant(model, variant, target, config, block_sparse, recipe, backend, rope)
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
    panel = {"title": f"{Path(str(result['model'])).name}: dense vs patched ({env.get('device', '')}, {env.get('dtype', '')})",
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
