"""The one assembly of the op: :func:`attend` checks its inputs, picks a backend and runs it on a resolved layout.

Every caller goes through :func:`attend`: the public functional op :func:`dilated_attention` (which resolves the
layout from masks and positions first), the Transformers attention function, and layers left dense (one branch
``(DENSE_SEGMENT, 1)``, optionally with a sliding ``window``). Ring and block-sparse attention plug in beside it.
"""

from __future__ import annotations

import math

import torch

from ..config import BACKENDS, DENSE_SEGMENT, validate_branches
from .layout import TokenLayout, resolve_layout
from .reference import dilated_attention_reference

__all__ = ["attend", "dilated_attention", "check_tensors", "check_scale", "choose_backend", "DENSE", "DENSE_SEGMENT"]

# The branch list of a layer left dense: one segment longer than any position, no dilation (SPEC.md).
DENSE = ((DENSE_SEGMENT, 1),)


def triton_available(device: torch.device) -> bool:
    """Whether the Triton backend can run on ``device`` (CUDA, or anything under ``TRITON_INTERPRET=1``)."""
    from . import triton as triton_backend

    return triton_backend.is_available(device)


def transposed_layout_hint(q_shape, k_shape) -> str:
    """A hint when q, k look like ``[B, N, H, D]`` instead of ``[B, H, N, D]``: the same dim 1 and, read transposed,
    a valid GQA ratio."""
    _, n_q, h_q, _ = q_shape
    _, n_k, h_k, _ = k_shape
    if n_q == n_k and h_k > 0 and h_q % h_k == 0 and n_q > h_q:
        return (f"; the shapes look like [B, N, H, D] (N={n_q}, H={h_q}/{h_k}), but query/key/value must be "
                "[B, H, N, D] like F.scaled_dot_product_attention: pass q.transpose(1, 2), k.transpose(1, 2), "
                "v.transpose(1, 2)")
    return ""


def check_tensors(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Raise a ``ValueError`` naming the fault when q, k, v are not ``[B, H, N, D]`` tensors the op accepts."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, H, N, D], got {getattr(t, 'shape', type(t))}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.shape[1] == 0 or t.shape[3] == 0:
            raise ValueError(f"{name} must have at least one head and a positive head dim, got {tuple(t.shape)}")
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
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({key.shape[1]})"
                         f"{transposed_layout_hint(query.shape, key.shape)}")
    if Nq > key.shape[2]:
        raise ValueError(f"query length ({Nq}) must not exceed key length ({key.shape[2]})"
                         f"{transposed_layout_hint(query.shape, key.shape)}")


