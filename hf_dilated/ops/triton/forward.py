"""Forward kernel: one launch per branch, one program per (segment item, tile of dilated query rows, query head).

A segment item (see ``schedule.py``) is the part of one sequence's segment that holds queries: positions
``[q_lo, q_hi)`` of the queries, ``[k_lo, k_hi)`` of the keys; position ``p`` sits at column ``base + p``. For head
``h`` the branch selects positions ``p = first + j * r`` with ``p % r == (h + head_offset) % r``; the kernel reads those
rows in place through the row stride times ``r``: no gathered copies. It folds its branch into the running output
(float32) and log-sum-exp of the earlier branches with the exact merge ``o = sum_i softmax(lse)_i o_i``.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E_F = 1.4426950408889634
LOG2E = tl.constexpr(LOG2E_F)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def mm(a, b, UPCAST: tl.constexpr):
    """``tl.dot`` by mode: 0 plain (bf16 / fp16), 1 float32 operands (works around the interpreter's wrong bfloat16
    dots, CPU tests only), 2 full float32 (``ieee``) for float32 inputs:
    exact but slower (tf32 missed SPEC's 1e-3 tolerance in the H100 tests)."""
    if UPCAST == 1:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif UPCAST == 2:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _first_selected(lo, off, r):
    """Smallest position ``p >= lo`` with ``p % r == off`` (``lo, off >= 0``)."""
    return lo + ((off - lo) % r + r) % r


@triton.jit
def _fwd_tile_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, kp, qp, n_keys_ok, qk_scale,
                   MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    kmask = n_keys_ok
    if MASK:
        k = tl.load(k_ptrs, mask=kmask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    qk = mm(q, tl.trans(k), UPCAST) * qk_scale
    if MASK:
        ok = kmask[None, :]
        if IS_CAUSAL:
            ok = ok & (kp[None, :] <= qp[:, None])
        qk = tl.where(ok, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASK:
        v = tl.load(v_ptrs, mask=kmask[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, UPCAST)
    return acc, l_i, m_new


@triton.jit
def dilated_fwd_branch_kernel(
    Q, K, V, O, L, T,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    head_offset, group, r, qk_scale,
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
    kvh = (h // group).to(tl.int64)
    h64 = h.to(tl.int64)
    q_ptrs = Q + b * stride_qb + h64 * stride_qh + (qbase + qp).to(tl.int64)[:, None] * stride_qn + d[None, :]
    q = tl.load(q_ptrs, mask=qmask[:, None], other=0.0)

    k_first = _first_selected(k_lo, off, r)
    k_end = k_hi
    if IS_CAUSAL:
        p_max = tl.minimum(p_min + (BLOCK_M - 1) * r, q_hi - 1)
        k_end = tl.minimum(k_end, p_max + 1)
    n_k = tl.maximum((k_end - k_first + r - 1) // r, 0)
    if IS_CAUSAL:
        n_full = tl.where(p_min >= k_first, (p_min - k_first) // r + 1, 0)
        n_full = tl.minimum(n_full, n_k)
    else:
        n_full = n_k
    n_full = (n_full // BLOCK_N) * BLOCK_N

    cols = tl.arange(0, BLOCK_N)
    k_row = K + b * stride_kb + kvh * stride_kh + d[None, :]
    v_row = V + b * stride_vb + kvh * stride_vh + d[None, :]
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(0, n_full, BLOCK_N):
        kp = k_first + (start + cols) * r
        kc = (kbase + kp).to(tl.int64)[:, None]
        acc, l_i, m_i = _fwd_tile_step(acc, l_i, m_i, q, k_row + kc * stride_kn, v_row + kc * stride_vn,
                                       kp, qp, cols < BLOCK_N, qk_scale, False, IS_CAUSAL, UPCAST)
    for start in range(n_full, n_k, BLOCK_N):
        kp = k_first + (start + cols) * r
        kc = (kbase + kp).to(tl.int64)[:, None]
        acc, l_i, m_i = _fwd_tile_step(acc, l_i, m_i, q, k_row + kc * stride_kn, v_row + kc * stride_vn,
                                       kp, qp, start + cols < n_k, qk_scale, True, IS_CAUSAL, UPCAST)

    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    o_b = acc / l_safe[:, None]
    lse_b = tl.where(has, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    o_ptrs = O + b * stride_ob + h64 * stride_oh + (qbase + qp).to(tl.int64)[:, None] * stride_on + d[None, :]
    l_ptrs = L + b * stride_lb + h64 * stride_lh + (qbase + qp).to(tl.int64)
    if FIRST:
        out = o_b
        lse = lse_b
    else:
        old_lse = tl.load(l_ptrs, mask=qmask, other=float("-inf"))
        old_o = tl.load(o_ptrs, mask=qmask[:, None], other=0.0).to(tl.float32)
        m = tl.maximum(old_lse, lse_b)
        m = tl.where(m == float("-inf"), 0.0, m)
        a = tl.exp(old_lse - m)
        c = tl.exp(lse_b - m)
        s = a + c
        reached = s > 0
        s_safe = tl.where(reached, s, 1.0)
        out = (old_o * a[:, None] + o_b * c[:, None]) / s_safe[:, None]
        lse = tl.where(reached, m + tl.log(s_safe), float("-inf"))
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=qmask[:, None])
    tl.store(l_ptrs, lse, mask=qmask)
