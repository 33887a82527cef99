"""Attended keys per query: the measure that puts dilated and block-sparse attention on one scale.

"Attended keys per query" is the number of distinct keys a query attends to, averaged over the ``seq_len`` queries of
one sequence and over heads. For dilated attention (SPEC.md) a query at position ``p`` in a head with offset ``h``
attends, in each branch ``(w, r)`` that selects it (``p % r == h % r``), to the keys of its segment with
``p' % r == p % r`` (causal: ``p' <= p``); a key reached by several branches counts once (the union; the kernels score
it once per branch); global tokens add the keys ``p' < g``. For a block layout: every key of an active tile (causal:
on the diagonal tile only keys up to the query).

All counts are exact, computed from positions and block indices, never from scores: inclusion-exclusion over the
branches, each set of branches in closed form when its segment lengths are multiples of the shortest (LongNet's and
the default branches) and position by position otherwise (``O(2^branches * seq_len)``); ``O((seq_len / b) * active
blocks)`` for a layout.
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
    g = min(global_tokens, n)
    spans = branches + ([(None, 1)] if g else [])  # (segment length, rate); None: the global branch [0, g)
    total = 0.0
    for mask in range(1, 1 << len(spans)):
        members = [spans[i] for i in range(len(spans)) if mask >> i & 1]
        period = math.lcm(*(r for _, r in members))
        sign = 1.0 if len(members) % 2 else -1.0
        total += sign * _intersection_sum(members, period, n, g, causal) / period
    return total / n


def _floor_sum(t: int, period: int) -> int:
    """``sum(u // period for u in range(t))``."""
    q, rem = divmod(t, period)
    return period * q * (q - 1) // 2 + q * rem


def _intersection_sum(members: list, period: int, n: int, g: int, causal: bool) -> int:
    """``sum_p |keys ≡ p (mod period) in the intersection of the members' intervals|`` over positions ``p < n``."""
    ws = [w for w, _ in members if w is not None]
    if len(ws) < len(members):
        # The global branch is a member: every key is some p' < g; count, for each, the queries p that reach it
        # (p ≡ p' mod period, in p''s segment of every member branch, causal: p >= p').
        key = torch.arange(g, dtype=torch.int64)
        start, end = torch.zeros_like(key), torch.full_like(key, n)
        for w in ws:
            seg = torch.div(key, w, rounding_mode="floor") * w
            start, end = torch.maximum(start, seg), torch.minimum(end, seg + w)
        first = key if causal else start
        return int((torch.div(end - 1 - key, period, rounding_mode="floor")
                    + torch.div(key - first, period, rounding_mode="floor") + 1).clamp_min(0).sum())
    if all(w % min(ws) == 0 for w in ws):
        # Every segment of the set is a multiple of the shortest, m: the intersection is p's segment of length m,
        # and the count depends only on p's offset u in it (causal: keys u' <= u; else the whole segment, cut at n).
        m = min(ws)
        full, tail = divmod(n, m)
        per = (lambda t: _floor_sum(t, period) + t) if causal else (lambda t: 2 * _floor_sum(t, period) + t)
        return full * per(m) + per(tail)
    p = torch.arange(n, dtype=torch.int64)  # in general, position by position
    lo = torch.zeros_like(p)
    hi = p.clone() if causal else torch.full_like(p, n - 1)
    for w in ws:
        start = torch.div(p, w, rounding_mode="floor") * w
        lo, hi = torch.maximum(lo, start), torch.minimum(hi, start + w - 1)
    # residue class of p in [lo, hi]: floor((hi - p) / L) - ceil((lo - p) / L) + 1, at least 0
    count = torch.div(hi - p, period, rounding_mode="floor") + torch.div(p - lo, period, rounding_mode="floor") + 1
    return int(count.clamp_min(0).sum())


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
