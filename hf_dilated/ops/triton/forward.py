"""Forward kernel: one launch per branch, one program per (segment item, tile of dilated query rows, query head), the
tiles of an item consecutive and last-first (``tiles.item_tile``).

A segment item (``schedule.py``) is the part of one sequence's segment that holds queries: positions ``[q_lo, q_hi)``
of the queries, ``[k_lo, k_hi)`` of the keys; position ``p`` sits at column ``base + p``. For head ``h`` the branch
selects positions ``p = first + j * r`` with ``p % r == (h + head_offset) % r``; the kernel reads those rows in place
through the row stride times ``r``: no gathered copies. A sliding window (``WINDOW``) narrows each tile's key range,
holes (``HOLES``) mask keys and queries by their validity, ``DROPOUT`` drops probabilities by the counter-based draw.
With ``TMA`` (Hopper, unpadded head dim, no holes) the dilated Q, K and V rows are read through tensor descriptors
whose row stride is ``r`` rows, so the copy engine fetches them and zero-fills the rows past the item's end.
The kernel folds its branch into the running output (float32) and log-sum-exp of the earlier launches with the
exact merge ``o = sum_i softmax(lse)_i o_i``, reading only the rows an earlier launch wrote (``tiles.written_before``);
the ``LAST`` launch (an ``r = 1`` branch, which reaches every row) writes the final output in its dtype to ``OUT``.
With ``PARTS`` (``launch.forward``, contiguous layouts) the branches but the last run as one launch instead, each
program's branch ("part") from a table, each part's rows stored once, compact (row ``base + column // r`` of ``O`` and
``PL``), and the last launch merges every part's rows into its own: no launch per small branch, whose last wave left
SMs idle.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    PART_COLUMNS, allowed, drop_rows, finish, item_query_tile, load_rows, merge_rows, mm, n_rows, nest_query_tile,
    nest_weight, part_query_tile, query_tile_keys, row_desc, rounded, softmax_step, tile_mask, tile_rows,
    written_before,
)


@triton.jit
def dilated_fwd_branch_kernel(
    Q, K, V, O, L, OUT, PREV, T, QV, KV, S, PL, NESTS,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    Nq, Nk, H, head_offset, group, r, qk_scale, window, drop_threshold, inv_keep, n_tiles, n_prev, nest_i,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HOLES: tl.constexpr, DROPOUT: tl.constexpr,
    MERGE: tl.constexpr, LAST: tl.constexpr, PARTS: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    NESTED: tl.constexpr,
):
    base = 0
    if PARTS and not LAST:  # the one launch over the parts: this program's part (``PREV``: the parts' table)
        r, base, nest_i, b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, p_min = part_query_tile(
            PREV, n_prev, T, head_offset, BLOCK_M, IS_CAUSAL)
    else:
        b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, p_min = item_query_tile(
            T, n_tiles, head_offset, r, BLOCK_M, IS_CAUSAL)
    if p_min >= q_hi:
        return
    qp, in_range, qc, qmask = tile_rows(q_first, tile, r, q_hi, qbase, QV, b * Nq, BLOCK_M, HOLES)
    d = tl.arange(0, HEAD_DIM)
    dmask = d < D
    EVEN_D: tl.constexpr = D == HEAD_DIM
    kvh = (h // group).to(tl.int64)
    h64 = h.to(tl.int64)
    if TMA:
        q_desc = row_desc(Q + b * stride_qb + h64 * stride_qh + (qbase + q_first).to(tl.int64) * stride_qn,
                          n_rows(q_first, q_hi, r), r * stride_qn, BLOCK_M, HEAD_DIM)
        q = q_desc.load([row0, 0])
    else:
        q_ptrs = Q + b * stride_qb + h64 * stride_qh + qc.to(tl.int64)[:, None] * stride_qn + d[None, :]
        q = load_rows(q_ptrs, qmask, dmask, True, EVEN_D)
    row_hash = qp
    if DROPOUT:
        row_hash = drop_rows(S, b, h, H, qc)

    k_first, n_k, n_full = query_tile_keys(p_min, q_hi, k_lo, k_hi, off, r, window, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                           WINDOW, HOLES)
    if NESTED:  # keys only in earlier segments of the branch below; each pair weighted by the branches that have it
        NEST, qlim, n_k, n_full, q_weight = nest_query_tile(NESTS, nest_i, qp, p_min, q_hi, k_first, n_k, n_full, h,
                                                            head_offset, r, qk_scale, BLOCK_M, BLOCK_N)

    cols = tl.arange(0, BLOCK_N)
    k_row = K + b * stride_kb + kvh * stride_kh + d[None, :]
    v_row = V + b * stride_vb + kvh * stride_vh + d[None, :]
    if TMA:
        k0 = (kbase + k_first).to(tl.int64)
        k_desc = row_desc(K + b * stride_kb + kvh * stride_kh + k0 * stride_kn, n_k, r * stride_kn, BLOCK_N, HEAD_DIM)
        v_desc = row_desc(V + b * stride_vb + kvh * stride_vh + k0 * stride_vn, n_k, r * stride_vn, BLOCK_N, HEAD_DIM)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(0, n_full, BLOCK_N):
        kp = k_first + (start + cols) * r
        kc = kbase + kp
        if TMA:
            k = k_desc.load([start, 0])
            v = v_desc.load([start, 0])
        else:
            k = load_rows(k_row + kc.to(tl.int64)[:, None] * stride_kn, cols, dmask, False, EVEN_D)
            v = load_rows(v_row + kc.to(tl.int64)[:, None] * stride_vn, cols, dmask, False, EVEN_D)
        qk = mm(q, tl.trans(k), UPCAST)
        if NESTED:
            qk += tl.minimum(q_weight[:, None], nest_weight(kp, h, head_offset, NEST, 1.0 / qk_scale)[None, :])
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, qk_scale, v, row_hash, kc, drop_threshold, inv_keep, DROPOUT,
                                     UPCAST)
    for start in range(n_full, n_k, BLOCK_N):
        kp = k_first + (start + cols) * r
        kc = kbase + kp
        kmask = start + cols < n_k
        if HOLES:
            kmask = kmask & (tl.load(KV + b * Nk + kc, mask=kmask, other=0) != 0)
        if TMA:  # rows past the item's last come back as zeros
            k = k_desc.load([start, 0])
            v = v_desc.load([start, 0])
        else:
            k = load_rows(k_row + kc.to(tl.int64)[:, None] * stride_kn, kmask, dmask, True, EVEN_D)
            v = load_rows(v_row + kc.to(tl.int64)[:, None] * stride_vn, kmask, dmask, True, EVEN_D)
        qk = mm(q, tl.trans(k), UPCAST)
        ok = kmask[None, :]
        if HOLES:
            ok = ok & qmask[:, None]
        ok = allowed(ok, qp[:, None] - kp[None, :], window, IS_CAUSAL, WINDOW)
        if NESTED:
            ok = ok & (kp[None, :] < qlim[:, None])
            qk += tl.minimum(q_weight[:, None], nest_weight(kp, h, head_offset, NEST, 1.0 / qk_scale)[None, :])
        qk = tl.where(ok, qk, float("-inf"))
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, qk_scale, v, row_hash, kc, drop_threshold, inv_keep, DROPOUT,
                                     UPCAST)

    o_b, lse_b = finish(acc, l_i, m_i)
    smask = tile_mask(in_range, dmask, EVEN_D)
    if PARTS and not LAST:  # a part's rows, compact: row ``base + column // r`` of ``O`` and ``PL``
        rows = (base + qc // r).to(tl.int64)
        tl.store(O + b * stride_ob + h64 * stride_oh + rows[:, None] * stride_on + d[None, :], o_b, mask=smask)
        tl.store(PL + b * stride_lb + h64 * stride_lh + rows, lse_b, mask=in_range)
        return
    o_ptrs = O + b * stride_ob + h64 * stride_oh + qc.to(tl.int64)[:, None] * stride_on + d[None, :]
    l_ptrs = L + b * stride_lb + h64 * stride_lh + qc.to(tl.int64)
    out = o_b
    lse = lse_b
    if PARTS:  # the last launch: merge in each part's rows (a part's rate selects them; ``PREV``: the parts' table)
        for j in range(n_prev):
            rj = tl.load(PREV + j * PART_COLUMNS + 3)
            seen = in_range & ((((qp - h - head_offset) % rj) + rj) % rj == 0)
            rows = tl.where(seen, tl.load(PREV + j * PART_COLUMNS + 4) + qc // rj, 0).to(tl.int64)
            old_lse = tl.load(PL + b * stride_lb + h64 * stride_lh + rows, mask=seen, other=float("-inf"))
            old_o = tl.load(O + b * stride_ob + h64 * stride_oh + rows[:, None] * stride_on + d[None, :],
                            mask=tile_mask(seen, dmask, EVEN_D), other=0.0)
            out, lse = merge_rows(old_o, old_lse, out, lse)
    elif MERGE:  # rows an earlier launch wrote (the others read as no output, lse -inf)
        seen = in_range & written_before(qp, h, head_offset, PREV, n_prev, 1)
        old_lse = tl.load(l_ptrs, mask=seen, other=float("-inf"))
        old_o = tl.load(o_ptrs, mask=tile_mask(seen, dmask, EVEN_D), other=0.0).to(tl.float32)
        out, lse = merge_rows(old_o, old_lse, o_b, lse_b)
    if LAST:  # the final output, in its dtype (``OUT`` has ``O``'s strides)
        o_ptrs = OUT + b * stride_ob + h64 * stride_oh + qc.to(tl.int64)[:, None] * stride_on + d[None, :]
        tl.store(o_ptrs, rounded(out, OUT.dtype.element_ty, UPCAST), mask=smask)
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=smask)
    tl.store(l_ptrs, lse, mask=in_range)
