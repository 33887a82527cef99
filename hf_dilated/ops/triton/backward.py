"""Backward kernels, one launch of each per branch.

The merged output is one softmax over a multiset of keys (a key reached by ``m`` branches counts ``m`` times), so each
branch's share of the gradient is a flash-attention backward that uses the *merged* log-sum-exp ``L`` and
``delta = rowsum(dO * O)`` of the *merged* output: ``P = exp(s - L)``, ``dS = P * (dO V^T - delta)``.
With dropout (keep mask ``M`` of the branch, scale ``c = 1 / (1 - p)``, the lse undropped) the output is
``sum_branches (c M * P) V``, so ``dV += (c M * P)^T dO`` and ``dS = P * (c M * (dO V^T) - delta)``, with ``delta``
of the (dropped) output; a gradient ``dlse`` on the lse enters as ``delta - dlse``.
Launches run one branch after another and add into ``dq`` / ``dk`` / ``dv`` (read, add in float32, write) the rows
an earlier launch wrote (``tiles.written_before``); the ``LAST`` launch (an ``r = 1`` branch, which reaches every row)
writes the final gradients in their dtype to ``DQ_OUT`` / ``DK_OUT`` / ``DV_OUT``. Within a launch no two programs
touch the same row, so the sums need no atomics and are deterministic.

- ``dkdv``: one program per (segment item, tile of dilated key rows, kv head x offset class), the tiles of an item
  consecutive (``tiles.item_tile``). Query heads of a GQA group with the same offset ``(h + head_offset) % r`` read
  the same key rows; one program loops over them all, so K / V are never repeated and no two programs write one key
  row.
- ``dq``: one program per (segment item, tile of dilated query rows, query head), ordered like the forward.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    LOG2E, NEST_COLUMNS, allowed, drop_keep, drop_rows, first_selected, item_query_tile, item_tile, load_item,
    load_rows, mm, n_rows, nest_first_query, nest_limit, nest_query_tile, nest_weight, query_range, query_tile_keys,
    rounded, row_desc, tile_mask, tile_rows, written_before,
)


@triton.jit
def delta_kernel(O, DO, Delta, stride_ob, stride_oh, stride_on, stride_db, stride_dh, stride_dn, H, N,
                 HEAD_DIM: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """``delta[b, h, n] = sum_d dO * O`` in float32 (``Delta`` contiguous ``[B, H, N]``)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    mask = rows < N
    d = tl.arange(0, HEAD_DIM)
    dmask = d < D
    r64 = rows.to(tl.int64)[:, None]
    o = load_rows(O + b * stride_ob + h * stride_oh + r64 * stride_on + d[None, :], mask, dmask, True, D == HEAD_DIM)
    do = load_rows(DO + b * stride_db + h * stride_dh + r64 * stride_dn + d[None, :], mask, dmask, True, D == HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh.to(tl.int64) * N + rows, delta, mask=mask)


