"""Long-context fidelity: perplexity of a causal LM on real text at several context lengths, dense against patched.

For each context length ``N`` the text's tokens are cut into ``windows`` consecutive, non-overlapping windows of ``N``
tokens (the same leading windows for every model variant); a window's perplexity is ``exp`` of the mean next-token
negative log-likelihood over its ``N - 1`` predicted tokens, and the reported perplexity pools all windows' tokens.
Logits are computed in chunks from the base model's hidden states, so a 64K-token window never holds a
``64K x vocab`` tensor.

Variants (one model, patched and unpatched in turn, weights shared):

- ``dense``: the checkpoint as it is;
- ``dense+rope``: the recipe's RoPE setting for the target context alone, every layer exact (``layers=[]``);
- ``dilated``: dilated attention with the model's own RoPE (``rope="none"``);
- ``dilated+rope``: the full recipe: dilated attention and its RoPE setting for the target context.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .config import DilatedAttentionConfig
from .environment import run_environment
from .patching import is_patched, patch, patch_summary, unpatch

VARIANTS = ("dense", "dense+rope", "dilated", "dilated+rope")
VARIANTS_HELP = {
    "dense": "the checkpoint as it is (exact attention, its own RoPE)",
    "dense+rope": "exact attention with the recipe's RoPE setting for the target context",
    "dilated": "dilated attention, the model's own RoPE",
    "dilated+rope": "the full recipe: dilated attention and its RoPE setting",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def text_tokens(tokenizer: Any, text: str, n_tokens: int | None = None) -> torch.Tensor:
    """The text's token ids as a 1-D ``long`` tensor (no special tokens), cut to ``n_tokens`` when given."""
    chars = None if n_tokens is None else max(n_tokens * 8, 1)
    ids = tokenizer(text[:chars] if chars else text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.long)
    return ids[:n_tokens] if n_tokens is not None else ids


@torch.no_grad()
def sequence_nll(model: Any, input_ids: torch.Tensor, logits_chunk: int = 4096) -> tuple[float, int]:
    """Summed next-token NLL (float64) and the number of predicted tokens of one ``[1, N]`` sequence."""
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape [1, N], got {tuple(input_ids.shape)}")
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no language-model head; evaluation needs a *ForCausalLM model")
    hidden = model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
    softcap = getattr(model.config, "final_logit_softcapping", None)
    total, count = 0.0, 0
    n = input_ids.shape[1]
    for start in range(0, n - 1, logits_chunk):
        stop = min(start + logits_chunk, n - 1)
        logits = head(hidden[:, start:stop]).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        labels = input_ids[:, start + 1 : stop + 1]
        nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        total += nll.double().sum().item()  # float64 sum: 64K tokens of float32 NLL would lose digits
        count += labels.numel()
    return total, count


def _apply_variant(
    model: Any,
    variant: str,
    target: int,
    config: DilatedAttentionConfig | None,
    recipe: str,
    backend: str | None,
    rope: str = "recipe",
) -> None:
    if variant == "dense":
        return
    if variant == "dense+rope":
        patch(model, recipe=recipe, layers=[], context_length=target, rope=rope)
    elif variant == "dilated":
        patch(model, config, recipe=recipe, context_length=target, rope="none", backend=backend)
    elif variant == "dilated+rope":
        patch(model, config, recipe=recipe, context_length=target, rope=rope, backend=backend)
    else:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def _check_contexts(contexts: Sequence[int]) -> list[int]:
    if not contexts or any(isinstance(c, bool) or not isinstance(c, int) or c < 2 for c in contexts):
        raise ValueError(f"contexts must be a non-empty list of integers >= 2, got {list(contexts)!r}")
    return sorted(set(contexts))


