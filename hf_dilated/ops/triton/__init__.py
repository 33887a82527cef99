"""Triton backend of dilated attention: forward, backward and decode kernels (``forward.py``, ``backward.py``,
``decode.py``), their work lists (``schedule.py``), launch configurations (``configs.py``), launchers (``launch.py``)
and the ``torch.library`` custom op with its autograd (``op.py``). This file is the entry point the dispatcher calls."""

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


def dilated_attention_triton(query, key, value, branches, layout, is_causal, scale, head_offset):
    """Dilated attention per SPEC.md on the Triton kernels: ``(out [B, Hq, Nq, D], lse [B, Hq, Nq] float32)``,
    differentiable w.r.t. query, key and value. Layouts the kernels cannot address in place run the reference."""
    from .op import dilated_attention_op

    return dilated_attention_op(query, key, value, branches, layout, is_causal, scale, head_offset)


__all__ = ["is_available", "dilated_attention_triton"]