@triton.jit
def dkdv_step(dk, dv, k, v, kp, kc, kmask, start, rows_base, q_first, r, q_hi, qbase, b, h, h64, H, Nq, QV,
              q_row, do_row, l_row, dl_row, S, stride_qn, stride_dn, dmask, window, qk_scale, drop_threshold, inv_keep,
              MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HOLES: tl.constexpr,
              DROPOUT: tl.constexpr, UPCAST: tl.constexpr, EVEN_D: tl.constexpr, q_desc, do_desc, TMA: tl.constexpr,
              k_weight, NEST, below, head_offset, NESTED: tl.constexpr):
    """One query tile's share of a key tile's dK and dV (``NESTED``: the pairs and weights of a nested branch,
    ``tiles.nest_weight``; ``k_weight`` the keys' weights for head ``h``). Unmasked (``MASKED`` false) where every query
    of the tile is valid and sees every key: rows past the tile's last key were loaded as zeros and are never stored.
    With ``TMA`` the query and dO rows come through the descriptors over the head's dilated query rows (zeros past the
    last)."""
    rows = start + rows_base
    qp = q_first + rows * r
    qc = qbase + qp
    qc64 = qc.to(tl.int64)
    qmask = qc  # unused by unmasked loads
    if MASKED:
        qmask = qp < q_hi
        if HOLES:
            qmask = qmask & (tl.load(QV + b * Nq + qc, mask=qmask, other=0) != 0)
    if TMA:
        q = q_desc.load([start, 0])
        do = do_desc.load([start, 0])
    else:
        q = load_rows(q_row + qc64[:, None] * stride_qn, qmask, dmask, MASKED, EVEN_D)
        do = load_rows(do_row + qc64[:, None] * stride_dn, qmask, dmask, MASKED, EVEN_D)
    if MASKED:
        lse = tl.load(l_row + qc64, mask=qmask, other=0.0)
        delta = tl.load(dl_row + qc64, mask=qmask, other=0.0)
    else:
        lse = tl.load(l_row + qc64)
        delta = tl.load(dl_row + qc64)
    lse = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
    qkT = mm(k, tl.trans(q), UPCAST)
    if NESTED:
        qkT += tl.minimum(k_weight[:, None], nest_weight(qp, h, head_offset, NEST, 1.0 / qk_scale)[None, :])
    if MASKED:
        ok = allowed(kmask[:, None] & qmask[None, :], qp[None, :] - kp[:, None], window, IS_CAUSAL, WINDOW)
        if NESTED:
            ok = ok & (kp[:, None] < nest_limit(qp, below)[None, :])
        pT = tl.where(ok, tl.math.exp2(qkT * qk_scale - lse[None, :]), 0.0)
    else:
        pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
    dpT = mm(v, tl.trans(do), UPCAST)
    if DROPOUT:
        keepT = drop_keep(drop_rows(S, b, h, H, qc)[None, :], kc[:, None], drop_threshold)
        dv += mm(tl.where(keepT, pT * inv_keep, 0.0).to(do.dtype), do, UPCAST)
        dsT = pT * (tl.where(keepT, dpT * inv_keep, 0.0) - delta[None, :])
    else:
        dv += mm(pT.to(do.dtype), do, UPCAST)
        dsT = pT * (dpT - delta[None, :])
    dk += mm(dsT.to(q.dtype), q, UPCAST)
    return dk, dv


