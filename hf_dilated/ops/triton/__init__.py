"""Triton backend of dilated attention.

Kernels (``forward.py``, ``backward.py``, ``decode.py``) share their tile helpers (``tiles.py``); ``schedule.py`` turns
a layout into work lists, ``configs.py`` picks launch configurations (first those ``tuning.py`` measured on this GPU
and ``tuned.py`` keeps on disk: ``hf-dilated tune``), ``launch.py`` runs the kernels, and ``op.py``
wraps them as ``torch.library`` custom ops with autograd: :func:`dilated_attention_triton` is the entry point, and
:func:`fallback_reason` says beforehand whether a call runs the kernels. Importing this package does not import
Triton (only :func:`is_available` is defined here), so the package imports without it.
"""

from __future__ import annotations

import os

import torch


def is_available(device: torch.device) -> bool:
    """True when Triton imports and ``device`` is CUDA, or it is the CPU under ``TRITON_INTERPRET=1``."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def __getattr__(name: str):
    if name in ("dilated_attention_triton", "fallback_reason"):
        from . import op

        value = globals()[name] = getattr(op, name)  # found directly from now on (every attention call asks)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["is_available", "dilated_attention_triton", "fallback_reason"]
