"""Decode kernel: a short block of queries (1..64) against a KV cache, all branches in one launch.

One program per (block of consecutive query columns, query head, batch row). For each branch it walks only the keys
of the query block's segments that the branch selects (``<= (w + Nq) / r`` of them), so the time per token depends on
the branches, not on the cache length. Branches continue one online softmax: the merged output is one softmax over the
multiset of keys, so no merge step is needed.

Each batch row's valid keys must be one run (``base + p`` is the column of position ``p``, positions ``[k_lo, k_hi)``)
and its queries one sequence with it; ``ops/triton/__init__.py`` checks that before choosing this kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import LN2, _first_selected, mm


@triton.jit
def dilated_decode_kernel(
    Q, K, V, O, L, QPOS, QVALID, KDESC, BR,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    Nq, head_offset, group, qk_scale,
    N_BRANCHES: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
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
    h64 = h.to(tl.int64)
    kvh = (h // group).to(tl.int64)
    r64 = rows.to(tl.int64)
    q = tl.load(Q + b * stride_qb + h64 * stride_qh + r64[:, None] * stride_qn + d[None, :], mask=rmask[:, None], other=0.0)
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
            w = tl.load(BR + 2 * i)
            r = tl.load(BR + 2 * i + 1)
            off = (h + head_offset) % r
            sel = rmask & (qp % r == off)
            seg = qp // w
            lo = tl.maximum((p_min // w) * w, k_lo)
            if IS_CAUSAL:
                hi = tl.minimum(p_max + 1, k_hi)
            else:
                hi = tl.minimum((p_max // w + 1) * w, k_hi)
            k_first = _first_selected(lo, off, r)
            n_k = tl.maximum((hi - k_first + r - 1) // r, 0)
            for start in range(0, n_k, BLOCK_N):
                cols = start + cols_base
                kmask = cols < n_k
                kp = k_first + cols * r
                kc = (kbase + kp).to(tl.int64)[:, None]
                k = tl.load(k_row + kc * stride_kn, mask=kmask[:, None], other=0.0)
                qk = mm(q, tl.trans(k), UPCAST) * qk_scale
                ok = sel[:, None] & kmask[None, :] & ((kp // w)[None, :] == seg[:, None])
                if IS_CAUSAL:
                    ok = ok & (kp[None, :] <= qp[:, None])
                qk = tl.where(ok, qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                p = tl.math.exp2(qk - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_row + kc * stride_vn, mask=kmask[:, None], other=0.0)
                acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, UPCAST)
                m_i = m_new
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    tl.store(O + b * stride_ob + h64 * stride_oh + r64[:, None] * stride_on + d[None, :],
             out.to(O.dtype.element_ty), mask=(rows < Nq)[:, None])
    tl.store(L + b * stride_lb + h64 * stride_lh + r64, lse, mask=rows < Nq)
