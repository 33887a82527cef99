"""dilated_attention(): the public functional op. Checks its inputs, resolves the token layout, picks a backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import BACKENDS, validate_branches
from .layout import TokenLayout, resolve_layout
from .reference import dilated_attention_reference


def triton_available(device: torch.device) -> bool:
    """Whether the Triton backend can run on ``device`` (CUDA, or anything under ``TRITON_INTERPRET=1``)."""
    from . import triton as triton_backend

    return triton_backend.is_available(device)


def check_tensors(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Raise a ``ValueError`` naming the fault when q, k, v are not ``[B, H, N, D]`` tensors the op accepts."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, H, N, D], got {getattr(t, 'shape', type(t))}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}")
    B, Hq, Nq, D = query.shape
    if key.shape[0] != B or value.shape[0] != B:
        raise ValueError(f"batch sizes differ: query {B}, key {key.shape[0]}, value {value.shape[0]}")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same heads and length")
    if key.shape[3] != D:
        raise ValueError(f"query and key head dims differ: {D} and {key.shape[3]}")
    if Hq % key.shape[1]:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({key.shape[1]})")
    if Nq > key.shape[2]:
        raise ValueError(f"query length ({Nq}) must not exceed key length ({key.shape[2]})")


def choose_backend(backend: str, query: torch.Tensor) -> str:
    """Resolve ``"auto"``: Triton on CUDA when Triton is installed, else the PyTorch reference."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if query.is_cuda and triton_available(query.device) else "torch"
    if backend == "triton" and not triton_available(query.device):
        raise ValueError(
            "backend='triton' needs the `triton` package and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
            "use backend='torch' or 'auto'"
        )
    return backend


def run_backend(
    backend: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    branches: tuple[tuple[int, int], ...],
    layout: TokenLayout,
    is_causal: bool,
    scale: float,
    head_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":
        from .triton import dilated_attention_triton

        return dilated_attention_triton(query, key, value, branches, layout, is_causal, scale, head_offset)
    return dilated_attention_reference(query, key, value, branches, layout, is_causal, scale, head_offset)


def dilated_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_lengths,
    dilation_rates,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    head_offset: int = 0,
    backend: str = "auto",
    return_lse: bool = False,
):
    """LongNet dilated attention, exactly as SPEC.md defines it, in the layout of ``F.scaled_dot_product_attention``.

    Args:
        query: ``[B, Hq, Nq, D]``; key, value: ``[B, Hk, Nk, D]`` with ``Hq % Hk == 0`` (GQA by head ratio).
            ``Nq < Nk`` decodes against a cache: the queries are the last ``Nq`` positions unless ``position_ids`` say otherwise.
        segment_lengths, dilation_rates: the branches ``(w_i, r_i)``.
        is_causal: causal by position (``p' <= p``).
        scale: score scale, default ``D ** -0.5``.
        position_ids: ``[B, N]`` positions (restarting at 0 marks a new packed sequence); see :func:`resolve_layout`.
        attention_mask: ``[B, Nk]`` key mask, True / 1 for real tokens.
        cu_seqlens_q, cu_seqlens_k: flash-style offsets of packed sequences (``B == 1``).
        head_offset: global index of this shard's first query head (tensor / head parallelism).
        backend: ``"auto"``, ``"torch"`` (reference) or ``"triton"``.
        return_lse: also return the merged log-sum-exp ``[B, Hq, Nq]`` (float32).

    Returns:
        ``[B, Hq, Nq, D]`` in the dtype of ``query`` (and the lse when ``return_lse``).
    """
    check_tensors(query, key, value)
    branches = validate_branches(segment_lengths, dilation_rates)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    if isinstance(head_offset, bool) or not isinstance(head_offset, int) or head_offset < 0:
        raise ValueError(f"head_offset must be a non-negative int, got {head_offset!r}")
    backend = choose_backend(backend, query)
    B, _, Nq, _ = query.shape
    layout = resolve_layout(
        B, Nq, key.shape[2], query.device, attention_mask, position_ids, cu_seqlens_q, cu_seqlens_k
    )
    out, lse = run_backend(backend, query, key, value, branches, layout, bool(is_causal), float(scale), head_offset)
    return (out, lse) if return_lse else out


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: TokenLayout,
    is_causal: bool,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Exact dense attention under the same position / sequence / padding rules (for layers left dense).

    ``window`` (Transformers' ``sliding_window`` attention kwarg) keeps keys with ``p - p' < window`` (causal) or
    ``|p - p'| < window`` (bidirectional). Uses SDPA's fused kernels; a boolean mask is built only when padding,
    packing or a window makes one necessary.
    """
    Nq, Nk = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if gqa:
        rep = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    if window is None and layout.contiguous and (not is_causal or Nq == Nk or Nq == 1):
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=is_causal and Nq > 1, scale=scale
        )
    allowed = layout.k_valid[:, None, :] & (layout.q_seq[:, :, None] == layout.k_seq[:, None, :])
    distance = layout.q_pos[:, :, None] - layout.k_pos[:, None, :]
    if is_causal:
        allowed = allowed & (distance >= 0)
    if window is not None:
        allowed = allowed & (distance.abs() < window)
    allowed = allowed & layout.q_valid[:, :, None]
    # Rows with no key (padding queries) attend to nothing: give them one key and zero their output after.
    empty = ~allowed.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=(allowed | empty)[:, None], scale=scale)
    return out.masked_fill(empty[:, None], 0.0)
