"""Named block patterns, built directly in compact form: per query block a few candidate key blocks, computed with
integer arithmetic on ``[n_blocks, c]`` tensors and one sort (:func:`compact`). Nothing ``N x N`` or
``(N / b)^2``, no compilation: a 256K-token layout builds in milliseconds.

Every pattern takes ``causal``: when True it keeps only key blocks ``j <= i`` (blocks past the query block hold only
later positions, which causal attention masks anyway).
"""

from __future__ import annotations

import torch

from .layout import BlockLayout, _check_positive_int, check_block_size, compact


def _rows(n: int, device) -> torch.Tensor:
    return torch.arange(n, device=device, dtype=torch.int64)[:, None]


def _finish(cand: torch.Tensor, i: torch.Tensor, causal: bool, block_size: int, n: int) -> BlockLayout:
    """Drop future blocks when causal; ``cand`` is ``[Hl, n, c]`` or ``[n, c]``."""
    if causal:
        cand = torch.where(cand <= i, cand, -1)
    while cand.ndim < 4:
        cand = cand[None]
    return compact(cand, block_size, n)


def _check_n(n_blocks) -> int:
    return _check_positive_int("n_blocks", n_blocks)


def dense_blocks(n_blocks: int, block_size: int, *, causal: bool = True, device=None) -> BlockLayout:
    """Every tile (causal: every tile on or below the diagonal): exactly dense attention."""
    n, b = _check_n(n_blocks), check_block_size(block_size)
    i = _rows(n, device)
    return _finish(torch.arange(n, device=device).expand(n, n), i, causal, b, n)


def local_blocks(n_blocks: int, block_size: int, window: int, *, causal: bool = True, device=None) -> BlockLayout:
    """Sliding window in blocks: key blocks ``i - window < j <= i`` (causal) or ``|i - j| < window``."""
    n, b = _check_n(n_blocks), check_block_size(block_size)
    w = _check_positive_int("window", window)
    i = _rows(n, device)
    offsets = torch.arange(-(w - 1), 1 if causal else w, device=device)
    return _finish(i + offsets, i, causal, b, n)


def global_blocks(n_blocks: int, block_size: int, n_global: int, *, causal: bool = True, device=None) -> BlockLayout:
    """The first ``n_global`` key blocks for every query block (the attention sink of pretrained models)."""
    n, b = _check_n(n_blocks), check_block_size(block_size)
    g = _check_positive_int("global_blocks", n_global)
    i = _rows(n, device)
    return _finish(torch.arange(min(g, n), device=device).expand(n, -1), i, causal, b, n)


def dilated_blocks(n_blocks: int, block_size: int, segment_blocks, dilation_rates, *, causal: bool = True,
                   num_heads: int | None = None, head_offset: int = 0, device=None) -> BlockLayout:
    """LongNet at block granularity: for each branch ``(w, r)`` (in blocks), query block ``i`` reads the key blocks
    ``j`` of its segment (``j // w == i // w``) with ``j % r == (h + head_offset) % r``. With ``num_heads`` the layout
    is per head (heads cover different offsets, as in LongNet); without, offset ``head_offset`` for all heads."""
    n, b = _check_n(n_blocks), check_block_size(block_size)
    from ...config import validate_branches

    branches = validate_branches(list(segment_blocks), list(dilation_rates))
    H = 1 if num_heads is None else _check_positive_int("num_heads", num_heads)
    heads = torch.arange(H, device=device)[:, None, None] + head_offset  # [H, 1, 1]
    i = _rows(n, device)
    parts = []
    for w, r in branches:
        seg0 = (i // w) * w  # [n, 1]
        first = seg0 + (heads - seg0) % r  # [H, n, 1]: first selected block of the segment
        j = first + r * torch.arange((w + r - 1) // r, device=device)  # [H, n, w / r]
        parts.append(torch.where(j < seg0 + w, j, -1))
    return _finish(torch.cat(parts, -1), i, causal, b, n)


def hierarchical_blocks(n_blocks: int, block_size: int, windows, strides, *, causal: bool = True,
                        device=None) -> BlockLayout:
    """Multi-scale: level ``(window, stride)`` keeps key blocks at distance ``d = i - j`` (``|i - j|`` when not
    causal) with ``d < window`` and ``d % stride == 0``: fine near the query, coarser farther away."""
    n, b = _check_n(n_blocks), check_block_size(block_size)
    from ...config import _check_int_list

    ws, ss = _check_int_list("windows", windows), _check_int_list("strides", strides)
    if len(ws) != len(ss):
        raise ValueError(f"windows and strides must have the same length, got {len(ws)} and {len(ss)}")
    i = _rows(n, device)
    parts = []
    for w, s in zip(ws, ss):
        d = torch.arange(0, w, s, device=device)
        parts.append(i - d)
        if not causal:
            parts.append(i + d)
    return _finish(torch.cat(parts, -1).expand(n, -1), i, causal, b, n)


def random_blocks(n_blocks: int, block_size: int, per_row: int, *, seed: int = 0, causal: bool = True,
                  num_heads: int | None = None, device=None) -> BlockLayout:
    """``per_row`` key blocks per query block drawn uniformly (causal: among ``0..i``), reproducible from ``seed``
    (drawn on the CPU, so the same on every device). Repeated draws collapse, so a row may hold fewer."""
    n, b = _check_n(n_blocks), check_block_size(block_size)
    k = _check_positive_int("random_blocks", per_row)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    H = 1 if num_heads is None else _check_positive_int("num_heads", num_heads)
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(H, n, k, generator=gen, dtype=torch.float64)
    span = (torch.arange(n, dtype=torch.float64)[:, None] + 1) if causal else torch.full((n, 1), float(n))
    j = (u * span).long().clamp_max(n - 1).to(device)
    return _finish(j, _rows(n, device), causal, b, n)
