"""Attended keys per query: the measure that puts dilated and block-sparse attention on one scale.

"Attended keys per query" is the number of distinct keys a query attends to, averaged over the ``seq_len`` queries of
one sequence and over heads. For dilated attention (SPEC.md) a query at position ``p`` in a head with offset ``h``
attends, in each branch ``(w, r)`` that selects it (``p % r == h % r``), to the keys of its segment with
``p' % r == p % r`` (causal: ``p' <= p``); a key reached by several branches counts once (the union; the kernels score
it once per branch); global tokens add the keys ``p' < g``. For a block layout: every key of an active tile (causal:
on the diagonal tile only keys up to the query).

All counts are exact, computed from positions and block indices (inclusion-exclusion over the branches:
``O(2^branches * seq_len)`` integer operations; ``O((seq_len / b) * active blocks)`` for a layout), never from scores.
"""

from __future__ import annotations

import math

import torch

from ...config import validate_branches
from .layout import BlockLayout


def _check_len(seq_len) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    return seq_len


def dilated_keys_per_query(segment_lengths, dilation_rates, seq_len: int, *, causal: bool = True,
                           global_tokens: int = 0) -> float:
    """Mean distinct keys attended per query by dilated attention with these branches on one sequence of ``seq_len``
    tokens, averaged over queries and over head offsets (exact when the heads cover every offset class modulo the
    least common multiple of the rates equally, as LongNet's head counts do).

    Each branch ``i`` gives query ``p`` the keys ``p' ≡ p (mod r_i)`` in an interval (its segment cut by the sequence,
    or ``[0, g)`` for global tokens); a branch applies in ``1 / r_i`` of the head offsets. By inclusion-exclusion the
    union over the applying branches averages to ``sum_T (-1)^(|T|+1) / lcm(r_T) * mean_p |∩_{i in T} keys_i(p)|``
    over the non-empty sets ``T`` of branches, where the intersection is the residue class ``p mod lcm(r_T)`` in the
    intersected interval.
    """
    n = _check_len(seq_len)
    if isinstance(global_tokens, bool) or not isinstance(global_tokens, int) or global_tokens < 0:
        raise ValueError(f"global_tokens must be a non-negative integer, got {global_tokens!r}")
    branches = list(validate_branches(list(segment_lengths), list(dilation_rates)))
    if len(branches) > 16:
        raise ValueError(f"segment_lengths: at most 16 branches can be counted, got {len(branches)}")
    p = torch.arange(n, dtype=torch.int64)
    spans = []  # per branch: (lo, hi, r), keys p' with lo <= p' <= hi and p' ≡ p (mod r)
    for w, r in branches:
        lo = torch.div(p, w, rounding_mode="floor") * w
        spans.append((lo, torch.clamp(lo + w, max=n) - 1, r))
    if global_tokens:
        spans.append((torch.zeros_like(p), torch.full_like(p, min(global_tokens, n) - 1), 1))
    total = 0.0

    def visit(start: int, lo: torch.Tensor, hi: torch.Tensor, period: int, size: int) -> None:
        # every set T of branches, by its smallest-index-first extension (each intersection computed once)
        nonlocal total
        for i in range(start, len(spans)):
            lo_i, hi_i, r_i = spans[i]
            lo_t = lo_i if lo is None else torch.maximum(lo, lo_i)
            hi_t = hi_i if hi is None else torch.minimum(hi, hi_i)
            period_t = math.lcm(period, r_i)
            # residue class of p in [lo, hi]: floor((hi - p) / L) - ceil((lo - p) / L) + 1, at least 0
            count = (torch.div(hi_t - p, period_t, rounding_mode="floor")
                     + torch.div(p - lo_t, period_t, rounding_mode="floor") + 1).clamp_min_(0)
            total += (1.0 if size % 2 == 0 else -1.0) * float(count.sum()) / period_t
            if count.any():  # an empty intersection stays empty in every larger set
                visit(i + 1, lo_t, hi_t, period_t, size + 1)

    visit(0, None, torch.minimum(torch.full_like(p, n - 1), p) if causal else None, 1, 0)
    return total / n


def layout_keys_per_query(layout: BlockLayout, seq_len: int, *, causal: bool = True) -> float:
    """Mean keys scored per query (over queries, layout batch entries and layout heads) by a block layout on one
    sequence of ``seq_len`` tokens (``layout.n_blocks == ceil(seq_len / block_size)``)."""
    n, b = layout.n_blocks, layout.block_size
    layout.check_for(layout.layout_batch, layout.layout_heads, _check_len(seq_len))
    size = torch.clamp(seq_len - b * torch.arange(n, dtype=torch.float64), max=b)  # tokens per block
    idx = layout.kv_index.long().cpu()
    active = idx >= 0
    j = idx.clamp_min(0)
    i = torch.arange(n)[:, None]
    keys = torch.where(active & (j < i if causal else torch.ones_like(active)), size[j], 0.0).sum(-1)  # [L, H, n]
    per_block = keys * size  # every query of block i scores these
    if causal:  # the diagonal tile: the query at offset t of block i scores t + 1 keys
        diag = (active & (j == i)).any(-1)
        per_block = per_block + diag * size * (size + 1) / 2
    return float(per_block.sum()) / (seq_len * idx.shape[0] * idx.shape[1])


def adaptive_blocks_per_query_block(n_blocks: int, top_k: int, local_blocks: int, global_blocks: int, *,
                                    causal: bool = True) -> torch.Tensor:
    """``[n_blocks]``: active key blocks of each query block under :func:`adaptive_blocks` on a sequence without
    padding: the local and global blocks (distinct, causal ones only) plus ``top_k`` others where that many remain."""
    i = torch.arange(n_blocks)
    last = i if causal else torch.full_like(i, n_blocks - 1)  # the last allowed key block
    allowed = last + 1
    near_lo = torch.clamp(i - local_blocks + 1, min=0)
    near_hi = i if causal else torch.clamp(i + local_blocks - 1, max=n_blocks - 1)
    near = (near_hi - near_lo + 1) if local_blocks else torch.zeros_like(i)
    sink = torch.clamp(torch.minimum(torch.full_like(i, global_blocks), last + 1), min=0)
    overlap = torch.clamp(torch.minimum(sink - 1, near_hi) - near_lo + 1, min=0) if local_blocks else 0
    forced = near + sink - overlap
    return forced + torch.clamp(allowed - forced, max=top_k)


def adaptive_keys_per_query(seq_len: int, block_size: int, top_k: int, local_blocks: int, global_blocks: int, *,
                            causal: bool = True) -> float:
    """Mean keys scored per query by the adaptive pattern (content-independent: only which blocks is chosen by
    content, not how many). Exact for causal attention with ``local_blocks >= 1`` (the diagonal tile is always
    active and every chosen block is a full earlier one); otherwise each chosen block counts as ``block_size`` keys,
    an upper bound when the last, partial block is chosen."""
    n = -(-_check_len(seq_len) // block_size)
    count = adaptive_blocks_per_query_block(n, top_k, local_blocks, global_blocks, causal=causal).double()
    size = torch.clamp(seq_len - block_size * torch.arange(n, dtype=torch.float64), max=block_size)
    if causal and local_blocks >= 1:
        # every block before the diagonal is full (only the last block of the sequence can be partial)
        keys = (count - 1) * block_size * size + size * (size + 1) / 2
    else:
        keys = count * block_size * size
    return float(keys.sum()) / seq_len
