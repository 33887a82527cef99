"""Backward kernels, one launch of each per branch.

The merged output is one softmax over a multiset of keys (a key reached by ``m`` branches counts ``m`` times), so each
branch's share of the gradient is a flash-attention backward that uses the *merged* log-sum-exp ``L`` and
``delta = rowsum(dO * O)`` of the *merged* output: ``P = exp(s - L)``, ``dS = P * (dO V^T - delta)``.
Launches run one branch after another and add into ``dq`` / ``dk`` / ``dv`` (read, add in float32, write); within a
launch no two programs touch the same row, so the sums need no atomics and are deterministic.

- ``dkdv``: one program per (segment item, tile of dilated key rows, kv head x offset class). Query heads of a GQA
  group with the same offset ``(h + head_offset) % r`` read the same key rows; one program loops over them all, so
  K / V are never repeated and no two programs write one key row.
- ``dq``: one program per (segment item, tile of dilated query rows, query head), like the forward.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import LOG2E, _first_selected, mm


@triton.jit
def delta_kernel(O, DO, Delta, stride_ob, stride_oh, stride_on, stride_db, stride_dh, stride_dn, H, N,
                 HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """``delta[b, h, n] = sum_d dO * O`` in float32 (``Delta`` contiguous ``[B, H, N]``)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    mask = rows < N
    d = tl.arange(0, HEAD_DIM)
    r64 = rows.to(tl.int64)[:, None]
    o = tl.load(O + b * stride_ob + h * stride_oh + r64 * stride_on + d[None, :], mask=mask[:, None], other=0.0)
    do = tl.load(DO + b * stride_db + h * stride_dh + r64 * stride_dn + d[None, :], mask=mask[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh.to(tl.int64) * N + rows, delta, mask=mask)


@triton.jit
def dilated_bwd_dkdv_kernel(
    Q, K, V, DO, L, Delta, DK, DV, T,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dn,
    stride_lb, stride_lh,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    head_offset, group, n_classes, r, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, FIRST: tl.constexpr, UPCAST: tl.constexpr,
):
    item = tl.program_id(0)
    tile = tl.program_id(1)
    hc = tl.program_id(2)
    kvh = hc // n_classes
    h0 = kvh * group + hc % n_classes
    t = T + item * 7
    b = tl.load(t).to(tl.int64)
    qbase = tl.load(t + 1)
    kbase = tl.load(t + 2)
    q_lo = tl.load(t + 3)
    q_hi = tl.load(t + 4)
    k_lo = tl.load(t + 5)
    k_hi = tl.load(t + 6)
    off = (h0 + head_offset) % r
    k_first = _first_selected(k_lo, off, r)
    col0 = tile * BLOCK_N
    kp_min = k_first + col0 * r
    if kp_min >= k_hi:
        return
    cols = col0 + tl.arange(0, BLOCK_N)
    kp = k_first + cols * r
    kmask = kp < k_hi
    d = tl.arange(0, HEAD_DIM)
    kvh64 = kvh.to(tl.int64)
    kc = (kbase + kp).to(tl.int64)[:, None]
    k = tl.load(K + b * stride_kb + kvh64 * stride_kh + kc * stride_kn + d[None, :], mask=kmask[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + kvh64 * stride_vh + kc * stride_vn + d[None, :], mask=kmask[:, None], other=0.0)

    q_first = _first_selected(q_lo, off, r)
    n_q = tl.maximum((q_hi - q_first + r - 1) // r, 0)
    start_q = 0
    if IS_CAUSAL:
        # queries before the tile's first key see none of its keys
        j0 = tl.where(kp_min > q_first, (kp_min - q_first) // r, 0)
        start_q = (j0 // BLOCK_M) * BLOCK_M
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    rows_base = tl.arange(0, BLOCK_M)
    for h in range(h0, (kvh + 1) * group, r):
        h64 = tl.cast(h, tl.int64)
        q_row = Q + b * stride_qb + h64 * stride_qh + d[None, :]
        do_row = DO + b * stride_db + h64 * stride_dh + d[None, :]
        l_row = L + b * stride_lb + h64 * stride_lh
        dl_row = Delta + b * stride_lb + h64 * stride_lh
        for start in range(start_q, n_q, BLOCK_M):
            rows = start + rows_base
            qp = q_first + rows * r
            qmask = qp < q_hi
            qc = (qbase + qp).to(tl.int64)
            q = tl.load(q_row + qc[:, None] * stride_qn, mask=qmask[:, None], other=0.0)
            do = tl.load(do_row + qc[:, None] * stride_dn, mask=qmask[:, None], other=0.0)
            lse = tl.load(l_row + qc, mask=qmask, other=0.0)
            lse = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
            delta = tl.load(dl_row + qc, mask=qmask, other=0.0)
            qkT = mm(k, tl.trans(q), UPCAST) * qk_scale
            ok = kmask[:, None] & qmask[None, :]
            if IS_CAUSAL:
                ok = ok & (kp[:, None] <= qp[None, :])
            pT = tl.where(ok, tl.math.exp2(qkT - lse[None, :]), 0.0)
            dv += mm(pT.to(do.dtype), do, UPCAST)
            dpT = mm(v, tl.trans(do), UPCAST)
            dsT = pT * (dpT - delta[None, :])
            dk += mm(dsT.to(q.dtype), q, UPCAST)
    dk = dk * scale
    dk_ptrs = DK + b * stride_dkb + kvh64 * stride_dkh + kc * stride_dkn + d[None, :]
    dv_ptrs = DV + b * stride_dvb + kvh64 * stride_dvh + kc * stride_dvn + d[None, :]
    if not FIRST:
        dk += tl.load(dk_ptrs, mask=kmask[:, None], other=0.0).to(tl.float32)
        dv += tl.load(dv_ptrs, mask=kmask[:, None], other=0.0).to(tl.float32)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=kmask[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kmask[:, None])


@triton.jit
def dilated_bwd_dq_kernel(
    Q, K, V, DO, L, Delta, DQ, T,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dn,
    stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqn,
    head_offset, group, r, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, FIRST: tl.constexpr, UPCAST: tl.constexpr,
):
    item = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    t = T + item * 7
    b = tl.load(t).to(tl.int64)
    qbase = tl.load(t + 1)
    kbase = tl.load(t + 2)
    q_lo = tl.load(t + 3)
    q_hi = tl.load(t + 4)
    k_lo = tl.load(t + 5)
    k_hi = tl.load(t + 6)
    off = (h + head_offset) % r
    q_first = _first_selected(q_lo, off, r)
    row0 = tile * BLOCK_M
    p_min = q_first + row0 * r
    if p_min >= q_hi:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    qp = q_first + rows * r
    qmask = qp < q_hi
    d = tl.arange(0, HEAD_DIM)
    h64 = h.to(tl.int64)
    kvh = (h // group).to(tl.int64)
    qc = (qbase + qp).to(tl.int64)
    q = tl.load(Q + b * stride_qb + h64 * stride_qh + qc[:, None] * stride_qn + d[None, :], mask=qmask[:, None], other=0.0)
    do = tl.load(DO + b * stride_db + h64 * stride_dh + qc[:, None] * stride_dn + d[None, :], mask=qmask[:, None], other=0.0)
    lse = tl.load(L + b * stride_lb + h64 * stride_lh + qc, mask=qmask, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
    delta = tl.load(Delta + b * stride_lb + h64 * stride_lh + qc, mask=qmask, other=0.0)

    k_first = _first_selected(k_lo, off, r)
    k_end = k_hi
    if IS_CAUSAL:
        p_max = tl.minimum(p_min + (BLOCK_M - 1) * r, q_hi - 1)
        k_end = tl.minimum(k_end, p_max + 1)
    n_k = tl.maximum((k_end - k_first + r - 1) // r, 0)
    cols_base = tl.arange(0, BLOCK_N)
    k_row = K + b * stride_kb + kvh * stride_kh + d[None, :]
    v_row = V + b * stride_vb + kvh * stride_vh + d[None, :]
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(0, n_k, BLOCK_N):
        cols = start + cols_base
        kmask = cols < n_k
        kp = k_first + cols * r
        kc = (kbase + kp).to(tl.int64)[:, None]
        k = tl.load(k_row + kc * stride_kn, mask=kmask[:, None], other=0.0)
        v = tl.load(v_row + kc * stride_vn, mask=kmask[:, None], other=0.0)
        qk = mm(q, tl.trans(k), UPCAST) * qk_scale
        ok = qmask[:, None] & kmask[None, :]
        if IS_CAUSAL:
            ok = ok & (kp[None, :] <= qp[:, None])
        p = tl.where(ok, tl.math.exp2(qk - lse[:, None]), 0.0)
        dp = mm(do, tl.trans(v), UPCAST)
        ds = p * (dp - delta[:, None])
        dq += mm(ds.to(k.dtype), k, UPCAST)
    dq = dq * scale
    dq_ptrs = DQ + b * stride_dqb + h64 * stride_dqh + qc[:, None] * stride_dqn + d[None, :]
    if not FIRST:
        dq += tl.load(dq_ptrs, mask=qmask[:, None], other=0.0).to(tl.float32)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=qmask[:, None])