def check_scale(scale, head_dim: int) -> float:
    """The score scale: ``head_dim ** -0.5`` when ``None``, else a finite positive number (``ValueError`` otherwise)."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a finite positive number (or None for head_dim ** -0.5), got {scale!r}")
    scale = float(scale)
    # A scale so large that scale * |q.k| overflows float32 for unit-size q, k would give inf / NaN scores; one so small
    # that it rounds to 0 in float32 would turn the kernels' masked scores (-inf * scale) into NaN.
    if not (math.isfinite(scale) and 1e-30 <= scale < 1e30):
        raise ValueError(
            f"scale must be a finite positive number in [1e-30, 1e30) (or None for head_dim ** -0.5), got {scale!r}"
        )
    return scale


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


def _check_options(window, global_tokens: int, dropout_p: float, seed) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"window must be None or a positive int (keys with 0 <= p - p' < window), got {window!r}")
    if isinstance(global_tokens, bool) or not isinstance(global_tokens, int) or global_tokens < 0:
        raise ValueError(f"global_tokens must be a non-negative int, got {global_tokens!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if dropout_p > 0 and not (isinstance(seed, torch.Tensor) and seed.numel() == 1 and seed.dtype == torch.int64):
        raise ValueError(f"dropout_p > 0 needs seed, an int64 scalar tensor (see draw_seed), got {seed!r}")


def draw_seed(device: torch.device) -> torch.Tensor:
    """A dropout seed: an int64 scalar tensor drawn from torch's generator on ``device`` (no host sync, traceable)."""
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: TokenLayout,
    branches: tuple[tuple[int, int], ...],
    *,
    is_causal: bool,
    scale: float | None,
    head_offset: int = 0,
    window: int | None = None,
    global_tokens: int = 0,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention (SPEC.md) on a resolved :class:`TokenLayout`: ``(out [B, Hq, Nq, D], lse [B, Hq, Nq])``.

    The single place that checks inputs, fills the default scale (``D ** -0.5``), chooses the backend
    (``"auto"``: Triton on CUDA, else the PyTorch reference) and runs it. ``branches`` are validated ``(w, r)``
    pairs (``DENSE`` for a dense layer); ``window``: sliding window over positions; ``global_tokens``: SPEC's global
    branch; ``dropout_p`` with ``seed`` (int64 scalar tensor): SPEC's dropout.
    """
    check_tensors(query, key, value)
    return _attend_checked(query, key, value, layout, branches, is_causal, scale, head_offset, window, global_tokens,
                           dropout_p, seed, backend)


def _attend_checked(query, key, value, layout, branches, is_causal, scale, head_offset, window, global_tokens,
                    dropout_p, seed, backend):
    """:func:`attend` on tensors :func:`check_tensors` has passed."""
    scale = check_scale(scale, query.shape[-1])
    if isinstance(head_offset, bool) or not isinstance(head_offset, int) or head_offset < 0:
        raise ValueError(f"head_offset must be a non-negative int, got {head_offset!r}")
    _check_options(window, global_tokens, dropout_p, seed)
    B, _, Nq, _ = query.shape
    if layout.q_pos.shape != (B, Nq) or layout.n_keys != key.shape[2]:
        raise ValueError(
            f"layout covers [B, Nq] = {tuple(layout.q_pos.shape)} queries and {layout.n_keys} keys; "
            f"the tensors have {(B, Nq)} and {(B, key.shape[2])}"
        )
    chosen = choose_backend(backend, query)
    options = dict(window=window, global_tokens=global_tokens, dropout_p=float(dropout_p), seed=seed)
    if chosen == "triton":
        from .triton import dilated_attention_triton

        # backend="triton" asked for the kernels: a call they cannot run raises; "auto" warns once and falls back.
        return dilated_attention_triton(query, key, value, tuple(branches), layout, bool(is_causal), scale,
                                        head_offset, strict=backend == "triton", **options)
    return dilated_attention_reference(query, key, value, tuple(branches), layout, bool(is_causal), scale,
                                       head_offset, **options)


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
    window: int | None = None,
    global_tokens: int = 0,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
    backend: str = "auto",
    return_lse: bool = False,
):
    """LongNet dilated attention, exactly as SPEC.md defines it, in the layout of ``F.scaled_dot_product_attention``.

    Args:
        query: ``[B, Hq, Nq, D]``; key, value: ``[B, Hk, Nk, D]`` with ``Hq % Hk == 0`` (GQA by head ratio).
            ``Nq < Nk`` decodes against a cache: the queries are the last ``Nq`` positions unless ``position_ids`` say otherwise.
        segment_lengths, dilation_rates: the branches ``(w_i, r_i)``.
        is_causal: causal by position (``p' <= p``).
        scale: score scale, a finite positive number; default ``D ** -0.5``.
        position_ids: ``[B, N]`` positions; without a mask, restarting at 0 marks a new packed sequence.
        attention_mask: ``[B, Nk]`` key mask, bool or 0/1 integers, True / 1 for real keys. Each row is one sequence;
            a 0 hides that key only. Float masks are refused (see :func:`~hf_dilated.ops.layout.resolve_layout`).
        cu_seqlens_q, cu_seqlens_k: flash-style offsets of packed sequences (``B == 1``).
        head_offset: global index of this shard's first query head (tensor / head parallelism).
        window: sliding window over positions (causal ``0 <= p - p' < window``, else ``|p - p'| < window``).
        global_tokens: every query also attends to its sequence's first ``global_tokens`` positions (SPEC.md).
        dropout_p: attention-probability dropout (training); ``seed`` (int64 scalar tensor) is drawn when omitted.
        backend: ``"auto"``, ``"torch"`` (reference) or ``"triton"``.
        return_lse: also return the merged log-sum-exp ``[B, Hq, Nq]`` (float32).

    Returns:
        ``[B, Hq, Nq, D]`` in the dtype of ``query`` (and the lse when ``return_lse``).
    """
    check_tensors(query, key, value)
    branches = validate_branches(segment_lengths, dilation_rates)
    B, _, Nq, _ = query.shape
    layout = resolve_layout(B, Nq, key.shape[2], query.device, attention_mask, position_ids, cu_seqlens_q, cu_seqlens_k)
    if seed is None and isinstance(dropout_p, (int, float)) and dropout_p > 0:
        seed = draw_seed(query.device)
    out, lse = _attend_checked(query, key, value, layout, branches, is_causal, scale, head_offset, window,
                               global_tokens, dropout_p, seed, backend)
    return (out, lse) if return_lse else out
