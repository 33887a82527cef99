"""Content-chosen ("adaptive") block selection, as in MInference / MoBA / NSA's selection branch.

Per kv head (the query heads of a GQA group pool together, so the group shares its key blocks), each query block's
mean-pooled query is scored against every key block's mean-pooled key; the ``top_k`` best key blocks that are not
already in the local window or the global (sink) blocks are kept together with those, so every query block reads
``local + global + top_k`` distinct blocks (fewer only where causality leaves fewer): the budget is exact, which
:meth:`BlockSparseConfig.keys_per_query` and :meth:`BlockSparseConfig.matching_budget` rely on. Selection runs without gradient: the layout is a
constant of the attention call, and gradients flow through the attention over the selected blocks.

Cost: pooling O(B * H * N * D); scores O(B * Hk * (N / b)^2 * D) multiply-adds and a top-k over ``(N / b)^2`` entries
per kv head, computed ``CHUNK`` query blocks at a time so memory stays O(B * Hk * CHUNK * N / b); never ``N x N``.
Decoding scores only the query blocks that hold queries: O(B * Hk * N / b * D) per step.
At 128K tokens with ``b = 64`` that is 2048^2 * 128 = 0.5 GFLOP per kv head, against 2^34 * 128 for dense attention.
"""

from __future__ import annotations

import math

import torch

from ..layout import TokenLayout
from .layout import BlockLayout, _check_positive_int, check_block_size, compact

CHUNK = 512


@torch.no_grad()
def adaptive_blocks(query: torch.Tensor, key: torch.Tensor, block_size: int, top_k: int, *, local_blocks: int = 1,
                    global_blocks: int = 1, causal: bool = True, tokens: TokenLayout | None = None) -> BlockLayout:
    """A per-batch, per-kv-head :class:`BlockLayout` ``[B, Hk, n, top_k + local + global]`` chosen from ``query``
    ``[B, Hq, Nq, D]`` and ``key`` ``[B, Hk, Nk, D]`` (queries at key columns ``Nk - Nq ..``).

    Padding keys (``tokens.k_valid``) and padding queries do not enter the means; a key block without a real key is
    never chosen by score. Query blocks holding no query get no blocks.
    """
    b = check_block_size(block_size)
    k_top = _check_positive_int("top_k", top_k)
    local = _check_positive_int("local_blocks", local_blocks, 0)
    n_global = _check_positive_int("global_blocks", global_blocks, 0)
    B, H, Nq, D = query.shape
    Hk, Nk = key.shape[1], key.shape[2]
    group = H // Hk
    n = math.ceil(Nk / b)
    dev = query.device
    k_valid = torch.ones(B, Nk, dtype=torch.bool, device=dev) if tokens is None else tokens.k_valid
    q_valid = torch.ones(B, Nq, dtype=torch.bool, device=dev) if tokens is None else tokens.q_valid

    # Padding is selected away (torch.where), not multiplied by 0: a NaN / inf there would survive ``0 * x``.
    pad = n * b - Nk
    kw = torch.nn.functional.pad(k_valid, (0, pad)).view(B, 1, n, b, 1)
    ksum = torch.where(kw, torch.nn.functional.pad(key.float(), (0, 0, 0, pad)).view(B, Hk, n, b, D), 0.0).sum(3)
    kcnt = kw.sum(3, dtype=torch.float32)  # [B, 1, n, 1]
    kbar = ksum / kcnt.clamp_min(1)

    qblock = (Nk - Nq + torch.arange(Nq, device=dev)) // b
    qw = q_valid[:, None, :, None]
    qsum = torch.zeros(B, H, n, D, device=dev).index_add_(2, qblock, torch.where(qw, query.float(), 0.0))
    qcnt = torch.zeros(B, 1, n, 1, device=dev).index_add_(2, qblock, qw.float())
    qbar = qsum.view(B, Hk, group, n, D).sum(2) / (qcnt * group).clamp_min(1)  # [B, Hk, n, D]
    has_q = qcnt[:, 0, :, 0] > 0  # [B, n]
    empty_k = kcnt[:, 0, :, 0] == 0  # [B, n]

    kk = min(k_top, n)
    j = torch.arange(n, device=dev)
    first = (Nk - Nq) // b  # query blocks before it hold no query (decoding): nothing to score
    chosen = [torch.full((B, Hk, first, kk), -1, dtype=torch.long, device=dev)]
    for i0 in range(first, n, CHUNK):
        i1 = min(n, i0 + CHUNK)
        s = qbar[:, :, i0:i1] @ kbar.transpose(-1, -2)  # [B, Hk, C, n]
        rows = torch.arange(i0, i1, device=dev)[:, None]
        bad = empty_k[:, None, None, :] | _forced(rows, j[None, :], local, n_global, causal)
        if causal:
            bad = bad | (j[None, None, None, :] > rows)
        s = s.masked_fill(bad, float("-inf"))
        val, idx = torch.topk(s, kk, dim=-1)
        chosen.append(torch.where(torch.isfinite(val), idx, -1))
    top = torch.cat(chosen, 2)  # [B, Hk, n, kk]

    i = j[:, None]
    parts = [top]  # disjoint from the local and global blocks added below
    if local:
        offsets = torch.arange(-(local - 1), 1 if causal else local, device=dev)
        parts.append((i + offsets).expand(B, Hk, n, -1))
    if n_global:
        parts.append(torch.arange(min(n_global, n), device=dev).expand(B, Hk, n, -1))
    cand = torch.cat(parts, -1)
    if causal:
        cand = torch.where(cand <= i, cand, -1)
    cand = torch.where(has_q[:, None, :, None], cand, -1)
    return compact(cand, b, n)


def _forced(i: torch.Tensor, j: torch.Tensor, local: int, n_global: int, causal: bool) -> torch.Tensor:
    """Whether key block ``j`` is in query block ``i``'s local window or among the global blocks (broadcast)."""
    near = (i - j >= 0) & (i - j < local) if causal else (i - j).abs() < local
    return near | (j < n_global)