def evaluate(
    model: Any,
    tokens: torch.Tensor,
    contexts: Sequence[int],
    *,
    variants: Sequence[str] = VARIANTS,
    windows: int = 1,
    config: DilatedAttentionConfig | dict | None = None,
    recipe: str = "auto",
    target_context: int | None = None,
    backend: str | None = None,
    rope: str = "recipe",
    logits_chunk: int = 4096,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Perplexity of each variant at each context length; returns the JSON-ready result dict.

    ``model`` is a dense causal LM (a patched one is unpatched first and its dilated config reused);
    ``tokens`` the text's 1-D token ids, at least ``windows * max(contexts)`` long. ``target_context`` is the context
    the patch is made for (default ``max(contexts)``): one patched model is measured at every length, as deployed.
    ``backend`` overrides the dilated-attention backend (default: the config's, ``"auto"``); ``rope`` is the RoPE
    setting of the ``+rope`` variants (default: the recipe's).
    """
    contexts = _check_contexts(contexts)
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"variants must be a non-empty subset of {VARIANTS}, got {list(variants)!r}")
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise ValueError(f"windows must be a positive integer, got {windows!r}")
    needed = windows * contexts[-1]
    if tokens.ndim != 1 or tokens.numel() < needed:
        raise ValueError(
            f"the text has {tokens.numel()} tokens; {windows} window(s) of {contexts[-1]} need {needed}: "
            "use fewer windows or shorter contexts"
        )
    if is_patched(model):
        stored = DilatedAttentionConfig.from_model_config(model.config)
        unpatch(model)
        config = config if config is not None else stored
    if isinstance(config, dict):
        config = DilatedAttentionConfig.from_dict(config)
    target = target_context or contexts[-1]
    device = next(model.parameters()).device
    model.eval()
    rows, summaries = [], {}
    for variant in variants:
        _apply_variant(model, variant, target, config, recipe, backend, rope)
        try:
            summaries[variant] = patch_summary(model)
            for n in contexts:
                total, count, start_t = 0.0, 0, time.perf_counter()
                for w in range(windows):
                    ids = tokens[w * n : (w + 1) * n].unsqueeze(0).to(device)
                    nll, k = sequence_nll(model, ids, logits_chunk)
                    total, count = total + nll, count + k
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds = time.perf_counter() - start_t
                mean = total / count
                row = {
                    "variant": variant,
                    "context": n,
                    "perplexity": math.exp(mean),
                    "nll": mean,
                    "tokens": count,
                    "seconds": round(seconds, 3),
                }
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


def format_table(result: dict) -> str:
    """The perplexity table: one row per context length, one column per variant."""
    variants = list(dict.fromkeys(r["variant"] for r in result["results"]))
    table = {(r["context"], r["variant"]): r["perplexity"] for r in result["results"]}
    head = f"{'context':>8} | " + " | ".join(f"{v:>12}" for v in variants)
    lines = [head, "-" * len(head)]
    for n in result["contexts"]:
        lines.append(f"{n:>8} | " + " | ".join(f"{table.get((n, v), float('nan')):>12.3f}" for v in variants))
    return "\n".join(lines)


def plot(result: dict, path: str | Path) -> Path:
    """Perplexity against context length (log-log), one line per variant, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant in dict.fromkeys(r["variant"] for r in result["results"]):
        rows = sorted((r for r in result["results"] if r["variant"] == variant), key=lambda r: r["context"])
        ax.plot([r["context"] for r in rows], [r["perplexity"] for r in rows], marker="o", label=variant)
    trained = result.get("trained_context")
    if trained:
        ax.axvline(trained, color="gray", linestyle="--", linewidth=1, label=f"trained context ({trained})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity")
    env = result.get("environment", {})
    ax.set_title(f"{Path(str(result['model'])).name}: dense vs dilated ({env.get('device', '')}, {env.get('dtype', '')})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save(result: dict, output_dir: str | Path, name: str = "long_context_eval") -> dict[str, Path]:
    """Write ``<name>.json`` and ``<name>.png`` into ``output_dir``; return their paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return {"json": json_path, "png": plot(result, out / f"{name}.png")}
