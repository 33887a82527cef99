#!/usr/bin/env python
"""Fidelity study: zero-shot perplexity of a pretrained causal LM on real text, dense against a grid of dilated and
block-sparse configurations, plotted against the number of keys each query attends (issue 16).

    python scripts/fidelity_study.py --gguf .gpu/smol.gguf --text .gpu/text.txt --out "$OUT" --device cuda

Lengths: 2K, the trained context ``T`` and 2T / 4T / 8T (SmolLM2: 2K, 8K, 16K, 32K, 64K). The text is tokenized once
and cut into ``--windows`` windows that start ``len(tokens) / windows`` apart (different parts of the text); at every
length, window ``k`` is the first ``N`` tokens from start ``k``, the same for every variant. Each window's perplexity
is that of its tokens from ``--score-from * N`` on (default: the second half, where long-range attention matters),
computed by :func:`hf_dilated.evaluation.causal_lm_nll` (the LM head in chunks). Reported per (variant, length): the
pooled perplexity, its mean / spread / min / max over windows, the ratio to dense, and the attended keys per query
(mean over queries, heads and layers; exact, from the configuration: :func:`hf_dilated.evaluation
.dilated_attended_keys`, and for the content-chosen block-sparse pattern from the layouts its forward built).

Variants (one model, patched and unpatched in turn; each patched for the length it reads, ``context_length = N``,
so past ``T`` the recipe's RoPE scaling applies unless the name says ``rope=none``):

- ``dense`` (sdpa), ``dense+rope`` (the recipe's RoPE scaling alone, past ``T`` only);
- ``dilated w0=W g=G``: the recipe's geometric branches from first segment ``W`` (``w`` and ``r`` double until a
  segment covers ``max(N, T)``), plus ``G`` global tokens; suffixes change one thing: ``sched=slow`` (``r`` lags
  one doubling: 1, 1, 2, 4, ..., more keys), ``sched=fast`` (``r`` quadruples: 1, 4, 16, ..., fewer keys),
  ``cap=trained`` (no segment longer than ``T``: relative distances stay as trained), ``rope=none``,
  ``layers=odd`` / ``layers=upper`` (only odd layers / the upper half dilated, the rest dense);
- ``bs ...``: block-sparse (``"block_sparse"``, block 64): ``adaptive`` (top-k by pooled scores + local + the sink
  block), ``local+sink`` and ``dilated`` block patterns, each given about the keys of ``dilated w0=<first> g=1``.

Writes ``--out/NAME.json`` (every row, the configurations, the GPU, versions and command), ``NAME.png`` (one
panel per length: perplexity against attended keys) and ``NAME_ratio.png`` (the ratio to dense), rewritten after every variant so a cut-off run keeps what
finished; ``--budget-s`` skips what would not finish. ``--list`` prints the variant names.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
if not __package__ and str(ROOT) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(ROOT))

try:
    from . import reporting
except ImportError:  # run as a file: python scripts/fidelity_study.py
    import reporting

SCHEDULES = ("geometric", "slow", "fast")
LAYER_SETS = ("all", "odd", "upper")
BLOCK_SIZE = 64


# ---------------------------------------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One row of the grid. ``kind``: ``dense``, ``dense+rope``, ``dilated`` or ``block_sparse``."""

    name: str
    kind: str
    group: str
    w0: int = 0
    schedule: str = "geometric"
    cap: str = "target"  # "target": segments grow to cover the length; "trained": none longer than T
    global_tokens: int = 0
    layers: str = "all"
    rope: str = "recipe"
    pattern: str = ""  # block_sparse: adaptive, local, dilated
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    def applies_at(self, n: int, trained: int) -> bool:
        """``dense+rope`` and ``rope=none`` differ from their partners only past the trained context."""
        if self.kind == "dense+rope" or (self.rope == "none" and self.kind == "dilated"):
            return n > trained
        return True


def read_text_arg(path: str | None) -> str:
    """``--text`` or the bundled Shakespeare; a missing asset ends the program with the reason."""
    from hf_dilated import assets

    try:
        return assets.text_file_or_shakespeare(path)
    except ValueError as err:
        raise SystemExit(f"fidelity_study: {err}") from None


