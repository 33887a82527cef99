"""Triton backend of dilated attention (kernels in their own modules; this file is the entry point)."""

from __future__ import annotations

import torch


def is_available(device: torch.device) -> bool:
    """The Triton kernels are not built yet (issue: Triton kernels); the dispatcher falls back to the reference."""
    return False


def dilated_attention_triton(query, key, value, branches, layout, is_causal, scale, head_offset):
    raise NotImplementedError("the Triton backend is not available yet; use backend='torch'")
