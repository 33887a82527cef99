"""Decode kernel: a short block of queries (1..64) against a KV cache, all branches in one launch.

One program per (block of consecutive query columns, query head, batch row). For each branch ``(w, r, cap)`` (the
global-token branch is ``(DENSE_SEGMENT, 1, g)``: keys below position ``g``) it walks only the keys of the query
block's segments that the branch selects (``<= (w + Nq) / r`` of them, fewer in a window), so the time per token
depends on the branches, not on the cache length. Branches continue one online softmax: the merged output is one
softmax over the multiset of keys (with dropout: the kept probabilities over the undropped normaliser), so no merge
step is needed.

Each batch row's valid keys must be one run (``base + p`` is the column of position ``p``, positions ``[k_lo, k_hi)``,
invalid columns inside masked with ``HOLES``) and its valid queries one sequence with it; ``op.py`` checks that before
choosing this kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    allowed, drop_rows, finish, first_selected, load_rows, mm, n_rows, softmax_step, tile_mask,
)


@triton.jit
def dilated_decode_kernel(
    Q, K, V, O, L, QPOS, QVALID, KV, KDESC, BR, S,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    Nq, Nk, B, H, head_offset, group, qk_scale, window, drop_threshold, inv_keep,
    N_BRANCHES: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HOLES: tl.constexpr,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < Nq
    qp = tl.load(QPOS + b * Nq + rows, mask=rmask, other=0).to(tl.int32)
    rmask = rmask & (tl.load(QVALID + b * Nq + rows, mask=rmask, other=0) != 0)
    kbase = tl.load(KDESC + b * 3)
    k_lo = tl.load(KDESC + b * 3 + 1)
    k_hi = tl.load(KDESC + b * 3 + 2)
    d = tl.arange(0, HEAD_DIM)
    dmask = d < D
    EVEN_D: tl.constexpr = D == HEAD_DIM
    h64 = h.to(tl.int64)
    kvh = (h // group).to(tl.int64)
    r64 = rows.to(tl.int64)
    q = load_rows(Q + b * stride_qb + h64 * stride_qh + r64[:, None] * stride_qn + d[None, :], rmask, dmask, True,
                  EVEN_D)
    p_min = tl.min(tl.where(rmask, qp, 2147483647), 0)
    p_max = tl.max(tl.where(rmask, qp, -1), 0)
    k_row = K + b * stride_kb + kvh * stride_kh + d[None, :]
    v_row = V + b * stride_vb + kvh * stride_vh + d[None, :]
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    cols_base = tl.arange(0, BLOCK_N)
    if p_max >= 0:
        for i in tl.static_range(N_BRANCHES):
            w = tl.load(BR + 3 * i)
            r = tl.load(BR + 3 * i + 1)
            cap = tl.load(BR + 3 * i + 2)
            off = (h + head_offset) % r
            sel = rmask & (qp % r == off)
            seg = qp // w
            lo = tl.maximum((p_min // w) * w, k_lo)
            if IS_CAUSAL:
                hi = tl.minimum(p_max + 1, k_hi)
            else:
                hi = tl.minimum((p_max // w + 1) * w, k_hi)
            hi = tl.minimum(hi, cap)
            if WINDOW:
                lo = tl.maximum(lo, p_min - window + 1)
                if not IS_CAUSAL:
                    hi = tl.minimum(hi, p_max + window)
            k_first = first_selected(lo, off, r)
            n_k = n_rows(k_first, hi, r)
            row_hash = qp
            if DROPOUT:
                row_hash = drop_rows(S + i * B * H, b, h, H, rows)
            for start in range(0, n_k, BLOCK_N):
                cols = start + cols_base
                kmask = cols < n_k
                kp = k_first + cols * r
                kc = kbase + kp
                if HOLES:
                    kmask = kmask & (tl.load(KV + b * Nk + kc, mask=kmask, other=0) != 0)
                kc64 = kc.to(tl.int64)[:, None]
                k = load_rows(k_row + kc64 * stride_kn, kmask, dmask, True, EVEN_D)
                v = load_rows(v_row + kc64 * stride_vn, kmask, dmask, True, EVEN_D)
                qk = mm(q, tl.trans(k), UPCAST)
                ok = sel[:, None] & kmask[None, :] & ((kp // w)[None, :] == seg[:, None])
                ok = allowed(ok, qp[:, None] - kp[None, :], window, IS_CAUSAL, WINDOW)
                qk = tl.where(ok, qk, float("-inf"))
                acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, qk_scale, v, row_hash, kc, drop_threshold, inv_keep,
                                             DROPOUT, UPCAST)
    out, lse = finish(acc, l_i, m_i)
    tl.store(O + b * stride_ob + h64 * stride_oh + r64[:, None] * stride_on + d[None, :],
             out.to(O.dtype.element_ty), mask=tile_mask(rows < Nq, dmask, EVEN_D))
    tl.store(L + b * stride_lb + h64 * stride_lh + r64, lse, mask=rows < Nq)
