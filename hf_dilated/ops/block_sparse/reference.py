"""Block-sparse attention in plain PyTorch (CPU, float64, and the oracle of the kernels' fallback).

Per chunk of query blocks it gathers each query block's active key blocks (``[B, H, C, A, b, D]``), so memory is
O(N * A * b * D / chunking), never ``N x N``; one softmax over all active keys of a query; autograd does the rest.
"""

from __future__ import annotations

import torch

from ..layout import TokenLayout
from .layout import BlockLayout

# Query blocks per chunk: bounds the gathered keys to CHUNK * A * b rows per (batch, head).
CHUNK = 64


def block_sparse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: BlockLayout,
                           tokens: TokenLayout, is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, Nq, D] in q's dtype, lse [B, Hq, Nq] float32, float64 for float64)``; queries sit at key
    columns ``Nk - Nq ..`` (see ``layout.py``). Queries with no key get output 0 and lse ``-inf``."""
    B, H, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    b, n = blocks.block_size, blocks.n_blocks
    group, ratio = H // Hk, H // blocks.layout_heads
    q_offset = Nk - Nq
    i0 = q_offset // b
    dev = q.device
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    # Keys padded to n * b columns, per-column metadata padded as invalid.
    pad = n * b - Nk
    kp = torch.nn.functional.pad(k.to(acc), (0, 0, 0, pad)).view(B, Hk, n, b, D)
    vp = torch.nn.functional.pad(v.to(acc), (0, 0, 0, pad)).view(B, Hk, n, b, -1)
    k_pos = torch.nn.functional.pad(tokens.k_pos, (0, pad)).view(B, n, b)
    k_seq = torch.nn.functional.pad(tokens.k_seq, (0, pad)).view(B, n, b)
    k_ok = torch.nn.functional.pad(tokens.k_valid, (0, pad)).view(B, n, b)
    # Queries placed on their key columns, rows outside [q_offset, Nk) empty.
    cols = torch.arange(i0 * b, n * b, device=dev)
    rows = cols - q_offset
    q_in = (rows >= 0) & (rows < Nq)
    r_safe = rows.clamp(0, max(Nq - 1, 0))
    qq = torch.where(q_in[:, None], q.to(acc)[:, :, r_safe], 0.0)  # [B, H, R, D]
    q_pos = torch.where(q_in, tokens.q_pos[:, r_safe], 0)
    q_seq = tokens.q_seq[:, r_safe]
    q_ok = q_in & tokens.q_valid[:, r_safe]

    heads = torch.arange(H, device=dev)
    bidx = torch.arange(B, device=dev)[:, None, None, None]
    lay_b = torch.arange(B, device=dev) if blocks.layout_batch == B else torch.zeros(B, dtype=torch.long, device=dev)
    outs, lses = [], []
    for c0 in range(i0, n, CHUNK):
        c1 = min(n, c0 + CHUNK)
        C = c1 - c0
        idx = blocks.kv_index[lay_b][:, heads // ratio, c0:c1].long()  # [B, H, C, A]
        active = idx >= 0
        idx = idx.clamp_min(0)
        kvh = (heads // group)[None, :, None, None]
        kb = kp[bidx, kvh, idx]  # [B, H, C, A, b, D]
        vb = vp[bidx, kvh, idx]
        kpos, kseq, kok = k_pos[bidx, idx], k_seq[bidx, idx], k_ok[bidx, idx]  # [B, H, C, A, b]
        r0, r1 = (c0 - i0) * b, (c1 - i0) * b
        qb = qq[:, :, r0:r1].reshape(B, H, C, b, D)
        qpos = q_pos[:, r0:r1].reshape(B, 1, C, b, 1, 1)
        qseq = q_seq[:, r0:r1].reshape(B, 1, C, b, 1, 1)
        qok = q_ok[:, r0:r1].reshape(B, 1, C, b, 1, 1)
        s = torch.einsum("bhcmd,bhcand->bhcman", qb, kb) * scale  # [B, H, C, b, A, b]
        ok = active[:, :, :, None, :, None] & kok[:, :, :, None] & qok
        ok = ok & (kseq[:, :, :, None] == qseq)
        if is_causal:
            ok = ok & (kpos[:, :, :, None] <= qpos)
        ok = ok.reshape(B, H, C, b, -1)
        has = ok.any(-1)
        # Rows with no key: a finite stand-in, so that neither the value nor the gradient becomes NaN.
        s = s.reshape(B, H, C, b, -1).masked_fill(~ok, float("-inf")).masked_fill(~has[..., None], 0.0)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]) * has[..., None]
        lse = lse.masked_fill(~has, float("-inf"))
        o = torch.einsum("bhcmk,bhckd->bhcmd", p, vb.reshape(B, H, C, -1, vb.shape[-1]))
        outs.append(o.reshape(B, H, C * b, -1))
        lses.append(lse.reshape(B, H, C * b))
    out = torch.cat(outs, 2)[:, :, q_in.nonzero().flatten()]
    lse = torch.cat(lses, 2)[:, :, q_in.nonzero().flatten()]
    return out.to(q.dtype), lse.to(acc)
