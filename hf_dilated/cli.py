"""The ``hf-dilated`` command: ``patch`` a checkpoint, ``eval`` its long-context perplexity, ``finetune`` it.

    hf-dilated patch SRC DST [--recipe auto] [--layers all|0,2,4] [--context-length N] [--rope recipe] ...
    hf-dilated recipes
    hf-dilated finetune ...   (runs scripts/finetune.py)
    hf-dilated eval ...       (runs scripts/eval_long_context.py)

Options are checked before anything is loaded or written; ``patch`` writes DST atomically (a temporary directory
renamed at the end), so a failure leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from .config import BACKENDS, DilatedAttentionConfig
from .patching import ROPE_CHOICES

SCRIPTS = {"finetune": "finetune", "eval": "eval_long_context"}  # subcommands that are programs in scripts/


class CLIError(ValueError):
    """A bad option: reported as ``hf-dilated: error: ...`` with exit status 2."""


def _layers(value: str) -> str | list[int]:
    if value == "all":
        return value
    try:
        layers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers must be 'all' or comma-separated layer indices, got {value!r}")
    if not layers or any(i < 0 for i in layers):
        raise argparse.ArgumentTypeError(f"--layers must be 'all' or comma-separated layer indices, got {value!r}")
    return layers


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def _add_attention_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default="auto", help="recipe name (see `hf-dilated recipes`), default: by model_type")
    p.add_argument("--segment-lengths", type=_positive, nargs="+", metavar="W", help="branch segment lengths w_i")
    p.add_argument("--dilation-rates", type=_positive, nargs="+", metavar="R", help="branch dilation rates r_i")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="dilated-attention backend (default: auto)")
    p.add_argument("--rope", choices=ROPE_CHOICES, default="recipe", help="RoPE scaling past the trained context")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-dilated", description="LongNet dilated attention for Transformers checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("patch", help="patch a checkpoint to dilated attention and save it with a model card")
    p.add_argument("src", metavar="SRC", help="checkpoint directory, .gguf file, or 'smollm2'")
    p.add_argument("dst", metavar="DST", help="output directory (must not exist, or be empty, unless --overwrite)")
    _add_attention_options(p)
    p.add_argument("--layers", type=_layers, default="all", help="'all' (the recipe's default) or e.g. 0,2,4")
    p.add_argument("--context-length", type=_positive, help="target context; past the trained one RoPE is scaled")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="dtype to load (auto keeps the stored dtype, so weights stay bitwise identical)")
    p.add_argument("--eval-results", type=Path, help="JSON from `hf-dilated eval` to put in the model card")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")

    sub.add_parser("eval", help="perplexity on long real text, dense vs patched (see `hf-dilated eval --help`)",
                   add_help=False)
    sub.add_parser("recipes", help="list the shipped patch recipes")
    sub.add_parser("finetune", help="fine-tune a patched model (see `hf-dilated finetune --help`)", add_help=False)
    return parser


def _attention_config(args: argparse.Namespace) -> DilatedAttentionConfig | None:
    ws, rs = args.segment_lengths, args.dilation_rates
    if (ws is None) != (rs is None):
        raise CLIError("--segment-lengths and --dilation-rates must be given together")
    if ws is None:
        return None
    return DilatedAttentionConfig(segment_lengths=ws, dilation_rates=rs, backend=args.backend)


def _check_recipe(name: str) -> None:
    from .patching import load_recipe

    if name != "auto":
        load_recipe(name)


def cmd_patch(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from .patching import load_checkpoint, patch, patch_summary, save_patched

    attention = _attention_config(args)
    _check_recipe(args.recipe)
    dst = Path(args.dst)
    if dst.exists() and not args.overwrite and (not dst.is_dir() or any(dst.iterdir())):
        raise CLIError(f"DST {dst} exists and is not empty; pass --overwrite to replace it")
    eval_results = None
    if args.eval_results is not None:
        try:
            eval_results = json.loads(args.eval_results.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise CLIError(f"--eval-results {args.eval_results}: {err}")
    src = args.src
    if src != "smollm2" and not Path(src).exists():
        raise CLIError(f"SRC {src} does not exist")

    steps = tqdm(total=4, desc="hf-dilated patch", unit="step")
    steps.set_postfix_str("load")
    model, tokenizer = load_checkpoint(src, dtype=args.dtype)
    steps.update()
    steps.set_postfix_str("patch")
    patch(model, attention, layers=args.layers, recipe=args.recipe, context_length=args.context_length,
          rope=args.rope, backend=args.backend)
    steps.update()
    steps.set_postfix_str("save")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        save_patched(model, str(tmp), tokenizer=tokenizer, eval_results=eval_results)
        steps.update()
        steps.set_postfix_str("verify")
        n_tensors = verify_weights(model, tmp)
        steps.update()
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        steps.close()
    summary = patch_summary(model)
    from .patching import PatchSummary

    lines = PatchSummary(
        rope_parameters_before=summary["base"]["rope_parameters"],
        attn_implementation_before=summary["base"]["attn_implementation"],
        **{k: v for k, v in summary.items()},
    ).lines()
    print(f"patched {args.src} -> {dst}")
    for line in lines:
        print(f"  {line}")
    print(f"  weights: {n_tensors} tensors saved as safetensors, bitwise identical to the loaded model")
    print(f"  model card: {dst / 'README.md'}")
    return 0


def verify_weights(model, path: Path) -> int:
    """Check that every tensor in the safetensors files under ``path`` equals the model's; return how many."""
    import torch
    from safetensors import safe_open

    state = model.state_dict()
    count = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                saved = f.get_tensor(key)
                if key not in state or not torch.equal(saved, state[key].detach().cpu()):
                    raise RuntimeError(f"saved tensor {key} differs from the model's weights")
                count += 1
    if count == 0:
        raise RuntimeError(f"no safetensors weights were written to {path}")
    return count


def run_script(name: str, argv: Sequence[str]) -> int:
    """Run the program ``scripts/<name>.py`` (installed as ``hf_dilated.scripts.<name>``) with ``argv``."""
    import importlib

    try:
        module = importlib.import_module(f"hf_dilated.scripts.{name}")
    except ModuleNotFoundError as err:  # a checkout on sys.path, not installed: the scripts/ beside the package
        if err.name not in ("hf_dilated.scripts", f"hf_dilated.scripts.{name}"):
            raise
        scripts = str(Path(__file__).resolve().parents[1] / "scripts")
        if scripts not in sys.path:
            sys.path.insert(0, scripts)
        module = importlib.import_module(name)
    return module.main(list(argv))


def cmd_recipes(args: argparse.Namespace) -> int:
    from .patching import load_recipe, list_recipes

    for name in list_recipes():
        r = load_recipe(name)
        rope = r.rope_type or ("none (absolute positions)" if r.positions == "absolute" else "none")
        print(f"{name:<11} model_types={','.join(r.model_types):<40} convert={r.convert:<15} "
              f"sliding_window={r.sliding_window:<7} rope={rope}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SCRIPTS:
        return run_script(SCRIPTS[argv[0]], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"patch": cmd_patch, "recipes": cmd_recipes}
    try:
        return commands[args.command](args)
    except ValueError as err:  # bad options, unsupported models: argparse's style, exit status 2
        parser.exit(2, f"hf-dilated {args.command}: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