def branches(w0: int, schedule: str, cover: int) -> tuple[list[int], list[int]]:
    """Segment lengths from ``w0``, doubling until one covers ``cover``, and their rates by ``schedule``:
    ``geometric`` (r doubles with w: every branch costs ``w0`` keys), ``slow`` (1, 1, 2, 4, ...), ``fast``
    (1, 4, 16, ..., capped at w)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    ws = [w0]
    while ws[-1] < cover:
        ws.append(ws[-1] * 2)
    if schedule == "geometric":
        rs = [2**i for i in range(len(ws))]
    elif schedule == "slow":
        rs = [1] + [2**i for i in range(len(ws) - 1)]
    else:
        rs = [min(4**i, w) for i, w in enumerate(ws)]
    return ws, rs


def layer_list(which: str, convertible: Sequence[int]) -> list[int] | None:
    """The layers a variant converts, among those the recipe may convert (Gemma3: its global layers only):
    ``all`` (``None``: the recipe's choice), ``odd`` (every other one, from the second) or ``upper`` (the later half)."""
    convertible = list(convertible)
    if which == "all":
        return None
    if which == "odd":
        return convertible[1::2]
    if which == "upper":
        return convertible[len(convertible) // 2:]
    raise ValueError(f"layers must be one of {LAYER_SETS}, got {which!r}")


def convertible_layers(model) -> list[int]:
    """The layers the model's recipe converts (every layer but sliding-window ones where it keeps them)."""
    from hf_dilated.patching import recipe_for, sliding_window_layers

    n = model.config.num_hidden_layers
    recipe = recipe_for(model)
    if recipe.convert == "full_attention" or recipe.sliding_window == "keep":
        sliding = set(sliding_window_layers(model.config))
        return [i for i in range(n) if i not in sliding]
    return list(range(n))


def grid(first_segments: Sequence[int], global_tokens: Sequence[int]) -> list[Variant]:
    """The study's variants, most important first (a cut-off run loses the tail)."""
    w_first = first_segments[0]
    g_mid = 4 if 4 in global_tokens else global_tokens[-1]
    out = [Variant("dense", "dense", "dense"), Variant("dense+rope", "dense+rope", "dense")]
    for g in global_tokens:  # the sink lever, at the recipe's first segment
        out.append(Variant(f"dilated w0={w_first} g={g}", "dilated", "dilated: global tokens", w0=w_first, global_tokens=g))
    for w0 in first_segments[1:]:  # the first-segment lever, without and with sinks
        for g in dict.fromkeys((0, g_mid)):
            out.append(Variant(f"dilated w0={w0} g={g}", "dilated", "dilated: first segment", w0=w0, global_tokens=g))
    for sched in ("slow", "fast"):  # the rate schedule
        out.append(Variant(f"dilated w0={w_first} g={g_mid} sched={sched}", "dilated", "dilated: schedule / cap",
                           w0=w_first, global_tokens=g_mid, schedule=sched))
    out.append(Variant(f"dilated w0={w_first} g={g_mid} cap=trained", "dilated", "dilated: schedule / cap",
                       w0=w_first, global_tokens=g_mid, cap="trained", rope="none"))
    out.append(Variant(f"dilated w0={w_first} g={g_mid} rope=none", "dilated", "dilated: schedule / cap",
                       w0=w_first, global_tokens=g_mid, rope="none"))
    for which in ("odd", "upper"):  # layers converted
        out.append(Variant(f"dilated w0={w_first} g={g_mid} layers={which}", "dilated", "dilated: layers",
                           w0=w_first, global_tokens=g_mid, layers=which))
    for pattern, label in (("adaptive", "adaptive"), ("local", "local+sink"), ("dilated", "dilated")):
        out.append(Variant(f"bs {label}", "block_sparse", "block-sparse", w0=w_first, global_tokens=1, pattern=pattern))
    # What a user gets: hf_dilated.patch(model, attention=..., context_length=n) with the model's recipe defaults
    # (block-sparse: adaptive, as many keys per query as the recipe's dilated default).
    out.append(Variant("recipe dilated", "dilated", "recipe", pattern="recipe"))
    out.append(Variant("recipe bs adaptive", "block_sparse", "recipe", pattern="recipe"))
    return out


def dilated_config(v: Variant, n: int, trained: int, convertible: Sequence[int]):
    from hf_dilated import DilatedAttentionConfig

    cover = trained if v.cap == "trained" else max(n, trained)
    ws, rs = branches(v.w0, v.schedule, cover)
    return DilatedAttentionConfig(segment_lengths=ws, dilation_rates=rs, global_tokens=v.global_tokens,
                                  layers=layer_list(v.layers, convertible))


def block_sparse_config(v: Variant, n: int, trained: int, num_heads: int, convertible: Sequence[int], device=None):
    """A block-sparse config of the variant's pattern with about the attended keys of ``dilated w0=<w0> g=1`` at
    length ``n`` (the adaptive one by its upper bound, every chosen block distinct)."""
    from hf_dilated import BlockSparseConfig
    from hf_dilated.evaluation import dilated_attended_keys

    b = BLOCK_SIZE
    reference = dilated_config(Variant("ref", "dilated", "", w0=v.w0, global_tokens=1), n, trained, convertible)
    target = dilated_attended_keys(reference, n, num_heads, device=device)
    n_blocks = math.ceil(n / b)
    if v.pattern == "adaptive":
        # causal tiles of a budget of B blocks ending at the diagonal: about (B - 1/2) b keys once past B blocks
        budget = max(3, min(n_blocks, round(target / b + 0.5)))
        return BlockSparseConfig(pattern="adaptive", block_size=b, local_blocks=1, global_blocks=1, top_k=budget - 2)
    if v.pattern == "local":
        budget = max(2, min(n_blocks, round(target / b + 0.5)))
        return BlockSparseConfig(pattern="local", block_size=b, local_blocks=budget - 1, global_blocks=1)
    if v.pattern == "dilated":  # the reference's branches at block granularity (segments of at least one block)
        ws, rs = [max(w // b, 1) for w in reference.segment_lengths], list(reference.dilation_rates)
        rs = [min(r, w) for w, r in zip(ws, rs)]
        return BlockSparseConfig(pattern="dilated", block_size=b, local_blocks=1, global_blocks=1,
                                 segment_blocks=ws, dilation_rates=rs)
    raise ValueError(f"unknown block-sparse pattern {v.pattern!r}")


# ---------------------------------------------------------------------------------------------------------------------
# Applying a variant to the model
# ---------------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def applied(model, v: Variant, n: int, trained: int, dense_impl: str = "sdpa"):
    """The model switched to variant ``v`` for length ``n``, restored on exit. Yields the attention config used.
    ``dense_impl="kernels"``: ``dense`` runs through this package's kernels (a patch converting no layer) instead of
    sdpa, whose sliding-window masks are ``N x N`` (Gemma3 past 64K)."""
    from hf_dilated.ops.block_sparse.config import CONFIG_KEY as BS_KEY
    from hf_dilated.patching import is_patched, patch, unpatch

    mc = model.config
    target = n if n > trained else None
    previous = mc._attn_implementation
    cfg = None
    try:
        if v.pattern == "recipe":  # the recipe's defaults through the public patch call
            from hf_dilated import BlockSparseConfig, DilatedAttentionConfig

            patch(model, attention=v.kind, context_length=target)
            cfg = (DilatedAttentionConfig if v.kind == "dilated" else BlockSparseConfig).from_model_config(mc)
        elif v.kind == "dense" and dense_impl == "kernels":
            patch(model, layers=[], rope="none")
        elif v.kind == "dense+rope":
            patch(model, layers=[], context_length=target)
        elif v.kind == "dilated":
            cfg = dilated_config(v, n, trained, convertible_layers(model))
            patch(model, cfg, context_length=target, rope=v.rope)
        elif v.kind == "block_sparse":
            cfg = block_sparse_config(v, n, trained, mc.num_attention_heads, convertible_layers(model),
                                      next(model.parameters()).device)
            layers = convertible_layers(model)
            if layers != list(range(mc.num_hidden_layers)):  # the recipe's layers only (Gemma3: the global ones)
                cfg.layers = layers
            if target is not None:  # the recipe's RoPE through a dense patch, then the block-sparse implementation
                patch(model, layers=[], context_length=target)
            cfg.save_to(mc)
            model.set_attn_implementation("block_sparse")
        elif v.kind != "dense":
            raise ValueError(f"unknown variant kind {v.kind!r}")
        yield cfg
    finally:
        if getattr(mc, BS_KEY, None) is not None:
            delattr(mc, BS_KEY)
            model.set_attn_implementation(previous)
        if is_patched(model):
            unpatch(model)


@contextlib.contextmanager
def recorded_layouts(n: int, sink: list[float]):
    """Record the exact attended keys of every block-sparse layout built inside (one per layer call)."""
    from hf_dilated.evaluation import layout_attended_keys
    from hf_dilated.ops.block_sparse.config import BlockSparseConfig

    original = BlockSparseConfig.build

    def build(self, query, key, tokens, is_causal):
        layout = original(self, query, key, tokens, is_causal)
        if query.shape[2] == key.shape[2] == n:
            sink.append(layout_attended_keys(layout, n, bool(is_causal)))
        return layout

    BlockSparseConfig.build = build
    try:
        yield sink
    finally:
        BlockSparseConfig.build = original


def attended_keys(v: Variant, cfg, n: int, model, converted_keys: float | None = None) -> tuple[float, str]:
    """``(keys per query, how it was counted)``: the mean over layers of each layer's mean (converted layers by the
    configuration, sliding-window layers by their window, the others dense)."""
    from hf_dilated.evaluation import block_sparse_attended_keys, dense_attended_keys, dilated_attended_keys
    from hf_dilated.patching import sliding_window_layers

    mc = model.config
    heads, n_layers = mc.num_attention_heads, mc.num_hidden_layers
    sliding = set(sliding_window_layers(mc))
    dense, windowed = dense_attended_keys(n), dense_attended_keys(n, getattr(mc, "sliding_window", None) or None)
    how = "exact"
    if cfg is None:
        converted_keys, converted = dense, set()
    elif v.kind == "dilated":
        device = next(model.parameters()).device  # thousands of small vector operations: faster on the GPU
        converted_keys = dilated_attended_keys(cfg, n, heads, device=device) if converted_keys is None else converted_keys
        converted = set(range(n_layers) if cfg.layers is None else cfg.layers)
    else:
        converted_keys = block_sparse_attended_keys(cfg, n, heads) if converted_keys is None else converted_keys
        converted = set(range(n_layers) if cfg.layers is None else cfg.layers)
        how = "upper bound" if cfg.pattern == "adaptive" else how
    per_layer = [windowed if i in sliding else converted_keys if i in converted else dense for i in range(n_layers)]
    return sum(per_layer) / n_layers, how


# ---------------------------------------------------------------------------------------------------------------------
# Text, model, measurement
# ---------------------------------------------------------------------------------------------------------------------
def text_windows(tokenizer, text: str, windows: int, longest: int) -> tuple[list, list[int]]:
    """``windows`` token sequences of ``longest`` tokens (1-D long tensors, no special tokens), starting at the first
    line break after ``k * len(text) / windows``: different parts of the text, the same for every variant and length
    (a shorter window is a prefix). Only what is needed is tokenized."""
    import torch

    if windows < 1 or longest < 2:
        raise ValueError(f"windows must be >= 1 and lengths >= 2, got {windows} and {longest}")
    starts, out = [], []
    for k in range(windows):
        start = k * len(text) // windows
        if start:
            cut = text.find("\n", start)
            start = cut + 1 if cut >= 0 else start
        end = len(text) if k == windows - 1 else (k + 1) * len(text) // windows
        chars = longest * 4
        while True:  # tokenize a little more than needed, growing until enough tokens are read
            ids = tokenizer(text[start : min(end, start + chars)], add_special_tokens=False,
                            return_attention_mask=False)["input_ids"]
            if len(ids) > longest or start + chars >= end:
                break
            chars *= 2
        if len(ids) < longest:
            raise ValueError(f"the text is too short: {windows} window(s) of {longest} tokens need about "
                             f"{windows * longest} tokens; give fewer --windows or shorter --lengths")
        starts.append(start)
        out.append(torch.tensor(ids[:longest], dtype=torch.long))
    return out, starts


def window_nll(model, ids, score_from: int, chunk: int) -> tuple[float, int]:
    import torch

    from hf_dilated.evaluation import IGNORE_INDEX, causal_lm_nll

    labels = ids.clone()
    labels[:, : max(score_from, 1)] = IGNORE_INDEX  # target of token t is labels[t + 1]: tokens >= score_from scored
    with torch.no_grad():
        total, count = causal_lm_nll(model, {"input_ids": ids, "labels": labels}, chunk)
    return float(total), int(count)


def load_model(args):
    import torch

    from hf_dilated import assets

    dtype = getattr(torch, args.dtype)
    if args.gguf:
        model, tokenizer = assets.load_gguf(args.gguf, dtype=dtype)
        name = Path(args.gguf).name
    elif args.checkpoint:
        model, tokenizer = assets.load_checkpoint(args.checkpoint, dtype=dtype)
        name = Path(args.checkpoint).name
    else:
        loaded = assets.load_model(args.model, dtype=dtype)
        if loaded is None:
            raise SystemExit(f"fidelity_study: {args.model} is not available: {assets.missing_reason(args.model)}")
        model, tokenizer = loaded
        name = args.model
    if tokenizer is None:
        raise SystemExit("fidelity_study: the model has no tokenizer beside it")
    return model.to(args.device).eval(), tokenizer, name


def default_lengths(trained: int) -> list[int]:
    return sorted({2048, trained, 2 * trained, 4 * trained, 8 * trained})


def summarize(per_window: list[tuple[float, int]]) -> dict[str, Any]:
    ppls = [math.exp(s / c) for s, c in per_window]
    total, count = sum(s for s, _ in per_window), sum(c for _, c in per_window)
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count,
            "window_perplexities": ppls, "mean": statistics.fmean(ppls),
            "std": statistics.stdev(ppls) if len(ppls) > 1 else 0.0, "min": min(ppls), "max": max(ppls)}


def run(args, model=None, tokenizer=None, name: str | None = None) -> dict[str, Any]:
    """The study; ``model`` / ``tokenizer`` (already on ``args.device``, in eval mode) instead of loading one."""
    import torch

    from hf_dilated.config import trained_context
    from hf_dilated.environment import run_environment

    t_start = time.time()
    if model is None:
        model, tokenizer, name = load_model(args)
    trained = trained_context(model.config)
    if trained is None:
        raise SystemExit("fidelity_study: the model config states no trained context (max_position_embeddings)")
    lengths = sorted(set(args.lengths or default_lengths(trained)))
    text = read_text_arg(args.text)
    windows, starts = text_windows(tokenizer, text, args.windows, lengths[-1])
    variants = grid(args.first_segments, args.global_tokens)
    if args.variants:
        known = {v.name: v for v in variants}
        unknown = [n for n in args.variants if n not in known]
        if unknown:
            raise SystemExit(f"fidelity_study: unknown variants {unknown}; --list prints the names")
        variants = [known[n] for n in args.variants]
    device = torch.device(args.device)
    result: dict[str, Any] = {
        "model": name or getattr(model.config, "_name_or_path", "") or type(model).__name__, "model_class": type(model).__name__, "trained_context": trained, "lengths": lengths,
        "windows": args.windows, "window_start_chars": starts, "text": Path(args.text).name if args.text else "shakespeare (bundled)", "text_chars": len(text),
        "score_from": args.score_from, "block_size": BLOCK_SIZE, "dense_impl": args.dense_impl,
        "num_layers": model.config.num_hidden_layers, "num_heads": model.config.num_attention_heads,
        "num_kv_heads": getattr(model.config, "num_key_value_heads", None),
        "environment": run_environment(device, next(model.parameters()).dtype),
        "variants": {v.name: {"kind": v.kind, "group": v.group, "w0": v.w0, "schedule": v.schedule, "cap": v.cap,
                              "global_tokens": v.global_tokens, "layers": v.layers, "rope": v.rope,
                              "pattern": v.pattern} for v in variants},
        "rows": [], "skipped": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(v, n) for v in variants for n in lengths if v.applies_at(n, trained)]
    from tqdm.auto import tqdm

    bar = tqdm(jobs, desc="fidelity", unit="run", disable=args.no_progress)
    dense = {}
    for v, n in bar:
        bar.set_postfix_str(f"{v.name} @ {n}")
        if time.time() - t_start > args.budget_s:
            result["skipped"].append({"variant": v.name, "length": n, "reason": "time budget"})
            continue
        t0 = time.perf_counter()
        try:
            with applied(model, v, n, trained, args.dense_impl) as cfg:
                keys, how = attended_keys(v, cfg, n, model)
                measured: list[float] = []
                per_window = []
                adaptive = v.kind == "block_sparse" and getattr(cfg, "pattern", None) == "adaptive"
                record = recorded_layouts(n, measured) if adaptive else contextlib.nullcontext()
                with record:
                    for tokens in windows:
                        ids = tokens[:n].unsqueeze(0).to(device)
                        per_window.append(window_nll(model, ids, int(args.score_from * n), args.logits_chunk))
                if measured:  # the layouts the forward built: the exact count of the converted layers
                    keys, how = attended_keys(v, cfg, n, model, converted_keys=statistics.fmean(measured))
                    how = "exact (measured layouts)"
                config_used = None if cfg is None else cfg.to_dict()
        except Exception as err:  # noqa: BLE001  (one variant failing, e.g. out of memory, must not end the study)
            kind = "out of memory" if isinstance(err, torch.cuda.OutOfMemoryError) else type(err).__name__
            result["skipped"].append({"variant": v.name, "length": n, "reason": f"{kind}: {str(err)[:300]}"})
            bar.write(f"{v.name} @ {n}: {kind}: {str(err)[:200]}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row = {"variant": v.name, "group": v.group, "kind": v.kind, "length": n, **summarize(per_window),
               "attended_keys": keys, "attended_keys_counted": how,
               "config": config_used, "seconds": round(time.perf_counter() - t0, 3)}
        if v.kind == "dense":
            dense[n] = row
        if n in dense:  # paired by window: the text's spread cancels
            ratios = [a / b for a, b in zip(row["window_perplexities"], dense[n]["window_perplexities"])]
            row.update(vs_dense=row["perplexity"] / dense[n]["perplexity"], vs_dense_windows=ratios,
                       vs_dense_min=min(ratios), vs_dense_max=max(ratios))
        if device.type == "cuda":
            row["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
            torch.cuda.reset_peak_memory_stats(device)
        result["rows"].append(row)
        result["seconds"] = round(time.time() - t_start, 1)
        save(result, out, args.name)
    result["seconds"] = round(time.time() - t_start, 1)
    save(result, out, args.name, final=True)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------------
def table(result: dict) -> str:
    """Perplexity (and ratio to dense) per variant (rows) and length (columns), with the keys per query."""
    lengths = result["lengths"]
    cell = {(r["variant"], r["length"]): r for r in result["rows"]}
    rows = []
    for name in dict.fromkeys(r["variant"] for r in result["rows"]):
        line = [name]
        for n in lengths:
            r = cell.get((name, n))
            ratio = f" ({r['vs_dense']:.2f}x, {r['vs_dense_min']:.2f}-{r['vs_dense_max']:.2f})" if r and "vs_dense" in r else ""
            line.append("" if r is None else f"{r['perplexity']:.2f}{ratio} [{r['attended_keys']:.0f}]")
        rows.append(line)
    return reporting.format_table(["variant", *(f"{n}: ppl (x dense, windows) [keys]" for n in lengths)], rows, width=8)


def plot(result: dict, path: Path, ratio: bool = False) -> Path | None:
    """One panel per length against attended keys per query: the pooled perplexity (bars: min..max over windows),
    or with ``ratio`` its ratio to dense paired by window (bars: min..max of the per-window ratios)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    panels = []
    y, lo, hi = ("vs_dense", "vs_dense_min", "vs_dense_max") if ratio else ("perplexity", "min", "max")
    for n in result["lengths"]:
        rows = [r for r in result["rows"] if r["length"] == n and y in r]
        series = []
        for group in dict.fromkeys(r["group"] for r in rows):
            g = [r for r in rows if r["group"] == group]
            series.append({"label": group, "x": [r["attended_keys"] for r in g], "y": [r[y] for r in g],
                           "points": True, "marker": "o", "yerr": [[r[y] - r[lo] for r in g], [r[hi] - r[y] for r in g]],
                           "annotate": [r["variant"].replace("dilated ", "").replace("bs ", "") for r in g]})
        panels.append({"title": f"{n} tokens (trained {result['trained_context']})", "xlabel": "attended keys per query",
                       "ylabel": "perplexity / dense (paired by window)" if ratio else "perplexity",
                       "series": series, "logx": True, "logy": not ratio})
    env = result["environment"]
    return reporting.plot(path, panels, title=f"{result['model']} on {result['text']}: zero-shot fidelity "
                                               f"({env.get('device')}, {env.get('dtype')}, {result['windows']} windows)")


def save(result: dict, out: Path, name: str, final: bool = False) -> None:
    reporting.write_json(out / f"{name}.json", result)
    if final or len(result["rows"]) % 5 == 0:
        plot(result, out / f"{name}.png")
        plot(result, out / f"{name}_ratio.png", ratio=True)


# ---------------------------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="a GGUF file (e.g. SmolLM2's), dequantized on load")
    src.add_argument("--checkpoint", help="a Transformers checkpoint directory")
    src.add_argument("--model", default="smollm2", help="a bundled asset name (hf_dilated.assets.MODELS)")
    p.add_argument("--text", required=False, help="a plain-text file (default: the bundled Shakespeare)")
    p.add_argument("--out", required=False, help="output directory (NAME.json, NAME.png)")
    p.add_argument("--name", default="fidelity", help="file name stem of the outputs")
    p.add_argument("--lengths", type=int, nargs="+", help="tokens per window (default: 2K, T, 2T, 4T, 8T)")
    p.add_argument("--windows", type=int, default=4, help="windows per length")
    p.add_argument("--score-from", type=float, default=0.5, help="score tokens from this fraction of each window on")
    p.add_argument("--first-segments", type=int, nargs="+", default=[2048, 4096, 8192], help="first segment lengths w0")
    p.add_argument("--global-tokens", type=int, nargs="+", default=[0, 1, 4, 16, 64], help="global tokens to try")
    p.add_argument("--variants", nargs="+", help="run only these variants (names from --list)")
    p.add_argument("--list", action="store_true", help="print the variant names and exit")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--dense-impl", default="sdpa", choices=("sdpa", "kernels"),
                   help="exact attention of the dense variant: sdpa, or this package's kernels (no N x N sliding mask)")
    p.add_argument("--logits-chunk", type=int, default=4096, help="tokens per LM-head chunk")
    p.add_argument("--budget-s", type=float, default=330.0, help="skip what starts after this many seconds")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = p.parse_args(argv)
    if not 0.0 <= args.score_from < 1.0:
        p.error(f"--score-from must be in [0, 1), got {args.score_from}")
    if args.windows < 1:
        p.error(f"--windows must be >= 1, got {args.windows}")
    if any(w <= 0 or w & (w - 1) for w in args.first_segments):
        p.error(f"--first-segments must be powers of two, got {args.first_segments}")
    if any(g < 0 for g in args.global_tokens) or not args.global_tokens:
        p.error(f"--global-tokens must be non-negative integers, got {args.global_tokens}")
    if not args.list and not args.out:
        p.error("--out is required")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for v in grid(args.first_segments, args.global_tokens):
            print(v.name)
        return 0
    result = run(args)
    print(table(result), flush=True)
    if result["skipped"]:
        print(f"skipped: {json.dumps(result['skipped'])}")
    print(f"results: {Path(args.out) / (args.name + '.json')} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