@triton.jit
def dilated_bwd_dkdv_kernel(
    Q, K, V, DO, L, Delta, DK, DV, DK_OUT, DV_OUT, PREV, T, QV, KV, S, NESTS,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dn,
    stride_lb, stride_lh,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_xkb, stride_xkh, stride_xkn,
    stride_xvb, stride_xvh, stride_xvn,
    Nq, Nk, H, head_offset, group, n_classes, r, scale, qk_scale, window, drop_threshold, inv_keep, n_tiles, n_prev,
    nest_i,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HOLES: tl.constexpr, DROPOUT: tl.constexpr,
    MERGE: tl.constexpr, LAST: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr, NESTED: tl.constexpr,
):
    item, tile = item_tile(n_tiles, False)  # under causal attention the first key tile is the heaviest already
    hc = tl.program_id(1)
    kvh = hc // n_classes
    h0 = kvh * group + hc % n_classes
    b, qbase, kbase, q_lo, q_hi, k_lo, k_hi = load_item(T, item)
    off = (h0 + head_offset) % r
    k_first = first_selected(k_lo, off, r)
    col0 = tile * BLOCK_N
    kp_min = k_first + col0 * r
    if kp_min >= k_hi:
        return
    kp, in_range, kc, kmask = tile_rows(k_first, tile, r, k_hi, kbase, KV, b * Nk, BLOCK_N, HOLES)
    d = tl.arange(0, HEAD_DIM)
    dmask = d < D
    EVEN_D: tl.constexpr = D == HEAD_DIM
    kvh64 = kvh.to(tl.int64)
    kc64 = kc.to(tl.int64)[:, None]
    k = load_rows(K + b * stride_kb + kvh64 * stride_kh + kc64 * stride_kn + d[None, :], kmask, dmask, True, EVEN_D)
    v = load_rows(V + b * stride_vb + kvh64 * stride_vh + kc64 * stride_vn + d[None, :], kmask, dmask, True, EVEN_D)

    kp_max = tl.minimum(kp_min + (BLOCK_N - 1) * r, k_hi - 1)
    lo, hi = query_range(kp_min, kp_max, q_lo, q_hi, window, IS_CAUSAL, WINDOW)
    NEST = NESTS + nest_i * NEST_COLUMNS
    below = 0
    if NESTED:  # queries only in later segments of the branch below
        below = tl.load(NEST)
        lo = tl.maximum(lo, nest_first_query(kp_min, below))
    q_first = first_selected(q_lo, off, r)
    n_q = n_rows(q_first, hi, r)
    j0 = tl.where(lo > q_first, (lo - q_first) // r, 0)  # queries before ``lo`` see none of the tile's keys
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
        q_desc = q_row
        do_desc = do_row
        if TMA:  # the head's dilated query rows, row stride r (at least one row: no tile is read when there is none)
            q0 = (qbase + q_first).to(tl.int64)
            n_all = tl.maximum(n_rows(q_first, q_hi, r), 1)
            q_desc = row_desc(Q + b * stride_qb + h64 * stride_qh + q0 * stride_qn, n_all, r * stride_qn, BLOCK_M,
                              HEAD_DIM)
            do_desc = row_desc(DO + b * stride_db + h64 * stride_dh + q0 * stride_dn, n_all, r * stride_dn, BLOCK_M,
                               HEAD_DIM)
        # Query tiles that see every key of this tile need no mask (plain causal or bidirectional layouts only):
        # [start_q, start_full) masked, [start_full, end_full) unmasked, [end_full, n_q) masked (the partial tail).
        if WINDOW or HOLES:
            start_full = n_q
        elif NESTED:
            j_full = n_rows(q_first, nest_first_query(kp_max, below), r)
            start_full = tl.minimum(tl.maximum((j_full + BLOCK_M - 1) // BLOCK_M * BLOCK_M, start_q), n_q)
        elif IS_CAUSAL:
            j_full = tl.where(kp_max > q_first, (kp_max - q_first + r - 1) // r, 0)
            start_full = tl.minimum(tl.maximum((j_full + BLOCK_M - 1) // BLOCK_M * BLOCK_M, start_q), n_q)
        else:
            start_full = start_q
        end_full = tl.maximum((n_q // BLOCK_M) * BLOCK_M, start_full)
        k_weight = kp
        if NESTED:
            k_weight = nest_weight(kp, h, head_offset, NEST, 1.0 / qk_scale)
        for start in range(start_q, start_full, BLOCK_M):
            dk, dv = dkdv_step(dk, dv, k, v, kp, kc, kmask, start, rows_base, q_first, r, q_hi, qbase, b, h, h64, H,
                               Nq, QV, q_row, do_row, l_row, dl_row, S, stride_qn, stride_dn, dmask, window,
                               qk_scale, drop_threshold, inv_keep, True, IS_CAUSAL, WINDOW, HOLES, DROPOUT, UPCAST,
                               EVEN_D, q_desc, do_desc, TMA, k_weight, NEST, below, head_offset, NESTED)
        for start in range(start_full, end_full, BLOCK_M):
            dk, dv = dkdv_step(dk, dv, k, v, kp, kc, kmask, start, rows_base, q_first, r, q_hi, qbase, b, h, h64, H,
                               Nq, QV, q_row, do_row, l_row, dl_row, S, stride_qn, stride_dn, dmask, window,
                               qk_scale, drop_threshold, inv_keep, False, IS_CAUSAL, WINDOW, HOLES, DROPOUT, UPCAST,
                               EVEN_D, q_desc, do_desc, TMA, k_weight, NEST, below, head_offset, NESTED)
        for start in range(end_full, n_q, BLOCK_M):
            dk, dv = dkdv_step(dk, dv, k, v, kp, kc, kmask, start, rows_base, q_first, r, q_hi, qbase, b, h, h64, H,
                               Nq, QV, q_row, do_row, l_row, dl_row, S, stride_qn, stride_dn, dmask, window,
                               qk_scale, drop_threshold, inv_keep, True, IS_CAUSAL, WINDOW, HOLES, DROPOUT, UPCAST,
                               EVEN_D, q_desc, do_desc, TMA, k_weight, NEST, below, head_offset, NESTED)
    dk = dk * scale
    smask = tile_mask(in_range, dmask, EVEN_D)
    dk_ptrs = DK + b * stride_dkb + kvh64 * stride_dkh + kc64 * stride_dkn + d[None, :]
    dv_ptrs = DV + b * stride_dvb + kvh64 * stride_dvh + kc64 * stride_dvn + d[None, :]
    if MERGE:  # key rows an earlier launch wrote for some query head of this kv head
        seen = tile_mask(in_range & written_before(kp, kvh * group, head_offset, PREV, n_prev, group), dmask, EVEN_D)
        dk += tl.load(dk_ptrs, mask=seen, other=0.0).to(tl.float32)
        dv += tl.load(dv_ptrs, mask=seen, other=0.0).to(tl.float32)
    if LAST:
        tl.store(DK_OUT + b * stride_xkb + kvh64 * stride_xkh + kc64 * stride_xkn + d[None, :],
                 rounded(dk, DK_OUT.dtype.element_ty, UPCAST), mask=smask)
        tl.store(DV_OUT + b * stride_xvb + kvh64 * stride_xvh + kc64 * stride_xvn + d[None, :],
                 rounded(dv, DV_OUT.dtype.element_ty, UPCAST), mask=smask)
    else:
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=smask)
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=smask)


@triton.jit
def dilated_bwd_dq_kernel(
    Q, K, V, DO, L, Delta, DQ, DQ_OUT, PREV, T, QV, KV, S, NESTS,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dn,
    stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqn,
    stride_xqb, stride_xqh, stride_xqn,
    Nq, Nk, H, head_offset, group, r, scale, qk_scale, window, drop_threshold, inv_keep, n_tiles, n_prev, nest_i,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HOLES: tl.constexpr, DROPOUT: tl.constexpr,
    MERGE: tl.constexpr, LAST: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr, NESTED: tl.constexpr,
):
    b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, p_min = item_query_tile(T, n_tiles, head_offset, r,
                                                                                           BLOCK_M, IS_CAUSAL)
    if p_min >= q_hi:
        return
    qp, in_range, qc, qmask = tile_rows(q_first, tile, r, q_hi, qbase, QV, b * Nq, BLOCK_M, HOLES)
    d = tl.arange(0, HEAD_DIM)
    dmask = d < D
    EVEN_D: tl.constexpr = D == HEAD_DIM
    h64 = h.to(tl.int64)
    kvh = (h // group).to(tl.int64)
    qc64 = qc.to(tl.int64)
    q = load_rows(Q + b * stride_qb + h64 * stride_qh + qc64[:, None] * stride_qn + d[None, :], qmask, dmask, True,
                  EVEN_D)
    do = load_rows(DO + b * stride_db + h64 * stride_dh + qc64[:, None] * stride_dn + d[None, :], qmask, dmask, True,
                   EVEN_D)
    lse = tl.load(L + b * stride_lb + h64 * stride_lh + qc64, mask=qmask, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
    delta = tl.load(Delta + b * stride_lb + h64 * stride_lh + qc64, mask=qmask, other=0.0)
    row_hash = qp
    if DROPOUT:
        row_hash = drop_rows(S, b, h, H, qc)

    k_first, n_k, n_full = query_tile_keys(p_min, q_hi, k_lo, k_hi, off, r, window, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                           WINDOW, HOLES)
    NEST = NESTS
    qlim = qp
    q_weight = lse
    if NESTED:  # keys only in earlier segments of the branch below (as the forward)
        NEST, qlim, n_k, n_full, q_weight = nest_query_tile(NESTS, nest_i, qp, p_min, q_hi, k_first, n_k, n_full, h,
                                                            head_offset, r, qk_scale, BLOCK_M, BLOCK_N)
    cols_base = tl.arange(0, BLOCK_N)
    k_row = K + b * stride_kb + kvh * stride_kh + d[None, :]
    v_row = V + b * stride_vb + kvh * stride_vh + d[None, :]
    k_desc = k_row
    v_desc = v_row
    if TMA:  # the tile's dilated key rows, row stride r (at least one row: no tile is read when there is none)
        k0 = (kbase + k_first).to(tl.int64)
        n_all = tl.maximum(n_k, 1)
        k_desc = row_desc(K + b * stride_kb + kvh * stride_kh + k0 * stride_kn, n_all, r * stride_kn, BLOCK_N, HEAD_DIM)
        v_desc = row_desc(V + b * stride_vb + kvh * stride_vh + k0 * stride_vn, n_all, r * stride_vn, BLOCK_N, HEAD_DIM)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(0, n_full, BLOCK_N):
        dq = dq_step(dq, q, do, lse, delta, qp, qmask, row_hash, start, cols_base, k_first, r, n_k, kbase, b, Nk, KV,
                     k_row, v_row, stride_kn, stride_vn, dmask, window, qk_scale, drop_threshold, inv_keep, False,
                     IS_CAUSAL, WINDOW, HOLES, DROPOUT, UPCAST, EVEN_D, k_desc, v_desc, TMA, qlim, q_weight, NEST, h,
                     head_offset, NESTED)
    for start in range(n_full, n_k, BLOCK_N):
        dq = dq_step(dq, q, do, lse, delta, qp, qmask, row_hash, start, cols_base, k_first, r, n_k, kbase, b, Nk, KV,
                     k_row, v_row, stride_kn, stride_vn, dmask, window, qk_scale, drop_threshold, inv_keep, True,
                     IS_CAUSAL, WINDOW, HOLES, DROPOUT, UPCAST, EVEN_D, k_desc, v_desc, TMA, qlim, q_weight, NEST, h,
                     head_offset, NESTED)
    dq = dq * scale
    smask = tile_mask(in_range, dmask, EVEN_D)
    dq_ptrs = DQ + b * stride_dqb + h64 * stride_dqh + qc64[:, None] * stride_dqn + d[None, :]
    if MERGE:  # query rows an earlier launch wrote
        seen = tile_mask(in_range & written_before(qp, h, head_offset, PREV, n_prev, 1), dmask, EVEN_D)
        dq += tl.load(dq_ptrs, mask=seen, other=0.0).to(tl.float32)
    if LAST:
        tl.store(DQ_OUT + b * stride_xqb + h64 * stride_xqh + qc64[:, None] * stride_xqn + d[None, :],
                 rounded(dq, DQ_OUT.dtype.element_ty, UPCAST), mask=smask)
    else:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=smask)


@triton.jit
def dq_step(dq, q, do, lse, delta, qp, qmask, row_hash, start, cols_base, k_first, r, n_k, kbase, b, Nk, KV, k_row,
            v_row, stride_kn, stride_vn, dmask, window, qk_scale, drop_threshold, inv_keep, MASKED: tl.constexpr,
            IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HOLES: tl.constexpr, DROPOUT: tl.constexpr,
            UPCAST: tl.constexpr, EVEN_D: tl.constexpr, k_desc, v_desc, TMA: tl.constexpr, qlim, q_weight, NEST, h,
            head_offset, NESTED: tl.constexpr):
    """One key tile's share of a query tile's dQ (``NESTED``: keys below ``qlim`` per query, pairs weighted as
    ``tiles.nest_weight``). Unmasked (``MASKED`` false) where every key of the tile is valid
    and seen by every query: rows past the tile's last query were loaded as zeros and are never stored. With ``TMA``
    the key and value rows come through the descriptors over the tile's dilated key rows (zeros past the last)."""
    cols = start + cols_base
    kp = k_first + cols * r
    kc = kbase + kp
    kc64 = kc.to(tl.int64)[:, None]
    if TMA:
        k = k_desc.load([start, 0])
        v = v_desc.load([start, 0])
    if MASKED:
        kmask = cols < n_k
        if HOLES:
            kmask = kmask & (tl.load(KV + b * Nk + kc, mask=kmask, other=0) != 0)
        if not TMA:
            k = load_rows(k_row + kc64 * stride_kn, kmask, dmask, True, EVEN_D)
            v = load_rows(v_row + kc64 * stride_vn, kmask, dmask, True, EVEN_D)
    elif not TMA:
        k = load_rows(k_row + kc64 * stride_kn, cols, dmask, False, EVEN_D)
        v = load_rows(v_row + kc64 * stride_vn, cols, dmask, False, EVEN_D)
    qk = mm(q, tl.trans(k), UPCAST)
    if NESTED:
        qk += tl.minimum(q_weight[:, None], nest_weight(kp, h, head_offset, NEST, 1.0 / qk_scale)[None, :])
    if MASKED:
        ok = allowed(qmask[:, None] & kmask[None, :], qp[:, None] - kp[None, :], window, IS_CAUSAL, WINDOW)
        if NESTED:
            ok = ok & (kp[None, :] < qlim[:, None])
        p = tl.where(ok, tl.math.exp2(qk * qk_scale - lse[:, None]), 0.0)
    else:
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
    dp = mm(do, tl.trans(v), UPCAST)
    if DROPOUT:
        dp = tl.where(drop_keep(row_hash[:, None], kc[None, :], drop_threshold), dp * inv_keep, 0.0)
    ds = p * (dp - delta[:, None])
    return dq + mm(ds.to(k.dtype), k, UPCAST)
